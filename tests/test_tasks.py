"""tasks.py's build stamp: the commit is read before the build, handed to the pages, and checked after it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("tasks", Path(__file__).resolve().parent.parent / "tasks.py")
assert spec is not None and spec.loader is not None
tasks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tasks)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "page.txt").write_text("one\n")
    git(tmp_path, "add", "page.txt")
    git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(tasks, "ROOT", tmp_path)
    for name in ("ROPELIB_BOOK_COMMIT", "ROPELIB_BOOK_DIRTY"):  # restored after the test, set or not
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path


def test_a_quiet_build_sees_the_commit_it_started_from(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD").strip()
    seen = {}

    def build() -> None:
        seen.update({k: os.environ[k] for k in ("ROPELIB_BOOK_COMMIT", "ROPELIB_BOOK_DIRTY")})
        (repo / "untracked.txt").write_text("build output\n")  # untracked files do not count

    tasks.stamped_build(build)
    assert seen == {"ROPELIB_BOOK_COMMIT": head, "ROPELIB_BOOK_DIRTY": "0"}


def test_uncommitted_changes_are_stamped(repo: Path) -> None:
    (repo / "page.txt").write_text("edited\n")
    tasks.stamped_build(lambda: None)
    assert os.environ["ROPELIB_BOOK_DIRTY"] == "1"


def test_a_commit_during_the_build_fails_it(repo: Path) -> None:
    def build() -> None:
        git(repo, "commit", "-q", "--allow-empty", "-m", "two")

    with pytest.raises(SystemExit, match="HEAD changed during the build"):
        tasks.stamped_build(build)


def test_an_edit_of_a_tracked_file_during_the_build_fails_it(repo: Path) -> None:
    def build() -> None:
        (repo / "page.txt").write_text("edited\n")

    with pytest.raises(SystemExit, match=r"tracked files \(git status\) changed"):
        tasks.stamped_build(build)


def test_outside_git_there_is_no_stamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setenv("ROPELIB_BOOK_COMMIT", "stale")
    monkeypatch.setenv("ROPELIB_BOOK_DIRTY", "0")
    ran = []
    tasks.stamped_build(lambda: ran.append(os.environ.get("ROPELIB_BOOK_COMMIT")))
    assert ran == [None]
