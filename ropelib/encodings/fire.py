r"""FIRE (Li et al., 2024): a learned function of the progressively normalised distance as the score bias.

For a causal query at position ``i`` and a key at ``j <= i``,

.. math::

    b_{ij} = f_\theta\!\left(\frac{\psi(i - j)}{\psi(\max(L, i))}\right), \qquad \psi(x) = \log(c x + 1),

with ``f_theta`` a small MLP (one input, one output per head), and ``c > 0`` and the threshold
``L > 0`` learned. The input lies in ``[0, 1]`` for every query (``i - j <= i``): at any length
the MLP is evaluated only where it was trained, and a longer sequence interpolates (the
"progressive interpolation" of the title). Below the threshold (``i < L``) the normaliser is
fixed at ``psi(L)``, so short sequences see the distances themselves.

As in the paper's code, ``psi`` reads ``|i - j|`` and the MLP is one hidden layer of 32 ReLU
units; ``c = exp(.)`` and ``L = exp(.)`` stay positive and start at the paper's 0.1 and 512.
ropelib takes ``max(L, i, D_i)`` as the normaliser, ``D_i`` the farthest ``|i - j|`` the query
sees (``i`` itself for causal attention over positions ``0, 1, ...``, where this is the paper's
formula): so the input stays in ``[0, 1]`` for any positions, and in a non-causal layer too.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from .._validation import check_bool, check_int, check_integer_tensor, check_position_range, check_positive_float
from .flex import SIZES, ScoreMod, ScoreModSizes


class FireBias(nn.Module):
    r"""FIRE's bias ``f_theta(psi(|i - j|) / psi(max(L, i, D_i)))``, one output per head.

    Args:
        num_heads: outputs of the MLP.
        mlp_width: hidden ReLU units (32 in the paper).
        init_c: the initial ``c`` of ``psi(x) = log(c x + 1)`` (0.1 in the paper's code).
        init_threshold: the initial ``L`` (512 in the paper's code).

    Shapes:
        ``forward(positions, causal=True)``: integer positions ``[seq]`` or ``[batch, seq]`` of the
        queries and keys (self-attention) -> ``[..., num_heads, seq, seq]`` in the parameters' dtype.
    """

    def __init__(self, num_heads: int, mlp_width: int = 32, init_c: float = 0.1, init_threshold: float = 512.0):
        super().__init__()
        self.num_heads = check_int(num_heads, "num_heads", minimum=1)
        width = check_int(mlp_width, "mlp_width", minimum=1)
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, self.num_heads))
        self.log_c = nn.Parameter(torch.tensor(math.log(check_positive_float(init_c, "init_c"))))
        threshold = check_positive_float(init_threshold, "init_threshold")
        self.log_threshold = nn.Parameter(torch.tensor(math.log(threshold)))

    @property
    def c(self) -> torch.Tensor:
        return self.log_c.exp()

    @property
    def threshold(self) -> torch.Tensor:
        """``L``."""
        return self.log_threshold.exp()

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        """``log(c x + 1)``."""
        return torch.log1p(self.c * x)

    def normalized_distance(self, positions: torch.Tensor, causal: bool) -> torch.Tensor:
        """The MLP's input ``psi(|i - j|) / psi(max(L, i, D_i))`` in ``[0, 1]``, ``[..., seq, seq]`` (no checks)."""
        positions = positions.to(device=self.log_c.device, dtype=self.log_c.dtype)
        distance = (positions.unsqueeze(-1) - positions.unsqueeze(-2)).abs()
        if causal:
            seq = positions.shape[-1]
            hidden = torch.ones(seq, seq, dtype=torch.bool, device=distance.device).triu(1)
            distance = distance.masked_fill(hidden, 0.0)  # future keys: masked by the layer anyway
        farthest = torch.maximum(distance.amax(-1), positions)
        normaliser = torch.maximum(farthest, self.threshold)
        return self.psi(distance) / self.psi(normaliser).unsqueeze(-1)

    def forward(self, positions: torch.Tensor, causal: bool = True) -> torch.Tensor:
        positions = check_integer_tensor(positions, "positions")
        if positions.ndim not in (1, 2):
            raise ValueError(f"positions must have shape [seq] or [batch, seq], got {list(positions.shape)}")
        check_position_range(positions, "positions", minimum=0)
        return self.bias(positions.long(), check_bool(causal, "causal"))

    def bias(self, positions: torch.Tensor, causal: bool) -> torch.Tensor:
        """The module's call without argument checks (int64 ``positions`` ``[seq]`` or ``[batch, seq]``)."""
        return self.mlp(self.normalized_distance(positions, causal).unsqueeze(-1)).movedim(-1, -3)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


def fire_score_mod(fire: FireBias) -> ScoreMod:
    """A causal ``flex_attention`` ``score_mod`` adding ``fire``'s bias (parameters detached, float32).

    Query and key indices are the positions (``0 .. seq - 1``); keys after the query get ``-inf``
    (FIRE is a causal encoding, and :func:`~ropelib.encodings.flex.flex_bias_attention` takes no
    mask). The MLP is unrolled over its hidden units, one scalar each, as ``score_mod`` computes
    one score at a time. Any length; built for ``fire.num_heads`` heads.
    """
    if not isinstance(fire, FireBias):
        raise TypeError(f"fire must be a FireBias, got {type(fire).__name__}")
    first, last = cast(nn.Linear, fire.mlp[0]), cast(nn.Linear, fire.mlp[2])
    w1, b1 = (t.detach().to(torch.float32).flatten() for t in (first.weight, first.bias))
    w2, b2 = (t.detach().to(torch.float32) for t in (last.weight, last.bias))
    c, threshold = (t.detach().to(torch.float32) for t in (fire.c, fire.threshold))
    width = w1.shape[0]

    def fire_bias(score, batch, head, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs().to(torch.float32)
        x = torch.log1p(c * distance) / torch.log1p(c * torch.maximum(q_idx.to(torch.float32), threshold))
        out = b2[head]
        for unit in range(width):
            out = out + w2[head, unit] * torch.relu(w1[unit] * x + b1[unit])
        return torch.where(kv_idx <= q_idx, score + out, float("-inf"))

    setattr(fire_bias, SIZES, ScoreModSizes("fire", fire.num_heads, None, w1.device))
    return fire_bias
