"""The bundled corpus: real text that exists offline on every machine, the Python standard library's own source.

It is about 800 files and 12-13 MB of code, comments and docstrings (English prose included), enough for a small
model's loss curve to mean something, and it needs no download. Tokenized once with the byte tokenizer into
megatron-core's indexed format (one document per file, EOD appended) and cached per Python version, since each
version ships different sources.

Left out, and why:
- site-packages, dist-packages: third-party code, different on every machine; it would make the corpus (and
  every loss curve) depend on what happens to be installed;
- test, tests, idle_test directories: large, repetitive fixtures (test tables, deliberately odd source);
- empty files: a document with no text.
idlelib itself stays: it is ordinary, well-written stdlib code.
"""

from __future__ import annotations

import os
import platform
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from recipes.data.megatron_indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path
from recipes.data.tokenizer import EOD, encode

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def stdlib_sources() -> list[Path]:
    """The corpus's documents, in a fixed order (sorted by path) so every build is byte-identical."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for directory, subdirectories, files in os.walk(root):
        # Prune rather than filter afterwards: site-packages can hold far more files than the stdlib itself.
        subdirectories[:] = [name for name in subdirectories if name not in EXCLUDED_DIRS]
        sources += [Path(directory, name) for name in files if name.endswith(".py")]
    sources = [path for path in sources if path.stat().st_size > 0]
    return sorted(sources, key=lambda path: path.relative_to(root).as_posix())


def build_corpus(cache_dir: str) -> str:
    """Return the corpus's indexed-dataset prefix (PREFIX.bin, PREFIX.idx), building it unless `cache_dir` has it.

    Safe when several processes (one per GPU) start at once: each builds into its own temporary directory and
    renames it into place. The rename is atomic, so a reader sees the whole corpus or none of it; a process that
    loses the race throws its identical copy away.
    """
    final_dir = _corpus_dir(cache_dir)
    if not final_dir.is_dir():
        final_dir.parent.mkdir(parents=True, exist_ok=True)
        build_dir = Path(tempfile.mkdtemp(prefix=f"{final_dir.name}.building-", dir=final_dir.parent))
        try:
            _write_corpus(build_dir / "corpus", final_dir)
            try:
                os.rename(build_dir, final_dir)
            except OSError:  # another process renamed its copy into place first
                if not final_dir.is_dir():
                    raise
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return str(final_dir / "corpus")


def _corpus_dir(cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / f"python-stdlib-{platform.python_version()}-bytes"


def _write_corpus(prefix: Path, final_dir: Path) -> None:
    sources = stdlib_sources()
    print(f"[data] building the bundled corpus: {len(sources)} Python files -> {final_dir}", flush=True)
    start = time.perf_counter()
    # uint16 holds every id (0..256) in 2 bytes; the builder's default, int32, would double the file.
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=np.uint16)
    num_tokens = 0
    for path in sources:
        document = np.append(encode(path.read_bytes()), EOD)
        builder.add_document(document, lengths=[document.size])
        num_tokens += document.size
    builder.finalize(get_idx_path(str(prefix)))
    seconds = time.perf_counter() - start
    summary = f"{len(sources)} documents, {num_tokens:,} tokens in {seconds:.1f} s"
    print(f"[data] built the bundled corpus: {summary}", flush=True)
