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


def book() -> None:
    ensure_env()
    run(BIN / "jupyter-book", "build", ".", "--all", "-W", "-n", "--keep-going")
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
