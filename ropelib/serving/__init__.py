"""RoPE as serving engines call it: flattened tokens, a cos/sin cache, packed buffers, cached keys.

* :mod:`~ropelib.serving.cos_sin_cache`: FlashInfer's and vLLM's entry point,
  :func:`~ropelib.apply_rope_with_cos_sin_cache`, over one ``cos_sin_cache`` table;
* :mod:`~ropelib.serving.packed`: q and k rotated in place inside a packed QKV buffer;
* :mod:`~ropelib.serving.kv_cache`: the rotation fused with the key/value-cache write,
  :func:`~ropelib.rotary_kv_cache_write` (contiguous or paged caches, vLLM's slot mapping);
* :mod:`~ropelib.serving.rerotate`: cached keys moved to other positions, :func:`~ropelib.rerotate_keys`;
* :mod:`~ropelib.serving.sink`: an attention-sink cache (StreamingLLM) that re-rotates the keys it keeps.
"""

from .cos_sin_cache import apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace, make_cos_sin_cache
from .kv_cache import rotary_kv_cache_write
from .packed import rotary_qkv_
from .rerotate import rerotate_keys
from .sink import SinkCache

__all__ = [
    "SinkCache",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "make_cos_sin_cache",
    "rerotate_keys",
    "rotary_kv_cache_write",
    "rotary_qkv_",
]
