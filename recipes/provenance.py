"""What produced a number: commit, library versions, hardware. Every summary and benchmark records it."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from recipes.config import REPO_ROOT


def git_commit(root: Path = REPO_ROOT) -> str:
    """HEAD's hash of the project's own checkout, with '-dirty' when tracked files differ from it; 'unknown'
    where `root` is not the top of a git checkout.

    FP8_RECIPES_COMMIT, when set, is taken instead: for copies of the repo without .git (containers, lent machines).
    Such a copy may lie inside another git repository, whose HEAD git would give for `root`: that commit is not
    the project's, so it is never taken.
    """
    if os.environ.get("FP8_RECIPES_COMMIT"):
        return os.environ["FP8_RECIPES_COMMIT"]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)

    try:
        top, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "HEAD")
        if top.returncode or head.returncode or Path(top.stdout.strip()).resolve() != Path(root).resolve():
            return "unknown"
        dirty = git("diff", "--quiet", "HEAD").returncode
    except OSError:  # no git
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "megatron-core": _version("megatron-core"),
        "torchao": _version("torchao"),
        "transformer_engine": _version("transformer_engine"),
    }
    return {name: version for name, version in found.items() if version is not None}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def provenance() -> dict:
    return {"commit": git_commit(), "versions": versions(), "device": device_name()}
