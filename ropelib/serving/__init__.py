"""RoPE as serving engines call it: flattened tokens, a cos/sin cache, packed buffers, cached keys."""

__all__: list[str] = [
]
