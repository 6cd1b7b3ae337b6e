"""The rendered-page check finds TeX left in the prose by a formula the math parser missed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_rendered_book  # noqa: E402

PATTERN = check_rendered_book.RAW_TEX_PATTERN


def test_a_formula_cut_by_a_list_item_is_found() -> None:
    # beyond_hybrids once rendered "gives $e^{\tau\Delta}/(e^{\tau\Delta} + N" and a bullet "1) ..."
    text = r"Scaling the logits by gives $e^{\tau\Delta}/(e^{\tau\Delta} + N 1) a N"
    hits = {hit.group() for hit in PATTERN.finditer(text)}
    assert hits == {"$", r"\tau"}  # "\Delta" follows a letter of "\tau": one control word is enough


def test_prose_without_tex_passes() -> None:
    for text in (
        "the cost is 5 $ per hour",  # a currency sign before a space
        r"a path C:\ and a lone backslash \ ",
        "The rotation keeps |q| and |k|; costs 3$ at most.",
    ):
        assert PATTERN.search(text) is None, text


def test_an_unparsed_markdown_table_is_found() -> None:
    table = check_rendered_book.RAW_TABLE_PATTERN
    assert table.search("| family | rows | |\u2014|\u2014| | llama | 3 |")  # smart quotes' dashes
    assert table.search("| a | b | | --- | --- | | 1 | 2 |")
    assert table.search("rows 3 \u2014 5 | and | a dash") is None
    assert table.search("a | b -- c | d") is None
