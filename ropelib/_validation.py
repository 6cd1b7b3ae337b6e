"""Argument checks shared by every public function.

Each check raises :class:`TypeError` for a value of the wrong kind and :class:`ValueError`
for a value of the right kind but the wrong size or range; the message always names the
argument and says what was expected.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an ``int``; rejects bools, floats and anything below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_even(value: object, name: str) -> int:
    """A positive even ``int`` (rotations act on pairs of features)."""
    value = check_int(value, name, minimum=2)
    if value % 2:
        raise ValueError(f"{name} must be even (features are rotated in pairs), got {value}")
    return value


def check_positive_float(value: object, name: str) -> float:
    """A finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {list(choices)}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_float_tensor(x: object, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """A floating-point tensor (float16, bfloat16, float32 or float64), optionally of rank ``ndim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_positions(
    positions: object,
    name: str,
    *,
    batch: int | None,
    seq_len: int,
    limit: int | None = None,
) -> torch.Tensor:
    """Integer positions of shape ``[seq_len]`` or ``[batch, seq_len]``, all >= 0 (and < ``limit``).

    Returns the tensor as ``int64``. Floating, boolean and complex tensors are rejected rather
    than rounded: a position is a token index.
    """
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {positions.dtype}")
    shapes = [(seq_len,)] + ([(batch, seq_len)] if batch is not None else [])
    if tuple(positions.shape) not in shapes:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {expected}, got {list(positions.shape)}")
    if positions.numel():
        low = int(positions.min())
        if low < 0:
            raise ValueError(f"{name} must be >= 0, got a minimum of {low}")
        if limit is not None:
            high = int(positions.max())
            if high >= limit:
                raise ValueError(f"{name} must be < {limit} (the table's size), got a maximum of {high}")
    return positions.long()


def check_same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Both tensors on the same device."""
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}; expected the same device")
