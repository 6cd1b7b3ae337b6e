"""Float64 reference implementations for the tests, written from the papers' formulas, independently of ropelib.

They loop over pairs and build explicit 2x2 rotation matrices, so a mistake in ropelib's
vectorised code cannot be repeated here by construction. Test modules import them with
``from references import ...`` (pytest puts this directory on ``sys.path``).
"""

from __future__ import annotations

import math

import torch

# Machine epsilon (spacing of floats just above 1.0) of each dtype the library accepts.
EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def sinusoid_ref(positions: list[int], dim: int, base: float = 10000.0) -> torch.Tensor:
    """The table from the paper's formula, one entry at a time, float64 ``[len(positions), dim]``."""
    rows = []
    for p in positions:
        row = []
        for i in range(dim // 2):
            angle = p / base ** (2 * i / dim)
            row += [math.sin(angle), math.cos(angle)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def inverse_frequencies_ref(rotary_dim: int, theta: float) -> list[float]:
    """``theta^(-2i/r)`` for ``i = 0 .. r/2 - 1`` (RoFormer eq. 15), as Python floats (double)."""
    return [theta ** (-2.0 * i / rotary_dim) for i in range(rotary_dim // 2)]


def pair_indices(rotary_dim: int, layout: str) -> list[tuple[int, int]]:
    """Which two features form pair ``i``: ``(i, i + r/2)`` for "half", ``(2i, 2i+1)`` for "interleaved"."""
    if layout == "half":
        return [(i, i + rotary_dim // 2) for i in range(rotary_dim // 2)]
    return [(2 * i, 2 * i + 1) for i in range(rotary_dim // 2)]


def rotation_matrix_ref(
    position: float, head_dim: int, *, theta: float = 10000.0, layout: str = "half", rotary_dim: int | None = None
) -> torch.Tensor:
    """The ``[head_dim, head_dim]`` float64 matrix ``R_m``: one 2x2 rotation per pair, identity on the tail.

    Pair ``(a, b)`` at angle ``phi = m * theta^(-2i/r)`` maps ``(x_a, x_b)`` to
    ``(x_a cos phi - x_b sin phi, x_a sin phi + x_b cos phi)``.
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    R = torch.eye(head_dim, dtype=torch.float64)
    for (a, b), freq in zip(pair_indices(rotary_dim, layout), inverse_frequencies_ref(rotary_dim, theta)):
        phi = position * freq
        c, s = math.cos(phi), math.sin(phi)
        R[a, a], R[a, b] = c, -s
        R[b, a], R[b, b] = s, c
    return R


def rotate_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    theta: float = 10000.0,
    layout: str = "half",
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Rotate ``x`` (``[batch, seq, heads, d]``) by ``R_{positions}``, in float64, one matrix per token.

    ``positions`` is ``[seq]`` or ``[batch, seq]``.
    """
    batch, seq, _, head_dim = x.shape
    positions = positions.expand(batch, seq) if positions.ndim == 1 else positions
    out = torch.empty(x.shape, dtype=torch.float64)
    cache: dict[int, torch.Tensor] = {}
    for b in range(batch):
        for s in range(seq):
            p = int(positions[b, s])
            if p not in cache:
                cache[p] = rotation_matrix_ref(p, head_dim, theta=theta, layout=layout, rotary_dim=rotary_dim)
            out[b, s] = x[b, s].double() @ cache[p].T
    return out


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v on ``[batch, heads, seq, d]``, with an explicit max-subtracted softmax."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if causal:
        n = q.shape[-2]
        future = torch.tensor([[j > i for j in range(n)] for i in range(n)])
        scores = scores.masked_fill(future, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    weights = weights / weights.sum(-1, keepdim=True)
    return weights @ v


def yarn_ref(
    rotary_dim: int, base: float, factor: float, original: int, beta_fast: float = 32.0, beta_slow: float = 1.0
):
    """YaRN's inverse frequencies and temperature from the formulas (Peng et al., 2024, sec. 3; the ramp
    bounds floored/ceiled as in the released code), in Python floats: ``(list of d/2 floats, mscale)``."""

    def pair_of(turns: float) -> float:  # the pair index whose wavelength fits `turns` times in `original`
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair_of(beta_fast)), 0), min(math.ceil(pair_of(beta_slow)), rotary_dim - 1)
    high = high + 0.001 if low == high else high
    out = []
    for i, inv in enumerate(inverse_frequencies_ref(rotary_dim, base)):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(inv * (1 - ramp) + inv / factor * ramp)
    return out, 0.1 * math.log(factor) + 1.0


def t5_bucket_peer(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's own bucket function (``transformers``' ``T5Attention._relative_position_bucket``): the peer."""
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(
        relative_position, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


def remapped_scores_ref(q: torch.Tensor, k: torch.Tensor, relative, *, theta: float = 10000.0, layout: str = "half"):
    """Scores at remapped relative positions, one explicit rotation per pair, float64 ``[batch, heads, seq, seq]``.

    ``relative(b, i, j)`` is the relative position pair ``(i, j)`` of row ``b`` is scored at (the
    scheme's formula); RoPE's score at relative position ``r`` is ``(R_r q_i) . k_j / sqrt(d)``, since
    ``(R_a q) . (R_b k) = q^T R_{b - a} k``.
    """
    batch, seq, heads, head_dim = q.shape
    out = torch.empty(batch, heads, seq, seq, dtype=torch.float64)
    matrices: dict[float, torch.Tensor] = {}
    for b in range(batch):
        for i in range(seq):
            for j in range(seq):
                r = relative(b, i, j)
                if r not in matrices:
                    matrices[r] = rotation_matrix_ref(r, head_dim, theta=theta, layout=layout)
                for h in range(heads):
                    rotated = matrices[r] @ q[b, i, h].double()
                    out[b, h, i, j] = rotated @ k[b, j, h].double() / math.sqrt(head_dim)
    return out
