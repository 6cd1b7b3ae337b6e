r"""FoPE (Hua et al., 2025, "Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length Generalization").

RoPE multiplies pair ``j`` of a query or key at position ``m`` (a complex number ``x_j``) by
``e^{i theta_j m}``: one frequency per pair. FoPE makes each pair a Fourier series over the
frequencies the training length ``L`` trains, and clips the ones it does not train:

.. math::

    \begin{aligned}
    z_j(m) &= \textstyle\sum_{k \in K} \big(A^c_{kj} \cos \theta_k m
              + i\, A^s_{kj} \sin \theta_k m\big) \quad (j \in K), \\
    z_j(m) &= 1 \quad (j \notin K),
    \end{aligned}

with ``theta_k = base^{-2k/d}``, ``K = {k : theta_k >= 2 pi / L}`` (every pair when ``L`` is None)
and ``x_j -> x_j z_j(m)``. ``A = I + (sigma / sqrt|K|) E``, ``E`` standard normal, one matrix for the
cosines and one for the sines (the authors' ``eye_xavier_norm`` initialisation with separate bases;
fixed, or learned with ``learned=True``). The pairs ``j not in K`` turn at zero frequency: their
wavelength ``2 pi / theta_j`` exceeds ``L``, so they never completed a turn in training ("clip to
floor"), and they become position-free. With ``sigma = 0`` (``A = I``) and ``L = None`` this is RoPE.

Choices, stated: the coefficients are shared by the heads (the authors can keep one matrix per
head); pair ``j`` keeps its own dominant frequency as the leading term (the authors' code maps the
``|K|`` kept frequencies onto ``min(|K|, d/4)`` output pairs); the clipped pairs take the zero
frequency's ``cos 0 = 1, sin 0 = 0`` as the paper states (the authors' code pads both with 1, a fixed
position-free map too). ``|z_j| != 1`` in general, so FoPE is not a rotation, and ``q . k`` depends on
``m`` and ``n``, not only on ``m - n``; it is still applied by ropelib's operator, with the tables
``(Re z, Im z)`` in the place of ``(cos, sin)``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .._validation import (
    check_bool,
    check_choice,
    check_even,
    check_int,
    check_positions,
    check_positive_float,
    check_qk,
)
from ..frequencies import default_inverse_frequencies
from ..kernels.door import check_kernel
from ..layouts import LAYOUTS
from .cache import table_dtype
from .rotation import Rotation


def fope_kept_pairs(inv_freq: torch.Tensor, train_length: int | None) -> int:
    """``|K|``: the pairs whose frequency is ``>= 2 pi / train_length`` (all for None); they come first (decreasing)."""
    if train_length is None:
        return inv_freq.numel()
    return int(inv_freq.ge(2 * math.pi / train_length).sum())


class FourierPositionEmbedding(nn.Module):
    r"""FoPE (Hua et al., 2025): every pair a Fourier series of the trained frequencies (see the module docstring).

    Args:
        head_dim: per-head width ``d`` (even).
        theta: RoPE's base (``theta_k = base^{-2k/d}``).
        train_length: ``L``; the pairs with ``theta_j < 2 pi / L`` are clipped to zero frequency (None: none).
        sigma: the spread of the extra coefficients, ``>= 0`` (0.3 in the paper's smallest models).
        learned: the coefficient matrices are parameters (else fixed buffers).
        layout: ``"half"`` or ``"interleaved"``.
        kernel: ``"auto"``, ``"torch"``, ``"native"`` or ``"triton"``.

    Shapes:
        ``forward(q, k, positions=None)`` as :class:`~ropelib.RotaryEmbedding`: ``q`` ``[batch, seq,
        q_heads, d]``, ``k`` ``[batch, seq, kv_heads, d]``, integer ``positions`` ``[seq]``, ``[1, seq]``
        or ``[batch, seq]``, ``>= 0``. :meth:`tables` gives ``(Re z, Im z)``.

    Example:
        >>> fope = FourierPositionEmbedding(8, train_length=64)
        >>> fope.kept, fope.cos_coef.shape  # 2 pi / 64 ~ 0.098: keeps 1 and 0.1
        (2, torch.Size([2, 2]))
    """

    cos_coef: torch.Tensor
    sin_coef: torch.Tensor
    head_dim: int
    theta: float
    train_length: int | None
    sigma: float
    learned: bool
    layout: str
    kernel: str
    kept: int
    _inv_freq64: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        *,
        train_length: int | None = None,
        sigma: float = 0.3,
        learned: bool = False,
        layout: str = "half",
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.head_dim = check_even(head_dim, "head_dim")
        self.theta = check_positive_float(theta, "theta")
        self.train_length = None if train_length is None else check_int(train_length, "train_length", minimum=1)
        if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
            raise TypeError(f"sigma must be a real number >= 0, got {type(sigma).__name__}")
        if not 0.0 <= float(sigma) < math.inf:
            raise ValueError(f"sigma must be a finite number >= 0, got {float(sigma)}")
        self.sigma = float(sigma)
        self.learned = check_bool(learned, "learned")
        self.layout = check_choice(layout, "layout", LAYOUTS)
        self.kernel = check_choice(kernel, "kernel", ("auto", "torch", "native", "triton"))
        self._inv_freq64 = default_inverse_frequencies(self.head_dim, self.theta)  # float64, a plain attribute
        self.kept = fope_kept_pairs(self._inv_freq64, self.train_length)
        for name in ("cos_coef", "sin_coef"):
            empty = torch.empty(self.kept, self.kept)
            if self.learned:
                setattr(self, name, nn.Parameter(empty))
            else:
                self.register_buffer(name, empty)
        self.reset_parameters()

    @property
    def frequencies(self) -> torch.Tensor:
        """The frequencies in use, float64 ``[d/2]``, ``theta_j`` for the kept pairs and 0 for the clipped ones."""
        out = self._inv_freq64.clone()
        out[self.kept :] = 0.0
        return out

    def reset_parameters(self) -> None:
        """``A = I + (sigma / sqrt|K|) E`` for both matrices (the global generator draws ``E``)."""
        with torch.no_grad():
            for coef in (self.cos_coef, self.sin_coef):
                coef.normal_(0.0, self.sigma / math.sqrt(max(self.kept, 1))).add_(torch.eye(self.kept))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Re z(m), Im z(m))`` for checked integer ``positions`` of any shape: ``positions.shape + (d/2,)`` in ``dtype``.

        The base ``cos theta_k m``, ``sin theta_k m`` in float64, rounded once to ``dtype``, then mixed by the
        coefficients in ``dtype`` (differentiable with respect to them).
        """
        angles = positions.to(torch.float64)[..., None] * self._inv_freq64[: self.kept].to(positions.device)
        real = angles.cos().to(dtype) @ self.cos_coef.to(dtype)
        imag = angles.sin().to(dtype) @ self.sin_coef.to(dtype)
        ones = torch.ones((*positions.shape, self.head_dim // 2 - self.kept), dtype=dtype, device=positions.device)
        real, imag = torch.cat((real, ones), dim=-1), torch.cat((imag, torch.zeros_like(ones)), dim=-1)
        return real, imag

    def rotation(self, q: torch.Tensor, positions: torch.Tensor | None = None) -> Rotation:
        """The :class:`~ropelib.Rotation` (a row of ``(Re z, Im z)`` per token) for ``q`` ``[batch, seq, heads, d]``."""
        batch, seq = q.shape[:2]
        if positions is None:
            positions = torch.arange(seq, device=q.device)
        else:
            positions = check_positions(positions, "positions", batch=batch, seq_len=seq, expand=False).to(q.device)
        real, imag = self.tables(positions, table_dtype(q.dtype))
        rows = torch.arange(positions.numel(), device=q.device).view(positions.shape)
        return Rotation(
            real.reshape(-1, real.shape[-1]),
            imag.reshape(-1, imag.shape[-1]),
            rows,
            self.layout == "interleaved",
            check_kernel(self.kernel, q.device, q.dtype),
            self.head_dim,
            seq,
            differentiable=real.requires_grad,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_qk(q, k, head_dim=self.head_dim)
        return self.rotation(q, positions).apply(q, k)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, theta={self.theta}, train_length={self.train_length}, sigma={self.sigma}, "
            f"kept={self.kept}, learned={self.learned}, layout={self.layout!r}"
        )
