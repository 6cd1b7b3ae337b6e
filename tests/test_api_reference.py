"""The API reference page (book/api.md) documents every name of ``ropelib.__all__``.

A name added to ``ropelib.__all__`` without an autodoc entry in book/api.md fails here, with the
module section it belongs in, rather than silently missing from the book.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import ropelib

API_PAGE = Path(__file__).resolve().parent.parent / "book" / "api.md"
DIRECTIVE = re.compile(r"^\.\. auto(function|class|data|module):: (\S+)$", flags=re.MULTILINE)


def documented_objects() -> dict[int, str]:
    """``id(object) -> directive target`` for every autodoc directive on the page."""
    found = {}
    for kind, target in DIRECTIVE.findall(API_PAGE.read_text(encoding="utf-8")):
        if kind == "module":
            continue
        module_name, _, attr = target.rpartition(".")
        found[id(getattr(importlib.import_module(module_name), attr))] = target
    return found


@pytest.mark.parametrize("name", ropelib.__all__)
def test_every_public_name_is_on_the_api_page(name: str) -> None:
    obj = getattr(ropelib, name)
    home = getattr(obj, "__module__", None) if inspect.isfunction(obj) or inspect.isclass(obj) else None
    assert id(obj) in documented_objects(), (
        f"ropelib.{name} is not in book/api.md: add '.. auto{'class' if inspect.isclass(obj) else 'function'}:: "
        f"ropelib.{name}' to the section of {home or 'its module'}"
    )


@pytest.mark.parametrize(
    "name",
    [n for n in ropelib.__all__ if inspect.isfunction(getattr(ropelib, n)) or inspect.isclass(getattr(ropelib, n))],
)
def test_every_public_function_and_class_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(ropelib, name)) or ""
    assert len(doc.split()) >= 5, f"ropelib.{name} needs a docstring (formula, shapes, dtypes, source paper)"


def test_page_targets_resolve() -> None:
    # every directive points at an importable object (a renamed function would otherwise fail only in the book build)
    assert len(documented_objects()) >= len(ropelib.__all__)
