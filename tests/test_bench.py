"""A tiny smoke run of ``python -m ropelib.bench`` and its byte count. No timing is asserted."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ropelib.bench import main, parse_shape, rope_bytes
from ropelib.bench.rope import FRESH_ROOF, INPLACE_ROOF

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {
    "impl",
    "shape",
    "dtype",
    "layout",
    "mode",
    "median_ms",
    "times_ms",
    "bytes",
    "gbs",
    "roof",
    "pct_roof",
    "max_abs_error",
    "tolerance",
    "correct",
    "ratio_to_ropelib",
}


def test_rope_bytes_by_hand() -> None:
    # (1, 4, 2, 1, 8) float32: q has 1*4*2*8 = 64 elements, k 32; each read and written once
    # (2 * 96 * 4 = 768 bytes) plus 4 rows of 4 cos and 4 sin in float32 (128 bytes).
    assert rope_bytes(1, 4, 2, 1, 8, torch.float32) == 896
    # bfloat16 halves the tensor part only; the backward pass moves everything again.
    assert rope_bytes(1, 4, 2, 1, 8, torch.bfloat16, "fwd+bwd") == 2 * (384 + 128)


def test_parse_shape() -> None:
    assert parse_shape("4,2048,32,8,128") == (4, 2048, 32, 8, 128)
    for bad in ("4,2048,32,128", "1,2,3,2,8", "1,2,4,2,7"):
        with pytest.raises(Exception, match="shape|head_dim|integers"):
            parse_shape(bad)


def test_json_report(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    doc = main(
        ["--shapes", "1,4,2,1,8", "--reps", "2", "--warmup", "0", "--no-compile", "--quiet", "--json", str(path)]
    )
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(doc))
    for key in (
        "device",
        "device_type",
        "torch",
        "triton",
        "python",
        "date",
        "command",
        "inplace_roof_gbs",
        "fresh_roof_gbs",
        "results",
        "skipped",
    ):
        assert key in saved
    assert saved["torch"] == torch.__version__ and saved["device_type"] == "cpu"
    assert datetime.datetime.fromisoformat(saved["date"]).tzinfo is not None
    assert saved["command"].startswith("python -m ropelib.bench")
    for key, roof in (("inplace_roof_gbs", INPLACE_ROOF), ("fresh_roof_gbs", FRESH_ROOF)):
        assert saved[key] > 0
        assert saved[key] == pytest.approx(statistics.median(r["gbs"] for r in saved["results"] if r["impl"] == roof))
    combos = {(r["layout"], r["mode"]) for r in saved["results"] if r["impl"] == "ropelib"}
    assert combos == {("half", "fwd"), ("half", "fwd+bwd"), ("interleaved", "fwd"), ("interleaved", "fwd+bwd")}
    roofs = (INPLACE_ROOF, FRESH_ROOF)
    for r in saved["results"]:
        assert set(r) == FIELDS
        assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
        forward_only = r["mode"] == "fwd" or r["impl"] in roofs  # a roof moves q and k once
        assert r["bytes"] == (896 if forward_only else 1792)  # the hand count above
        assert r["gbs"] == pytest.approx(r["bytes"] / r["median_ms"] / 1e6)
    # Every implementation is checked against the float64 reference before it is timed.
    assert all(r["correct"] for r in saved["results"]), [(r["impl"], r["max_abs_error"]) for r in saved["results"]]
    assert {"HF eager", "seed complex"} <= {r["impl"] for r in saved["results"]}
    # both roofs are timed in every configuration's rounds (as many times as the others), and the
    # percentages are taken of them: of the in-place roof for in-place rows, of the fresh one otherwise
    for layout, mode in combos:
        rows = {r["impl"]: r for r in saved["results"] if (r["layout"], r["mode"]) == (layout, mode)}
        assert set(roofs) <= set(rows)
        for name in roofs:
            assert rows[name]["roof"] == name and rows[name]["pct_roof"] == pytest.approx(100.0)
        for r in rows.values():
            assert len(r["times_ms"]) == len(rows[INPLACE_ROOF]["times_ms"])
            assert r["roof"] == (INPLACE_ROOF if "in place" in r["impl"] or r["impl"] == INPLACE_ROOF else FRESH_ROOF)
            assert r["pct_roof"] == pytest.approx(100 * r["gbs"] / rows[r["roof"]]["gbs"])
    assert ("ropelib (in place)", "fwd") in {(r["impl"], r["mode"]) for r in saved["results"]}
    decode = {r["impl"]: r for r in saved["decode"]}
    assert set(decode) == {"ropelib RotaryEmbedding", "ropelib rotary_qk", "HF apply_rotary_pos_emb"}
    assert decode["HF apply_rotary_pos_emb"]["ratio_to_hf"] == 1.0
    steps = saved["model_step"]
    assert [r["impl"] for r in steps] == ["tiny Llama, unpatched", "tiny Llama, patched"]
    assert all(r["same_tokens"] and r["ms_per_token"] > 0 for r in steps)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--impls", "nonexistent"], "invalid choice"),
        (["--device", "meta"], "--device must be cpu or cuda"),
        (["--device", "nonsense"], "--device must name a torch device"),
        (["--shapes", "0,4,2,1,8"], "positive sizes"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--json", "/nonexistent-folder/out.json"], "does not exist or is not writable"),
    ],
)
def test_bad_arguments_fail_before_any_work(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and "copy bandwidth" not in err.out


def test_command_line(tmp_path: Path) -> None:
    # The module entry point records the environment it was started with (and never restarts itself).
    path = tmp_path / "cli.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ropelib.bench",
            "--shapes",
            "1,2,2,2,4",
            "--layouts",
            "half",
            "--modes",
            "fwd",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--no-compile",
            "--no-decode",
            "--quiet",
            "--json",
            str(path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HF eager" in proc.stdout and "GB/s" in proc.stdout
    saved = json.loads(path.read_text())
    assert saved["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert saved["command"].endswith(f"--json {path}")
