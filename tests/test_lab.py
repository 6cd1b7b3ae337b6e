"""The extrapolation lab: tasks, models, seeds, the dynamic-NTK rule, T5 buckets, fine-tuning, the record and CLI.

Expected values are worked by hand (or come from the library the lab builds on, never from the lab).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ropelib import lab
from ropelib.attention.plugs import PLUGS
from ropelib.lab import (
    ENCODINGS,
    LabConfig,
    TinyTransformer,
    accuracy,
    evaluate,
    fine_tune,
    repeat_batch,
    run,
    scaling_for_length,
    train,
    with_rope_scaling,
)
from ropelib.lab.experiment import CLASSIC_ENCODINGS
from ropelib.scaling import inverse_frequencies64

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
    seeds=(0, 1, 2),
    t5_num_buckets=8,
    t5_max_distance=8,
    fine_tune_multiples=(2,),
    fine_tune_steps=2,
)
ROOT = Path(__file__).resolve().parents[1]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


# ----------------------------------------------------------------------------- tasks


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


def test_lag_task_targets_are_the_token_lag_positions_back():
    tokens, targets = lab.task_batch("lag", 3, 10, TINY, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (3, 10)
    assert bool((targets[:, :3] == lab.IGNORE).all())  # TINY.lag = 3: nothing to recall yet
    for t in range(3, 10):
        assert torch.equal(targets[:, t], tokens[:, t - 3])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < TINY.vocab_size
    with pytest.raises(ValueError, match="exceed lag"):
        lab.task_batch("lag", 1, 3, TINY, torch.Generator())
    with pytest.raises(ValueError, match="task"):
        lab.task_batch("sort", 1, 8, TINY, torch.Generator())


# ----------------------------------------------------------------------------- models and seeds


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_encoding_builds_and_maps_tokens_to_logits(encoding):
    torch.manual_seed(0)
    model = TinyTransformer(TINY, encoding)
    tokens, _ = repeat_batch(3, 8, TINY, torch.Generator().manual_seed(1))
    assert model(tokens).shape == (3, 8, TINY.vocab_size)
    assert bool(model(tokens).isfinite().all())
    if encoding not in CLASSIC_ENCODINGS:  # a later encoding: in every layer, through its plug
        assert {block.attn.position for block in model.blocks} <= set(PLUGS)
        return
    kinds = {type(block.attn.encoding).__name__ for block in model.blocks}
    expected = {"rope": {"RotaryEmbedding"}, "t5": {"T5RelativeBias"}}.get(encoding, {"NoneType"})
    assert kinds == expected
    if encoding == "t5":
        assert {(b.attn.encoding.num_buckets, b.attn.encoding.max_distance) for b in model.blocks} == {(8, 8)}


@pytest.mark.parametrize("task", ["repeat", "lag"])
def test_training_is_deterministic_per_seed_and_seeds_differ(task):
    model_a, losses_a = train(TINY, "rope", task=task, seed=1, device="cpu")
    model_b, losses_b = train(TINY, "rope", task=task, seed=1, device="cpu")
    assert losses_a == losses_b and len(losses_a) == TINY.steps
    assert same(params(model_a), params(model_b))
    model_c, losses_c = train(TINY, "rope", task=task, seed=2, device="cpu")
    assert losses_c != losses_a and not same(params(model_a), params(model_c))
    torch.manual_seed(1)
    init_1 = params(TinyTransformer(TINY, "rope"))
    torch.manual_seed(2)
    init_2 = params(TinyTransformer(TINY, "rope"))
    assert not same(init_1, init_2)  # the seed sets the initialisation, not only the data


def test_training_keeps_one_thread_on_cpu_and_restores_it():
    before = torch.get_num_threads()
    seen = []
    real = lab.experiment._optimise

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    lab.experiment._optimise = spy
    try:
        train(TINY, "none", device="cpu")
    finally:
        lab.experiment._optimise = real
    assert seen == [1] and torch.get_num_threads() == before


def test_learned_table_is_not_applicable_past_L():
    model, _ = train(TINY, "learned", device="cpu")
    at_l = accuracy(model, 8, TINY)
    assert at_l is not None and 0.0 <= at_l <= 1.0
    assert accuracy(model, 16, TINY) is None  # no row for positions >= L: reported N/A, never clamped
    with pytest.raises(ValueError, match="learned table"):
        model(repeat_batch(1, 16, TINY, torch.Generator())[0])


def test_evaluate_loss_of_a_uniform_model_is_log_vocab():
    torch.manual_seed(0)
    model = TinyTransformer(TINY, "rope").eval()
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)  # every logit 0: p = 1/16 for every token, argmax = token 0
    for task in ("repeat", "lag"):
        scores = evaluate(model, 8, TINY, task=task)
        assert scores is not None and scores["loss"] == pytest.approx(math.log(16), rel=1e-6)
        generator = torch.Generator().manual_seed(lab.experiment.eval_seed(task, 8))
        _, targets = lab.task_batch(task, TINY.eval_sequences, 8, TINY, generator)
        asked = targets[targets != lab.IGNORE]
        assert scores["accuracy"] == pytest.approx(float((asked == 0).float().mean()))  # ties: argmax picks 0


def test_evaluate_uses_the_same_data_for_every_model():
    assert lab.experiment.eval_seed("repeat", 64) == 12345 + 64
    assert lab.experiment.eval_seed("lag", 64) == 12345 + 1_000_000 + 64


# ----------------------------------------------------------------------------- context extension


def test_rope_scaling_swap_is_identity_at_factor_one_and_changes_longer_inputs():
    torch.manual_seed(0)
    model = TinyTransformer(TINY, "rope").eval()
    tokens, _ = repeat_batch(2, 16, TINY, torch.Generator().manual_seed(3))
    short = tokens[:, :8]
    with torch.no_grad():
        plain_short, plain_long = model(short), model(tokens)
        for name in lab.TEST_TIME_SCALINGS:
            unit = with_rope_scaling(model, scaling_for_length(name, 1, TINY.train_length))
            assert torch.allclose(unit(short), plain_short, rtol=0, atol=1e-6), name  # float32 rounding
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
    assert scaling_for_length("linear", 8, 32)["factor"] == 8.0
    with pytest.raises(ValueError, match="name"):
        scaling_for_length("longrope", 2, 32)


@pytest.mark.parametrize("multiple", [2, 4, 8])
def test_dynamic_ntk_rule_stretches_the_slowest_pair_exactly_to_the_test_length(multiple):
    scaling = scaling_for_length("dynamic", multiple, 32)
    assert scaling == {"rope_type": "dynamic", "factor": 1.0}  # the configured s, whatever the length
    d, theta, L = 16, 10000.0, 32
    plain = [theta ** (-2 * i / d) for i in range(d // 2)]  # by hand: inv_i = theta^(-2i/d)
    dynamic, _ = inverse_frequencies64(d, theta, scaling, max_position_embeddings=L, seq_len=multiple * L)
    assert dynamic[0].item() == pytest.approx(1.0)  # the fastest pair is kept
    assert dynamic[-1].item() == pytest.approx(plain[-1] / multiple, rel=1e-12)  # slowest divided by n / L = m
    assert lab.dynamic_alpha(1.0, multiple * L, L) == multiple
    assert lab.dynamic_alpha(float(multiple), multiple * L, L) == multiple**2 - multiple + 1  # the old over-stretch
    assert lab.dynamic_alpha(2.0, 16, 32) == 1.0  # below L nothing changes


def test_t5_max_distance_is_within_the_training_length_and_no_test_bucket_is_untrained():
    for config in (lab.SMALL, lab.LARGE, lab.QUICK):
        assert config.t5_max_distance <= config.train_length
        for m in config.multiples:
            n = m * config.train_length
            assert lab.t5_untrained_buckets(config.t5_num_buckets, config.t5_max_distance, config.train_length, n) == 0


def test_t5_untrained_buckets_by_hand():
    # causal, 32 buckets: 0..15 exact; distance n >= 16 -> 16 + floor(16 ln(n/16) / ln(max_distance/16)).
    # max_distance 128, L = 32: training reaches n = 31 -> bucket 21; n = 63 -> 26 (5 new), n >= 112 -> 31 (10 new).
    assert lab.t5_untrained_buckets(32, 128, 32, 32) == 0
    assert lab.t5_untrained_buckets(32, 128, 32, 64) == 5
    assert lab.t5_untrained_buckets(32, 128, 32, 128) == 10
    assert lab.t5_untrained_buckets(32, 128, 32, 256) == 10
    assert lab.t5_untrained_buckets(32, 32, 32, 256) == 0  # distance 31 already reaches the last bucket


def test_fine_tune_changes_a_copy_and_leaves_the_pretrained_model_alone():
    model, _ = train(TINY, "rope", device="cpu")
    before = params(model)
    tuned, losses = fine_tune(model, "linear", 2, TINY, device="cpu")
    assert len(losses) == TINY.fine_tune_steps
    assert same(params(model), before) and model.blocks[0].attn.encoding.scaling is None
    assert not same(params(tuned), before)
    assert tuned.blocks[0].attn.encoding.scaling == {"rope_type": "linear", "factor": 2.0}
    again, losses_again = fine_tune(model, "linear", 2, TINY, device="cpu")
    assert losses_again == losses and same(params(again), params(tuned))  # deterministic
    control, _ = fine_tune(model, "default", 2, TINY, device="cpu")
    assert control.blocks[0].attn.encoding.scaling is None and not same(params(control), before)


def test_fine_tune_variants_see_the_same_batches():
    seen: dict[str, list[int]] = {}
    real = lab.experiment.task_batch

    def spy(task, batch, length, config, generator):
        seen.setdefault(current, []).append(length)
        return real(task, batch, length, config, generator)

    model, _ = train(TINY, "rope", device="cpu")
    lab.experiment.task_batch = spy
    try:
        for current in ("linear", "yarn"):
            fine_tune(model, current, 2, TINY, device="cpu")
    finally:
        lab.experiment.task_batch = real
    assert seen["linear"] == seen["yarn"] and all(8 <= n <= 16 and n % 2 == 0 for n in seen["linear"])


# ----------------------------------------------------------------------------- summaries


def test_stats_by_hand():
    assert lab.mean_std([0.5, 0.7, 0.9]) == pytest.approx((0.7, 0.2))
    assert lab.mean_std([0.4]) == (0.4, 0.0)
    assert lab.separated([0.8, 0.9, 0.85], [0.5, 0.7, 0.79])
    assert not lab.separated([0.8, 0.9, 0.85], [0.5, 0.7, 0.8])  # ties are not a separation
    assert lab.chance_of_separation(3) == pytest.approx(1 / 20)  # 3! 3! / 6! = 36 / 720
    assert lab.format_mean_std([0.5, 0.7, 0.9]) == "0.70 ± 0.20" and lab.format_mean_std(None) == "n/a"


# ----------------------------------------------------------------------------- the record


def check_record(record: dict, config: LabConfig) -> None:
    """The record schema, written out here independently of the code that writes it."""
    assert record["schema"] == 2
    assert record["config"] == json.loads(json.dumps(dataclasses.asdict(config)))
    assert record["seeds"] == list(config.seeds) and len(config.seeds) >= 3
    assert record["chance"] == 1 / config.vocab_size
    assert record["t5"]["max_distance"] == config.t5_max_distance <= config.train_length
    assert set(record["t5"]["untrained_buckets"]) == {str(m) for m in config.multiples}
    assert "alpha = s * n / L - (s - 1)" in record["dynamic_factor_rule"]
    assert record["fine_tune"]["steps"] == config.fine_tune_steps
    assert record["fine_tune"]["fraction_of_pretraining"] == config.fine_tune_steps / config.steps
    assert set(record["tasks"]) == set(config.tasks)
    expected_rows = list(config.encodings)
    if "rope" in config.encodings:
        expected_rows += [f"rope+{s}" for s in config.zero_shot]
        expected_rows += ["rope+ft" if s == "default" else f"rope+{s}+ft" for s in config.fine_tune]
    keys = [str(m) for m in config.multiples]
    for task, rows in record["tasks"].items():
        assert list(rows) == expected_rows, task
        for name, row in rows.items():
            assert row["kind"] == (
                "trained" if "+" not in name else "fine-tuned" if name.endswith("ft") else "zero-shot"
            )
            for metric in ("accuracy", "loss"):
                assert list(row[metric]) == keys, (task, name)
                for m, values in row[metric].items():
                    applicable = (
                        (name != "learned" or m == "1")
                        if row["kind"] != "fine-tuned"
                        else int(m) in config.fine_tune_multiples
                    )
                    assert (values is not None) == applicable, (task, name, m)
                    if values is not None:
                        assert len(values) == len(config.seeds), (task, name, m)  # one value per seed
                        low, high = (0.0, 1.0) if metric == "accuracy" else (0.0, math.inf)
                        assert all(low <= v <= high for v in values), (task, name, m)
            if row["kind"] == "trained":
                assert len(row["train_seconds"]) == len(row["final_train_loss"]) == len(config.seeds)
    assert record["wall_seconds"] >= 0
    json.dumps(record)  # serialisable as is


def test_run_writes_every_row_with_one_value_per_seed():
    record = run(TINY, device="cpu", progress=False)
    check_record(record, TINY)
    assert record["tasks"]["repeat"]["rope+dynamic"]["scaling"]["2"] == {"rope_type": "dynamic", "factor": 1.0}
    assert record["tasks"]["lag"]["rope+yarn"]["scaling"]["2"]["factor"] == 2.0
    seed_0, seed_1, _ = record["tasks"]["repeat"]["rope"]["final_train_loss"]
    assert seed_0 != seed_1  # the seeds are different runs
    table = lab.format_table(record, "repeat")
    assert "n/a" in table and "±" in table
    # rows by method name, never by row code
    assert all(name in table for name in ("YaRN, fine-tuned", "PI", "dynamic NTK", "RoPE, fine-tuned", "T5 bias"))
    assert "rope+" not in table and "linear" not in table


def test_row_labels_are_method_names():
    assert lab.row_label("rope+linear") == "PI" and lab.row_label("rope+ntk") == "NTK-aware"
    assert lab.row_label("rope+yarn+ft") == "YaRN, fine-tuned" and lab.row_label("rope+ft") == "RoPE, fine-tuned"
    assert lab.row_label("rope+llama3") == "Llama 3.1" and lab.row_label("none") == "NoPE"
    assert lab.row_label("xpos") == "xPos" and lab.row_label("rnope_swa") == "RNoPE-SWA"
    for bad in ("rope+nope", "rope+linear+tuned", "nonsense"):
        with pytest.raises(ValueError, match="not a row"):
            lab.row_label(bad)
    # every row a record can hold has a name that is not its code
    names = ["rope+ft"] + [f"rope+{s}" for s in lab.SCALING_LABELS] + [f"rope+{s}+ft" for s in lab.SCALING_LABELS]
    assert all("+" not in lab.row_label(n) and "_" not in lab.row_label(n) for n in names + list(lab.ENCODINGS))


def test_help_points_at_the_text_lab(capsys):
    with pytest.raises(SystemExit):
        lab.main(["--help"])
    out = capsys.readouterr().out
    assert "--text" in out and "python -m ropelib.lab --text --help" in " ".join(out.split())
    with pytest.raises(SystemExit):  # --text hands the command line to the text lab's parser
        lab.main(["--text", "--help"])
    assert "python -m ropelib.lab --text" in capsys.readouterr().out


def test_quick_cli_writes_a_valid_record(tmp_path, monkeypatch, capsys):
    quick = dataclasses.replace(TINY, tasks=("lag",), encodings=("alibi", "rope"), fine_tune=("linear", "yarn"))
    monkeypatch.setattr(lab.experiment, "QUICK", quick)
    path = tmp_path / "quick.json"
    lab.main(["--quick", "--quiet", "--json", str(path)])
    saved = json.loads(path.read_text())
    check_record(saved, quick)
    assert saved["provenance"]["command"] == f"python -m ropelib.lab --quick --quiet --json {path}"
    assert {"device", "torch", "python", "ropelib", "date_utc", "threads", "seed_streams"} <= set(saved["provenance"])
    assert saved["provenance"]["wall_seconds"] == saved["wall_seconds"]
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress lines
    assert "YaRN, fine-tuned" in captured.out and "rope+" not in captured.out


def test_the_real_quick_and_large_configurations_parse_and_build(capsys):
    assert lab.main(["--large", "--dry-run"])["parameters"]["rope"] > 1_000_000
    assert set(lab.main(["--quick", "--dry-run"])["parameters"]) == set(lab.QUICK.encodings)
    with pytest.raises(SystemExit):
        lab.main(["--quick", "--large"])
    assert lab.LARGE.seeds == lab.SMALL.seeds and len(lab.QUICK.seeds) >= 3


def test_committed_cpu_record_is_complete():
    saved = json.loads((ROOT / "results" / "lab_cpu.json").read_text())
    check_record(saved, lab.SMALL)  # results of the configuration in the code
    assert saved["provenance"]["command"] == "python -m ropelib.lab --json results/lab_cpu.json"
    assert saved["provenance"]["threads"] == 1
    assert saved["wall_seconds"] < 45 * 60  # one command, under 45 minutes on the recording machine
    assert all(v == 0 for v in saved["t5"]["untrained_buckets"].values())
    assert saved["fine_tune"]["fraction_of_pretraining"] <= 0.2  # a short fine-tune
