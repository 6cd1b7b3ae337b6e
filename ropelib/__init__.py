"""ropelib: position encodings for PyTorch, from sinusoids to RoPE.

Tensors follow ``[batch, seq, heads, head_dim]`` unless a docstring says otherwise. See the book for the mathematics.
"""

from ._device import default_device, device_name
from .attention.linear import LinearAttention, elu_feature_map, linear_attention, linear_attention_weights
from .attention.mha import POSITION_ENCODINGS, MultiHeadAttention
from .complex_rope import apply_rotary_emb, precompute_pos_cis
from .config import rope_config
from .distributed import context_parallel_attention, shard_positions, shard_sequence, unshard_sequence
from .encodings.absolute import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
)
from .encodings.relative import (
    ShawRelativePosition,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    relative_positions,
    t5_relative_bucket,
)
from .frequencies import cos_sin_table, relative_decay_bound
from .integrations.huggingface import HFRotaryEmbedding, patch_hf_rope, unpatch_hf_rope, use_ropelib_rope
from .kernels import KERNEL_CHOICES, KERNELS, choose_kernel, rotary_qk
from .layouts import LAYOUTS, convert_rotary_layout, layout_permutation, rotate_half
from .packing import packed_positions
from .reference import apply_rotary
from .rotary import (
    AxialRotaryEmbedding,
    MRotaryEmbedding,
    RopeSpec,
    RotaryEmbedding,
    Rotation,
    TableCache,
    XPos,
    axial_positions,
    mrope_axes,
    mrope_positions,
    xpos_decay_rates,
)
from .scaling import ROPE_SCALINGS, register_scaling, rope_frequencies, scaled_inverse_frequencies
from .serving import (
    SinkCache,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
    make_cos_sin_cache,
    rerotate_keys,
    rotary_kv_cache_write,
    rotary_qkv_,
)

__version__ = "0.1.0"

__all__ = [
    "AxialRotaryEmbedding",
    "HFRotaryEmbedding",
    "KERNELS",
    "KERNEL_CHOICES",
    "LAYOUTS",
    "LearnedPositionalEmbedding",
    "LinearAttention",
    "MRotaryEmbedding",
    "MultiHeadAttention",
    "POSITION_ENCODINGS",
    "ROPE_SCALINGS",
    "RopeSpec",
    "RotaryEmbedding",
    "Rotation",
    "ShawRelativePosition",
    "SinkCache",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "TableCache",
    "XPos",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "apply_rotary",
    "apply_rotary_emb",
    "axial_positions",
    "choose_kernel",
    "context_parallel_attention",
    "convert_rotary_layout",
    "cos_sin_table",
    "relative_decay_bound",
    "default_device",
    "device_name",
    "elu_feature_map",
    "layout_permutation",
    "linear_attention",
    "linear_attention_weights",
    "make_cos_sin_cache",
    "mrope_axes",
    "mrope_positions",
    "packed_positions",
    "patch_hf_rope",
    "precompute_pos_cis",
    "register_scaling",
    "relative_positions",
    "rerotate_keys",
    "rope_config",
    "rope_frequencies",
    "rotary_kv_cache_write",
    "rotary_qk",
    "rotary_qkv_",
    "rotate_half",
    "scaled_inverse_frequencies",
    "shard_positions",
    "shard_sequence",
    "sinusoidal_encoding",
    "sinusoidal_shift_matrix",
    "t5_relative_bucket",
    "unpatch_hf_rope",
    "unshard_sequence",
    "use_ropelib_rope",
    "xpos_decay_rates",
]
