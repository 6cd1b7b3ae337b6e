r"""KERPLE (Chi et al., 2022): conditionally positive definite kernels of ``|i - j|`` as score biases.

The bias of head ``h`` is a kernel of the distance alone,

.. math::

    \text{log:}\quad b_{ij} = -r_1 \log(1 + r_2 |i - j|), \qquad
    \text{power:}\quad b_{ij} = -r_1 |i - j|^{r_2},

with learned ``r_1, r_2 > 0`` per head (``r_2 <= 2`` for the power kernel). Both are conditionally
positive definite (CPD, the paper's section 3): ``sum_ij c_i c_j b_ij >= 0`` whenever
``sum_i c_i = 0``. On a finite set of positions a CPD kernel plus a large enough constant is
positive definite, and softmax ignores a constant added to every score, so the scores
``q_i . k_j + b_ij`` act as a positive definite kernel: the paper's reason for these shapes.
ALiBi is the power kernel with ``r_2 = 1`` and ``r_1`` its slope.

The parameters are kept in range by construction: ``r_1 = softplus(a)``, ``r_2 = softplus(b)``
(log) or ``r_2 = 2 sigmoid(b)`` (power, the open interval ``(0, 2)``). They start at ALiBi: the
power kernel at ``r_1`` = ALiBi's slopes and ``r_2 = 1``; the log kernel at ``r_1 = 1`` and
``r_2`` = ALiBi's slopes (the same slope at ``|i - j| -> 0``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_choice, check_int
from .flex import SIZES, ScoreMod, ScoreModSizes
from .relative import _check_relative, alibi_slopes

#: The two kernels of the paper.
KERPLE_KINDS = ("log", "power")


def kerple_kernel(distance: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, kind: str) -> torch.Tensor:
    """``-r1 log(1 + r2 d)`` or ``-r1 d^r2`` for a floating ``distance`` ``d >= 0`` (broadcast with ``r1``, ``r2``).

    ``d^r2`` is written as ``where(d > 0, d, 1)^r2`` at ``d > 0`` and 0 at ``d = 0``, so that its
    gradient in ``r2`` (``d^r2 log d``) is 0 there rather than ``0 * -inf``.
    """
    if kind == "log":
        return -r1 * torch.log1p(r2 * distance)
    positive = distance > 0
    return torch.where(positive, -r1 * torch.where(positive, distance, 1.0) ** r2, 0.0)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))  # log(e^y - 1), without overflow for large y


class KerpleBias(nn.Module):
    r"""KERPLE's learned bias ``b_ij = k(|i - j|)`` per head (log or power kernel).

    Args:
        num_heads: attention heads (each learns its own ``r_1``, ``r_2``).
        kind: ``"log"`` (the paper's best) or ``"power"``.

    Shapes:
        ``forward(relative_position)`` takes integer ``j - i`` of shape ``[..., query_len, key_len]``
        (see :func:`~ropelib.relative_positions`) and returns ``[..., num_heads, query_len, key_len]``
        in the parameters' dtype.
    """

    def __init__(self, num_heads: int, kind: str = "log") -> None:
        super().__init__()
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        self.kind = check_choice(kind, "kind", KERPLE_KINDS)
        slopes = alibi_slopes(self.num_heads).float()
        ones = torch.ones(self.num_heads)
        r1, r2 = (slopes, ones) if self.kind == "power" else (ones, slopes)
        self.raw_r1 = nn.Parameter(_inverse_softplus(r1))
        self.raw_r2 = nn.Parameter(torch.logit(r2 / 2) if self.kind == "power" else _inverse_softplus(r2))

    @property
    def r1(self) -> torch.Tensor:
        """``[heads]``, > 0."""
        return F.softplus(self.raw_r1)

    @property
    def r2(self) -> torch.Tensor:
        """``[heads]``, > 0 (and < 2 for the power kernel)."""
        return 2 * torch.sigmoid(self.raw_r2) if self.kind == "power" else F.softplus(self.raw_r2)

    def forward(self, relative_position: torch.Tensor) -> torch.Tensor:
        return self.bias(_check_relative(relative_position, ndim_at_least=2))

    def bias(self, relative_position: torch.Tensor) -> torch.Tensor:
        """The module's call without argument checks (int64 ``relative_position``)."""
        distance = relative_position.to(self.raw_r1.device).abs().to(self.raw_r1.dtype).unsqueeze(-3)
        return kerple_kernel(distance, self.r1[:, None, None], self.r2[:, None, None], self.kind)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, kind={self.kind!r}"


def kerple_score_mod(kerple: KerpleBias) -> ScoreMod:
    """A ``flex_attention`` ``score_mod`` adding ``kerple``'s bias (its current ``r_1``, ``r_2``, detached, float32).

    Any length; built for ``kerple.num_heads`` heads (:func:`~ropelib.encodings.flex.flex_bias_attention` checks).
    """
    if not isinstance(kerple, KerpleBias):
        raise TypeError(f"kerple must be a KerpleBias, got {type(kerple).__name__}")
    r1, r2 = (p.detach().to(torch.float32) for p in (kerple.r1, kerple.r2))
    kind = kerple.kind

    def kerple_bias(score, batch, head, q_idx, kv_idx):
        distance = (kv_idx - q_idx).abs().to(torch.float32)
        return score + kerple_kernel(distance, r1[head], r2[head], kind)

    setattr(kerple_bias, SIZES, ScoreModSizes("kerple", kerple.num_heads, None, r1.device))
    return kerple_bias
