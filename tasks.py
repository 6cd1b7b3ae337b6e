#!/usr/bin/env python3
"""The two jobs of this repository, with nothing but Python 3.10+ and pip.

    python3 tasks.py book   # venv + pinned install, execute every chapter, render _build/html
    python3 tasks.py test   # unit tests, docstring examples and every notebook (nbmake)
    python3 tasks.py lint   # ruff (lint + format check) and mypy, as CI runs them

Both create ``.venv`` on first use and reuse it afterwards. Extra arguments after ``test``
go to pytest (``python3 tasks.py test -k rotary``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".installed"


def run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def ensure_env() -> None:
    """Create the virtual environment and install the pinned requirements and ropelib (editable)."""
    wanted = (ROOT / "requirements.txt").read_text() + (ROOT / "pyproject.toml").read_text()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not (BIN / "python").exists():
        print(f"+ creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = (BIN / "python", "-m", "pip", "install", "--disable-pip-version-check")
    run(*pip, "-r", "requirements.txt")
    run(*pip, "--no-deps", "-e", ".")
    run(BIN / "python", "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3")
    STAMP.write_text(wanted)


def git_state() -> tuple[str, str] | None:
    """``(HEAD's full hash, git status --porcelain of the tracked files)``, or None outside a git checkout."""
    try:
        head, status = (
            subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            for args in (("rev-parse", "HEAD"), ("status", "--porcelain", "--untracked-files=no"))
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.strip(), status


def stamped_build(build: Callable[[], None]) -> None:
    """Run ``build`` with the commit it builds from in the environment, and fail if it moved meanwhile.

    The state is read before the build and handed to the chapters as ``ROPELIB_BOOK_COMMIT`` (HEAD's
    hash) and ``ROPELIB_BOOK_DIRTY`` (``1`` if tracked files differ from it, else ``0``), which
    book/how_built.ipynb prints; a commit, checkout or edit of a tracked file during the build would make
    that stamp wrong for some pages, so the build then exits non-zero.
    """
    before = git_state()
    if before is None:  # not a git checkout: how_built says so
        os.environ.pop("ROPELIB_BOOK_COMMIT", None)
        os.environ.pop("ROPELIB_BOOK_DIRTY", None)
        build()
        return
    os.environ["ROPELIB_BOOK_COMMIT"] = before[0]
    os.environ["ROPELIB_BOOK_DIRTY"] = "1" if before[1].strip() else "0"
    build()
    after = git_state()
    if after != before:
        what = "HEAD" if after is None or after[0] != before[0] else "the tracked files (git status)"
        sys.exit(
            f"tasks.py book: {what} changed during the build (started at {before[0]}), so the pages may "
            "mix two states of the repository and the build stamp on how_built is not theirs; rebuild."
        )


def book() -> None:
    ensure_env()
    stamped_build(lambda: run(BIN / "jupyter-book", "build", ".", "--all", "-W", "-n", "--keep-going"))
    print(f"\nThe book is at {ROOT / '_build' / 'html' / 'book' / 'index.html'}")


def test(args: list[str]) -> None:
    ensure_env()
    run(BIN / "python", "-m", "pytest", "tests", "ropelib", "--doctest-modules", "--nbmake", "book", *args)


def lint() -> None:
    ensure_env()
    run(BIN / "ruff", "check", "ropelib", "tests", "conftest.py", "tasks.py", "scripts")
    run(BIN / "ruff", "format", "--check", "ropelib", "tests", "conftest.py", "tasks.py", "scripts")
    run(BIN / "mypy")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("book", "test", "lint"):
        sys.exit(__doc__)
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    if sys.argv[1] == "book":
        book()
    elif sys.argv[1] == "lint":
        lint()
    else:
        test(sys.argv[2:])


if __name__ == "__main__":
    main()
