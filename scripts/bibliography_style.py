"""The book's bibliography style: author-year labels, made unique, and ``et al.`` for a truncated list.

* BibTeX writes a truncated author list as ``A and B and C and others``; pybtex's styles print the
  last name ``others`` literally ("A, B, C, and others"). This style prints "A, B, C et al.".
* The chapters cite by author and year ("Sun et al., 2023"), and two works can share that text
  (xPos and RetNet). As natbib does, such works get a letter after the year, in the order of the
  bibliography ("2023a", "2023b"), in the citations and in the bibliography alike.
* Each entry's label is its citation as the chapters print it, "[Sun et al., 2023a]", rather
  than ``alpha``'s [SDP+23], so that a reader finds in the list what the text cited.

Entries are formatted as pybtex's ``unsrt`` (and ``alpha``) style formats them, sorted by
author, year and title read as text (so that ``{OpenAI}`` sorts under O).
``_config.yml`` loads this module as a local Sphinx extension and names the style in
``bibtex_default_style``.
"""

from __future__ import annotations

import string
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.sorting.author_year_title import SortingStyle as AuthorYearTitleSorting
from pybtex.style.template import FieldIsMissing, join, node, sentence

#: The sorting style's plugin name (author, year, title, with braces and TeX markup read as text).
SORTING_NAME = "author_year_title_as_text"

#: The name ``_config.yml`` gives in ``bibtex_default_style``.
STYLE_NAME = "author_year_et_al"


#: The field that keeps an entry's year as written once a letter is added to ``year``.
YEAR_AS_WRITTEN = "year_as_written"


def _is_others(person: Any) -> bool:
    return str(person).strip().lower() == "others"


def cited_as(entry: Any) -> tuple[str, ...]:
    """The author part of an author-year citation of ``entry``: one or two last names, or the first and "et al."."""
    persons = entry.persons.get("author") or entry.persons.get("editor") or []
    lasts = tuple(" ".join(person.last_names) for person in persons)
    if not lasts:
        return (entry.fields.get("title", entry.key),)
    return lasts if len(lasts) <= 2 else (lasts[0], "et al.")


def _plain(latex: str) -> str:
    """A name or title as text: braces and TeX markup resolved (``{OpenAI}`` -> ``OpenAI``)."""
    return Text.from_latex(latex).render_as("text") if "{" in latex or "\\" in latex else latex


def citation_label(entry: Any) -> str:
    """``entry`` as an author-year citation prints it: "Su, 2021a", "Su and Lu, 2021", "Sun et al., 2023"."""
    names = [_plain(name) for name in cited_as(entry)]
    if len(names) == 2:
        authors = f"{names[0]} et al." if names[1] == "et al." else f"{names[0]} and {names[1]}"
    else:
        authors = names[0]
    return f"{authors}, {entry.fields.get('year', 'n.d.')}"


def disambiguate_years(entries: Iterable[Any]) -> None:
    """Give works that share an author-year citation the letters a, b, ... after the year, in the given order.

    The year as written is kept in :data:`YEAR_AS_WRITTEN`, so that a second call (Sphinx formats a
    bibliography more than once) starts from it and gives the same letters.
    """
    groups: defaultdict[tuple[Any, ...], list[Any]] = defaultdict(list)
    for entry in entries:
        if YEAR_AS_WRITTEN in entry.fields:
            entry.fields["year"] = entry.fields[YEAR_AS_WRITTEN]
        groups[(*cited_as(entry), entry.fields.get("year"))].append(entry)
    for group in groups.values():
        if len(group) < 2 or group[0].fields.get("year") is None:
            continue
        for letter, entry in zip(string.ascii_lowercase, group):
            entry.fields[YEAR_AS_WRITTEN] = entry.fields["year"]
            entry.fields["year"] = entry.fields["year"] + letter


@node
def names_et_al(children: Any, context: Any, role: str) -> Text:
    """The names of ``role`` joined as ``unsrt`` joins them, with a final ``others`` as "et al."."""
    if children:
        raise ValueError(children)
    try:
        persons = context["entry"].persons[role]
    except KeyError as error:
        raise FieldIsMissing(role, context["entry"]) from error
    style = context["style"]
    truncated = bool(persons) and _is_others(persons[-1])
    named = persons[:-1] if truncated else persons
    formatted = [style.format_name(person, style.abbreviate_names) for person in named]
    if truncated:
        return Text(join(sep=", ")[formatted].format_data(context), " et al.")
    return join(sep=", ", sep2=" and ", last_sep=", and ")[formatted].format_data(context)


class AsTextSorting(AuthorYearTitleSorting):
    """pybtex's author-year-title order on the names as text: ``{OpenAI}`` sorts under O, not after Z."""

    def sorting_key(self, entry: Any) -> tuple[str, str, str]:
        author, year, title = super().sorting_key(entry)
        return _plain(author).lower(), year, _plain(title).lower()


# Registered on import: the formatting style finds its sorting style by name when it is made.
register_plugin("pybtex.style.sorting", SORTING_NAME, AsTextSorting)


class EtAlStyle(UnsrtStyle):
    """Author-year labels with a letter after a shared author-year, and ``et al.`` for a truncated list."""

    default_sorting_style = SORTING_NAME

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # pybtex's BaseStyle binds format_labels to its label style in __init__: replace that binding.
        self.format_labels = self._citation_labels

    def _citation_labels(self, sorted_entries: Iterable[Any]) -> list[str]:
        """Each entry's author-year citation, the years of shared citations with their letters."""
        entries = list(sorted_entries)
        disambiguate_years(entries)
        return [citation_label(entry) for entry in entries]

    def format_names(self, role: str, as_sentence: bool = True) -> Any:
        formatted = names_et_al(role)
        return sentence[formatted] if as_sentence else formatted


def setup(app: Any) -> dict[str, Any]:
    """Register the style with pybtex (Sphinx calls this when it loads the extension)."""
    register_plugin("pybtex.style.formatting", STYLE_NAME, EtAlStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
