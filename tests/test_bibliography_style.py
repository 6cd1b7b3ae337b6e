"""The book's bibliography style prints a truncated author list ("and others") as "et al."."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pybtex = pytest.importorskip("pybtex")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bibliography_style  # noqa: E402
from pybtex.database import parse_string  # noqa: E402

ENTRIES = r"""
@misc{four, author = {Bai, Jinze and Bai, Shuai and Chu, Yunfei and others}, title = {{Qwen}}, year = {2023}}
@misc{one, author = {Su, Jianlin}, title = {{One}}, year = {2021}}
@misc{two, author = {Su, Jianlin and Lu, Yu}, title = {{Two}}, year = {2021}}
@misc{three, author = {Su, Jianlin and Lu, Yu and Pan, Shengfeng}, title = {{Three}}, year = {2021}}
@misc{short, author = {Press, Ofir and others}, title = {{Short}}, year = {2022}}
"""


def _rendered() -> dict[str, tuple[str, str]]:
    style = bibliography_style.EtAlStyle()
    entries = parse_string(ENTRIES, "bibtex").entries
    return {entry.key: (entry.label, entry.text.render_as("text")) for entry in style.format_entries(entries.values())}


def test_truncated_lists_end_in_et_al() -> None:
    rendered = _rendered()
    assert rendered["four"][1] == "Jinze Bai, Shuai Bai, Yunfei Chu et al. Qwen. 2023."
    assert rendered["short"][1] == "Ofir Press et al. Short. 2022."


def test_full_lists_and_labels_are_alphas() -> None:
    rendered = _rendered()
    assert rendered["one"] == ("Su21", "Jianlin Su. One. 2021.")
    assert rendered["two"] == ("SL21", "Jianlin Su and Yu Lu. Two. 2021.")
    assert rendered["three"] == ("SLP21", "Jianlin Su, Yu Lu, and Shengfeng Pan. Three. 2021.")
    assert rendered["four"][0] == "BBC+23"


def test_the_book_uses_the_style() -> None:
    config = (Path(__file__).resolve().parents[1] / "_config.yml").read_text()
    assert f"bibtex_default_style: {bibliography_style.STYLE_NAME}" in config
    assert "bibliography_style: scripts" in config


SHARED = r"""
@misc{xpos, author = {Sun, Yutao and Dong, Li and Patra, Barun}, title = {{A Length-Extrapolatable Transformer}}, year = {2023}}
@misc{retnet, author = {Sun, Yutao and Dong, Li and Huang, Shaohan}, title = {{Retentive Network}}, year = {2023}}
@misc{alone, author = {Sun, Yutao and Dong, Li}, title = {{Two Authors}}, year = {2023}}
@misc{other_year, author = {Sun, Yutao and Ma, Shuming and Wang, Wenhui}, title = {{Later}}, year = {2024}}
"""


def test_works_sharing_an_author_year_citation_get_letters_in_bibliography_order() -> None:
    style = bibliography_style.EtAlStyle()
    entries = parse_string(SHARED, "bibtex").entries
    for _ in range(2):  # Sphinx formats a bibliography more than once: the same letters each time
        ordered = list(style.sort(entries.values()))
        labels = list(style.format_labels(ordered))
        years = {entry.key: entry.fields["year"] for entry in ordered}
        assert [entry.key for entry in ordered] == ["alone", "retnet", "xpos", "other_year"]
        assert years == {"retnet": "2023a", "xpos": "2023b", "alone": "2023", "other_year": "2024"}
        assert labels == ["SD23", "SDH23", "SDP23", "SMW24"]  # the alpha labels, from the years as written
    text = {e.key: e.text.render_as("text") for e in style.format_entries(entries.values())}
    assert text["xpos"] == "Yutao Sun, Li Dong, and Barun Patra. A Length-Extrapolatable Transformer. 2023b."


def test_cited_as_is_the_author_part_of_an_author_year_citation() -> None:
    entries = parse_string(SHARED + ENTRIES, "bibtex").entries
    assert bibliography_style.cited_as(entries["xpos"]) == ("Sun", "et al.")
    assert bibliography_style.cited_as(entries["alone"]) == ("Sun", "Dong")
    assert bibliography_style.cited_as(entries["one"]) == ("Su",)
    assert bibliography_style.cited_as(entries["four"]) == ("Bai", "et al.")  # "others" counts as a person
