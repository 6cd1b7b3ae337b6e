"""The book's chapters start with the install cell that scripts/sync_install_cells.py writes.

The cell clones ``repository.url`` (at ``repository.branch``) of _config.yml and installs ropelib
from the clone when ropelib is not importable, so that every chapter runs in Colab. These tests
read the notebooks as JSON; the cell itself runs with its shell commands and magics recorded,
not run.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import sync_install_cells as sync  # noqa: E402

CHAPTERS = sync.toc_notebooks(ROOT)


def test_toc_has_notebook_chapters() -> None:
    assert CHAPTERS, "no .ipynb chapter found in _toc.yml"


def test_install_cell_comes_from_the_config() -> None:
    url, branch = sync.repository_settings(ROOT)
    source = sync.install_cell_source(url, branch)
    assert f'REPOSITORY = "{url}"' in source
    assert (f'BRANCH = "{branch}"' in source) == bool(branch)
    assert ("--branch {BRANCH}" in source) == bool(branch)
    assert (
        "!git clone -q --depth 1 " in source and f'%pip install -q "./{sync.CLONE}[hf]" myst-nb matplotlib\n' in source
    )
    assert "-e " not in source  # non-editable: the running kernel imports it at once
    compile(_python(source), "<install cell>", "exec")
    assert "--branch" not in sync.install_cell_source(url)  # no branch: the default one


def _python(source: str) -> str:
    """The cell as IPython runs it: ``!cmd`` and ``%magic`` lines become ``get_ipython()`` calls."""
    transformer = pytest.importorskip("IPython.core.inputtransformer2")
    return transformer.TransformerManager().transform_cell(source)


class _Shell:
    """Records the shell commands and magics the cell runs instead of running them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def system(self, command: str) -> None:
        self.calls.append(("system", command))

    def run_line_magic(self, name: str, line: str) -> None:
        self.calls.append((name, line))


def _run_cell(source: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, importable: bool) -> _Shell:
    import importlib.util

    shell = _Shell()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: real(name, *a) if importable or name != "ropelib" else None
    )
    exec(_python(source), {"get_ipython": lambda: shell})
    return shell


def test_install_cell_does_nothing_where_ropelib_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = list(sys.path)
    shell = _run_cell(sync.install_cell_source("https://x.org/a/b", "dev"), tmp_path, monkeypatch, importable=True)
    assert shell.calls == [] and Path.cwd() == tmp_path and sys.path == path


def test_install_cell_clones_installs_and_runs_in_the_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / sync.CLONE / "book").mkdir(parents=True)  # what the clone leaves
    shell = _run_cell(sync.install_cell_source("https://x.org/a/b", "dev"), tmp_path, monkeypatch, importable=False)
    clone = f"git clone -q --depth 1 --branch {{BRANCH}} {{REPOSITORY}} {sync.CLONE}"
    assert shell.calls == [("system", clone), ("pip", f'install -q "./{sync.CLONE}[hf]" myst-nb matplotlib')]
    # relative paths (../results/) resolve in the clone, and ropelib.__file__ is in it too
    assert Path.cwd() == tmp_path / sync.CLONE / "book"
    assert sys.path[0] == str(tmp_path / sync.CLONE)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_starts_with_the_install_cell(chapter: Path) -> None:
    cells = json.loads(chapter.read_text(encoding="utf-8"))["cells"]
    expected = sync.expected_source(ROOT)
    first = sync.first_code_source(cells)
    assert first == expected, f"{chapter.name}: first code cell differs; run python scripts/sync_install_cells.py"
    assert not sync.sync_cells(copy.deepcopy(cells), expected), f"{chapter.name}: run scripts/sync_install_cells.py"
    install = next(c for c in cells if c.get("cell_type") == "code")
    assert "hide-input" in install["metadata"].get("tags", []), f"{chapter.name}: the install cell is not collapsed"


def _code(source: str, cell_id: str) -> dict:
    return {
        "cell_type": "code",
        "id": cell_id,
        "metadata": {},
        "outputs": [],
        "execution_count": None,
        "source": source,
    }


def test_sync_inserts_updates_and_is_idempotent() -> None:
    title = {"cell_type": "markdown", "id": "title", "metadata": {}, "source": "# A chapter"}
    cells = [title, _code("import ropelib", "imports")]
    new = sync.install_cell_source("https://example.org/fork/ropelib", "dev")

    assert sync.sync_cells(cells, new)
    assert [c["id"] for c in cells] == ["title", sync.CELL_ID, "imports"]
    assert cells[1]["source"] == new
    assert cells[1]["metadata"]["tags"] == [sync.TAG]  # shown collapsed on the page
    assert not sync.sync_cells(cells, new)  # a second run changes nothing

    newer = sync.install_cell_source("https://example.org/other/ropelib")
    assert sync.sync_cells(cells, newer)  # a changed URL replaces the cell, in place
    assert [c["id"] for c in cells] == ["title", sync.CELL_ID, "imports"]
    assert cells[1]["source"] == newer

    by_hand = _code('%pip install "ropelib @ git+https://x/y"', "by-hand")
    stale = [title, by_hand, _code("import ropelib", "imports")]
    assert sync.sync_cells(stale, newer)  # a hand-written first install cell is replaced
    assert [c["id"] for c in stale] == ["title", sync.CELL_ID, "imports"]
    later = [title, _code("import ropelib", "imports"), _code('%pip install "ropelib[hf]"', "extras")]
    assert sync.sync_cells(later, newer)  # a later cell that installs something is left alone
    assert [c["id"] for c in later] == ["title", sync.CELL_ID, "imports", "extras"]


def test_repository_settings_read_the_repository_block(tmp_path: Path) -> None:
    (tmp_path / "_config.yml").write_text(
        "title: x\nhtml:\n  url: https://not-this-one.org\nrepository:\n"
        "  url: https://github.com/someone/fork/  # a comment\n  branch: book\nlaunch_buttons:\n  x: 1\n",
        encoding="utf-8",
    )
    assert sync.repository_settings(tmp_path) == ("https://github.com/someone/fork", "book")
