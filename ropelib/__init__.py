"""ropelib: position encodings for PyTorch, from sinusoids to RoPE.

Tensors follow ``[batch, seq, heads, head_dim]``. See the book for the mathematics.
"""

from . import _device  # first: sets TRITON_INTERPRET when there is no CUDA device
from ._device import default_device, device_name
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

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS",
    "POSITION_ENCODINGS",
    "LearnedPositionalEmbedding",
    "LinearAttention",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalPositionalEncoding",
    "T5RelativeBias",
    "alibi_bias",
    "alibi_slopes",
    "apply_rotary",
    "apply_rotary_emb",
    "convert_rotary_layout",
    "cos_sin_table",
    "default_device",
    "device_name",
    "elu_feature_map",
    "layout_permutation",
    "linear_attention",
    "linear_attention_weights",
    "precompute_pos_cis",
    "relative_positions",
    "rope_frequencies",
    "rotate_half",
    "sinusoidal_encoding",
    "sinusoidal_shift_matrix",
    "t5_relative_bucket",
]

# Sections below are filled by later parts of the book; each adds its imports and names.
# --- fast kernels ---
from .kernels import choose_kernel, rotary_qk  # noqa: E402

__all__ += ["choose_kernel", "rotary_qk"]
# --- long context ---
from .scaling import ROPE_SCALINGS, rope_config, scaled_inverse_frequencies  # noqa: E402

__all__ += ["ROPE_SCALINGS", "rope_config", "scaled_inverse_frequencies"]
from .variants import AxialRotaryEmbedding, XPos, axial_positions, xpos_decay_rates  # noqa: E402

__all__ += ["AxialRotaryEmbedding", "XPos", "axial_positions", "xpos_decay_rates"]
# --- ecosystem ---
from .integrations.huggingface import HFRotaryEmbedding, patch_hf_rope, unpatch_hf_rope, use_ropelib_rope  # noqa: E402

__all__ += ["HFRotaryEmbedding", "patch_hf_rope", "unpatch_hf_rope", "use_ropelib_rope"]
