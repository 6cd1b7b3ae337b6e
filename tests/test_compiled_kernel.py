"""The compiled CPU path (ropelib.kernels.compiled_kernel): built off the caller's path, same results, eager fallback.

Expected values come from ``references.rotate_ref`` (float64 rotation matrices). The size threshold
is lowered so that small tensors take the path; each test starts from an empty build state.
"""

from __future__ import annotations

import pytest
import torch

from ropelib import RotaryEmbedding
from ropelib.kernels import compiled_kernel, rotary_qk, torch_kernel

from references import rotate_ref

THETA = 10000.0


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> compiled_kernel._Builds:
    builds = compiled_kernel._Builds()
    monkeypatch.setattr(compiled_kernel, "_BUILDS", builds)
    monkeypatch.setattr(compiled_kernel, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 0)  # not the decoding path
    return builds


def inputs(rotary_dim: int = 16) -> tuple[torch.Tensor, ...]:
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    cos, sin = RotaryEmbedding(rotary_dim, theta=THETA).cos_sin_cache(40)
    positions = torch.tensor([[0, 3, 39, 7, 7, 1], [1, 2, 3, 4, 5, 6]])
    return q, k, cos[:40], sin[:40], positions


def assert_rotated(out: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, positions, r: int) -> None:
    # float32 tables and products on inputs of size ~4: a few float32 ulps of |x| (1e-6 each)
    for got, x in zip(out, (q, k)):
        ref = rotate_ref(x, positions, theta=THETA, rotary_dim=r)
        assert (got.double() - ref).abs().max().item() < 1e-5


@pytest.mark.skipif(not compiled_kernel.enabled(), reason="no C++ compiler: the compiled path is off")
@pytest.mark.parametrize("rotary_dim", [16, 12])
def test_first_call_is_eager_then_the_compiled_function_serves(
    fresh: compiled_kernel._Builds, rotary_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, cos, sin, positions = inputs(rotary_dim)
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, rotary_dim)  # eager, build started
    assert len(fresh.kinds) == 1
    assert compiled_kernel.wait(300) is True
    calls = [0]
    inner = compiled_kernel._call

    def counted(*args: object) -> object:
        calls[0] += 1
        result = inner(*args)
        assert result is not None  # served by the compiled function, not sent back to eager
        return result

    monkeypatch.setattr(compiled_kernel, "_call", counted)
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, rotary_dim)
    assert calls[0] == 1


def test_a_failed_build_leaves_the_eager_kernel(
    fresh: compiled_kernel._Builds, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_kernel, "enabled", lambda: True)
    monkeypatch.setattr(torch, "compile", broken)
    q, k, cos, sin, positions = inputs()
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert compiled_kernel.wait(60) is False
    assert list(fresh.kinds.values()) == [False]
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)  # eager again, no new build
    assert len(fresh.kinds) == 1


def test_turned_off_by_the_environment(fresh: compiled_kernel._Builds, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled_kernel.ENV, "0")
    assert compiled_kernel.enabled() is False
    q, k, cos, sin, positions = inputs()
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert fresh.kinds == {}  # nothing started


def test_small_calls_and_other_layouts_never_start_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = compiled_kernel._Builds()
    monkeypatch.setattr(compiled_kernel, "_BUILDS", builds)
    q, k, cos, sin, positions = inputs()
    monkeypatch.setattr(torch_kernel, "FEW_ELEMENTS", 0)
    rotary_qk(q, k, cos, sin, positions)  # below MIN_ELEMENTS
    monkeypatch.setattr(compiled_kernel, "MIN_ELEMENTS", 0)
    rotary_qk(q, k, cos, sin, positions, layout="interleaved")  # one complex multiply already
    rotary_qk(q, k, cos, sin, positions, inplace=True)
    rotary_qk(q, k, cos, sin, positions, conjugate=True)
    assert builds.kinds == {}


def test_no_build_past_the_limit_of_kinds(fresh: compiled_kernel._Builds, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_kernel, "enabled", lambda: True)
    monkeypatch.setattr(compiled_kernel, "MAX_KINDS", 0)
    q, k, cos, sin, positions = inputs()
    assert_rotated(rotary_qk(q, k, cos, sin, positions), q, k, positions, 16)
    assert fresh.kinds == {}
