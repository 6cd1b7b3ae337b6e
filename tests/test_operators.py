"""ropelib's operators as PyTorch's own tools see them: version counters, make_fx, vmap, dispatch modes, export.

Every rotation goes through ``ropelib::rotary`` or ``ropelib::rotary_``: these tests look at it with
the tools a PyTorch user has, and compare with float64 references (``references.rotate_ref``) or
with PyTorch's own behaviour for its in-place operations.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import ropelib
from ropelib import MultiHeadAttention, RotaryEmbedding, rotary_qk

from references import EPS, rotate_ref

THETA = 10000.0
LAYOUT = pytest.mark.parametrize("layout", ["half", "interleaved"])
KERNEL = pytest.mark.parametrize("kernel", ["torch", "native"] if ropelib.kernels.native_build.enabled() else ["torch"])


class Dispatched(TorchDispatchMode):
    """Records every operator dispatched below autograd (what FlopCounterMode and debug modes see)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def tables(rotary_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return RotaryEmbedding(rotary_dim, theta=THETA).cos_sin(torch.arange(length))


def close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> bool:
    # float32 tables, products and sum: a few float32 ulps of max|x|
    return bool(((got.double() - ref).abs() <= 8 * EPS[torch.float32] * x.double().abs().max()).all())


# ----------------------------------------------------------------------------- in place: versions and autograd


@KERNEL
def test_in_place_bumps_versions_and_autograd_refuses_stale_saved_tensors(kernel: str) -> None:
    # As for PyTorch's own in-place operations: y saved q for its backward, the rotation changed q.
    w = torch.randn(1, 4, 2, 8, requires_grad=True)
    q = torch.randn(1, 4, 2, 8, requires_grad=True) * 1.0
    k = torch.randn(1, 4, 1, 8)
    cos, sin = tables(8, 4)
    y = (w * q).sum()
    before = (q._version, k._version)
    rotary_qk(q, k, cos, sin, inplace=True, kernel=kernel)
    assert q._version > before[0] and k._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with torch.no_grad():  # no gradient recorded: the counters move all the same
        version = k._version
        rotary_qk(q.detach(), k, cos, sin, inplace=True, kernel=kernel)
        assert k._version > version


@KERNEL
@LAYOUT
def test_in_place_autograd_on_views_of_one_packed_buffer(kernel: str, layout: str) -> None:
    # flash-attn's apply_rotary_emb_qkv_: q and k are views of one [B, S, Hq + 2 Hk, D] projection
    # (and of its [B, S, 3, H, D] form); the gradient of a rotated view is R(-theta) of its gradient.
    weight = torch.randn(1, 5, 8, 16, requires_grad=True)
    cos, sin = tables(16, 5)
    positions = torch.arange(5)
    for split in ("heads", "qkv"):
        packed = weight * 1.0
        if split == "heads":
            q, k = packed[:, :, :4], packed[:, :, 4:6]
        else:
            q, k = packed[:, :, :6].unflatten(2, (3, 2))[:, :, 0], packed[:, :, :6].unflatten(2, (3, 2))[:, :, 1]
        rotary_qk(q, k, cos, sin, layout=layout, inplace=True, kernel=kernel)
        grad = torch.randn_like(packed)
        (weight_grad,) = torch.autograd.grad(packed, weight, grad)
        want = grad.double().clone()
        if split == "heads":
            regions = ((slice(0, 4)), (slice(4, 6)))
            for region in regions:
                want[:, :, region] = rotate_ref(grad[:, :, region], -positions, theta=THETA, layout=layout)
        else:
            view = want[:, :, :6].unflatten(2, (3, 2))
            for i in (0, 1):
                view[:, :, i] = rotate_ref(
                    grad[:, :, :6].unflatten(2, (3, 2))[:, :, i], -positions, theta=THETA, layout=layout
                )
            want[:, :, :6] = view.flatten(2, 3)
        assert close(weight_grad, want, grad), split


def test_in_place_gradients_flow_like_out_of_place() -> None:
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = RotaryEmbedding(8).cos_sin(torch.arange(3), torch.float64)

    def rotate(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = x[:, :, :3] * 1.0, x[:, :, 3:] * 2.0
        return rotary_qk(q, k, cos, sin, inplace=inplace)

    assert torch.autograd.gradcheck(lambda _: torch.cat(rotate(True), 2), (x,))
    grads = [torch.autograd.grad(torch.cat(rotate(inplace), 2).square().sum(), x)[0] for inplace in (False, True)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- graphs, vmap, modes


@KERNEL
@LAYOUT
def test_make_fx_records_the_operator_and_its_graph_equals_eager(kernel: str, layout: str) -> None:
    q, k = torch.randn(2, 64, 4, 32), torch.randn(2, 64, 2, 32)
    cos, sin = tables(32, 64)
    graph = make_fx(lambda a, b: rotary_qk(a, b, cos, sin, layout=layout, kernel=kernel))(q, k)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "ropelib.rotary.default" in targets
    assert not any("empty_like" in t for t in targets)  # the kernel's work is inside the operator
    got, want = graph(q, k), rotary_qk(q, k, cos, sin, layout=layout, kernel=kernel)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    fake = make_fx(lambda a, b, c, s: rotary_qk(a, b, c, s, kernel=kernel), tracing_mode="fake")(q, k, cos, sin)
    assert "ropelib.rotary.default" in [str(n.target) for n in fake.graph.nodes]


@KERNEL
def test_make_fx_of_the_in_place_rotation(kernel: str) -> None:
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16)
    cos, sin = tables(16, 8)

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = a.clone(), b.clone()
        return rotary_qk(a, b, cos, sin, inplace=True, kernel=kernel)

    graph = make_fx(f)(q, k)
    assert "ropelib.rotary_.default" in [str(n.target) for n in graph.graph.nodes]
    got, want = graph(q, k), rotary_qk(q, k, cos, sin, kernel=kernel)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@KERNEL
def test_vmap_equals_a_loop(kernel: str) -> None:
    qs, ks = torch.randn(3, 2, 16, 4, 32), torch.randn(3, 2, 16, 2, 32)
    cos, sin = tables(32, 40)
    positions = torch.randint(0, 40, (3, 2, 16))
    shared = torch.vmap(lambda a, b: rotary_qk(a, b, cos, sin, kernel=kernel))(qs, ks)
    own = torch.vmap(lambda a, b, p: rotary_qk(a, b, cos, sin, p, kernel=kernel))(qs, ks, positions)
    for i in range(3):
        loop = rotary_qk(qs[i], ks[i], cos, sin, kernel=kernel)
        assert torch.equal(shared[0][i], loop[0]) and torch.equal(shared[1][i], loop[1])
        loop = rotary_qk(qs[i], ks[i], cos, sin, positions[i], kernel=kernel)
        assert torch.equal(own[0][i], loop[0]) and torch.equal(own[1][i], loop[1])
    # batched tables (one per member) take one call per member
    cos3, sin3 = torch.stack([cos] * 3), torch.stack([sin.neg(), sin, sin])
    per_member = torch.vmap(lambda a, b, c, s: rotary_qk(a, b, c, s, kernel=kernel))(qs, ks, cos3, sin3)
    first = rotary_qk(qs[0], ks[0], cos, -sin, kernel=kernel)
    assert torch.equal(per_member[0][0], first[0])


def test_vmap_in_place_and_autograd() -> None:
    qs, ks = torch.randn(3, 1, 8, 2, 16), torch.randn(3, 1, 8, 1, 16)
    cos, sin = tables(16, 8)
    want = [rotary_qk(qs[i], ks[i], cos, sin) for i in range(3)]
    q_in, k_in = qs.clone(), ks.clone()
    torch.vmap(lambda a, b: rotary_qk(a, b, cos, sin, inplace=True))(q_in, k_in)
    assert all(torch.equal(q_in[i], want[i][0]) and torch.equal(k_in[i], want[i][1]) for i in range(3))
    # autograd through a vmapped rotation: the gradient of sum(R q) is R(-theta) 1 for every member
    leaf = qs.clone().requires_grad_()
    torch.vmap(lambda a, b: rotary_qk(a, b, cos, sin))(leaf, ks)[0].sum().backward()
    ones = torch.ones_like(qs[0])
    assert all(close(leaf.grad[i], rotate_ref(ones, -torch.arange(8), theta=THETA), ones) for i in range(3))


@KERNEL
def test_a_dispatch_mode_sees_the_operator(kernel: str) -> None:
    rope = RotaryEmbedding(16, kernel=kernel)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 1, 16)
    rope(q, k)  # tables built: what follows is the call itself
    with Dispatched() as mode:
        rope(q, k)
    assert mode.ops.count("ropelib.rotary") == 1
    with Dispatched() as mode:
        rotary_qk(q.clone(), k.clone(), *rope.cos_sin_cache(4), inplace=True, kernel=kernel)
    assert "ropelib.rotary_" in mode.ops


def test_the_device_branch_costs_at_most_three_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU every operation is a kernel launch. With the branch taken where positions cannot be
    # read for free (forced here on the CPU), a decoding step dispatches the rotation and at most
    # three operations beside it: the queued check that positions are >= 0.
    import ropelib._validation as validation
    import ropelib.rotary.standard as standard

    rope = RotaryEmbedding(128)
    q, k, positions = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 8, 128), torch.tensor([[1000]])
    rope(q, k, positions)
    monkeypatch.setattr(validation, "values_readable", lambda x: False)
    monkeypatch.setattr(standard, "values_readable", lambda x: False)
    with Dispatched() as mode:
        got, _ = rope(q, k, positions)
    others = [op for op in mode.ops if not op.startswith("ropelib.")]
    assert mode.ops.count("ropelib.rotary") == 1 and len(others) <= 3, mode.ops
    assert close(got, rotate_ref(q, positions, theta=THETA), q)
    with pytest.raises(RuntimeError, match="positions must be >= 0"):
        rope(q, k, torch.tensor([[-1]]))  # the queued check fires (at once on the CPU)


def test_torch_export_keeps_the_operator() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = RotaryEmbedding(16)

        def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.rope(q, k)

    layer = Layer()
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16)
    layer(q, k)
    exported = torch.export.export(layer, (q, k))
    assert "ropelib.rotary.default" in [str(n.target) for n in exported.graph.nodes]
    got, want = exported.module()(q, k), layer(q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_compiled_in_place_training_step_equals_eager() -> None:
    weight = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(2, 6, 16)
    cos, sin = tables(8, 6)

    def step(w: torch.Tensor) -> torch.Tensor:
        qk = (x @ w).unflatten(-1, (4, 8))
        q, k = rotary_qk(qk[:, :, :2], qk[:, :, 2:], cos, sin, inplace=True)
        return (q * k).sum()

    eager = torch.autograd.grad(step(weight), weight)[0]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(weight), weight)[0]
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- one cache, shared and safe


def test_a_model_holds_one_table_per_spec() -> None:
    rope = RotaryEmbedding(16)
    layers = [MultiHeadAttention(64, 4, "rope", causal=True, rotary=rope) for _ in range(4)]
    x = torch.randn(2, 33, 64)
    rotation = rope.rotation(x)
    for layer in layers:
        x = layer(x, rotation=rotation)
    assert all(layer.encoding is rope for layer in layers)
    assert len(rope.cache._state.tables) == 1  # one device, one dtype: one table for all four layers
    own = [MultiHeadAttention(64, 4, "rope") for _ in range(2)]  # each its own module: its own cache
    assert own[0].encoding.cache is not own[1].encoding.cache


def test_threads_sharing_a_module_while_its_cache_grows() -> None:
    rope = RotaryEmbedding(16)
    q = torch.randn(1, 1, 2, 16)
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def work(offset: int) -> None:
        barrier.wait()
        for step in range(40):
            position = torch.tensor([[offset * 997 + step * 613]])
            got, _ = rope(q, q, position)
            if not close(got, rotate_ref(q, position, theta=THETA), q):
                errors.append(f"position {position.item()}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_no_module_level_mutable_state() -> None:
    # Registries are read-only mappings; the only process-wide state is the loaded native library
    # (NativeBuild), compiled functions (as torch's own), and the public scaling registry that
    # register_scaling extends by design.
    import importlib
    import pkgutil
    import weakref

    from ropelib.scaling.registry import ROPE_SCALINGS

    allowed = {id(ROPE_SCALINGS)}  # the registry (and the modules that import it by name)
    mutable = (dict, list, set, bytearray, weakref.WeakSet, weakref.WeakValueDictionary, weakref.WeakKeyDictionary)
    found = []
    for info in pkgutil.walk_packages(ropelib.__path__, "ropelib."):
        if info.name.startswith(("ropelib.bench", "ropelib.lab", "ropelib.__main__")):
            continue  # tools on top of the library
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                name.startswith("__")
                or getattr(value, "__module__", info.name) != info.name
                and not isinstance(value, mutable)
            ):
                continue
            if isinstance(value, mutable) and id(value) not in allowed:
                found.append(f"{info.name}.{name}: {type(value).__name__}")
    assert found == []
