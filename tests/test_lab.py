"""The extrapolation lab: task data, models, determinism, N/A handling, scaling swap, CLI and the committed results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ropelib import lab
from ropelib.lab import (
    ENCODINGS,
    LabConfig,
    TinyTransformer,
    accuracy,
    repeat_batch,
    run,
    scaling_for_length,
    train,
    with_rope_scaling,
)

TINY = LabConfig(
    train_length=8,
    multiples=(1, 2),
    vocab_size=16,
    embed_dim=16,
    num_heads=2,
    num_layers=1,
    steps=3,
    batch_size=4,
    eval_sequences=8,
)
ROOT = Path(__file__).resolve().parents[1]


def test_repeat_batch_layout_and_targets():
    tokens, targets = repeat_batch(5, 12, TINY, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (5, 12) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, :6], tokens[:, 6:])
    for row in tokens[:, :6]:
        assert len(set(row.tolist())) == 6  # distinct, so the next token of the copy is unambiguous
    assert bool((targets[:, :6] == lab.IGNORE).all()) and bool((targets[:, -1] == lab.IGNORE).all())
    assert torch.equal(targets[:, 6:11], tokens[:, 1:6])  # at copy position j the target is x_{j+1}


def test_repeat_batch_errors():
    g = torch.Generator()
    with pytest.raises(ValueError, match="even"):
        repeat_batch(1, 7, TINY, g)
    with pytest.raises(ValueError, match="distinct tokens"):
        repeat_batch(1, 34, TINY, g)  # 17 distinct tokens from a vocabulary of 16


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_builds_and_maps_tokens_to_logits(encoding):
    torch.manual_seed(0)
    model = TinyTransformer(TINY, encoding)
    tokens, _ = repeat_batch(3, 8, TINY, torch.Generator().manual_seed(1))
    assert model(tokens).shape == (3, 8, TINY.vocab_size)
    kinds = {type(block.attn.encoding).__name__ for block in model.blocks}
    expected = {"rope": {"RotaryEmbedding"}, "t5": {"T5RelativeBias"}}.get(encoding, {"NoneType"})
    assert kinds == expected


def test_training_is_deterministic_and_learned_table_is_not_applicable_past_L():
    model_a, losses_a = train(TINY, "learned", device="cpu", progress=False)
    model_b, losses_b = train(TINY, "learned", device="cpu", progress=False)
    assert losses_a == losses_b and len(losses_a) == TINY.steps
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
    at_l = accuracy(model_a, 8, TINY)
    assert at_l is not None and 0.0 <= at_l <= 1.0
    assert accuracy(model_a, 16, TINY) is None  # no row for positions >= L: reported N/A, never clamped
    with pytest.raises(ValueError, match="learned table"):
        model_a(repeat_batch(1, 16, TINY, torch.Generator())[0])


def test_rope_scaling_swap_is_identity_at_factor_one_and_changes_longer_inputs():
    torch.manual_seed(0)
    model = TinyTransformer(TINY, "rope").eval()
    tokens, _ = repeat_batch(2, 16, TINY, torch.Generator().manual_seed(3))
    short = tokens[:, :8]
    with torch.no_grad():
        plain_short, plain_long = model(short), model(tokens)
        for name in lab.TEST_TIME_SCALINGS:
            same = with_rope_scaling(model, scaling_for_length(name, 1, TINY.train_length))
            assert torch.allclose(same(short), plain_short, rtol=0, atol=1e-6), name  # float32 rounding of equal angles
            stretched = with_rope_scaling(model, scaling_for_length(name, 2, TINY.train_length))
            assert not torch.allclose(stretched(tokens), plain_long, atol=1e-4), name
    assert model.blocks[0].attn.encoding.scaling is None  # the original is untouched
    with pytest.raises(ValueError, match="RoPE model"):
        with_rope_scaling(TinyTransformer(TINY, "alibi"), scaling_for_length("linear", 2, 8))


def test_scaling_for_length_uses_the_multiple_and_training_length():
    assert scaling_for_length("yarn", 4, 32) == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    assert scaling_for_length("dynamic", 2, 32) == {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="name"):
        scaling_for_length("longrope", 2, 32)


def test_run_reports_every_encoding_and_scaling(tmp_path):
    results = run(TINY, ("learned", "rope"), ("linear", "yarn"), device="cpu", progress=False)
    assert set(results["accuracy"]) == {"learned", "rope", "rope+linear", "rope+yarn"}
    assert results["accuracy"]["learned"]["2"] is None
    for name, row in results["accuracy"].items():
        assert list(row) == ["1", "2"]
        assert all(v is None or 0.0 <= v <= 1.0 for v in row.values()), name
    assert results["config"]["train_length"] == 8 and results["chance"] == 1 / 16
    table = lab.format_table(results)
    assert "n/a" in table and "rope+yarn" in table
    json.dumps(results)  # serialisable as is


def test_cli_writes_json_with_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "SMALL", dataclasses.replace(TINY, steps=2))
    path = tmp_path / "out.json"
    lab.main(["--encodings", "none", "--steps", "2", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["provenance"]["command"] == f"python -m ropelib.lab --encodings none --steps 2 --json {path}"
    assert {"device", "torch", "date_utc", "python"} <= set(saved["provenance"])
    assert saved["config"]["steps"] == 2 and list(saved["accuracy"]) == ["none"]


def test_committed_cpu_results_are_complete():
    saved = json.loads((ROOT / "results" / "lab_cpu.json").read_text())
    assert saved["provenance"]["command"].startswith("python -m ropelib.lab")
    assert saved["config"] == json.loads(
        json.dumps(dataclasses.asdict(lab.SMALL))
    )  # results of the configuration in the code
    names = set(ENCODINGS) | {f"rope+{s}" for s in lab.TEST_TIME_SCALINGS}
    assert set(saved["accuracy"]) == names
    for name, row in saved["accuracy"].items():
        assert list(row) == [str(m) for m in lab.SMALL.multiples]
        assert (row["2"] is None) == (name == "learned")
