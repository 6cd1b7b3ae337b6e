"""Every argument check of ropelib, in one place, and the one rule for checking position values.

Each check raises :class:`TypeError` for a value of the wrong kind and :class:`ValueError`
for a value of the right kind but the wrong size or range; the message names the argument and
says what was expected. Public functions call these once, at their door; the internal functions
behind them (the kernels, the rotations a module applies after validating) do not check again.

Checking *values* of tensors: the rule
--------------------------------------
Shapes, dtypes and devices are metadata: checking them costs nothing and never waits for a
device. Position *values* (a position outside a table, a negative one) live in the tensor's
memory. ropelib checks them in one way everywhere, :func:`check_position_range`:

* **Eager, tensor on the CPU**: the values are in host memory, so they are read directly and a bad
  one raises :class:`ValueError` with the offending value. No device is waited for.
* **On a GPU, or under** :func:`torch.compile` **(any device)**: reading a value would stall the
  host until the device catches up (a device-to-host synchronisation on every call), break the
  compiled graph and make CUDA-graph capture impossible. The check is instead queued on the device
  with :func:`torch._assert_async`: no synchronisation, no graph break. A bad value raises a
  :class:`RuntimeError` carrying the same message when the device reaches it (on CUDA, as a
  device-side assertion at the next synchronisation, after which the CUDA context must be
  recreated, as with any device-side assert).
* **Meta tensors** hold no values: nothing to check.

Where a value is needed to *decide* something (how large a table to build), ropelib avoids
needing it: :class:`ropelib.RotaryEmbedding` computes the rows for the positions it is given
when it cannot read them for free. The exception is the pair of scalings whose frequencies follow
the current length (``dynamic``, ``longrope``): like ``transformers``' ``dynamic_rope_update``,
they read the largest position on the host.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32})


def check_int(value: object, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int``; rejects bools, floats and anything outside ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_even(value: object, name: str) -> int:
    """A positive even ``int`` (rotations act on pairs of features)."""
    value = check_int(value, name, minimum=2)
    if value % 2:
        raise ValueError(f"{name} must be even (features are rotated in pairs), got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    """A real ``bool`` (not a truthy string or number)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_positive_float(value: object, name: str) -> float:
    """A finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (float(value) > 0.0 and math.isfinite(float(value))):
        raise ValueError(f"{name} must be a finite number > 0, got {float(value)}")
    return float(value)


def check_heads(embed_dim: object, num_heads: object) -> tuple[int, int, int]:
    """``(embed_dim, num_heads, head_dim)`` for an attention layer: positive ints, ``num_heads`` dividing ``embed_dim``."""
    embed = check_int(embed_dim, "embed_dim", minimum=1)
    heads = check_int(num_heads, "num_heads", minimum=1)
    if embed % heads:
        raise ValueError(f"num_heads={heads} must divide embed_dim={embed}")
    return embed, heads, embed // heads


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (strings)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {list(choices)}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """A floating ``torch.dtype`` (float16, bfloat16, float32 or float64)."""
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating torch.dtype (float16, bfloat16, float32 or float64), got {dtype}")
    return dtype


def check_float_tensor(x: object, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """A floating-point tensor (float16, bfloat16, float32 or float64), optionally of rank ``ndim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_integer_tensor(x: object, name: str) -> torch.Tensor:
    """An integer tensor that int64 holds exactly: int8..int64, uint8..uint32 (not uint64, bool, float, complex)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INTEGER_DTYPES:
        if x.dtype == torch.uint64:
            raise TypeError(f"{name} must be an integer tensor that int64 holds exactly; got uint64 (use int64)")
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    return x


def check_same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Both tensors on the same device."""
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}; expected the same device")


def check_qk(q: object, k: object, *, head_dim: int | None = None, names: tuple[str, str] = ("q", "k")) -> None:
    """Queries and keys ``[batch, seq, heads, head_dim]`` that share batch, seq, head_dim, dtype and device.

    The head counts may differ (grouped-query attention).
    """
    qn, kn = names
    q = check_float_tensor(q, qn, ndim=4)
    k = check_float_tensor(k, kn, ndim=4)
    if head_dim is not None and (q.shape[-1] != head_dim or k.shape[-1] != head_dim):
        raise ValueError(
            f"{qn} and {kn} must have head_dim={head_dim} as last dimension, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{qn} and {kn} must share [batch, seq] and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            f"{qn} and {kn} must share dtype and device, got {q.dtype}/{q.device} and {k.dtype}/{k.device}"
        )


def values_readable(x: torch.Tensor) -> bool:
    """True when ``x``'s values can be read without waiting for a device: eager, on the CPU, a plain tensor.

    False under :func:`torch.compile`, for fake tensors (``make_fx``, export) and for tensors wrapped
    by :func:`torch.func.vmap` or ``grad``, whose values are not one tensor's.
    """
    if torch.compiler.is_compiling():  # first: the checks below are not traced
        return False
    return (
        type(x) in _PLAIN_TENSORS  # not a fake or other tensor subclass
        and x.device.type == "cpu"
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
    )


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_position_range(
    positions: torch.Tensor, name: str, *, minimum: int | None = 0, limit: int | None = None
) -> tuple[int, int] | None:
    """All of ``positions`` in ``[minimum, limit)`` (either bound may be None), by the rule of this module.

    Eager on the CPU: :class:`ValueError` naming the extreme value. On a GPU or under
    :func:`torch.compile`: a queued device-side assertion (no synchronisation), see the module docstring.

    Returns:
        ``(smallest, largest)`` position when they were read on the host (eager, CPU, not empty),
        so that a caller that needs them (to size a table) does not read them again; else None.
    """
    while not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(positions):
        positions = torch._C._functorch.get_unwrapped(positions)  # vmap: the tensor holding every member's values
    count = positions.numel()
    if count == 0 or positions.device.type == "meta":
        return None
    if values_readable(positions):
        if count == 1:  # a decoding step: one read, no reduction
            low = high = int(positions.item())
        else:
            low, high = (
                int(v) for v in torch.aminmax(positions if positions.dtype == torch.int64 else positions.long())
            )
        if minimum is not None and low < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got a minimum of {low}")
        if limit is not None and high >= limit:
            raise ValueError(f"{name} must be < {limit} (the table's size), got a maximum of {high}")
        return low, high
    if minimum is None:
        if limit is None:
            return None
        ok, bounds = positions < limit, f"< {limit}"
    elif limit is None:
        ok, bounds = positions >= minimum, f">= {minimum}"
    else:
        ok, bounds = (positions >= minimum) & (positions < limit), f"in [{minimum}, {limit})"
    torch._assert_async(ok.all(), f"{name} must be {bounds}")  # queued: no wait, no graph break
    return None


def check_positions(
    positions: object,
    name: str,
    *,
    batch: int | None,
    seq_len: int,
    limit: int | None = None,
    minimum: int | None = 0,
    expand: bool = True,
) -> torch.Tensor:
    """Integer positions of shape ``[seq_len]``, ``[1, seq_len]`` or ``[batch, seq_len]``, in ``[minimum, limit)``.

    Returns the tensor as ``int64``; with ``expand``, ``[1, seq_len]`` is broadcast over the batch
    (as Hugging Face's default ``position_ids``). Floating, boolean and complex tensors are rejected
    rather than rounded: a position is a token index. Values are checked by :func:`check_position_range`.
    """
    positions = check_integer_tensor(positions, name)
    shape = positions.shape
    if (
        shape[-1:] != (seq_len,)
        or len(shape) > 2
        or (len(shape) == 2 and (batch is None or shape[0] not in (1, batch)))
    ):
        shapes = [(seq_len,)] + ([(batch, seq_len), (1, seq_len)] if batch is not None else [])
        expected = " or ".join(str(list(s)) for s in dict.fromkeys(shapes))
        raise ValueError(f"{name} must have shape {expected}, got {list(positions.shape)}")
    if positions.dtype != torch.int64:
        positions = positions.long()
    if minimum is not None or limit is not None:
        check_position_range(positions, name, minimum=minimum, limit=limit)
    if expand and len(shape) == 2 and shape[0] == 1 and batch is not None and batch != 1:
        positions = positions.expand(batch, seq_len)
    return positions


def check_real_positions(
    positions: torch.Tensor, name: str, *, batch: int | None = None, seq_len: int | None = None
) -> torch.Tensor:
    """Real-valued (floating) positions, finite; of shape ``[seq_len]``, ``[1, seq_len]`` or ``[batch, seq_len]``
    when ``seq_len`` is given. Finiteness is checked by the rule of this module (read on the CPU, a
    queued assertion elsewhere)."""
    if seq_len is not None:
        shapes = [(seq_len,)] + ([(batch, seq_len), (1, seq_len)] if batch is not None else [])
        if tuple(positions.shape) not in shapes:
            expected = " or ".join(str(list(s)) for s in dict.fromkeys(shapes))
            raise ValueError(f"{name} must have shape {expected}, got {list(positions.shape)}")
    if positions.numel() and positions.device.type != "meta":
        finite = torch.isfinite(positions).all()
        if values_readable(positions):
            if not bool(finite):
                bad = positions[~torch.isfinite(positions)].flatten()[0].item()
                raise ValueError(f"{name} must be finite, got {bad}")
        else:
            torch._assert_async(finite, f"{name} must be finite")
    return positions
