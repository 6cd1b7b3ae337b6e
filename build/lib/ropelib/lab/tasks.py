"""The lab's two synthetic tasks: sequence repetition (a long-range lookup) and lagged copy (a fixed local offset).

Both return ``(tokens, targets)``, int64 ``[batch, length]``, with ``targets == IGNORE`` where no
loss is taken. A model is scored (accuracy and cross-entropy) only on the other positions.

* ``repeat``: ``x_1 .. x_n x_1 .. x_n`` with ``n`` distinct tokens; in the copy, predict the next
  token. Solved by an induction circuit (Olsson et al., 2022): a one-token local step plus a content
  lookup whose distance ``n`` grows with the length.
* ``lag``: uniform random tokens (repeats allowed); at every position ``t >= K`` output ``x_{t-K}``,
  the token ``K`` positions back. Only the relative offset ``K`` matters, never the content and never
  a long distance: a model needs *exact* relative position, the opposite demand from ``repeat``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._validation import check_int

IGNORE = -100  # target of positions without a loss

#: ``(batch_size, length, vocab_size, lag, generator) -> (tokens, targets)``
TaskFunction = Callable[[int, int, int, int, torch.Generator], "tuple[torch.Tensor, torch.Tensor]"]


def repeat_task(
    batch_size: int, length: int, vocab_size: int, lag: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat-the-sequence examples (``lag`` is unused): see :func:`ropelib.lab.repeat_batch`."""
    length = check_int(length, "length", minimum=4)
    half = length // 2
    if length % 2:
        raise ValueError(f"length must be even (two copies), got {length}")
    if half > vocab_size:
        raise ValueError(f"length {length} needs {half} distinct tokens but vocab_size={vocab_size}")
    first = torch.rand(batch_size, vocab_size, generator=generator).argsort(-1)[:, :half]
    tokens = torch.cat((first, first), dim=1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, half:-1] = first[:, 1:]
    return tokens, targets


def lag_task(
    batch_size: int, length: int, vocab_size: int, lag: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lagged-copy examples: tokens uniform in ``[0, vocab)``; ``targets[t] = tokens[t - lag]`` for ``t >= lag``.

    Example:
        >>> tokens, targets = lag_task(1, 6, 10, 2, torch.Generator().manual_seed(0))
        >>> targets[0, :2].tolist(), targets[0, 2:].tolist() == tokens[0, :4].tolist()
        ([-100, -100], True)
    """
    length = check_int(length, "length", minimum=2)
    lag = check_int(lag, "lag", minimum=1)
    if length <= lag:
        raise ValueError(f"length must exceed lag={lag} (nothing to predict), got {length}")
    tokens = torch.randint(0, vocab_size, (batch_size, length), generator=generator)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, lag:] = tokens[:, :-lag]
    return tokens, targets


#: Task name -> batch function. The evaluation seed of a task adds ``1_000_000 * index`` (its place here).
TASKS: dict[str, TaskFunction] = {"repeat": repeat_task, "lag": lag_task}
