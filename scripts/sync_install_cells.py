#!/usr/bin/env python3
"""Write the install cell at the top of every chapter, from ``repository`` in ``_config.yml``.

Every chapter notebook starts (as its first code cell) with a cell that, when ropelib is not
importable (Colab, a fresh environment), makes a shallow clone of the book's repository, installs
ropelib from it and runs the chapter from the clone's ``book/`` folder; where ropelib is
installed (as when the book is built) it does nothing::

    # Colab or a fresh environment: install ropelib from the book's repository.
    import importlib.util
    import os
    import sys

    REPOSITORY = "https://github.com/ropelib/ropelib"
    BRANCH = "main"
    if importlib.util.find_spec("ropelib") is None:
        # a shallow clone: the chapters read its files too (../results/)
        !git clone -q --depth 1 --branch {BRANCH} {REPOSITORY} ropelib-book
        # ropelib with its Hugging Face extra, myst-nb for the chapters'
        # glue and matplotlib for their figures (Colab ships the last two)
        %pip install -q "./ropelib-book[hf]" myst-nb matplotlib
        importlib.invalidate_caches()
    if os.path.isdir("ropelib-book"):  # run in the clone, also after a restart
        os.chdir("ropelib-book/book")
        sys.path.insert(0, os.path.dirname(os.getcwd()))  # its ropelib first

The chapters read repository files by paths relative to ``book/`` (``../results/*.json``) or to
the package (``Path(ropelib.__file__).parents[1] / "results"``), which a pip install alone does
not provide: hence the working directory, and the clone first on ``sys.path`` (the
non-editable install, importable at once in the running kernel, brings the dependencies).

The URL and branch are ``repository.url`` and ``repository.branch`` of ``_config.yml``, the
same settings the Colab launch button uses (without a branch the clone takes the default one).
After changing them, run this script; it inserts or updates the cell (id ``install-ropelib``)
in every ``.ipynb`` chapter of ``_toc.yml``, in place and idempotently, leaving every other
cell as it is. The cell carries the ``hide-input`` tag, so a page shows it as one collapsed
line that a reader can open. ``--check`` changes nothing and exits with status 1 when a chapter's cell
differs from what the script would write (``tests/test_book_pages.py`` runs the same
comparison).

Usage:
    python scripts/sync_install_cells.py [--check] [--root .] [NOTEBOOK ...]

Without ``NOTEBOOK`` arguments every notebook chapter of ``_toc.yml`` is synced. The
functions that compute the cell use only the standard library (the rendered-book checker
imports them); reading and writing notebooks uses ``nbformat``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CELL_ID = "install-ropelib"
COMMENT = "# Colab or a fresh environment: install ropelib from the book's repository."
CLONE = "ropelib-book"  # the clone's folder, next to the notebook (not an importable name)
TAG = "hide-input"  # the page shows a one-line toggle, not the fifteen lines of the cell


def repository_settings(root: Path = ROOT) -> tuple[str, str]:
    """``(url, branch)`` of the ``repository:`` block of ``_config.yml`` (branch may be "")."""
    config = root / "_config.yml"
    values: dict[str, str] = {}
    inside = False
    for line in config.read_text(encoding="utf-8").splitlines():
        if re.match(r"repository\s*:\s*(#.*)?$", line):
            inside = True
            continue
        if inside and line.strip() and not line[0].isspace():
            break  # the next top-level key
        match = re.match(r"\s+(url|branch)\s*:\s*['\"]?([^'\"#\s]*)", line) if inside else None
        if match:
            values[match.group(1)] = match.group(2)
    url = values.get("url", "").rstrip("/")
    if not re.match(r"https://\S+$", url):
        raise ValueError(f"{config}: repository.url must be an https URL, found {url!r}")
    return url, values.get("branch", "")


def install_cell_source(url: str, branch: str = "") -> str:
    """The source of the install cell for a repository URL (and branch)."""
    settings = f'REPOSITORY = "{url}"\n' + (f'BRANCH = "{branch}"\n' if branch else "")
    option = "--branch {BRANCH} " if branch else ""
    return (
        f"{COMMENT}\n"
        "import importlib.util\n"
        "import os\n"
        "import sys\n"
        "\n"
        f"{settings}"
        'if importlib.util.find_spec("ropelib") is None:\n'
        "    # a shallow clone: the chapters read its files too (../results/)\n"
        f"    !git clone -q --depth 1 {option}{{REPOSITORY}} {CLONE}\n"
        "    # ropelib with its Hugging Face extra, myst-nb for the chapters'\n"
        "    # glue and matplotlib for their figures (Colab ships the last two)\n"
        f'    %pip install -q "./{CLONE}[hf]" myst-nb matplotlib\n'
        "    importlib.invalidate_caches()\n"
        f'if os.path.isdir("{CLONE}"):  # run in the clone, also after a restart\n'
        f'    os.chdir("{CLONE}/book")\n'
        "    sys.path.insert(0, os.path.dirname(os.getcwd()))  # its ropelib first"
    )


def expected_source(root: Path = ROOT) -> str:
    return install_cell_source(*repository_settings(root))


def toc_notebooks(root: Path = ROOT) -> list[Path]:
    """Every ``root``/``file`` entry of ``_toc.yml`` that is a notebook, in order."""
    found: list[Path] = []
    for line in (root / "_toc.yml").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\s*(?:-\s*)?(?:root|file)\s*:\s*['\"]?([^'\"#\s]+)", line)
        if not match:
            continue
        entry = re.sub(r"\.(ipynb|md|rst)$", "", match.group(1))
        path = root / f"{entry}.ipynb"
        if path.is_file() and path not in found:
            found.append(path)
    return found


def _text(source: Any) -> str:
    return "".join(source) if isinstance(source, list) else str(source)


def is_install_cell(cell: dict) -> bool:
    """The install cell, by its id or by its first line (an older version of it)."""
    if cell.get("cell_type") != "code":
        return False
    return cell.get("id") == CELL_ID or _text(cell.get("source", "")).startswith(COMMENT)


def _hand_written(cell: dict) -> bool:
    """A first code cell that only installs ropelib, written by hand: the cell replaces it."""
    source = _text(cell.get("source", ""))
    return (
        cell.get("cell_type") == "code"
        and "%pip install" in source
        and "ropelib" in source
        and len(source.splitlines()) <= 6
    )


def first_code_source(cells: list[dict]) -> str | None:
    for cell in cells:
        if cell.get("cell_type") == "code":
            return _text(cell.get("source", ""))
    return None


def sync_cells(cells: list[dict], source: str) -> bool:
    """Make ``cells`` start their code with exactly one install cell; True if anything changed."""
    if first_code_source(cells) == source and sum(is_install_cell(c) for c in cells) == 1:
        first = next(c for c in cells if c.get("cell_type") == "code")
        if (
            first.get("id") == CELL_ID
            and not first.get("outputs")
            and first.get("execution_count") is None
            and TAG in first.get("metadata", {}).get("tags", [])
        ):
            return False
    code = [c for c in cells if c.get("cell_type") == "code"]
    replaced = [c for c in cells if is_install_cell(c) or (code and c is code[0] and _hand_written(c))]
    old = [c for c in replaced if c.get("id") == CELL_ID] or replaced
    cells[:] = [c for c in cells if all(c is not r for r in replaced)]
    metadata = dict(old[0].get("metadata", {})) if old else {}
    metadata["tags"] = [*(t for t in metadata.get("tags", []) if t != TAG), TAG]
    cell = {
        "cell_type": "code",
        "execution_count": None,
        "id": CELL_ID,
        "metadata": metadata,
        "outputs": [],
        "source": source,
    }
    at = next((i for i, c in enumerate(cells) if c.get("cell_type") == "code"), min(1, len(cells)))
    cells.insert(at, cell)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: every chapter in _toc.yml)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the book's root (where _config.yml is)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a cell is out of date")
    args = parser.parse_args(argv)

    import nbformat  # only for reading and writing notebooks

    root = args.root.resolve()
    source = expected_source(root)
    notebooks = args.notebooks or toc_notebooks(root)
    stale = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        if not sync_cells(nb.cells, source):
            continue
        stale.append(path)
        if not args.check:
            nb.cells = [nbformat.from_dict(c) for c in nb.cells]
            nbformat.validate(nb)
            nbformat.write(nb, path)
            print(f"updated {path}")
    if args.check and stale:
        for path in stale:
            print(f"{path}: install cell missing or out of date; run scripts/sync_install_cells.py", file=sys.stderr)
        return 1
    if not stale:
        print(f"{len(notebooks)} notebook(s) up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
