"""Root pytest configuration: names available to every docstring example in ropelib."""

import pytest
import torch

import ropelib


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
    doctest_namespace["ropelib"] = ropelib
    for name in ropelib.__all__:
        doctest_namespace[name] = getattr(ropelib, name)
