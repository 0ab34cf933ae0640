"""What produced a number: commit, library versions, hardware. Every summary and benchmark records it."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import torch

from recipes.config import REPO_ROOT



def git_commit() -> str:
    """HEAD's hash, with '-dirty' when tracked files differ from it; 'unknown' outside a git checkout.

    FP8_RECIPES_COMMIT, when set, is taken instead: for copies of the repo without .git (containers, lent machines).
    """
    if os.environ.get("FP8_RECIPES_COMMIT"):
        return os.environ["FP8_RECIPES_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "diff", "--quiet", "HEAD"], capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


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
