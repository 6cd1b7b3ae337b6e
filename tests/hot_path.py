"""Test helpers for the hot path: count tensor-to-Python conversions, and count graph breaks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

CONVERSIONS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def tensor_to_python_calls() -> Iterator[list[str]]:
    """Record every ``Tensor.item``/``tolist``/``int()``/``float()``/``bool()``/index conversion in the block."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counting(name: str) -> Callable[..., Any]:
        original = saved[name]

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def graph_breaks(fn: Callable[..., Any], *args: Any) -> tuple[int, list[str]]:
    """``torch._dynamo.explain``'s graph-break count and reasons for ``fn(*args)``."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_break_count, [str(reason.reason) for reason in explanation.break_reasons]
