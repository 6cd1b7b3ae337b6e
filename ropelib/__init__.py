"""ropelib: position encodings for PyTorch, from sinusoids to RoPE.

Tensors follow ``[batch, seq, heads, head_dim]``. See the book for the mathematics.
"""

from ._device import default_device, device_name  # first: sets TRITON_INTERPRET when there is no CUDA device
from .absolute import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    sinusoidal_encoding,
    sinusoidal_shift_matrix,
)
from .attention import (
    POSITION_ENCODINGS,
    LinearAttention,
    MultiHeadAttention,
    elu_feature_map,
    linear_attention,
    linear_attention_weights,
)
from .complex_rope import apply_rotary_emb, precompute_pos_cis
from .frequencies import cos_sin_table, rope_frequencies
from .integrations.huggingface import HFRotaryEmbedding, patch_hf_rope, unpatch_hf_rope, use_ropelib_rope
from .kernels import choose_kernel, rotary_qk
from .relative import (
    ShawRelativePosition,
    T5RelativeBias,
    alibi_bias,
    alibi_slopes,
    relative_positions,
    t5_relative_bucket,
)
from .rotary import (
    LAYOUTS,
    RotaryEmbedding,
    apply_rotary,
    convert_rotary_layout,
    layout_permutation,
    rotate_half,
)
from .scaling import ROPE_SCALINGS, rope_config, scaled_inverse_frequencies
from .variants import AxialRotaryEmbedding, XPos, axial_positions, xpos_decay_rates

__version__ = "0.1.0"

__all__ = [
    "AxialRotaryEmbedding",
    "HFRotaryEmbedding",
    "LAYOUTS",
    "LearnedPositionalEmbedding",
    "LinearAttention",
    "MultiHeadAttention",
    "POSITION_ENCODINGS",
    "ROPE_SCALINGS",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "XPos",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "apply_rotary_emb",
    "axial_positions",
    "choose_kernel",
    "convert_rotary_layout",
    "cos_sin_table",
    "default_device",
    "device_name",
    "elu_feature_map",
    "layout_permutation",
    "linear_attention",
    "linear_attention_weights",
    "patch_hf_rope",
    "precompute_pos_cis",
    "relative_positions",
    "rope_config",
    "rope_frequencies",
    "rotary_qk",
    "rotate_half",
    "scaled_inverse_frequencies",
    "sinusoidal_encoding",
    "sinusoidal_shift_matrix",
    "t5_relative_bucket",
    "unpatch_hf_rope",
    "use_ropelib_rope",
    "xpos_decay_rates",
]
