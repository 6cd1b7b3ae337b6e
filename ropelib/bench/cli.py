r"""``python -m ropelib.bench``: RoPE implementations side by side, against this device's memory roofs.

Run ``python -m ropelib.bench --help``. Every argument is checked before any work starts. The
rows: every implementation at each configuration (:mod:`ropelib.bench.rope`), with its true roof
(an in-place scale ``x.mul_(c)`` of q and k for in-place rows, a fresh ``torch.mul(x, c)`` for the
others) timed in the same rounds; a decode-shape row and a patched-vs-unpatched model step
(:mod:`ropelib.bench.decode`); ``--bias`` for relative-bias attention (:mod:`ropelib.bench.bias`);
``--kv-write`` instead times the rotation fused with the KV-cache write against the two-step path
(:mod:`ropelib.bench.kv_write`). ``--quick`` runs small shapes in under a minute.

The environment is recorded, never changed: on a small CPU, ``OMP_WAIT_POLICY=PASSIVE`` (idle
OpenMP threads sleep instead of spinning; ``torch.compile``'s kernels bring their own OpenMP
runtime) and ``THP_MEM_ALLOC_ENABLE=1`` (2 MiB pages for fresh CPU tensors) are read when the
process starts, so set them on the command line when you want them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .._device import device_name
from .._provenance import git_state
from ..layouts import LAYOUTS
from .kv_write import KINDS, KV_ROOF, format_kv_table, kv_write_rows
from .rope import (
    CPU_SHAPE,
    DTYPES,
    FRESH_ROOF,
    GPU_SHAPE,
    IMPL_NAMES,
    INPLACE_ROOF,
    MODES,
    PREFILL_SHAPE,
    Result,
    run_config,
)

QUICK_SHAPE = (1, 256, 8, 8, 64)
#: Read by the CLI's process at start-up; recorded with every result.
RECORDED_ENV = ("OMP_WAIT_POLICY", "THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS")


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


#: ``--kv-write --quick``: a decoding step of 16 sequences, small heads.
QUICK_KV_SHAPE = ("decode", (16, 8, 2, 64, 16))


def parse_kv_shape(text: str) -> tuple[str, tuple[int, int, int, int, int]]:
    """``"decode:64,32,8,128,16"`` -> ``("decode", (tokens, q_heads, kv_heads, head_dim, block_size))``."""
    kind, _, sizes = text.partition(":")
    parts = sizes.split(",")
    if kind not in KINDS or len(parts) != 5:
        raise argparse.ArgumentTypeError(
            f"a KV-write shape is decode|prefill:tokens,q_heads,kv_heads,head_dim,block_size, got {text!r}"
        )
    try:
        values = tuple(int(p) for p in parts)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"KV-write shape entries must be integers, got {text!r}") from exc
    if min(values) < 1 or values[3] % 2:
        raise argparse.ArgumentTypeError(f"need positive sizes and an even head_dim, got {text!r}")
    return kind, values  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ropelib.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        help="batch,seq,q_heads,kv_heads,head_dim (default: the target and prefill shapes on a CPU, one on a GPU)",
    )
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--impls", nargs="+", choices=IMPL_NAMES, help="time only these implementations (and ropelib)")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the torch.compile peer (its compilation is slow)"
    )
    parser.add_argument("--no-decode", action="store_true", help="leave out the decode-shape and model-step rows")
    parser.add_argument(
        "--bias", action="store_true", help="also time relative-bias attention (materialized vs flex_attention)"
    )
    parser.add_argument("--bias-shape", type=int, nargs=4, metavar=("B", "H", "N", "D"), default=None)
    parser.add_argument(
        "--kv-write",
        action="store_true",
        help="time the rotation fused with the KV-cache write against rotary_qk + index_copy_ (only that)",
    )
    parser.add_argument(
        "--kv-shapes",
        type=parse_kv_shape,
        nargs="+",
        help="with --kv-write: decode|prefill:tokens,q_heads,kv_heads,head_dim,block_size (default: the device's)",
    )
    parser.add_argument("--quick", action="store_true", help=f"small shapes ({QUICK_SHAPE}), 3 rounds: under a minute")
    parser.add_argument(
        "--json", dest="json_path", default=None, help="write the results (with provenance) to this file"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _checked_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, torch.device]:
    """Parse and check every argument before any work (a bad one exits with argparse's message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    try:
        device = (
            torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
    except RuntimeError:
        parser.error(f"--device must name a torch device (cpu or cuda), got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but PyTorch sees no CUDA device")
    if args.bias_shape is not None and min(args.bias_shape) < 1:
        parser.error(f"--bias-shape entries must be >= 1, got {args.bias_shape}")
    if args.json_path:
        folder = Path(args.json_path).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            parser.error(f"--json {args.json_path}: the folder {folder} does not exist or is not writable")
    if args.kv_shapes and not args.kv_write:
        parser.error("--kv-shapes needs --kv-write")
    if args.quick:
        args.kv_shapes = args.kv_shapes or ([QUICK_KV_SHAPE] if args.kv_write else None)
        args.shapes = args.shapes or [QUICK_SHAPE]
        args.reps, args.warmup = min(args.reps, 3), min(args.warmup, 1)
    return args, device


def environment(device: torch.device) -> dict[str, Any]:
    """Provenance stored with every result: device, versions, date, the exact command and the git commit."""
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
        "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        **git_state(),
    }


def format_table(results: Sequence[Result]) -> str:
    """A plain-text table, one block per configuration with its two roofs first, at most 76 characters wide."""
    lines = ["% roof: of x.mul_(c) in place, of torch.mul(x, c) out of place"]
    header = f"{'implementation':<25}{'ms':>9}{'GB/s':>8}{'% roof':>8}{'x ropelib':>10}{'ok':>4}"
    last = None
    for r in results:
        key = (tuple(r.shape), r.dtype, r.layout, r.mode)
        if key != last:
            lines += ["", f"shape={tuple(r.shape)} {r.dtype} {r.layout} {r.mode}", header]
            last = key
        ok = "yes" if r.correct else "NO"
        lines.append(
            f"{r.impl[:24]:<25}{r.median_ms:>9.3f}{r.gbs:>8.2f}{r.pct_roof:>8.1f}{r.ratio_to_ropelib:>10.2f}{ok:>4}"
        )
    return "\n".join(lines)


def _median_roof(results: Sequence[Result], roof: str) -> float:
    """The median over configurations of a roof's GB/s (each configuration has its own, in its rounds)."""
    return statistics.median(r.gbs for r in results if r.impl == roof)


def _write_json(document: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
        print(f"\nwrote {path}")


def kv_write_main(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``--kv-write``: the fused write and the two-step path at serving shapes (:mod:`ropelib.bench.kv_write`)."""
    dtypes = [DTYPES[d] for d in (args.dtypes or ["float32", "bfloat16"])]
    rows = kv_write_rows(
        device, shapes=args.kv_shapes, dtypes=dtypes, layouts=args.layouts, reps=args.reps, warmup=args.warmup
    )
    print(format_kv_table(rows))
    document: dict[str, Any] = {
        **environment(device),
        "benchmark": "kv_write",
        "roof": KV_ROOF,
        "reps": args.reps,
        "warmup": args.warmup,
        "results": rows,
    }
    _write_json(document, args.json_path)
    return document


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table; write ``--json`` if asked. Returns the JSON document."""
    args, device = _checked_args(argv)
    if args.kv_write:
        return kv_write_main(args, device)
    shapes = args.shapes or ([GPU_SHAPE] if device.type == "cuda" else [CPU_SHAPE, PREFILL_SHAPE])
    dtypes = [DTYPES[d] for d in (args.dtypes or (["bfloat16"] if device.type == "cuda" else ["float32"]))]
    configs = [(s, d, lay, m) for s in shapes for d in dtypes for lay in args.layouts for m in args.modes]
    from tqdm.auto import tqdm

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
                only=args.impls,
                compile_peer=not args.no_compile,
                progress=bar,
            )
            results += out
            skipped.update(skip)
    print(format_table(results))
    if skipped:
        print("\nnot timed: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    document: dict[str, Any] = {
        **environment(device),
        "inplace_roof_gbs": _median_roof(results, INPLACE_ROOF),
        "fresh_roof_gbs": _median_roof(results, FRESH_ROOF),
        "reps": args.reps,
        "warmup": args.warmup,
        "results": [asdict(r) for r in results],
        "skipped": skipped,
    }
    if not args.no_decode:
        from .decode import decode_rows, model_step_rows

        document["decode"] = decode_rows(device, reps=args.reps, warmup=args.warmup)
        for row in document["decode"]:
            print(f"decode {row['impl']:<26}{row['us_per_call']:>9.1f} us/call  {row['ratio_to_hf']:.2f}x HF apply")
        try:
            document["model_step"] = model_step_rows(device, reps=args.reps, warmup=args.warmup)
        except ImportError:
            skipped["model step"] = "transformers is not installed"
        for row in document.get("model_step", []):
            print(
                f"step   {row['impl']:<26}{row['ms_per_token']:>9.3f} ms/token {row['ratio_to_unpatched']:.2f}x unpatched"
            )
    if args.bias:
        from .bias import benchmark_bias

        document["bias"] = benchmark_bias(device, shape=args.bias_shape, reps=args.reps, warmup=args.warmup)
        for row in document["bias"]:
            print(f"bias {row['bias']:<6}{row['method']:<14}{row['median_ms']:>10.3f} ms  shape={row['shape']}")
    _write_json(document, args.json_path)
    return document
