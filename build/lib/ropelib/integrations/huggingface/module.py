r"""The drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..._validation import check_bool, check_choice, check_integer_tensor, check_positions
from ...config import rope_config
from ...kernels.ops import BACKENDS
from ...mrope import MRotaryEmbedding
from ...rotary import RotaryEmbedding
from ...scaling import rope_type_of

#: The forms of tables a ``transformers`` rotary module returns (see :class:`HFRotaryEmbedding`).
OUTPUTS = ("cat", "repeat", "sin_cos", "complex")


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

    ``forward(x, position_ids)`` returns what the Hugging Face module returns, built from
    ``c[b, s, i] = a * cos(p * f_i)`` and ``s[b, s, i] = a * sin(p * f_i)`` (``i < r/2``), where
    ``p = position_ids[b, s]``, ``f_i`` are the (scaled) inverse frequencies of the config's
    ``rope_type`` and ``a`` its attention scaling (YaRN's ``0.1 ln(factor) + 1``, LongRoPE's
    ``sqrt(1 + ln s / ln L)``; 1 otherwise). ``output`` says how (RoFormer, Su et al., 2021, section 3.4.2):

    * ``"cat"`` (Llama and most models): ``(cat(c, c), cat(s, s))``, ``[batch, seq, r]``, each
      angle written twice because ``transformers`` rotates in the ``"half"`` layout;
    * ``"repeat"`` (Cohere): ``(repeat_interleave(c, 2), ...)``, for the ``"interleaved"`` layout;
    * ``"sin_cos"`` (GPT-J): ``(s, c)``, ``[batch, seq, r/2]``, sine first;
    * ``"complex"`` (Llama 4): ``c + i s``, complex ``[batch, seq, r/2]`` (Meta's ``freqs_cis``).

    With several RoPE settings (Gemma 3's per-layer-type ``rope_parameters``) the module holds one
    :class:`ropelib.RotaryEmbedding` per layer type and is called as ``forward(x, position_ids,
    layer_type)``. With ``mrope_section`` (Qwen2-VL) ``position_ids`` are ``[3, batch, seq]`` and
    pair ``i`` takes the position of its axis (:mod:`ropelib.mrope`).

    The tables come from :class:`ropelib.RotaryEmbedding`: angles formed in float64 and rounded
    once (where ``transformers`` forms them in float32), the scalings of
    :data:`~ropelib.scaling.registry.ROPE_SCALINGS`, and for ``"dynamic"`` and ``"longrope"`` the same
    length-following rule as ``transformers``' ``dynamic_rope_update``. No call reads position
    values on a GPU or under :func:`torch.compile` (except for those two length-following types).

    Args:
        config: the model's ``transformers`` config, or its ``config.json`` dict (read by
            :func:`ropelib.rope_config` unless ``rope_options`` are given).
        backend: how the patched apply function rotates with these tables: ``"auto"``,
            ``"torch"`` or ``"triton"`` (see :class:`ropelib.RotaryEmbedding`).
        original: the module this one replaces; :func:`~ropelib.unpatch_hf_rope` puts it back.
        output: one of :data:`~ropelib.integrations.huggingface.module.OUTPUTS` (above).
        rope_options: :class:`~ropelib.RotaryEmbedding` arguments by layer type (key ``None``
            for a single setting); by default ``{None: rope_config(config)}``.
        mrope_section: ``(s_t, s_h, s_w)`` for M-RoPE, or None.
        mrope_interleaved: Qwen3-VL's interleaved assignment of pairs to axes.

    Shapes:
        ``x``: any tensor (only its dtype and device are read); ``position_ids``: integers of
        shape ``[batch, seq]`` or ``[seq]`` (``[3, batch, seq]`` too for M-RoPE; negative ones,
        at padded slots, are allowed). Returns the tables above in ``x``'s dtype
        (``[1, seq, ...]`` for 1-D positions; complex64 for ``"complex"``).

    Example:
        >>> config = {"hidden_size": 32, "num_attention_heads": 4,
        ...           "max_position_embeddings": 64}
        >>> rotary = HFRotaryEmbedding(config)
        >>> cos, sin = rotary(torch.zeros(1), torch.tensor([[0, 1, 2]]))
        >>> cos.shape, cos[0, 0].tolist() == [1.0] * 8
        (torch.Size([1, 3, 8]), True)
        >>> sin[0, 0].tolist() == [0.0] * 8
        True
    """

    def __init__(
        self,
        config: Any,
        *,
        backend: str = "auto",
        original: nn.Module | None = None,
        output: str = "cat",
        rope_options: Mapping[str | None, Mapping[str, Any]] | None = None,
        mrope_section: Sequence[int] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.output = check_choice(output, "output", OUTPUTS)
        check_bool(mrope_interleaved, "mrope_interleaved")
        self.config = config
        if rope_options is None:
            rope_options = {None: rope_config(config_dict(config))}
        if not isinstance(rope_options, Mapping) or not rope_options:
            raise TypeError("rope_options must be a non-empty dict of RotaryEmbedding arguments by layer type")
        if mrope_section is not None and set(rope_options) != {None}:
            raise ValueError("mrope_section needs a single RoPE setting (rope_options with the one key None)")
        self.mrope: MRotaryEmbedding | None = None
        self.ropes: dict[str | None, RotaryEmbedding]
        if mrope_section is not None:
            self.mrope = MRotaryEmbedding(
                mrope_section=mrope_section, interleaved=mrope_interleaved, backend=backend, **rope_options[None]
            )
            self.ropes = {None: self.mrope.rope}
        else:
            self.ropes = {
                key: RotaryEmbedding(layout="half", backend=backend, **opts) for key, opts in rope_options.items()
            }
        self.rope = next(iter(self.ropes.values()))  # the (first) setting: frequencies, rotary_dim
        self.rope_type = rope_type_of(self.rope.scaling)
        self._original = (original,)  # a tuple, so that the replaced module is not a submodule
        # by layer type: the key tensor last returned, with ropelib's half-width float tables behind it
        self._last: dict[str | None, tuple[weakref.ref[torch.Tensor], torch.Tensor, torch.Tensor]] = {}

    @property
    def original(self) -> nn.Module | None:
        """The ``transformers`` module this one replaced (None when built directly)."""
        return self._original[0]

    @property
    def layer_types(self) -> list[str | None]:
        """The layer types with a RoPE setting of their own (``[None]`` for one setting)."""
        return list(self.ropes)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float32 inverse frequencies in use, ``[r/2]`` (the Hugging Face attribute; the first setting's)."""
        return self.rope.inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor that multiplies cos and sin (the Hugging Face attribute; the first setting's)."""
        return self.rope.attention_scaling

    def half_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ropelib's ``[.., seq, r/2]`` tables at validated int64 ``positions``, in ``dtype`` (float32 or float64)."""
        rope = self.ropes[layer_type]
        seq = positions.shape[-1]
        cos, sin, rows = rope.tables_for(positions, seq, positions.device, dtype)
        if rows is None:
            return cos[:seq], sin[:seq]
        index = rows.reshape(-1)  # one gather per table (cheaper than advanced indexing)
        return cos.index_select(0, index).view(*rows.shape, -1), sin.index_select(0, index).view(*rows.shape, -1)

    def _positions(self, position_ids: object) -> torch.Tensor:
        position_ids = check_integer_tensor(position_ids, "position_ids")
        if self.mrope is not None and position_ids.ndim == 3:
            if position_ids.shape[0] not in (1, 3):
                raise ValueError(f"position_ids must have shape [3, batch, seq], got {list(position_ids.shape)}")
            return position_ids.long()
        if position_ids.ndim not in (1, 2):
            raise ValueError(f"position_ids must have shape [seq] or [batch, seq], got {list(position_ids.shape)}")
        return check_positions(
            position_ids, "position_ids", batch=position_ids.shape[0], seq_len=position_ids.shape[-1], minimum=None
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        layer_type: str | None = None,
    ) -> Any:
        self._check_layer_type(layer_type)
        if not isinstance(x, torch.Tensor):
            kind = type(x).__name__
            raise TypeError(f"x must be a torch.Tensor, got {kind}")
        positions = self._positions(position_ids).to(x.device)
        double = x.dtype == torch.float64
        compute = torch.float64 if double else torch.float32
        if self.mrope is not None:
            # [seq] -> [1, seq] -> [1, 1, seq]: text, the same on all axes
            while positions.ndim < 3:
                positions = positions[None]
            positions = positions.expand(3, -1, -1)
            cos_half, sin_half = self.mrope.tables(positions, compute)
        else:
            tables = self.half_tables(positions, compute, layer_type)
            cos_half, sin_half = tables
            if positions.ndim == 1:
                cos_half, sin_half = cos_half[None], sin_half[None]
        out = self._format(cos_half, sin_half, x.dtype)
        if not torch.compiler.is_compiling():
            key = out[0] if isinstance(out, tuple) else out
            record = (weakref.ref(key), cos_half, sin_half)
            self._last[layer_type] = record
        return out

    def _check_layer_type(self, layer_type: object) -> None:
        if layer_type in self.ropes:
            return
        if set(self.ropes) == {None}:
            raise ValueError(f"layer_type must be None (one RoPE setting for all layers), got {layer_type!r}")
        raise ValueError(f"layer_type must be one of {self.layer_types}, got {layer_type!r}")

    def _format(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> Any:
        """The half-width tables in the form of :attr:`output` (see the class docstring)."""
        if self.output == "complex":
            return torch.complex(cos, sin)
        if self.output == "sin_cos":
            return sin.to(dtype), cos.to(dtype)
        if self.output == "repeat":
            return cos.repeat_interleave(2, dim=-1).to(dtype), sin.repeat_interleave(2, dim=-1).to(dtype)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))

    def tables_of(self, key: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """ropelib's half-width ``(cos, sin)`` behind ``key`` (the first table returned, or the complex one) when this module returned it last, else None."""
        for ref, cos, sin in self._last.values():
            if ref() is key:
                return cos, sin
        return None

    def extra_repr(self) -> str:
        types = "" if self.layer_types == [None] else f", layer_types={self.layer_types}"
        mrope = "" if self.mrope is None else f", mrope_section={list(self.mrope.mrope_section)}"
        return f"rope_type={self.rope_type!r}, output={self.output!r}, backend={self.backend!r}{types}{mrope}"
