"""recipes.provenance.git_commit names the project's own commit or says it is unknown: a copy of the tree without
.git inside another git repository (as on a lent machine) must not take that repository's commit."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from recipes.provenance import git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def committed_repo(path) -> str:
    """A git repository at `path` with one commit; its hash."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "README").write_text("outer\n")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "outer"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def test_a_copy_without_git_inside_another_repository_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("FP8_RECIPES_COMMIT", raising=False)
    outer = committed_repo(tmp_path / "outer")
    project = tmp_path / "outer" / "work" / "project"  # the tree copied without its .git
    project.mkdir(parents=True)
    assert git_commit(project) == "unknown"
    assert git_commit(tmp_path / "outer") == outer  # the repository's own top level: its commit
    (tmp_path / "outer" / "README").write_text("changed\n")
    assert git_commit(tmp_path / "outer") == outer + "-dirty"
    assert git_commit(tmp_path / "nowhere") == "unknown"


def test_the_commit_given_in_the_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8_RECIPES_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"
