"""The book's bibliography style: pybtex's ``alpha``, with a list that ends in ``and others`` printed ``et al.``.

BibTeX writes a truncated author list as ``A and B and C and others``; pybtex's styles print the
last name ``others`` literally ("A, B, C, and others"). This style prints "A, B, C et al." and is
otherwise ``alpha`` (labels such as [BBC+23], sorted by author, year and title). ``_config.yml``
loads this module as a local Sphinx extension and names the style in ``bibtex_default_style``.
"""

from __future__ import annotations

from typing import Any

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.template import FieldIsMissing, join, node, sentence

#: The name ``_config.yml`` gives in ``bibtex_default_style``.
STYLE_NAME = "alpha_et_al"


def _is_others(person: Any) -> bool:
    return str(person).strip().lower() == "others"


@node
def names_et_al(children: Any, context: Any, role: str) -> Text:
    """The names of ``role`` joined as ``alpha`` joins them, with a final ``others`` as "et al."."""
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


class EtAlStyle(AlphaStyle):
    """``alpha`` with ``et al.`` for a truncated list of names."""

    def format_names(self, role: str, as_sentence: bool = True) -> Any:
        formatted = names_et_al(role)
        return sentence[formatted] if as_sentence else formatted


def setup(app: Any) -> dict[str, Any]:
    """Register the style with pybtex (Sphinx calls this when it loads the extension)."""
    register_plugin("pybtex.style.formatting", STYLE_NAME, EtAlStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
