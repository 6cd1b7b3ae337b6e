r"""An attention-sink KV cache whose keys stay rotated: :class:`SinkCache` (StreamingLLM, Xiao et al., 2024).

StreamingLLM keeps the first ``sink`` tokens (the "attention sinks" every query leans on) and a
window of the most recent ones, and gives the tokens their positions *in the cache*, ``0 .. n-1``,
so that no position exceeds ``sink + window``. When tokens are evicted from the middle, the kept
window's keys are moved down by the number evicted with :func:`~ropelib.rerotate_keys`
(``R(-e) R(p) = R(p - e)``), as transformers' ``SinkCache`` did, instead of keeping unrotated
keys and rotating the whole cache at every step. Attention over the cache then equals attention
over the kept tokens encoded from scratch at their new positions (to rounding).

A reference for that identity, small and plain: the buffers are allocated once, at the first
:meth:`~ropelib.SinkCache.append`, and eviction copies the window down.
"""

from __future__ import annotations

import torch

from .._validation import check_float_tensor, check_int
from ..rotary import RotaryEmbedding
from .rerotate import rerotate_keys


class SinkCache:
    """Keys and values of the first ``sink`` tokens and the ``window`` latest, keys rotated at their cache positions.

    Args:
        rope: the :class:`~ropelib.RotaryEmbedding` that rotates the keys.
        sink: the number of first tokens always kept (>= 0).
        window: the number of recent tokens kept (>= 1).
        device: where the positions :meth:`make_room` returns are made.

    Use per step: ``positions = cache.make_room(tokens)``, rotate the new queries and keys at
    ``positions``, ``cache.append(keys, values)``, then attend to ``cache.keys``/``cache.values``
    (``[batch, length, kv_heads, head_dim]``).

    Example:
        >>> rope = RotaryEmbedding(8)
        >>> cache = SinkCache(rope, sink=1, window=2)
        >>> for step in range(4):
        ...     positions = cache.make_room(1)
        ...     k = torch.randn(1, 1, 1, 8)
        ...     _, k = rope(k, k, positions)
        ...     cache.append(k, torch.randn(1, 1, 1, 8))
        >>> positions.tolist(), cache.length, cache.evicted
        ([2], 3, 1)
    """

    def __init__(
        self, rope: RotaryEmbedding, *, sink: int, window: int, device: torch.device | str | None = None
    ) -> None:
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be a ropelib.RotaryEmbedding, got {type(rope).__name__}")
        self.rope = rope
        self.sink = check_int(sink, "sink", minimum=0)
        self.window = check_int(window, "window", minimum=1)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.length = 0  # tokens held
        self.evicted = 0  # tokens dropped so far
        self._keys: torch.Tensor | None = None  # [batch, sink + window, kv_heads, head_dim]
        self._values: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """The most tokens held, ``sink + window``."""
        return self.sink + self.window

    @property
    def keys(self) -> torch.Tensor:
        """The held keys ``[batch, length, kv_heads, head_dim]``, rotated at positions ``0 .. length-1``."""
        if self._keys is None:
            raise ValueError("the cache is empty: append keys and values first")
        return self._keys[:, : self.length]

    @property
    def values(self) -> torch.Tensor:
        """The held values ``[batch, length, kv_heads, head_dim]``."""
        if self._values is None:
            raise ValueError("the cache is empty: append keys and values first")
        return self._values[:, : self.length]

    def make_room(self, tokens: int) -> torch.Tensor:
        """Room for ``tokens`` new tokens (1 .. ``window``), and their positions, int64 ``[tokens]``.

        When the cache would overflow, the oldest tokens after the sinks are evicted, as few as
        needed (``e``), and the keys after them are moved down by ``-e`` positions.
        """
        tokens = check_int(tokens, "tokens", minimum=1, maximum=self.window)
        excess = self.length + tokens - self.capacity
        if excess > 0 and self._keys is not None and self._values is not None:
            start, end = self.sink + excess, self.length
            moved = rerotate_keys(self._keys[:, start:end], -excess, rope=self.rope)
            self._keys[:, self.sink : end - excess].copy_(moved)
            self._values[:, self.sink : end - excess].copy_(self._values[:, start:end].clone())  # overlapping
            self.length -= excess
            self.evicted += excess
        return torch.arange(self.length, self.length + tokens, device=self.device)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` (rotated at the positions :meth:`make_room` returned) and ``values``, ``[batch, tokens, kv_heads, head_dim]``."""
        keys = check_float_tensor(keys, "keys", ndim=4)
        values = check_float_tensor(values, "values", ndim=4)
        if keys.shape != values.shape or keys.dtype != values.dtype or keys.device != values.device:
            raise ValueError(
                f"keys and values must share shape, dtype and device, got {tuple(keys.shape)} {keys.dtype} "
                f"{keys.device} and {tuple(values.shape)} {values.dtype} {values.device}"
            )
        if keys.shape[-1] != self.rope.head_dim:
            raise ValueError(f"keys must have head_dim={self.rope.head_dim} last, got shape {tuple(keys.shape)}")
        tokens = keys.shape[1]
        if self.length + tokens > self.capacity:
            raise ValueError(
                f"{tokens} tokens do not fit ({self.length} of {self.capacity} held): call make_room({tokens}) first"
            )
        if self._keys is None or self._values is None:
            shape = (keys.shape[0], self.capacity, *keys.shape[2:])
            self._keys = keys.new_empty(shape)
            self._values = values.new_empty(shape)
        elif (keys.shape[0], *keys.shape[2:]) != (self._keys.shape[0], *self._keys.shape[2:]) or (
            keys.dtype != self._keys.dtype or keys.device != self._keys.device
        ):
            raise ValueError(
                f"keys must be [batch, tokens, kv_heads, head_dim] = [{self._keys.shape[0]}, tokens, "
                f"{self._keys.shape[2]}, {self._keys.shape[3]}] in {self._keys.dtype} on {self._keys.device} "
                f"as before, got {tuple(keys.shape)} {keys.dtype} {keys.device}"
            )
        self._keys[:, self.length : self.length + tokens].copy_(keys)
        self._values[:, self.length : self.length + tokens].copy_(values)
        self.length += tokens
