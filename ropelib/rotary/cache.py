r"""The cos/sin rows of one :class:`~ropelib.rotary.spec.RopeSpec`, per device and dtype: :class:`TableCache`.

Row ``p`` of the tables holds ``a cos(p theta_i)`` and ``a sin(p theta_i)`` for the pairs ``i`` (``a`` the
scaling's attention factor), the angle formed in float64 and rounded once. The cache holds the rows
of positions ``0 .. L-1`` and grows when asked for more (doubling, in blocks of
:data:`~ropelib.rotary.cache.TABLE_BLOCK`), up to ``limit`` rows: rows of positions past it are computed
for the positions that need them, by the kernels, from ``frequencies``. It never
shrinks, and it changes by swapping one immutable state at once, so threads that share it read
whole tables. For the scalings whose frequencies follow the current length (dynamic NTK,
LongRoPE) the cache follows it too, by transformers' rule (``dynamic_rope_update``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from .._validation import check_int
from ..frequencies import angle_tables
from .spec import RopeSpec

#: The cache holds at most this many positions (or ``max_position_embeddings``, if larger).
CACHE_POSITIONS = 1 << 16
#: Rows are added in blocks of this many positions.
TABLE_BLOCK = 1024
#: The rows a device's first table holds when the call does not say how many it needs.
INITIAL_POSITIONS = 4096

#: The dtypes of tables: float32, and float64 for float64 inputs.
TABLE_DTYPES = frozenset({torch.float32, torch.float64})

Key = tuple[torch.device, torch.dtype]


def table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The tables' dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Tables:
    """The rows of one device and dtype: ``cos``/``sin`` ``[L, d_rot/2]`` and the ``frequencies`` behind them.

    ``frequencies``: float64 ``[d_rot/2 + 1]`` on the same device, the inverse frequencies and then the
    attention factor, from which a kernel computes the row of a position past ``L``.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    frequencies: torch.Tensor

    @property
    def length(self) -> int:
        """The number of positions tabled, ``L``."""
        return self.cos.shape[0]


@dataclass(frozen=True)
class _State:
    seq_len: int | None  # the length the frequencies follow (None: the original frequencies)
    inv_freq: torch.Tensor  # float64 [r/2] on the CPU
    attention_scaling: float
    tables: Mapping[Key, Tables]


class TableCache:
    """The tables of one spec (see the module docstring); share one between the layers of a model.

    Args:
        spec: the frequencies.
        limit: the most positions tabled (default: :data:`~ropelib.rotary.cache.CACHE_POSITIONS` or the spec's
            ``max_position_embeddings``, whichever is larger).

    Example:
        >>> cache = TableCache(RopeSpec.create(8))
        >>> cpu = torch.device("cpu")
        >>> tables = cache.tables(cpu, torch.float32, 10)
        >>> tables.length, tables.cos.shape[1]  # a block of rows, 4 pairs
        (1024, 4)
        >>> cache.tables(cpu, torch.float32, 5) is tables  # no growth
        True
    """

    def __init__(self, spec: RopeSpec, *, limit: int | None = None) -> None:
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
        self.spec = spec
        default = max(CACHE_POSITIONS, spec.max_position_embeddings or 0)
        self.limit = default if limit is None else check_int(limit, "limit", minimum=1)
        self._lock = threading.Lock()
        inv_freq, attention_scaling = spec.frequencies()
        self._state = _State(None, inv_freq, attention_scaling, {})

    @property
    def inv_freq(self) -> torch.Tensor:
        """The float64 inverse frequencies in use, ``[d_rot/2]`` (on the CPU)."""
        return self._state.inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin in use."""
        return self._state.attention_scaling

    @property
    def seq_len(self) -> int | None:
        """The length the frequencies follow (dynamic NTK, LongRoPE), or None for the original ones."""
        return self._state.seq_len

    def follow(self, needed: int) -> None:
        """Bring length-following frequencies to ``needed`` positions (transformers' rule; no-op otherwise)."""
        if not self.spec.follows_length:
            return
        with self._lock:
            state = self._state
            seq_len = self.spec.frequency_seq_len(needed, state.seq_len)
            if seq_len != state.seq_len:
                inv_freq, attention_scaling = self.spec.frequencies(seq_len)
                self._state = _State(seq_len, inv_freq, attention_scaling, {})

    def tables(self, device: torch.device, dtype: torch.dtype, length: int | None = None) -> Tables:
        """The tables on ``device`` in ``dtype`` (float32 or float64), with at least ``min(length, limit)`` rows.

        ``length=None``, or a length past the limit (whose far rows are computed, not tabled):
        whatever the device has (or :data:`~ropelib.rotary.cache.INITIAL_POSITIONS` rows at first). Under
        :func:`torch.compile` nothing grows (a table made there is not kept).
        """
        if dtype not in TABLE_DTYPES:
            raise TypeError(f"dtype must be torch.float32 or torch.float64 (the tables' dtypes), got {dtype}")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise ValueError(f"length must be an int >= 0 or None, got {length!r}")
        return self.tables_for(device, dtype, length)

    def tables_for(self, device: torch.device, dtype: torch.dtype, length: int | None) -> Tables:
        """:meth:`tables` for a checked dtype and length (the modules' call)."""
        if length is not None and self.spec.follows_length:
            self.follow(length)
        if length is not None and length > self.limit:
            length = None
        state = self._state
        found = state.tables.get((device, dtype))
        wanted = min(INITIAL_POSITIONS if length is None else length, self.limit)
        if found is not None and (length is None or found.length >= wanted):
            return found
        if torch.compiler.is_compiling():  # traced: a table made here is made at every call, and not kept
            return found if found is not None else self._make(state, device, dtype, wanted)
        with self._lock:
            state = self._state
            found = state.tables.get((device, dtype))
            if found is not None and found.length >= wanted:
                return found
            size = max(wanted, 2 * found.length if found is not None else 0)
            size = min(self.limit, -(-size // TABLE_BLOCK) * TABLE_BLOCK)
            made = self._make(state, device, dtype, size)
            self._state = replace(state, tables={**state.tables, (device, dtype): made})
            return made

    @staticmethod
    def _make(state: _State, device: torch.device, dtype: torch.dtype, size: int) -> Tables:
        inv_freq = state.inv_freq.to(device)
        cos, sin = angle_tables(inv_freq, torch.arange(size, device=device), state.attention_scaling, dtype)
        scaling = torch.full((1,), state.attention_scaling, dtype=torch.float64, device=device)
        return Tables(cos, sin, torch.cat((inv_freq, scaling)))

    def __deepcopy__(self, memo: dict[int, object]) -> TableCache:
        return self  # immutable states, swapped whole: a copied module shares the cache

    def __getstate__(self) -> dict[str, object]:
        return {"spec": self.spec, "limit": self.limit}  # pickled without tables (made again on use)

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["spec"], limit=state["limit"])  # type: ignore[misc]

    def nbytes(self) -> int:
        """The bytes of every table held."""
        return sum(t.cos.nbytes + t.sin.nbytes + t.frequencies.nbytes for t in self._state.tables.values())
