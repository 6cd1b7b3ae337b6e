"""A tiny run of ``python -m ropelib.bench --kv-write``: the record's fields and byte counts. No timing is asserted."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch

from ropelib.bench import main
from ropelib.bench.cli import parse_kv_shape
from ropelib.bench.kv_write import (
    FUSED,
    FUSED_INPLACE,
    KV_ROOF,
    KV_ROOF_INPLACE,
    TWO_STEP,
    TWO_STEP_INPLACE,
    kv_write_bytes,
    slot_mapping,
    two_step_bytes,
)

FIELDS = {
    "impl",
    "kind",
    "shape",
    "cache_slots",
    "dtype",
    "layout",
    "median_ms",
    "times_ms",
    "bytes",
    "path_bytes",
    "gbs",
    "roof",
    "pct_roof",
    "speedup_over_two_step",
    "bitwise_equal_to_two_step",
}


def test_bytes_by_hand() -> None:
    # 3 tokens, 4 query heads, 2 key/value heads, head_dim 8, float32: q is 3*4*8 = 96 elements, k and
    # v 48 each; each read once and written once: 2 * 192 * 4 = 1536 bytes; cos and sin rows, 4
    # float32 each per token: 3 * 32 = 96; int64 positions and slots: 3 * 16 = 48.
    assert kv_write_bytes(3, 4, 2, 8, torch.float32) == 1536 + 96 + 48
    # the two-step path writes the rotated k (48 elements) to a fresh tensor and reads it back
    assert two_step_bytes(3, 4, 2, 8, torch.bfloat16) == kv_write_bytes(3, 4, 2, 8, torch.bfloat16) + 2 * 48 * 2


def test_slot_mappings_are_distinct_and_prefill_fills_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    decode = slot_mapping("decode", 10, 4, 10, gen)
    assert decode.unique().numel() == 10 and int(decode.max()) < 40
    prefill = slot_mapping("prefill", 10, 4, 10, gen)
    assert prefill.unique().numel() == 10
    blocks = prefill // 4
    assert blocks.unique().numel() == 3  # ceil(10 / 4) blocks, rows 0..3 of each in order
    assert torch.equal(prefill % 4, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]))


def test_parse_kv_shape() -> None:
    assert parse_kv_shape("decode:64,32,8,128,16") == ("decode", (64, 32, 8, 128, 16))
    for bad in ("64,32,8,128,16", "warm:1,1,1,2,1", "prefill:1,1,1,3,1", "decode:1,1,1,2"):
        with pytest.raises(Exception, match="shape|head_dim"):
            parse_kv_shape(bad)


def test_json_record(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    argv = ["--kv-write", "--kv-shapes", "decode:6,4,2,8,4", "prefill:6,4,2,8,4", "--dtypes", "float32"]
    doc = main([*argv, "--layouts", "half", "--reps", "2", "--warmup", "0", "--quiet", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(doc))
    for key in ("device", "device_type", "torch", "triton", "python", "date", "command", "roof", "results"):
        assert key in saved
    assert saved["benchmark"] == "kv_write" and saved["roof"] == KV_ROOF and saved["torch"] == torch.__version__
    assert datetime.datetime.fromisoformat(saved["date"]).tzinfo is not None
    assert saved["command"].startswith("python -m ropelib.bench")
    rows = saved["results"]
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    for row in rows:
        assert set(row) == FIELDS and len(row["times_ms"]) == 2
        assert row["bytes"] == kv_write_bytes(6, 4, 2, 8, torch.float32) and row["cache_slots"] == 24
        assert row["gbs"] == pytest.approx(row["bytes"] / row["median_ms"] / 1e6)
        assert (row["bitwise_equal_to_two_step"] is None) == (row["impl"] in (KV_ROOF, KV_ROOF_INPLACE))
        assert row["bitwise_equal_to_two_step"] in (None, True)  # every path writes the two-step path's bits
    by_impl = {(r["kind"], r["impl"]): r for r in rows}
    for kind in ("decode", "prefill"):
        assert by_impl[kind, KV_ROOF]["pct_roof"] == 100.0 and by_impl[kind, TWO_STEP]["speedup_over_two_step"] == 1.0
        assert by_impl[kind, TWO_STEP]["path_bytes"] == two_step_bytes(6, 4, 2, 8, torch.float32)
        assert by_impl[kind, TWO_STEP_INPLACE]["path_bytes"] == by_impl[kind, TWO_STEP]["path_bytes"]
        fused = by_impl[kind, FUSED]
        assert fused["path_bytes"] == fused["bytes"]
        assert fused["speedup_over_two_step"] == pytest.approx(
            by_impl[kind, TWO_STEP]["median_ms"] / fused["median_ms"]
        )
        # q rotated in place: against the in-place roof and the in-place two-step path
        in_place = by_impl[kind, FUSED_INPLACE]
        assert in_place["roof"] == KV_ROOF_INPLACE and by_impl[kind, KV_ROOF_INPLACE]["pct_roof"] == 100.0
        assert in_place["speedup_over_two_step"] == pytest.approx(
            by_impl[kind, TWO_STEP_INPLACE]["median_ms"] / in_place["median_ms"]
        )


def test_kv_shapes_need_kv_write() -> None:
    with pytest.raises(SystemExit):
        main(["--kv-shapes", "decode:6,4,2,8,4"])
