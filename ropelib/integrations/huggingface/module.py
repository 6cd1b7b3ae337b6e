r"""The drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..._validation import check_bool, check_choice, check_integer_tensor, check_positions
from ...config import rope_config
from ...kernels.registry import KERNEL_CHOICES
from ...rotary import MRotaryEmbedding, RotaryEmbedding
from ...scaling import rope_type_of
from ...scaling.registry import key_names

#: The forms of tables a ``transformers`` rotary module returns (see :class:`HFRotaryEmbedding`).
OUTPUTS = ("cat", "cat_float32", "half", "repeat", "sin_cos", "complex")
#: The attribute of a returned table that holds its :class:`ReturnedTables`.
TAG = "_ropelib_tables"


@dataclass(frozen=True)
class ReturnedTables:
    """What stands behind tables an :class:`HFRotaryEmbedding` returned: ropelib's float ``[.., seq, d_rot/2]`` rows.

    Kept on the first returned tensor (attribute :data:`~ropelib.integrations.huggingface.module.TAG`), with the second one (held weakly)
    and the version counters of both at return, so that the patched apply function recognises
    exactly these tensors, unchanged. Inference tensors have no version counter: for them only
    the identity is checked.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    kernel: str
    partner: weakref.ref[torch.Tensor] | None
    versions: tuple[int, ...] | None


def _versions(*tensors: torch.Tensor) -> tuple[int, ...] | None:
    return None if any(t.is_inference() for t in tensors) else tuple(t._version for t in tensors)


def returned_tables(first: object, second: object = None) -> ReturnedTables | None:
    """The :class:`ReturnedTables` behind ``first`` (and ``second``, returned beside it), if both are the
    tensors an :class:`HFRotaryEmbedding` returned together and neither has changed since; else None."""
    tag = getattr(first, TAG, None) if isinstance(first, torch.Tensor) else None
    if not isinstance(tag, ReturnedTables):
        return None
    partner = None if tag.partner is None else tag.partner()
    if partner is not second or (partner is None and second is not None):
        return None
    tensors = (first,) if not isinstance(second, torch.Tensor) else (first, second)
    if tag.versions is not None and _versions(*tensors) != tag.versions:
        return None
    return tag


#: The keys :func:`ropelib.rope_config` reads, looked up on a ``transformers`` config as ``transformers`` does
#: (``getattr``: through its ``attribute_map`` aliases and properties) where ``to_dict()`` leaves them out.
READ_KEYS = (
    "head_dim",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "rope_theta",
    "rope_parameters",
)


def config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config (anything with ``to_dict()``) or a ``config.json`` dict, as a dict.

    For a config object, the keys of :data:`READ_KEYS` missing from ``to_dict()`` are read with
    ``getattr`` (DBRX's ``hidden_size`` is its ``d_model`` through ``attribute_map``, say).
    """
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise TypeError(f"config must be a transformers config (with to_dict()) or a dict, got {type(config).__name__}")
    found = dict(to_dict())
    for key in READ_KEYS:
        if found.get(key) is None:
            try:
                value = getattr(config, key, None)
            except Exception:  # noqa: BLE001  (a per-layer config's global attribute is ambiguous: leave it out)
                value = None
            if value is not None:
                found[key] = value
    return found


class HFRotaryEmbedding(nn.Module):
    r"""A drop-in for a ``transformers`` ``*RotaryEmbedding`` module, computed by ropelib.

    ``forward(x, position_ids)`` returns what the Hugging Face module returns, built from
    ``c[b, s, i] = a * cos(p * theta_i)`` and ``s[b, s, i] = a * sin(p * theta_i)`` (``i < d_rot/2``), where
    ``p = position_ids[b, s]``, ``theta_i`` are the (scaled) inverse frequencies of the config's
    ``rope_type`` and ``a`` its attention scaling (YaRN's ``0.1 ln(factor) + 1``, LongRoPE's
    ``sqrt(1 + ln s / ln L)``; 1 otherwise). ``output`` says how (RoFormer, Su et al., 2024, section 3.4.2):

    * ``"cat"`` (Llama and most models): ``(cat(c, c), cat(s, s))``, ``[batch, seq, d_rot]``, each
      angle written twice because ``transformers`` rotates in the ``"half"`` layout;
    * ``"cat_float32"`` (Ernie 4.5): the same in float32 whatever ``x``'s dtype;
    * ``"half"`` (GPT-OSS): ``(c, s)``, ``[batch, seq, d_rot/2]``;
    * ``"repeat"`` (Cohere): ``(repeat_interleave(c, 2), ...)``, for the ``"interleaved"`` layout;
    * ``"sin_cos"`` (GPT-J): ``(s, c)``, ``[batch, seq, d_rot/2]``, sine first;
    * ``"complex"`` (Llama 4): ``c + i s``, complex ``[batch, seq, d_rot/2]`` (Meta's ``freqs_cis``).

    With several RoPE settings (Gemma 3's per-layer-type ``rope_parameters``) the module holds one
    :class:`ropelib.RotaryEmbedding` per layer type and is called as ``forward(x, position_ids,
    layer_type)``. With ``mrope_section`` (Qwen2-VL) ``position_ids`` are ``[3, batch, seq]`` and
    pair ``i`` takes the position of its axis (:mod:`ropelib.rotary.mrope`).

    The tables come from :class:`ropelib.RotaryEmbedding`: angles formed in float64 and rounded
    once (where ``transformers`` forms them in float32), the scalings of
    :data:`~ropelib.scaling.registry.ROPE_SCALINGS`, and for ``"dynamic"`` and ``"longrope"`` the same
    length-following rule as ``transformers``' ``dynamic_rope_update``. No call reads position
    values on a GPU or under :func:`torch.compile` (except for those two length-following types).

    Args:
        config: the model's ``transformers`` config, or its ``config.json`` dict (read by
            :func:`ropelib.rope_config` unless ``rope_options`` are given).
        kernel: the kernel the patched apply function rotates with: ``"auto"``, ``"torch"``,
            ``"native"`` or ``"triton"`` (:func:`~ropelib.choose_kernel`).
        original: the module this one replaces; :func:`~ropelib.unpatch_hf_rope` puts it back.
        output: one of :data:`~ropelib.integrations.huggingface.module.OUTPUTS` (above).
        rope_options: :class:`~ropelib.RotaryEmbedding` arguments by layer type (key ``None``
            for a single setting); by default ``{None: rope_config(config)}``.
        mrope_section: ``(s_t, s_h, s_w)`` for M-RoPE, or None.
        mrope_interleaved: Qwen3-VL's interleaved assignment of pairs to axes.
        ignore_keys: model-specific keys of the config's rope parameters to let through unread
            (as ``transformers``' ``ignore_keys_at_rope_validation``), passed to
            :func:`ropelib.rope_config`; only with the ``config`` read here (not with ``rope_options``).

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
        kernel: str = "auto",
        original: nn.Module | None = None,
        output: str = "cat",
        rope_options: Mapping[str | None, Mapping[str, Any]] | None = None,
        mrope_section: Sequence[int] | None = None,
        mrope_interleaved: bool = False,
        ignore_keys: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self.kernel = check_choice(kernel, "kernel", KERNEL_CHOICES)
        self.output = check_choice(output, "output", OUTPUTS)
        check_bool(mrope_interleaved, "mrope_interleaved")
        ignored = key_names(ignore_keys, "ignore_keys")
        self.config = config
        if rope_options is None:
            rope_options = {None: rope_config(config_dict(config), ignore_keys=ignored)}
        elif ignored:
            raise ValueError(
                "ignore_keys is for the config read here (rope_config(config, ignore_keys=...)); with rope_options, "
                "leave the keys out of the options' scaling dicts instead"
            )
        if not isinstance(rope_options, Mapping) or not rope_options:
            raise TypeError("rope_options must be a non-empty dict of RotaryEmbedding arguments by layer type")
        if mrope_section is not None and set(rope_options) != {None}:
            raise ValueError("mrope_section needs a single RoPE setting (rope_options with the one key None)")
        self.mrope: MRotaryEmbedding | None = None
        self.ropes: dict[str | None, RotaryEmbedding]
        if mrope_section is not None:
            self.mrope = MRotaryEmbedding(
                mrope_section=mrope_section, interleaved=mrope_interleaved, kernel=kernel, **rope_options[None]
            )
            self.ropes = {None: self.mrope.rope}
        else:
            self.ropes = {
                key: RotaryEmbedding(layout="half", kernel=kernel, **opts) for key, opts in rope_options.items()
            }
        self.rope = next(iter(self.ropes.values()))  # the (first) setting: frequencies, rotary_dim
        self.rope_type = rope_type_of(self.rope.scaling)
        self._original = (original,)  # a tuple, so that the replaced module is not a submodule

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
        """The float32 inverse frequencies in use, ``[d_rot/2]`` (the Hugging Face attribute; the first setting's)."""
        return self.rope.inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor that multiplies cos and sin (the Hugging Face attribute; the first setting's)."""
        return self.rope.attention_scaling

    def half_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ropelib's ``[.., seq, d_rot/2]`` tables at validated int64 ``positions``, in ``dtype`` (float32 or float64)."""
        return self.ropes[layer_type].rows_at(positions, dtype)

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
        # compiled graphs call the original apply: no tag
        if not torch.compiler.is_compiling():
            first, second = out if isinstance(out, tuple) else (out, None)
            both = (first,) if second is None else (first, second)
            partner = None if second is None else weakref.ref(second)
            versions = _versions(*both)
            kept = (cos_half, sin_half, self.kernel, partner, versions)
            setattr(first, TAG, ReturnedTables(*kept))
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
        if self.output in ("sin_cos", "half"):
            return (sin.to(dtype), cos.to(dtype)) if self.output == "sin_cos" else (cos.to(dtype), sin.to(dtype))
        if self.output == "cat_float32":
            dtype = torch.float32
        if self.output == "repeat":
            return cos.repeat_interleave(2, dim=-1).to(dtype), sin.repeat_interleave(2, dim=-1).to(dtype)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))

    def extra_repr(self) -> str:
        types = "" if self.layer_types == [None] else f", layer_types={self.layer_types}"
        mrope = "" if self.mrope is None else f", mrope_section={list(self.mrope.mrope_section)}"
        return f"rope_type={self.rope_type!r}, output={self.output!r}, kernel={self.kernel!r}{types}{mrope}"
