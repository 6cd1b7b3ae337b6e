"""The code a run ran, for the provenance the bench and lab records carry."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

#: The directory that holds the ``ropelib`` package this module belongs to (a checkout's root, or site-packages).
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def git_state(root: str | Path = PACKAGE_ROOT) -> dict[str, Any]:
    """The code a run ran, for its provenance: ``{"git_commit": ..., "git_dirty": ...}``.

    ``git_commit`` is the full hash of HEAD of the git checkout whose root is ``root`` (by default the
    one holding this ``ropelib``), ``git_dirty`` whether its tracked files differ from HEAD
    (``git status --porcelain --untracked-files=no``). Where git cannot say (no ``git`` program,
    ``root`` not the root of a checkout, as for an installed package) both are ``"unknown"``; this
    never raises.
    """
    unknown = {"git_commit": "unknown", "git_dirty": "unknown"}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return unknown
        commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return unknown
    return {"git_commit": commit or "unknown", "git_dirty": bool(status)}
