r"""The drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..._validation import check_choice, check_integer_tensor, check_positions
from ...kernels.ops import BACKENDS
from ...rotary import RotaryEmbedding
from ...scaling import rope_type_of


def config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config (anything with ``to_dict()``) or a ``config.json`` dict, as a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"config must be a transformers config (with to_dict()) or a dict, got {type(config).__name__}")
    return dict(to_dict())


class HFRotaryEmbedding(nn.Module):
    r"""A drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib.

    ``forward(x, position_ids)`` returns what the Hugging Face module returns: tables with
    ``cos[b, s, i] = cos[b, s, i + r/2] = a * cos(p * f_i)`` and ``sin`` likewise, where
    ``p = position_ids[b, s]``, ``f_i`` are the (scaled) inverse frequencies of the config's
    ``rope_type`` and ``a`` its attention scaling (YaRN's ``0.1 ln(factor) + 1``, LongRoPE's
    ``sqrt(1 + ln s / ln L)``; 1 otherwise). Each of the ``r/2`` angles is written twice because
    ``transformers`` rotates in the ``"half"`` layout (GPT-NeoX's form of RoFormer, Su et al., 2021,
    section 3.4.2).

    The tables come from a :class:`ropelib.RotaryEmbedding` built by
    :meth:`~ropelib.RotaryEmbedding.from_config`: angles formed in float64 and rounded once (where
    ``transformers`` forms them in float32), the scalings of :data:`~ropelib.scaling.registry.ROPE_SCALINGS`,
    and for ``"dynamic"`` and ``"longrope"`` the same length-following rule as ``transformers``'
    ``dynamic_rope_update``. No call reads position values on a GPU or under :func:`torch.compile`
    (except for those two length-following types, which read the length as ``transformers`` does).

    Args:
        config: the model's ``transformers`` config, or its ``config.json`` dict (read by
            :func:`ropelib.rope_config`).
        backend: how the patched ``apply_rotary_pos_emb`` rotates with these tables:
            ``"auto"``, ``"torch"`` or ``"triton"`` (see :class:`ropelib.RotaryEmbedding`).
        original: the module this one replaces; :func:`~ropelib.unpatch_hf_rope` puts it back.

    Shapes:
        ``x``: any tensor (only its dtype and device are read); ``position_ids``: integers of
        shape ``[batch, seq]`` or ``[seq]`` (negative ones, at padded slots, are allowed). Returns
        ``(cos, sin)``, each ``[batch, seq, r]`` (``[1, seq, r]`` for 1-D positions) in ``x``'s dtype.

    Example:
        >>> config = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
        >>> cos, sin = HFRotaryEmbedding(config)(torch.zeros(1), torch.tensor([[0, 1, 2]]))
        >>> cos.shape, cos[0, 0].tolist() == [1.0] * 8, sin[0, 0].tolist() == [0.0] * 8
        (torch.Size([1, 3, 8]), True, True)
    """

    def __init__(self, config: Any, *, backend: str = "auto", original: nn.Module | None = None) -> None:
        super().__init__()
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.config = config
        self.rope = RotaryEmbedding.from_config(config_dict(config), layout="half", backend=backend)
        self.rope_type = rope_type_of(self.rope.scaling)
        self._original = (original,)  # a tuple, so that the replaced module is not a submodule
        # the last tables returned, with ropelib's half-width float tables behind them (see tables_of)
        self._last: tuple[weakref.ref[torch.Tensor], torch.Tensor, torch.Tensor] | None = None

    @property
    def original(self) -> nn.Module | None:
        """The ``transformers`` module this one replaced (None when built directly)."""
        return self._original[0]

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies in use, ``[r/2]`` (the Hugging Face attribute)."""
        return self.rope.inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor that multiplies cos and sin (the Hugging Face attribute)."""
        return self.rope.attention_scaling

    def half_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """ropelib's ``[.., seq, r/2]`` tables at validated int64 ``positions``, in ``dtype`` (float32 or float64)."""
        cos, sin, rows = self.rope.tables_for(positions, positions.shape[-1], positions.device, dtype)
        if rows is None:
            rows = torch.arange(positions.shape[-1], device=positions.device)
        return cos[rows], sin[rows]

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_type is not None:
            raise ValueError(f"layer_type must be None (one RoPE setting for all layers), got {layer_type!r}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_integer_tensor(position_ids, "position_ids")
        if position_ids.ndim not in (1, 2):
            raise ValueError(f"position_ids must have shape [seq] or [batch, seq], got {list(position_ids.shape)}")
        positions = check_positions(
            position_ids, "position_ids", batch=position_ids.shape[0], seq_len=position_ids.shape[-1], minimum=None
        )
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos_half, sin_half = self.half_tables(positions.to(x.device), compute)
        if positions.ndim == 1:
            cos_half, sin_half = cos_half[None], sin_half[None]
        cos = torch.cat((cos_half, cos_half), dim=-1).to(x.dtype)
        sin = torch.cat((sin_half, sin_half), dim=-1).to(x.dtype)
        if not torch.compiler.is_compiling():
            self._last = (weakref.ref(cos), cos_half, sin_half)
        return cos, sin

    def tables_of(self, cos: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """ropelib's half-width tables behind ``cos`` when this module returned it last, else None."""
        last = self._last
        if last is None or last[0]() is not cos:
            return None
        return last[1], last[2]

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type!r}, backend={self.backend!r}"
