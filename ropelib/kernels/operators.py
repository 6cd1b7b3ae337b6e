r"""ropelib's operators: the rotation as PyTorch sees it, with the rules autograd, compile, vmap and modes use.

Four operators, defined with :class:`torch.library.Library` (a low-level definition: one dispatcher
hop, no Python wrapper)::

    ropelib::rotary (Tensor q, Tensor k, Tensor cos, Tensor sin,
                     Tensor positions, Tensor? frequencies,
                     Tensor? cu_seqlens, bool interleaved,
                     bool conjugate, str kernel) -> (Tensor, Tensor)
    ropelib::rotary_(Tensor(a!) q, Tensor(b!) k, ...the same...) -> ()
    ropelib::rotary_kv_write_(Tensor q, Tensor k, Tensor v,
                              Tensor(a!) k_cache, Tensor(b!) v_cache,
                              Tensor slot_mapping, Tensor cos, Tensor sin,
                              Tensor positions, bool interleaved,
                              str kernel) -> Tensor
    ropelib::rotary_kv_write_inplace_(Tensor(a!) q, ...,
                              Tensor(b!) k_cache, Tensor(c!) v_cache,
                              ...the same...) -> ()

``rotary`` returns the rotated ``q`` ``[B, S, Hq, D]`` and ``k`` ``[B, S, Hk, D]`` (``Hk`` may be 0);
``rotary_`` overwrites them, and its schema says so, so that their version counters move
(autograd then refuses a stale saved tensor, as for any in-place op). ``cos``/``sin`` are
``[L, d_rot/2]`` tables, ``positions`` int64 ``[S]`` or ``[B, S]`` rows of them; ``frequencies``
(float64 ``[d_rot/2 + 1]``: the inverse frequencies, then the factor on cos and sin) lets positions
outside ``[0, L)`` have their rows computed; ``cu_seqlens`` replaces ``positions`` by the positions
within each packed document; ``kernel`` is ``"auto"`` or a name of
:data:`~ropelib.KERNELS`. The callers are :func:`ropelib.rotary_qk` and the
modules, which check their arguments first; the operators do not check again.

``rotary_kv_write_`` (inference only) returns the rotated ``q`` and writes the rotated ``k`` and
``v`` of token ``(b, s)`` into slot ``slot_mapping[b, s]`` of the caches (vLLM's slot mapping:
``[num_blocks, block_size, Hk, D]`` caches, or ``[num_slots, Hk, D]``; a negative slot is
padding, not written); ``rotary_kv_write_inplace_`` does the same with ``q`` rotated in place
(vLLM's order). Their caller is :func:`ropelib.rotary_kv_cache_write`. With
autograd recording and an input that requires grad it raises rather than drop the gradient.

What is registered, beside the kernel (every backend; the chosen kernel touches the memory):

* **autograd**: ``d/dq R(theta) q = R(-theta)``, so the backward of either operator is ``rotary``
  with ``conjugate`` flipped, itself differentiable (double backward). The in-place operator is
  recorded per tensor, one :class:`torch.autograd.Function` each, because autograd lets a function
  that modifies a view in place return only that view (q and k as views of one packed buffer);
* **ADInplaceOrView** for ``rotary_`` and the kv writes: the version counters of what they
  write (``q`` and ``k``; the caches, and ``q`` in place) are bumped;
* **fake** (shape-only) functions, for :func:`torch.compile`, :func:`torch.export`, ``make_fx`` and
  meta tensors;
* **vmap** rules: the vmapped dimension joins the batch (one call) when the tables are shared,
  else one call per member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import increment_version

from .registry import run, run_kv_write

_ARGS = (
    "Tensor cos, Tensor sin, Tensor positions, Tensor? frequencies, Tensor? cu_seqlens, "
    "bool interleaved, bool conjugate, str kernel"
)
#: The registration of the ``ropelib`` operators (kept alive by this module).
LIBRARY = torch.library.Library("ropelib", "DEF")
LIBRARY.define(f"rotary(Tensor q, Tensor k, {_ARGS}) -> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
LIBRARY.define(f"rotary_(Tensor(a!) q, Tensor(b!) k, {_ARGS}) -> ()", tags=(torch.Tag.pt2_compliant_tag,))
#: ``ropelib::rotary``, out of place.
rotary = torch.ops.ropelib.rotary.default
#: ``ropelib::rotary_``, in place.
rotary_ = torch.ops.ropelib.rotary_.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_AFTER_INPLACE_OR_VIEW = torch._C._after_ADInplaceOrView_keyset


def _keys(*keys: torch._C.DispatchKey) -> torch._C.DispatchKeySet:
    keyset = torch._C.DispatchKeySet(keys[0])
    for key in keys[1:]:
        keyset = keyset | torch._C.DispatchKeySet(key)
    return keyset


_KEY = torch._C.DispatchKey
#: The keysets of calls on plain tensors, where below Autograd (and ADInplaceOrView) comes the backend
#: itself: no mode, no fake or wrapped tensor, no functionalization. The Autograd kernels then call
#: the backend's kernel at once rather than dispatching again (what the dispatcher would reach).
_PLAIN = tuple(
    _keys(backend, autograd) for backend, autograd in ((_KEY.CPU, _KEY.AutogradCPU), (_KEY.CUDA, _KEY.AutogradCUDA))
)
_PLAIN_INPLACE = tuple(keyset | _keys(_KEY.ADInplaceOrView) for keyset in _PLAIN)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _run_into(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, *args: Any) -> None:
    """Both kernels' call of :func:`~ropelib.kernels.registry.run`; ``args`` are the operators' after ``k``."""
    cos, sin, positions, frequencies, cu_seqlens, interleaved, conjugate, kernel = args
    tables = cos.contiguous(), sin.contiguous()
    run(
        kernel,
        q,
        k,
        q_out,
        k_out,
        *tables,
        positions,
        frequencies,
        cu_seqlens,
        interleaved=interleaved,
        conjugate=conjugate,
    )


def _rotary_kernel(q: torch.Tensor, k: torch.Tensor, *args: Any) -> Any:
    q, k = _unit_stride(q), _unit_stride(k)  # the kernels read features at unit stride
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _run_into(q, k, q_out, k_out, *args)
    return q_out, k_out


def _rotary_inplace_kernel(q: torch.Tensor, k: torch.Tensor, *args: Any) -> None:
    q_unit, k_unit = _unit_stride(q), _unit_stride(k)  # a feature stride other than 1: through a copy
    _run_into(q_unit, k_unit, q_unit, k_unit, *args)
    for x, unit in ((q, q_unit), (k, k_unit)):
        if unit is not x:
            x.copy_(unit)


LIBRARY.impl("rotary", _rotary_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("rotary_", _rotary_inplace_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("ropelib::rotary", lib=LIBRARY)
def _rotary_fake(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(_unit_stride(q)), torch.empty_like(_unit_stride(k))


@torch.library.register_fake("ropelib::rotary_", lib=LIBRARY)
def _rotary_inplace_fake(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> None:
    return None


# ----------------------------------------------------------------------------- autograd


def _no_key(x: torch.Tensor) -> torch.Tensor:
    """A tensor of no heads beside ``x``: the operators rotate q and k, and here only ``x`` is rotated."""
    return x.new_empty((*x.shape[:2], 0, x.shape[3]))


class _Rotate(torch.autograd.Function):
    """``rotary`` as autograd records it; backward: ``rotary`` with ``conjugate`` flipped.

    ``forward`` takes ``ctx`` (no ``setup_context``): that form binds no signature at each call.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        *args, keyset = rest
        with torch._C._AutoDispatchBelowAutograd():
            q_out, k_out = rotary.redispatch(keyset & _AFTER_AUTOGRAD, q, k, *args)
        cos, sin, positions, frequencies, cu_seqlens, *flags = args
        ctx.save_for_backward(cos, sin, positions, frequencies, cu_seqlens)
        ctx.flags = flags
        return q_out, k_out

    @staticmethod
    def backward(ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        interleaved, conjugate, kernel = ctx.flags
        dq, dk = rotary(grad_q, grad_k, *ctx.saved_tensors, interleaved, not conjugate, kernel)
        return (dq, dk) + (None,) * 9


class _RotateInPlace(torch.autograd.Function):
    """``rotary_`` of one tensor as autograd records it (marked dirty); backward: ``rotary``, conjugated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        rotary_(x, _no_key(x), *args)
        ctx.mark_dirty(x)
        cos, sin, positions, frequencies, cu_seqlens, *flags = args
        ctx.save_for_backward(cos, sin, positions, frequencies, cu_seqlens)
        ctx.flags = flags
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        interleaved, conjugate, kernel = ctx.flags
        dx, _ = rotary(grad, _no_key(grad), *ctx.saved_tensors, interleaved, not conjugate, kernel)
        return (dx,) + (None,) * 8


def _records(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """True when autograd must record the call; refuses tables that would need a gradient."""
    if not torch.is_grad_enabled():
        return False
    if cos.requires_grad or sin.requires_grad:
        raise RuntimeError(
            "ropelib's operators give no gradient to cos and sin; rotate with ropelib.apply_rotary for that"
        )
    return q.requires_grad or k.requires_grad


def _rotary_autograd(keyset: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, *rest: Any) -> Any:
    if _records(q, k, cos, rest[0]):
        return _Rotate.apply(q, k, cos, *rest, keyset)
    if keyset == _PLAIN[0] or keyset == _PLAIN[1]:
        return _rotary_kernel(q, k, cos, *rest)
    return rotary.redispatch(keyset & _AFTER_AUTOGRAD, q, k, cos, *rest)


def _rotary_inplace_autograd(keyset: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, *rest: Any) -> None:
    if _records(q, k, cos, rest[0]):
        for x in (q, k):
            _RotateInPlace.apply(x, cos, *rest)
        return None
    if keyset == _PLAIN_INPLACE[0] or keyset == _PLAIN_INPLACE[1]:
        increment_version(q)  # what ADInplaceOrView does, then the backend
        increment_version(k)
        return _rotary_inplace_kernel(q, k, cos, *rest)
    return rotary_.redispatch(keyset & _AFTER_AUTOGRAD, q, k, cos, *rest)


def _rotary_inplace_version(keyset: Any, q: torch.Tensor, k: torch.Tensor, *rest: Any) -> None:
    increment_version(q)
    increment_version(k)
    return rotary_.redispatch(keyset & _AFTER_INPLACE_OR_VIEW, q, k, *rest)


LIBRARY.impl("rotary", _rotary_autograd, "Autograd", with_keyset=True)
LIBRARY.impl("rotary_", _rotary_inplace_autograd, "Autograd", with_keyset=True)
LIBRARY.impl("rotary_", _rotary_inplace_version, "ADInplaceOrView", with_keyset=True)


# ----------------------------------------------------------------------------- vmap


def _front(x: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """``x`` with its vmapped dimension first (expanded to ``size`` when it has none)."""
    if x is None:
        return None
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _member_args(args: tuple[Any, ...], in_dims: tuple[int | None, ...], index: int) -> list[Any]:
    """The arguments of member ``index`` of the vmapped call."""
    return [a.select(d, index) if d is not None else a for a, d in zip(args, in_dims)]


def _joined_positions(positions: torch.Tensor, batched: bool, size: int, batch: int) -> torch.Tensor:
    """Positions of ``[size * batch, S]`` rows: the members' batches one after another."""
    seq = positions.shape[-1]
    per_member = positions if batched else positions.expand(size, *positions.shape)  # [V, S] or [V, B, S]
    if per_member.ndim == 2:
        per_member = per_member[:, None]
    return per_member.expand(size, batch, seq).reshape(size * batch, seq)


def _joinable(in_dims: tuple[int | None, ...], cu_seqlens: torch.Tensor | None) -> bool:
    """True when the members can be one call: shared tables, and no packed row (a batch of one)."""
    cos_dim, sin_dim, _, freq_dim = in_dims[2:6]
    return cos_dim is None and sin_dim is None and freq_dim is None and cu_seqlens is None


@torch.library.register_vmap("ropelib::rotary", lib=LIBRARY)
def _rotary_vmap(info: Any, in_dims: tuple[int | None, ...], q: torch.Tensor, k: torch.Tensor, *rest: Any) -> Any:
    size, args = info.batch_size, (q, k, *rest)
    if not _joinable(in_dims, rest[4]):
        outs = [rotary(*_member_args(args, in_dims, i)) for i in range(size)]
        return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)
    qb, kb = _front(q, in_dims[0], size), _front(k, in_dims[1], size)
    assert qb is not None and kb is not None
    batch = qb.shape[1]
    positions = _joined_positions(rest[2], in_dims[4] is not None, size, batch)
    q_out, k_out = rotary(qb.flatten(0, 1), kb.flatten(0, 1), rest[0], rest[1], positions, *rest[3:])
    return (q_out.unflatten(0, (size, batch)), k_out.unflatten(0, (size, batch))), (0, 0)


@torch.library.register_vmap("ropelib::rotary_", lib=LIBRARY)
def _rotary_inplace_vmap(
    info: Any, in_dims: tuple[int | None, ...], q: torch.Tensor, k: torch.Tensor, *rest: Any
) -> Any:
    if in_dims[0] is None or in_dims[1] is None:
        raise ValueError(
            "vmap of an in-place rotation needs q and k both batched: an unbatched one would be rotated once per member"
        )
    for i in range(info.batch_size):  # views of q and k: each member rotated where it lies
        rotary_(*_member_args((q, k, *rest), in_dims, i))
    return None, None


# ----------------------------------------------------------------------------- the rotation fused with the KV-cache write

LIBRARY.define(
    "rotary_kv_write_(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor cos, Tensor sin, Tensor positions, bool interleaved, str kernel) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
LIBRARY.define(
    "rotary_kv_write_inplace_(Tensor(a!) q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, "
    "Tensor slot_mapping, Tensor cos, Tensor sin, Tensor positions, bool interleaved, str kernel) -> ()",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _paged(cache: torch.Tensor) -> torch.Tensor:
    """A cache as ``[num_blocks, block_size, heads, d]``: a contiguous ``[slots, heads, d]`` one is one block."""
    return cache if cache.ndim == 4 else cache.unsqueeze(0)


def _kv_write_into(q: torch.Tensor, q_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> None:
    """Both kv-write kernels' call of :func:`~ropelib.kernels.registry.run_kv_write`; ``args`` from ``k_cache`` on."""
    k_cache, v_cache, slot_mapping, cos, sin, positions, interleaved, kernel = args
    k, v = _unit_stride(k), _unit_stride(v)
    tables = cos.contiguous(), sin.contiguous()
    run_kv_write(
        kernel,
        q,
        k,
        v,
        q_out,
        _paged(k_cache),
        _paged(v_cache),
        slot_mapping,
        *tables,
        positions,
        interleaved=interleaved,
    )


def _kv_write_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> torch.Tensor:
    q = _unit_stride(q)
    q_out = torch.empty_like(q)
    _kv_write_into(q, q_out, k, v, *args)
    return q_out


def _kv_write_inplace_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any) -> None:
    q_unit = _unit_stride(q)  # a feature stride other than 1: through a copy
    _kv_write_into(q_unit, q_unit, k, v, *args)
    if q_unit is not q:
        q.copy_(q_unit)


def _refuse_gradients(name: str, *tensors: torch.Tensor) -> None:
    """The fused write records no gradient: refuse, rather than drop one, when autograd would record."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            f"ropelib::{name} is inference-only and gives no gradient: call it under torch.no_grad() "
            "or torch.inference_mode(), or rotate with ropelib.rotary_qk to train"
        )


def _register_kv_write(name: str, kernel: Callable[..., Any], writes_q: bool) -> Any:
    """Register a kv-write operator's kernel, its version bumps (what its schema writes) and its autograd refusal.

    The arguments of both are ``(q, k, v, k_cache, v_cache, slot_mapping, cos, sin, positions, ...)``;
    the caches are written, and ``q`` too when ``writes_q``.
    """
    op = getattr(torch.ops.ropelib, name).default

    def bump(args: tuple[Any, ...]) -> None:
        for tensor in (args[0], args[3], args[4]) if writes_q else (args[3], args[4]):
            increment_version(tensor)

    def autograd(keyset: Any, *args: Any) -> Any:
        _refuse_gradients(name, *args[:5], args[6], args[7])
        if keyset == _PLAIN_INPLACE[0] or keyset == _PLAIN_INPLACE[1]:
            bump(args)  # what ADInplaceOrView does, then the backend
            return kernel(*args)
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    def version(keyset: Any, *args: Any) -> Any:
        bump(args)
        return op.redispatch(keyset & _AFTER_INPLACE_OR_VIEW, *args)

    LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    LIBRARY.impl(name, autograd, "Autograd", with_keyset=True)
    LIBRARY.impl(name, version, "ADInplaceOrView", with_keyset=True)
    return op


#: ``ropelib::rotary_kv_write_``: returns the rotated q, writes the rotated k and v into the caches.
rotary_kv_write_ = _register_kv_write("rotary_kv_write_", _kv_write_kernel, writes_q=False)
#: ``ropelib::rotary_kv_write_inplace_``: the same with q rotated in place (vLLM's order), returns nothing.
rotary_kv_write_inplace_ = _register_kv_write("rotary_kv_write_inplace_", _kv_write_inplace_kernel, writes_q=True)


@torch.library.register_fake("ropelib::rotary_kv_write_", lib=LIBRARY)
def _kv_write_fake(q: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty_like(_unit_stride(q))


@torch.library.register_fake("ropelib::rotary_kv_write_inplace_", lib=LIBRARY)
def _kv_write_inplace_fake(q: torch.Tensor, *rest: Any) -> None:
    return None
