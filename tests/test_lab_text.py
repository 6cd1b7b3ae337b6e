"""The lab on real text: corpus, passkey, entropy, perplexity and the command line (python -m ropelib.lab --text)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ropelib import lab
from ropelib.lab import ENCODINGS, corpus, entropy, passkey, text
from ropelib.lab.experiment import TinyTransformer


@pytest.fixture(scope="module")
def stdlib_corpus() -> corpus.Corpus:
    return corpus.load_corpus()


def test_split_is_by_file_deterministic_and_disjoint(stdlib_corpus):
    again = corpus.load_corpus()
    assert again.files == stdlib_corpus.files
    for split in corpus.SPLITS:
        assert torch.equal(again.splits[split], stdlib_corpus.splits[split])
    names = [n for s in corpus.SPLITS for n in stdlib_corpus.files[s]]
    assert len(names) == len(set(names))  # no file in two splits
    present = {f"{m}.py" for m in corpus.MODULES} - set(stdlib_corpus.missing)
    assert set(names) == present
    for split in corpus.SPLITS:
        for name in stdlib_corpus.files[split]:
            first = hashlib.sha256(name.encode()).digest()[0]  # the documented rule, by hand
            expected = "test" if first < 26 else "validation" if first < 52 else "train"
            assert split == expected
        # each split is its files' bytes, joined in MODULES order
        joined = b"".join((corpus.stdlib_dir() / n).read_bytes() for n in stdlib_corpus.files[split])
        assert bytes(stdlib_corpus.splits[split].tolist()) == joined


def test_hash_is_of_the_bytes_used(stdlib_corpus, tmp_path):
    lines = "".join(
        f"{m}.py:{hashlib.sha256((corpus.stdlib_dir() / f'{m}.py').read_bytes()).hexdigest()}\n"
        for m in corpus.MODULES
        if f"{m}.py" not in stdlib_corpus.missing
    )
    assert stdlib_corpus.sha256 == hashlib.sha256(lines.encode()).hexdigest()
    for m in corpus.MODULES:  # a copy of the files hashes the same; one changed byte does not
        shutil.copy(corpus.stdlib_dir() / f"{m}.py", tmp_path / f"{m}.py")
    assert corpus.load_corpus(tmp_path).sha256 == stdlib_corpus.sha256
    path = tmp_path / "heapq.py"
    path.write_bytes(path.read_bytes() + b"#")
    changed = corpus.load_corpus(tmp_path)
    assert changed.sha256 != stdlib_corpus.sha256
    (tmp_path / "heapq.py").unlink()
    assert corpus.load_corpus(tmp_path).missing == ["heapq.py"]


def test_passkey_example_puts_the_key_where_it_says():
    filler = torch.tensor(list(b"x" * 200))
    length, depth, key = 100, 0.5, "01234"
    example = passkey.passkey_example(filler, length, depth, key)
    assert example.shape == (length,)
    text_ = bytes(example.tolist()).decode()
    needle = "the pass key is 01234.\n"
    room = length - len(needle) - len("\nthe pass key is ") - 5  # the filler bytes, by hand
    start = round(depth * room)
    assert text_.index(needle) == start
    assert text_ == "x" * start + needle + "x" * (room - start) + "\nthe pass key is 01234"


def test_exact_match_scoring_by_hand():
    tokens = torch.tensor([list(b"ab\nthe pass key is 98765")])
    logits = torch.zeros(1, tokens.shape[1] - 1, 256)
    logits[0, torch.arange(tokens.shape[1] - 1), tokens[0, 1:]] = 1.0  # a perfect next-byte model
    assert passkey.retrieved(logits, tokens).tolist() == [True]
    logits[0, -3, ord("7")] = 0.0
    logits[0, -3, ord("1")] = 2.0  # the third digit guessed wrong: no match
    assert passkey.retrieved(logits, tokens).tolist() == [False]


def test_uniform_attention_has_entropy_log_n():
    for n in (1, 2, 7, 64):
        assert float(entropy.entropy(torch.full((n,), 1.0 / n, dtype=torch.float64))) == pytest.approx(math.log(n))
    # a causal sequence of 5: mean of ln 1 .. ln 5, by hand
    assert entropy.uniform_causal_entropy(5) == pytest.approx(sum(math.log(i) for i in range(1, 6)) / 5)


def test_a_model_with_zero_queries_attends_uniformly():
    config = text.lab_config(text.QUICK_TEXT)
    torch.manual_seed(0)
    model = TinyTransformer(config, "none")
    for block in model.blocks:
        torch.nn.init.zeros_(block.attn.q_proj.weight)  # every score 0: uniform over the visible keys
    tokens = torch.randint(0, 256, (2, 9))
    expected = sum(math.log(i) for i in range(1, 10)) / 9
    # float32 softmax of 9 equal scores: entropy exact to ~1e-6
    assert entropy.attention_entropy(model, tokens) == pytest.approx([expected] * config.num_layers, abs=1e-5)


def test_query_scale_multiplies_the_scores():
    config = text.lab_config(text.QUICK_TEXT)
    torch.manual_seed(0)
    model = TinyTransformer(config, "rope")
    x = torch.randn(1, 6, config.embed_dim)
    attn = model.blocks[0].attn
    plain = attn.scores(x)
    scale = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 0.5])
    with entropy.query_scale(model, scale):
        scaled = attn.scores(x)
    visible = torch.isfinite(plain)
    # RoPE is linear in q: scaled logits are scale[i] * logits, up to float32 rounding
    torch.testing.assert_close(scaled[visible], (plain * scale[:, None])[visible], rtol=1e-5, atol=1e-6)
    assert torch.equal(attn.scores(x), plain)  # the hook is gone


def test_log_n_scale_by_hand():
    scale = entropy.log_n_scale(256, 64)
    assert scale[:64].tolist() == [1.0] * 64
    assert float(scale[255]) == pytest.approx(math.log(256) / math.log(64), rel=1e-6)  # float32


def test_perplexity_is_exp_mean_nll_by_hand():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 0]])
    by_hand = [
        -(2.0 - math.log(1 + math.e + math.e**2)),
        -(3.0 - math.log(math.e**3 + 2)),
    ]
    nll = text.nll_from_logits(logits, targets)
    assert nll[0].tolist() == pytest.approx(by_hand, rel=1e-12)  # float64 throughout
    assert text.perplexity(nll[0].tolist()) == pytest.approx(math.exp(sum(by_hand) / 2), rel=1e-12)


def test_training_batch_mixes_passkey_rows(stdlib_corpus):
    config = text.QUICK_TEXT
    inputs, targets = text.text_batch(stdlib_corpus.splits["train"], 48, config, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (config.batch_size, 48)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    rows = [bytes(r.tolist() + [int(t)]).decode("utf-8", "replace") for r, t in zip(inputs, targets[:, -1])]
    assert [("the pass key is" in r) for r in rows[-config.passkey_rows :]] == [True] * config.passkey_rows
    assert rows[-1][-5:].isdigit()


def test_cli_writes_the_record(tmp_path, capsys):
    path = tmp_path / "lab_text.json"
    text.main(["--text", "--quick", "--quiet", "--json", str(path)])
    captured = capsys.readouterr()
    assert captured.err == ""  # --quiet: no progress bar
    table = captured.out  # rows by method name, never by row code
    assert "YaRN, fine-tuned" in table and "log-n scaling" in table and "ALiBi" in table and "rope+" not in table
    record = json.loads(path.read_text())
    for key in ("config", "seeds", "corpus", "rows", "uniform_entropy", "left_out", "provenance"):
        assert key in record
    for key in ("command", "device", "python", "torch", "date_utc", "corpus_sha256"):
        assert key in record["provenance"]
    assert record["provenance"]["corpus_sha256"] == record["corpus"]["sha256"] == corpus.load_corpus().sha256
    seeds = len(record["seeds"])
    rope = record["rows"]["rope"]
    assert all(len(v) == seeds for v in rope["loss"].values())
    assert all(len(v) == seeds for depths in rope["passkey"].values() for v in depths.values())
    assert record["rows"]["rope+yarn+ft"]["loss"]["1"] is None  # fine-tuned rows: tested at 2L only
    assert len(record["rows"]["rope+yarn+ft"]["loss"]["2"]) == seeds


def test_progress_bar_is_on_without_quiet(capsys):
    pytest.importorskip("tqdm")
    bar = text.progress_bar(3, enabled=True)
    bar.update(3)
    bar.close()
    assert "lab text" in capsys.readouterr().err
    quiet = text.progress_bar(3, enabled=False)
    quiet.update(3)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_every_lab_encoding_is_run_or_left_out_with_a_reason():
    left = [name for names in text.LEFT_OUT for name in names.split()]
    assert len(left) == len(set(left)) and not set(left) & set(text.TEXT_ENCODINGS)
    assert set(left) | set(text.TEXT_ENCODINGS) == set(ENCODINGS)
    assert all(reason.strip() for reason in text.LEFT_OUT.values())
    assert "xpos" in text.TEXT_ENCODINGS  # the decaying rotation is trained like RoPE


def test_the_main_lab_command_line_runs_the_text_lab(tmp_path, capsys):
    path = tmp_path / "via_main.json"
    lab.main(["--text", "--quick", "--quiet", "--json", str(path)])
    record = json.loads(path.read_text())
    assert record["kind"] == "lab_text" and record["provenance"]["command"].startswith("python -m ropelib.lab --text")
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change", [{"encodings": ("nope",)}, {"zero_shot": ("pi",)}, {"fine_tune": ("ntk",)}, {"passkey_rows": 4}]
)
def test_run_rejects_a_bad_configuration(change):
    with pytest.raises(ValueError, match=next(iter(change))):
        text.run_text(dataclasses.replace(text.QUICK_TEXT, **change), progress=False)


def test_committed_text_record_is_complete():
    """``results/lab_text_cpu.json`` is a run of the default configuration: every encoding, seed and length."""
    root = Path(__file__).resolve().parents[1]
    saved = json.loads((root / "results" / "lab_text_cpu.json").read_text())
    config = text.SMALL_TEXT
    assert saved["config"] == json.loads(json.dumps(dataclasses.asdict(config)))
    # --quiet only silences the progress bar
    command = [w for w in saved["provenance"]["command"].split() if w != "--quiet"]
    assert command == "python -m ropelib.lab --text --json results/lab_text_cpu.json".split()
    assert saved["provenance"]["threads"] == 1
    assert saved["wall_seconds"] < 45 * 60  # one command, under 45 minutes on one thread of the recording machine
    assert saved["left_out"] == text.LEFT_OUT and saved["lab_encodings"] == list(ENCODINGS)
    expected = list(config.encodings) + [f"rope+{s}" for s in config.zero_shot]
    expected += ["rope+ft" if s == "default" else f"rope+{s}+ft" for s in config.fine_tune]
    assert list(saved["rows"]) == expected
    seeds = len(config.seeds)
    for name, row in saved["rows"].items():
        tested = [config.fine_tune_multiple] if row["kind"] == "fine-tuned" else list(config.multiples)
        for m in config.multiples:
            key = str(m)
            if m not in tested:
                assert row["loss"][key] is None and row["passkey"][key] is None, (name, m)
                continue
            assert len(row["loss"][key]) == seeds and all(0 < v < math.inf for v in row["loss"][key])
            assert all(len(v) == seeds for v in row["passkey"][key].values()), (name, m)
            assert len(row["entropy"][key]) == seeds, (name, m)
