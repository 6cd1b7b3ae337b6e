"""Passkey retrieval (Mohtashami and Jaggi, 2023) for byte-level models.

An example of ``n`` bytes is filler text with the needle ``"the pass key is 12345.\\n"`` inserted at
a chosen depth, then the question ``"\\nthe pass key is "`` and the key: the last
:data:`KEY_DIGITS` bytes are the answer. A model retrieves the key when its greedy continuation
of everything before the key is the key. Greedy decoding is exactly "every argmax, given the true
previous key bytes, is the true next byte" (by induction over the digits: a greedy decode that is
right so far has the true prefix), so one teacher-forced forward pass scores it (:func:`retrieved`).
"""

from __future__ import annotations

import torch

from .._validation import check_int

KEY_DIGITS = 5
NEEDLE = "the pass key is {key}.\n"
QUESTION = "\nthe pass key is "
OVERHEAD = len(NEEDLE.format(key="0" * KEY_DIGITS)) + len(QUESTION) + KEY_DIGITS


def encode(text: str) -> torch.Tensor:
    """ASCII text as int64 bytes."""
    return torch.tensor(list(text.encode("ascii")), dtype=torch.long)


def random_key(generator: torch.Generator) -> str:
    """A key of :data:`KEY_DIGITS` decimal digits (leading zeros allowed)."""
    return "".join(str(int(d)) for d in torch.randint(0, 10, (KEY_DIGITS,), generator=generator))


def needle_start(length: int, depth: float) -> int:
    """Where the needle begins in an example of ``length`` bytes: ``round(depth * filler bytes)``.

    Example:
        >>> needle_start(100, 0.0), needle_start(100, 1.0) == 100 - OVERHEAD
        (0, True)
    """
    length = check_int(length, "length", minimum=OVERHEAD + 1)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    return round(depth * (length - OVERHEAD))


def passkey_example(filler: torch.Tensor, length: int, depth: float, key: str) -> torch.Tensor:
    """One example of ``length`` bytes (int64): ``filler[:a] needle filler[a:] question key``.

    ``filler`` (int64 bytes) must hold at least ``length - OVERHEAD`` bytes; ``a = needle_start(length, depth)``.
    """
    start = needle_start(length, depth)
    if len(key) != KEY_DIGITS or not key.isdigit():
        raise ValueError(f"key must be {KEY_DIGITS} decimal digits, got {key!r}")
    room = length - OVERHEAD
    if filler.ndim != 1 or filler.numel() < room:
        raise ValueError(f"filler must be 1-D with at least {room} bytes, got shape {tuple(filler.shape)}")
    needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION + key)
    body = filler[:room].long()
    return torch.cat([body[:start], needle, body[start:], question])


def passkey_batch(
    data: torch.Tensor, length: int, depths: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, list[str]]:
    """Examples at ``depths`` (one per entry), fillers from random windows of ``data``: ``([b, length], keys)``."""
    room = length - OVERHEAD
    if data.numel() <= room:
        raise ValueError(f"data must hold more than {room} bytes of filler, got {data.numel()}")
    starts = torch.randint(0, data.numel() - room, (len(depths),), generator=generator)
    keys = [random_key(generator) for _ in range(len(depths))]
    rows = [passkey_example(data[s : s + room], length, float(d), k) for s, d, k in zip(starts, depths, keys)]
    return torch.stack(rows), keys


def retrieved(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exact match of the key per example: bool ``[batch]``.

    ``tokens`` ``[batch, n]`` are whole examples, ``logits`` ``[batch, n - 1, vocab]`` the model's
    outputs on ``tokens[:, :-1]``; the key is ``tokens[:, -KEY_DIGITS:]``, predicted at the last
    :data:`KEY_DIGITS` positions.
    """
    if logits.ndim != 3 or tokens.ndim != 2 or logits.shape[:2] != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(
            f"logits must be [batch, n - 1, vocab] for tokens [batch, n], got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    guess = logits[:, -KEY_DIGITS:].argmax(-1)
    return (guess == tokens[:, -KEY_DIGITS:]).all(-1)
