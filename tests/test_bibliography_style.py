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


def test_labels_are_the_author_year_citations() -> None:
    rendered = _rendered()
    # "one", "two" and "three" are all cited "Su ..., 2021" differently, so none needs a letter
    assert rendered["one"] == ("Su, 2021", "Jianlin Su. One. 2021.")
    assert rendered["two"] == ("Su and Lu, 2021", "Jianlin Su and Yu Lu. Two. 2021.")
    assert rendered["three"] == ("Su et al., 2021", "Jianlin Su, Yu Lu, and Shengfeng Pan. Three. 2021.")
    assert rendered["four"][0] == "Bai et al., 2023"


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
        assert labels == ["Sun and Dong, 2023", "Sun et al., 2023a", "Sun et al., 2023b", "Sun et al., 2024"]
    text = {e.key: e.text.render_as("text") for e in style.format_entries(entries.values())}
    assert text["xpos"] == "Yutao Sun, Li Dong, and Barun Patra. A Length-Extrapolatable Transformer. 2023b."


def test_a_corporate_author_is_labelled_as_written() -> None:
    entries = parse_string(
        r"@misc{meta, author = {{Llama Team, AI @ Meta}}, title = {{Herd}}, year = {2024}}", "bibtex"
    )
    assert bibliography_style.citation_label(entries.entries["meta"]) == "Llama Team, AI @ Meta, 2024"


def test_cited_as_is_the_author_part_of_an_author_year_citation() -> None:
    entries = parse_string(SHARED + ENTRIES, "bibtex").entries
    assert bibliography_style.cited_as(entries["xpos"]) == ("Sun", "et al.")
    assert bibliography_style.cited_as(entries["alone"]) == ("Sun", "Dong")
    assert bibliography_style.cited_as(entries["one"]) == ("Su",)
    assert bibliography_style.cited_as(entries["four"]) == ("Bai", "et al.")  # "others" counts as a person


def test_corporate_authors_sort_as_text() -> None:
    style = bibliography_style.EtAlStyle()
    entries = parse_string(
        r"""
@misc{openai, author = {{OpenAI}}, title = {{Card}}, year = {2025}}
@misc{zhu, author = {Zhu, Dawei}, title = {{PoSE}}, year = {2024}}
@misc{abdin, author = {Abdin, Marah}, title = {{Phi}}, year = {2024}}
""",
        "bibtex",
    ).entries
    assert [entry.key for entry in style.sort(entries.values())] == ["abdin", "openai", "zhu"]
