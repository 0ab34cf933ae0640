"""Compile a kernel for Hopper (sm_90a) on a machine without a GPU, with Triton's own ptxas: what the GPU would run,
for the CPU tests to check (register spills, the instructions it uses).

A test calls `run_compiled(SCRIPT, tmp_path)`: SCRIPT runs in a subprocess without TRITON_INTERPRET (the kernels
compiled, not interpreted: recipes.fp8.kernels reads it at import) and calls `compile_for_hopper` (a Triton kernel)
or `ptxas` (the PTX another compiler wrote, CUTLASS's DSL's), and may read the machine code with `sass`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def run_compiled(script: str, tmp_path: Path, env: dict | None = None) -> str:
    """SCRIPT's output, run with the PTX file's path as its argument (and `env` added to the environment); the
    test skips where this Triton has no ptxas for Hopper, fails where the script does."""
    from triton import knobs

    if not Path(knobs.nvidia.ptxas_blackwell.path or "").is_file():
        pytest.skip("this Triton ships no ptxas for Hopper")
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "kernel.ptx")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def compile_for_hopper(kernel, signature: dict, constants: dict, ptx_file: Path, num_warps: int = 4,
                       num_stages: int = 3, divisible: tuple[int, ...] = ()) -> tuple[str, int, int]:
    """(PTX, bytes spilled per thread, registers per thread) of `kernel` with `constants`, its arguments typed by
    `signature`; `divisible`: the positions of arguments a launch has 16-aligned or divisible by 16, as Triton
    specializes them (aligned pointers, sizes that are multiples of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, {**signature, **{name: "constexpr" for name in constants}}, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    ptx_file.write_text(ptx)
    return (ptx, *ptxas(ptx_file))


def ptxas(ptx_file: Path) -> tuple[int, int]:
    """(bytes spilled per thread, registers per thread) of the PTX in `ptx_file`, assembled for sm_90a by Triton's
    ptxas (the registers: those a thread starts with, before any setmaxnreg)."""
    from triton import knobs

    log = subprocess.run([knobs.nvidia.ptxas_blackwell.path, "-v", "--gpu-name", "sm_90a", str(ptx_file), "-o",
                          f"{ptx_file}.cubin"], capture_output=True, text=True, check=True).stderr
    spilled = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return spilled, registers


def sass(ptx_file: Path) -> str:
    """The machine code `ptxas(ptx_file)` assembled, as Triton's nvdisasm prints it."""
    from triton import knobs

    nvdisasm = Path(knobs.nvidia.ptxas_blackwell.path).with_name("nvdisasm")
    return subprocess.run([str(nvdisasm), "-c", f"{ptx_file}.cubin"], capture_output=True, text=True,
                          check=True).stdout
