"""The import layering of recipes/ that docs/architecture.md describes, read from the source with ast: every import
counts, those inside functions and under TYPE_CHECKING included.

- A module imports only from its own layer and the layers below it.
- The report reads run directories and logs: it imports no engine, Slurm or model code.
- An engine and the plan use FP8 through the FP8 object alone (`from recipes.fp8 import Fp8Training`), as
  scripts/layer_bench.py does; the engines do not import each other.
- No import cycle, between modules or within a package.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Bottom to top: each layer may import from itself and from the layers before it.
LAYERS = {
    "schema": ("recipes.config", "recipes.run_files", "recipes.folders"),
    "components": ("recipes.fp8", "recipes.models", "recipes.data", "recipes.metrics", "recipes.profiling",
                   "recipes.provenance", "recipes.layouts", "recipes.compute"),
    "trainer": ("recipes.trainer",),
    "engines": ("recipes.engine", "recipes.megatron", "recipes.nemo"),
    "plan": ("recipes.plan",),
    "launch and report": ("recipes.launcher", "recipes.slurm", "recipes.ssh", "recipes.nemo_run_home",
                          "recipes.hydra_schema", "recipes.report"),
}
REPORT_MAY_IMPORT = ("recipes.config", "recipes.run_files", "recipes.folders", "recipes.metrics", "recipes.report")
ENGINES = ("recipes.engine", "recipes.megatron", "recipes.nemo")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# recipes/__init__.py is empty, and importing recipes.x imports it: not a module of any layer.
MODULES = {module_name(path): path for path in sorted((REPO / "recipes").rglob("*.py"))
           if path != REPO / "recipes" / "__init__.py"}


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports(path: Path, package: str) -> set[str]:
    """The recipes modules a file imports; `from P import name` is P.name when that is a module, P otherwise."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if within(name, "recipes") and name != "recipes"}


def package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


GRAPH = {module: imports(path, package_of(module)) for module, path in MODULES.items()}


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS.values()):
        if any(within(module, prefix) for prefix in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of tests/test_layering.py (and docs/architecture.md): place it")


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def upward_imports(module: str, names: set[str]) -> list[str]:
    return sorted(name for name in names if layer_of(name) > layer_of(module))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (depth-first: a module met again while on the current path closes one), or None."""
    state: dict[str, str] = {}  # module -> "open" (on the path) or "done"

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for name in sorted(graph.get(module, ())):
            if state.get(name) == "open":
                return path[path.index(name):] + [name]
            if name not in state and (cycle := visit(name, path + [name])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_no_import_from_a_higher_layer():
    upward = {module: upward_imports(module, names) for module, names in GRAPH.items()}
    upward = {module: names for module, names in upward.items() if names}
    assert not upward, f"imports from a layer above: {upward}"


def test_report_reads_files_without_engine_slurm_or_model_code():
    for module, names in GRAPH.items():
        if within(module, "recipes.report"):
            foreign = [n for n in names if not any(within(n, allowed) for allowed in REPORT_MAY_IMPORT)]
            assert not foreign, f"{module} imports {foreign}"


def test_engines_and_the_plan_use_fp8_through_the_fp8_object_only_and_engines_not_each_other():
    layer_bench = REPO / "scripts" / "layer_bench.py"
    users = {m: GRAPH[m] for m in MODULES if any(within(m, user) for user in (*ENGINES, "recipes.plan"))}
    users["scripts.layer_bench"] = imports(layer_bench, "scripts")
    for module, names in users.items():
        fp8 = {n for n in names if within(n, "recipes.fp8")}
        assert fp8 <= {"recipes.fp8"}, f"{module} imports {sorted(fp8)}: only recipes.fp8's Fp8Training"
        own = [engine for engine in ENGINES if within(module, engine)]
        others = [n for n in names if any(within(n, engine) for engine in ENGINES if engine not in own)]
        assert not own or not others, f"{module} imports another engine: {others}"
    for module in users:
        path = layer_bench if module == "scripts.layer_bench" else MODULES[module]
        names = {alias.name for node in ast.walk(ast.parse(path.read_text())) for alias in getattr(node, "names", ())
                 if isinstance(node, ast.ImportFrom) and node.module == "recipes.fp8"}
        assert names <= {"Fp8Training"}, f"{module} imports {sorted(names)} from recipes.fp8"


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_checks_catch_a_function_level_import_an_upward_one_and_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from recipes.plan import make_plan\n\ndef f():\n    import recipes.engine.fsdp\n")
    found = imports(tmp_path / "a.py", "recipes.engine")
    assert found == {"recipes.plan", "recipes.engine.fsdp"}
    assert upward_imports("recipes.engine.fsdp", found) == ["recipes.plan"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
