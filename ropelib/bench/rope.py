r"""Benchmark RoPE implementations against each other and against this device's copy bandwidth.

Run ``python -m ropelib.bench --help``. For every shape ``(batch, seq, q_heads, kv_heads,
head_dim)``, dtype, layout and mode (forward, or forward + backward) it times every available
implementation, interleaved round by round in one process so that a noisy machine slows all of
them alike, and reports

* the median time after warm-up (CUDA events on a GPU, so compilation and launch queues are
  excluded; ``time.perf_counter`` on a CPU);
* the achieved bandwidth, :func:`rope_bytes` divided by the median: the bytes the operation
  cannot avoid moving, the same numerator for every implementation;
* that bandwidth as a percentage of the device's copy bandwidth, measured in the same run by
  copying a tensor of the size of ``q`` and ``k`` into a preallocated buffer.

Each implementation's output is checked against the float64 reference
(:func:`ropelib.apply_rotary`) before it is timed. ``--bias`` times the relative-bias
attention of :mod:`ropelib.bias_attention` with the same harness.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ._device import device_name
from ._validation import check_choice, check_int
from .complex_rope import apply_rotary_emb
from .kernels import rotary_qk
from .rotary import LAYOUTS, RotaryEmbedding, apply_rotary, rotate_half

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("fwd", "fwd+bwd")
CPU_SHAPE = (4, 2048, 32, 32, 128)
GPU_SHAPE = (1, 8192, 32, 8, 128)

Impl = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- harness


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    reps: int = 5,
    warmup: int = 2,
    progress: Any = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, round-robin: round ``i`` runs every function once.

    Warm-up rounds (compilation, allocator, caches) are run first and discarded. On CUDA each
    call is bracketed by CUDA events; on CPU by ``time.perf_counter``.

    Args:
        fns: name -> zero-argument callable.
        device: where the functions run.
        reps: timed rounds (>= 1).
        warmup: untimed rounds before.
        progress: an object with ``update(n)`` (a tqdm bar), advanced once per call.

    Returns:
        name -> list of ``reps`` durations in seconds.
    """
    reps = check_int(reps, "reps", minimum=1)
    warmup = check_int(warmup, "warmup", minimum=0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - begin
            if round_index >= warmup:
                times[name].append(elapsed)
            if progress is not None:
                progress.update(1)
    return times


def copy_fn(nbytes: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """A copy of ``nbytes`` into a preallocated buffer, and the bytes it moves (read + write).

    A fresh ``clone()`` would mostly measure the page faults of new memory on a CPU, not bandwidth.
    """
    count = max(1, nbytes // 4)
    src = torch.randn(count, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * count * 4


def rope_bytes(
    batch: int, seq: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, mode: str = "fwd"
) -> int:
    r"""The bytes a RoPE pass cannot avoid: read q and k once, write them once, read the cos/sin rows once.

    .. math:: B_{\text{fwd}} = 2\,b\,s\,(h_q + h_k)\,d\,e + 2\,s\,\tfrac{d}{2}\cdot 4

    with ``e`` the element size (float32 tables). The backward pass is the same rotation of the
    gradients, so ``fwd+bwd`` moves twice as much.

    Example:
        >>> rope_bytes(1, 2, 1, 1, 4, torch.float32)  # 2 * (8 + 8) * 4 + 2 * 2 * 2 * 4
        160
    """
    mode = check_choice(mode, "mode", MODES)
    tensors = 2 * batch * seq * (q_heads + kv_heads) * head_dim * torch.empty(0, dtype=dtype).element_size()
    tables = 2 * seq * (head_dim // 2) * 4
    return (tensors + tables) * (2 if mode == "fwd+bwd" else 1)


# ----------------------------------------------------------------------------- peers


def _full_width(
    cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, r/2]`` tables widened to ``[S, 1, r]`` in ``dtype``, the way eager code holds them."""
    if layout == "half":
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's ``rotate_every_two``: ``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def eager_peer(cos: torch.Tensor, sin: torch.Tensor, layout: str, dtype: torch.dtype) -> Impl:
    """Hugging Face-style eager RoPE: ``x * cos + rotate_half(x) * sin`` in the input dtype."""
    wide_cos, wide_sin = _full_width(cos, sin, layout, dtype)
    turn = rotate_half if layout == "half" else _rotate_pairs

    def eager(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * wide_cos + turn(q) * wide_sin, k * wide_cos + turn(k) * wide_sin

    return eager


def implementations(
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    compile_peer: bool = True,
) -> tuple[dict[str, tuple[Impl, str]], dict[str, str]]:
    """The implementations available here: name -> (function, the layout it computes), and name -> why skipped.

    ``cos``/``sin`` are the float32 ``[seq, r/2]`` tables. Peers that only know the interleaved
    pairing (the seed's complex code, rotary-embedding-torch) are timed in both runs and checked
    against the interleaved reference.
    """
    impls: dict[str, tuple[Impl, str]] = {}
    skipped: dict[str, str] = {}
    impls["ropelib"] = ((lambda q, k: rotary_qk(q, k, cos, sin, layout=layout)), layout)
    impls["ropelib (in place)"] = ((lambda q, k: rotary_qk(q, k, cos, sin, layout=layout, inplace=True)), layout)
    if device.type == "cuda":
        impls["ropelib (torch path)"] = (
            (lambda q, k: rotary_qk(q, k, cos, sin, layout=layout, kernel="torch")),
            layout,
        )
    eager = eager_peer(cos, sin, layout, dtype)
    impls["HF eager"] = (eager, layout)
    pos_cis = torch.complex(cos, sin)
    impls["seed complex"] = ((lambda q, k: apply_rotary_emb(q, k, pos_cis)), "interleaved")
    if compile_peer:
        impls["torch.compile(HF eager)"] = (torch.compile(eager), layout)
    try:
        from rotary_embedding_torch import apply_rotary_emb as ret_apply  # type: ignore[import-untyped]

        freqs = torch.atan2(sin, cos).repeat_interleave(2, -1)[:, None, :]  # [S, 1, r]: its table of angles

        def ret(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ret_apply(freqs, q), ret_apply(freqs, k)

        impls["rotary-embedding-torch"] = (ret, "interleaved")
    except ImportError:
        skipped["rotary-embedding-torch"] = "not installed"
    if device.type != "cuda":
        skipped["liger-kernel"] = "Triton-only; on a CPU it would run in the interpreter"
        skipped["flash-attn"] = "CUDA-only"
        return impls, skipped
    try:
        from liger_kernel.ops.rope import LigerRopeFunction  # type: ignore[import-untyped]

        wide_cos, wide_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

        def liger(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), wide_cos, wide_sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        impls["liger-kernel"] = (liger, "half")
    except ImportError:
        skipped["liger-kernel"] = "not installed"
    try:
        from flash_attn.layers.rotary import apply_rotary_emb as fa_apply  # type: ignore[import-not-found]

        interleaved = layout == "interleaved"

        def flash(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return fa_apply(q, cos, sin, interleaved=interleaved), fa_apply(k, cos, sin, interleaved=interleaved)

        impls["flash-attn"] = (flash, layout)
    except ImportError:
        skipped["flash-attn"] = "not installed"
    return impls, skipped


# ----------------------------------------------------------------------------- one configuration


@dataclass
class Result:
    """One implementation at one configuration."""

    impl: str
    shape: list[int]
    dtype: str
    layout: str
    mode: str
    median_ms: float
    times_ms: list[float]
    bytes: int
    gbs: float
    pct_copy: float
    max_abs_error: float
    tolerance: float
    correct: bool
    ratio_to_ropelib: float = field(default=float("nan"))


def reference_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ``max|out - ref| / max(1, max|ref|)``: two units in the last place of ``dtype``
    (ropelib rounds once; eager peers working in ``dtype`` round three times, each by at most half
    a unit of a term no larger than the largest input) plus 1e-5 for float32 arithmetic."""
    return 2 * torch.finfo(dtype).eps + 1e-5


def _max_error(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> float:
    errors = [(o.double() - r).abs().max().item() / max(1.0, r.abs().max().item()) for o, r in zip(out, ref)]
    return max(errors)


def run_config(
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    mode: str,
    device: torch.device,
    *,
    reps: int,
    warmup: int,
    copy_gbs: float,
    only: Sequence[str] | None = None,
    compile_peer: bool = True,
    progress: Any = None,
) -> tuple[list[Result], dict[str, str]]:
    """Time every implementation on one configuration; see the module docstring."""
    batch, seq, q_heads, kv_heads, head_dim = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    rope = RotaryEmbedding(head_dim, layout=layout)
    cos, sin = (t[:seq] for t in rope.cos_sin_cache(seq, device))
    impls, skipped = implementations(cos, sin, layout, dtype, device, compile_peer=compile_peer)
    if only:
        impls = {name: v for name, v in impls.items() if name in only or name == "ropelib"}
    if mode == "fwd+bwd":  # in-place rotation has no autograd
        impls.pop("ropelib (in place)", None)
    if progress is not None:
        progress.total += len(impls) * (reps + warmup)
        progress.refresh()
    refs = {}
    for ref_layout in {impl_layout for _, impl_layout in impls.values()}:
        cos64, sin64 = RotaryEmbedding(head_dim, layout=ref_layout).cos_sin(
            torch.arange(seq, device=device), torch.float64
        )
        refs[ref_layout] = (
            apply_rotary(q.double(), cos64, sin64, layout=ref_layout),
            apply_rotary(k.double(), cos64, sin64, layout=ref_layout),
        )
    errors = {}
    with torch.no_grad():
        for name, (fn, impl_layout) in impls.items():
            errors[name] = _max_error(fn(q.clone(), k.clone()), refs[impl_layout])
    del refs
    if mode == "fwd":
        calls: dict[str, Callable[[], Any]] = {name: functools.partial(fn, q, k) for name, (fn, _) in impls.items()}
        with torch.no_grad():
            times = time_interleaved(calls, device, reps=reps, warmup=warmup, progress=progress)
    else:
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        grads = (torch.randn_like(q), torch.randn_like(k))

        def step(fn: Impl) -> None:
            torch.autograd.grad(fn(qg, kg), (qg, kg), grads)

        calls = {name: functools.partial(step, fn) for name, (fn, _) in impls.items()}
        times = time_interleaved(calls, device, reps=reps, warmup=warmup, progress=progress)
    nbytes = rope_bytes(batch, seq, q_heads, kv_heads, head_dim, dtype, mode)
    tol = reference_tolerance(dtype)
    results = []
    for name in impls:
        median = statistics.median(times[name])
        gbs = nbytes / median / 1e9
        results.append(
            Result(
                impl=name,
                shape=list(shape),
                dtype=str(dtype).removeprefix("torch."),
                layout=layout,
                mode=mode,
                median_ms=median * 1e3,
                times_ms=[t * 1e3 for t in times[name]],
                bytes=nbytes,
                gbs=gbs,
                pct_copy=100.0 * gbs / copy_gbs,
                max_abs_error=errors[name],
                tolerance=tol,
                correct=errors[name] <= tol,
            )
        )
    ours = next(r.median_ms for r in results if r.impl == "ropelib")
    for r in results:
        r.ratio_to_ropelib = r.median_ms / ours
    return results, skipped


# ----------------------------------------------------------------------------- command line


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"4,2048,32,32,128"`` -> ``(batch, seq, q_heads, kv_heads, head_dim)``."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"a shape is batch,seq,q_heads,kv_heads,head_dim (5 integers), got {text!r}")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"shape entries must be integers, got {text!r}") from exc
    if min(values) < 1 or values[4] % 2 or values[2] % values[3]:
        raise argparse.ArgumentTypeError(
            f"need positive sizes, even head_dim and kv_heads dividing q_heads, got {text!r}"
        )
    return values  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ropelib.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", help="batch,seq,q_heads,kv_heads,head_dim (default: one per device)"
    )
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--impls", nargs="+", help="time only these implementations (and ropelib)")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the torch.compile peer (its compilation is slow)"
    )
    parser.add_argument(
        "--bias", action="store_true", help="also time relative-bias attention (materialized vs flex_attention)"
    )
    parser.add_argument("--bias-shape", type=int, nargs=4, metavar=("B", "H", "N", "D"), default=None)
    parser.add_argument(
        "--json", dest="json_path", default=None, help="write the results (with provenance) to this file"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--thp", action="store_true", help="restart with THP_MEM_ALLOC_ENABLE=1 (2 MiB pages for CPU tensors)"
    )
    parser.add_argument(
        "--raw-env",
        action="store_true",
        help="keep the environment (by default the CLI restarts itself with OMP_WAIT_POLICY=PASSIVE)",
    )
    return parser


TUNED_ENV = {
    # Idle OpenMP threads sleep instead of spinning: torch.compile's kernels bring their own
    # OpenMP runtime, and two spinning runtimes on two cores stall each other for milliseconds.
    "OMP_WAIT_POLICY": "PASSIVE",
}
# With --thp: PyTorch's switch for 2 MiB pages in its CPU allocator. Fresh outputs then cost far
# fewer page faults, for every implementation alike (eager code allocates the most).
THP_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def _reexec_with_tuned_env() -> None:
    """Restart ``python -m ropelib.bench`` with :data:`TUNED_ENV` (and :data:`THP_ENV` for ``--thp``).

    These are read when the process starts, hence the restart. ``--raw-env`` keeps the environment.
    """
    if "--raw-env" in sys.argv:
        return
    wanted = {**TUNED_ENV, **(THP_ENV if "--thp" in sys.argv else {})}
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    env = {**os.environ, **wanted}
    os.execve(sys.executable, [sys.executable, "-m", "ropelib.bench", *sys.argv[1:]], env)


def environment(device: torch.device) -> dict[str, Any]:
    """Provenance stored with every result: device, versions, date and the exact command."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "device_type": device.type,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m ropelib.bench " + " ".join(sys.argv[1:]),
        "env": {k: os.environ.get(k) for k in {**TUNED_ENV, **THP_ENV}},
    }


def format_table(results: Sequence[Result], copy_gbs: float) -> str:
    """A plain-text table, one block per configuration."""
    lines = [f"copy bandwidth: {copy_gbs:.1f} GB/s"]
    header = f"{'implementation':<26}{'median ms':>11}{'GB/s':>8}{'% copy':>8}{'x ropelib':>11}{'ok':>4}"
    last = None
    for r in results:
        key = (tuple(r.shape), r.dtype, r.layout, r.mode)
        if key != last:
            lines += ["", f"shape={tuple(r.shape)} dtype={r.dtype} layout={r.layout} mode={r.mode}", header]
            last = key
        lines.append(
            f"{r.impl:<26}{r.median_ms:>11.3f}{r.gbs:>8.2f}{r.pct_copy:>8.1f}{r.ratio_to_ropelib:>11.2f}{'yes' if r.correct else 'NO':>4}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table; write ``--json`` if asked. Returns the JSON document."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = args.shapes or [GPU_SHAPE if device.type == "cuda" else CPU_SHAPE]
    dtypes = [DTYPES[d] for d in (args.dtypes or (["bfloat16"] if device.type == "cuda" else ["float32"]))]
    configs = [(s, d, lay, m) for s in shapes for d in dtypes for lay in args.layouts for m in args.modes]
    from tqdm.auto import tqdm

    copy_call, copy_bytes = copy_fn(
        max(rope_bytes(b, s, hq, hk, d, torch.float32) // 2 for b, s, hq, hk, d in shapes), device
    )
    copy_times = time_interleaved({"copy": copy_call}, device, reps=args.reps, warmup=args.warmup)
    copy_gbs = copy_bytes / statistics.median(copy_times["copy"]) / 1e9
    results: list[Result] = []
    skipped: dict[str, str] = {}
    with tqdm(total=0, desc="rope bench", disable=args.quiet, unit="call") as bar:
        for shape, dtype, layout, mode in configs:
            bar.set_postfix_str(f"{shape} {str(dtype)[6:]} {layout} {mode}")
            out, skip = run_config(
                shape,
                dtype,
                layout,
                mode,
                device,
                reps=args.reps,
                warmup=args.warmup,
                copy_gbs=copy_gbs,
                only=args.impls,
                compile_peer=not args.no_compile,
                progress=bar,
            )
            results += out
            skipped.update(skip)
    print(format_table(results, copy_gbs))
    if skipped:
        print("\nnot timed: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    document: dict[str, Any] = {
        **environment(device),
        "copy_gbs": copy_gbs,
        "copy_bytes": copy_bytes,
        "reps": args.reps,
        "warmup": args.warmup,
        "results": [asdict(r) for r in results],
        "skipped": skipped,
    }
    if args.bias:
        from .bias_attention import benchmark_bias

        document["bias"] = benchmark_bias(device, shape=args.bias_shape, reps=args.reps, warmup=args.warmup)
        for row in document["bias"]:
            print(f"bias {row['bias']:<6}{row['method']:<14}{row['median_ms']:>10.3f} ms  shape={row['shape']}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
        print(f"\nwrote {args.json_path}")
    return document


if __name__ == "__main__":
    _reexec_with_tuned_env()
    main()
