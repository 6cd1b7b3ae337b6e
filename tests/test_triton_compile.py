"""Compile the Triton kernel ahead of time for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (used by test_kernels.py on a CPU) runs the kernel's semantics in NumPy; it does
not lower it. Compiling to PTX and a cubin catches what only the compiler sees: type errors in
the lowering, unsupported ops, and whether loads and stores are vectorized. Triton reads
``TRITON_INTERPRET`` when kernels are defined, so the compile runs in a subprocess with it off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ropelib.kernels.triton_kernel import rotary_qk_kernel as fn

POINTERS = {"Q": "*{t}", "K": "*{t}", "Q_OUT": "*{t}", "K_OUT": "*{t}", "COS": "*fp32", "SIN": "*fp32", "POS": "*i64",
            "FREQ": "*fp64"}
# What Triton's launcher specializes at run time for contiguous tensors whose sizes are multiples
# of 16: 16-byte aligned pointers and strides divisible by 16 (positions have stride 0/1 and are left out).
ALIGNED = set(POINTERS) | {n for n in fn.arg_names if n.startswith("stride_") and n not in ("stride_pb", "stride_ps")}
cases = json.loads(sys.argv[1])
out = []
for case in cases:
    sig = {}
    for name in fn.arg_names:
        if name in POINTERS:
            sig[name] = POINTERS[name].format(t=case["dtype"])
        elif name in case["constexprs"]:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=case["constexprs"], attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    out.append({
        "cubin_bytes": len(kernel.asm["cubin"]),
        "ops": sorted(set(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx))),
        "target": re.search(r"\.target\s+(\w+)", ptx).group(1),
        "fused_multiply_adds": len(re.findall(r"\bfma\.rn\.f32", ptx)),
        "float64_cosines": "cos" in ptx or "sin" in ptx or "__nv_cos" in ptx,
    })
print(json.dumps(out))
"""


def constexprs(interleaved: bool, rotary_dim: int, head_dim: int = 128) -> dict:
    rest = head_dim - rotary_dim
    return {
        "ROTARY_DIM": rotary_dim,
        "HEAD_DIM": head_dim,
        "BLOCK_H": 16,
        "BLOCK_R2": rotary_dim // 2,
        "BLOCK_REST": max(1, 1 << (max(rest, 1) - 1).bit_length()),
        "INTERLEAVED": interleaved,
        "CONJUGATE": False,
        "COPY_REST": rest > 0,
        "VARLEN": False,
        "SEARCH_STEPS": 1,
        "HAS_FREQ": False,
    }


CASES = [
    {"dtype": "bf16", "constexprs": constexprs(False, 128)},
    {"dtype": "bf16", "constexprs": constexprs(True, 128)},
    {"dtype": "fp32", "constexprs": {**constexprs(False, 64), "CONJUGATE": True}},
    {"dtype": "fp16", "constexprs": constexprs(True, 64)},
    {"dtype": "bf16", "constexprs": {**constexprs(False, 128), "VARLEN": True, "SEARCH_STEPS": 4}},  # packed rows
    {"dtype": "bf16", "constexprs": {**constexprs(False, 128), "HAS_FREQ": True}},  # rows past the table
]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # an explicit 0 makes ropelib define GPU kernels
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton build has no ptxas to assemble a cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(CASES)))
def test_compiles_to_sm90_cubin(compiled: list[dict], index: int) -> None:
    result = compiled[index]
    assert result["target"] == "sm_90a" or result["target"].startswith("sm_90")
    assert result["cubin_bytes"] > 1000  # a real ELF, not an empty stub


@pytest.mark.parametrize("index", range(len(CASES)))
def test_q_and_k_rows_move_in_16_byte_vectors(compiled: list[dict], index: int) -> None:
    # The bandwidth target needs 128-bit loads and stores of the head rows (v4 of 32 bits), in both
    # layouts: the interleaved pairs are split in registers, not loaded with a stride of 2.
    ops = compiled[index]["ops"]
    assert "ld.global.v4.b32" in ops, ops
    assert "st.global.v4.b32" in ops, ops


@pytest.mark.parametrize("index", range(len(CASES)))
def test_products_and_sums_are_rounded_apart(compiled: list[dict], index: int) -> None:
    # a c - b s with a rounding after each product and after the sum, as the PyTorch kernel computes
    # it on a GPU: no fused multiply-add of float32 in the rotation (ropelib launches with
    # enable_fp_fusion=False, as compiled here).
    assert compiled[index]["fused_multiply_adds"] == 0
