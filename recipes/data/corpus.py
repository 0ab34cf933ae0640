"""The bundled corpus: real text that exists offline on every machine, the Python standard library's own source.

It is about 800 files and 12-13 MB of code, comments and docstrings (English prose included), enough for a small
model's loss curve to mean something, and it needs no download. Tokenized once with the byte tokenizer into
megatron-core's indexed format (one document per file, EOD appended) and cached per Python version, since each
version ships different sources. The cache entry holds the SHA-256 of its two files (corpus.sha256, in sha256sum's
format), written before the entry is renamed into place: an entry whose files no longer match it (truncated,
overwritten, or built before there was a digest) is derived data, and is built again, saying so.

Left out, and why:
- site-packages, dist-packages: third-party code, different on every machine; it would make the corpus (and
  every loss curve) depend on what happens to be installed;
- test, tests, idle_test directories: large, repetitive fixtures (test tables, deliberately odd source);
- empty files: a document with no text.
idlelib itself stays: it is ordinary, well-written stdlib code.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from recipes.config import ConfigError
from recipes.data.megatron_indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path
from recipes.data.tokenizer import EOD, encode
from recipes.metrics import write_failure, write_fix

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
DIGEST, FILES = "corpus.sha256", ("corpus.bin", "corpus.idx")


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
    loses the race throws its identical copy away. A damaged entry is set aside and built again (_discard_damaged);
    a build the disk refuses (full, read-only) is a ConfigError naming the folder.
    """
    final_dir = _corpus_dir(cache_dir)
    _discard_damaged(final_dir)
    if not final_dir.is_dir():
        try:
            final_dir.parent.mkdir(parents=True, exist_ok=True)
            build_dir = Path(tempfile.mkdtemp(prefix=f"{final_dir.name}.building-", dir=final_dir.parent))
        except OSError as error:
            raise _unwritable(final_dir, error) from None
        try:
            _write_corpus(build_dir / "corpus", final_dir)
            _write_digest(build_dir)
            try:
                os.rename(build_dir, final_dir)
            except OSError:  # another process renamed its copy into place first
                if not final_dir.is_dir():
                    raise
        except OSError as error:
            raise _unwritable(final_dir, error) from None
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return str(final_dir / "corpus")


def _unwritable(final_dir: Path, error: OSError) -> ConfigError:
    where = f" ({error.filename})" if error.filename else ""
    return ConfigError(f"cannot build the bundled corpus in {final_dir}: {write_failure(error)}{where}; "
                       f"{write_fix(error, 'point data.cache_dir (FP8_RECIPES_CACHE) at a folder')} (it needs 30 MB)")


def _digest_lines(folder: Path) -> str:
    return "".join(f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}\n" for name in FILES)


def _write_digest(build_dir: Path) -> None:
    (build_dir / DIGEST).write_text(_digest_lines(build_dir))


def _damage(final_dir: Path) -> str | None:
    """Why the cache entry cannot be trusted, or None when its files match the digest written with them."""
    try:
        written = (final_dir / DIGEST).read_text()
    except (OSError, UnicodeDecodeError):
        return f"no readable {DIGEST}: cut short, damaged, or built before the cache kept one"
    try:
        found = _digest_lines(final_dir)
    except OSError as error:
        return f"{error.filename}: {error.strerror}"
    return None if found == written else f"its files do not match {DIGEST}: truncated or overwritten"


def _discard_damaged(final_dir: Path) -> None:
    """A damaged entry moved aside (one rename: a process reading it keeps its open files) and removed, for
    build_corpus to build again. Moved only while it is still the entry that was checked: another process may have
    rebuilt it meanwhile."""
    try:
        checked = final_dir.stat().st_ino
    except OSError:  # absent, or not to be read: the build says why
        return
    problem = _damage(final_dir)
    if problem is None:
        return
    print(f"[data] the cached corpus in {final_dir} is damaged ({problem}): building it again", flush=True)
    try:
        aside = Path(tempfile.mkdtemp(prefix=f"{final_dir.name}.damaged-", dir=final_dir.parent))
    except OSError as error:
        raise _unwritable(final_dir, error) from None
    try:
        if final_dir.stat().st_ino == checked:
            os.rename(final_dir, aside)  # onto the empty folder mkdtemp made
    except OSError:  # another process moved it first (or it cannot be moved: the build says why)
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


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
