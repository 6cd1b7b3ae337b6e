r"""The lab on real text: byte-level language models on Python's standard library, tested long.

One :class:`~ropelib.lab.TinyTransformer` per encoding (vocabulary 256, the bytes) is trained per
seed on windows of ``L`` bytes of the corpus's train split (:mod:`ropelib.lab.corpus`), a fraction
of each batch replaced by passkey examples of ``L`` bytes (:mod:`ropelib.lab.passkey`), so that
retrieval is learnable at ``L``. Each model is then scored on the test split at ``L, 2L, 4L, 8L``:

* ``loss``: the mean next-byte NLL (nats) over every position of fixed windows, the same windows
  for every model (``exp(loss)`` is the perplexity); ``loss_beyond``: over positions ``>= L`` only;
* ``passkey``: exact-match retrieval of a 5-digit key per needle depth;
* ``entropy``: the attention entropy per layer, mean over heads and queries (:mod:`ropelib.lab.entropy`).

The RoPE model is also read zero-shot with PI (``linear``), static NTK-aware scaling (``ntk``:
base ``theta s^{d/(d-2)}``, bloc97 2023), dynamic NTK, YaRN, YaRN without its temperature
(``yarn_no_temperature``: ``attention_factor = 1``), Llama 3's rule, and log-n query scaling
(``logn``), each at ``s = m`` for ``n = mL`` (:func:`ropelib.lab.scaling_for_length`); and after a
short fine-tune at ``2L`` without scaling (the control), with PI and with YaRN.

Command line::

    python -m ropelib.lab --text --json results/lab_text_cpu.json   # the committed CPU record
    python -m ropelib.lab --text --quick                            # seconds: a smoke run
    python -m ropelib.lab --text --large                            # meant for one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .._device import device_name
from .._validation import check_choice, check_int
from ..rotary import RotaryEmbedding
from .corpus import VOCAB_SIZE, Corpus, load_corpus, windows
from .entropy import attention_entropy, log_n_scale, query_scale, uniform_causal_entropy
from .experiment import (
    ENCODINGS,
    Block,
    LabConfig,
    TinyTransformer,
    _device,
    _one_thread_on_cpu,
    label_of,
    provenance,
    row_label,
    scaling_for_length,
    warmup_cosine,
    with_rope_scaling,
)
from .passkey import KEY_DIGITS, OVERHEAD, passkey_batch, retrieved

#: The encodings of the text run's default: the classic five with a position beyond ``L``, three
#: later ones (the first record's eight), then every other trained encoding the CPU budget allows.
TEXT_ENCODINGS = (
    ("none", "sinusoidal", "t5", "alibi", "rope", "kerple_log", "fire", "p_rope")
    + ("xpos", "kerple_power", "cope", "resonance_rope", "fope", "comrope", "liere", "rope_mixed")
    + ("rope_chunked", "rope_swa", "nope_temperature", "irope", "rnope_swa")
)
#: Why every other encoding of :data:`ropelib.lab.ENCODINGS` is left out of the default run.
LEFT_OUT = {
    "learned": "no table row past L: nothing to test at 2L..8L",
    "rerope leaky_rerope self_extend dual_chunk": "remappings of a trained RoPE model at inference, not trained "
    "encodings; ReRoPE's two-pass attention is also the slowest to evaluate",
}
#: Zero-shot rows of the RoPE model (``ntk``, ``yarn_no_temperature`` and ``logn`` are built here).
TEXT_ZERO_SHOT = ("linear", "ntk", "dynamic", "yarn", "yarn_no_temperature", "llama3", "logn")
TEXT_FINE_TUNE = ("default", "linear", "yarn")
TRAIN_SEED, FINE_TUNE_SEED, EVAL_SEED = 3000, 4000, 5000
SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Everything that defines a text run (saved with its results).

    ``passkey_rows`` of the ``batch_size`` rows of every training batch are passkey examples.
    Each test length ``n`` is scored on ``max(1, eval_tokens // n)`` windows of the test split.
    """

    train_length: int = 64
    multiples: tuple[int, ...] = (1, 2, 4, 8)
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 3
    steps: int = 1200
    batch_size: int = 8
    passkey_rows: int = 4
    learning_rate: float = 3e-3
    theta: float = 10000.0
    seeds: tuple[int, ...] = (0, 1, 2)
    encodings: tuple[str, ...] = TEXT_ENCODINGS
    zero_shot: tuple[str, ...] = TEXT_ZERO_SHOT
    fine_tune: tuple[str, ...] = TEXT_FINE_TUNE
    fine_tune_multiple: int = 2
    fine_tune_steps: int = 60
    fine_tune_learning_rate: float = 1e-3
    eval_tokens: int = 4096
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_trials: int = 8
    entropy_windows: int = 4


SMALL_TEXT = TextConfig()
#: Seconds on one CPU thread: a smoke run of the whole protocol (tests, ``--quick``).
QUICK_TEXT = TextConfig(
    train_length=48,
    multiples=(1, 2),
    embed_dim=16,
    num_heads=2,
    num_layers=1,
    steps=4,
    batch_size=4,
    passkey_rows=1,
    seeds=(0, 1),
    encodings=("alibi", "rope"),
    zero_shot=("linear", "yarn", "logn"),
    fine_tune=("yarn",),
    fine_tune_steps=2,
    eval_tokens=96,
    passkey_depths=(0.0, 1.0),
    passkey_trials=2,
    entropy_windows=1,
)
#: Meant for one GPU (sized, not measured): wider, deeper, longer, more steps and more passkey trials.
LARGE_TEXT = TextConfig(
    train_length=256,
    embed_dim=256,
    num_heads=8,
    num_layers=4,
    steps=3000,
    batch_size=32,
    passkey_rows=16,
    learning_rate=1e-3,
    fine_tune_steps=300,
    fine_tune_learning_rate=3e-4,
    eval_tokens=65536,
    passkey_trials=32,
    entropy_windows=8,
)


def lab_config(config: TextConfig) -> LabConfig:
    """The :class:`~ropelib.lab.LabConfig` a text model is built from (byte vocabulary, T5 up to ``L``)."""
    return LabConfig(
        train_length=config.train_length,
        vocab_size=VOCAB_SIZE,
        embed_dim=config.embed_dim,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        theta=config.theta,
        t5_max_distance=config.train_length,
        encodings=config.encodings,
    )


# ----------------------------------------------------------------------------- data and training


def text_batch(
    data: torch.Tensor, length: int, config: TextConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch ``(inputs, targets)``, int64 ``[batch_size, length]``.

    ``batch_size - passkey_rows`` rows are corpus windows; the last ``passkey_rows`` are passkey
    examples with uniformly random depths. Targets are the next bytes.
    """
    rows = windows(data, length, config.batch_size - config.passkey_rows, generator)
    if config.passkey_rows:
        depths = torch.rand(config.passkey_rows, generator=generator, dtype=torch.float64)
        keys, _ = passkey_batch(data, length + 1, depths, generator)
        rows = torch.cat([rows, keys])
    return rows[:, :-1], rows[:, 1:]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool) -> Any:
    """One tqdm bar on stderr over ``total`` optimiser steps; a silent stand-in when off or without tqdm.

    tqdm is optional (ropelib's ``bench`` extra): without it the run prints nothing and still runs.
    """
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="lab text", unit="step", file=sys.stderr, dynamic_ncols=True)


def text_loss(logits: torch.Tensor, targets: torch.Tensor, passkey_rows: int) -> torch.Tensor:
    """Mean next-byte NLL over every position, plus the mean NLL of the key bytes of the passkey rows.

    The second term (the last ``passkey_rows`` rows' last :data:`~ropelib.lab.passkey.KEY_DIGITS`
    targets) gives retrieval a weight equal to language modelling's: without it the key is a few
    bytes in thousands, and a short run does not learn to copy it.
    """
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if passkey_rows:
        answer = slice(targets.shape[1] - KEY_DIGITS, None)
        keys = logits[-passkey_rows:, answer].flatten(0, 1)
        loss = loss + F.cross_entropy(keys, targets[-passkey_rows:, answer].flatten())
    return loss


def optimise(
    model: TinyTransformer,
    data: torch.Tensor,
    config: TextConfig,
    *,
    steps: int,
    learning_rate: float,
    length: int,
    generator: torch.Generator,
    bar: Any = None,
) -> list[float]:
    """The lab's recipe (AdamW, weight decay 0.01, clip 1, warm-up + cosine) on :func:`text_batch`es."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    losses = []
    model.train()
    for _ in range(steps):
        inputs, targets = text_batch(data, length, config, generator)
        logits = model(inputs.to(device))
        loss = text_loss(logits, targets.to(device), config.passkey_rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
    model.eval()
    return losses


def train_text(
    config: TextConfig, encoding: str, corpus: Corpus, *, seed: int = 0, device: Any = None, bar: Any = None
) -> tuple[TinyTransformer, list[float]]:
    """Train one byte model at ``L`` from ``seed`` (init ``torch.manual_seed(seed)``, data ``TRAIN_SEED + seed``)."""
    device = _device(device)
    with _one_thread_on_cpu(device):
        torch.manual_seed(seed)
        model = TinyTransformer(lab_config(config), check_choice(encoding, "encoding", ENCODINGS)).to(device)
        generator = torch.Generator().manual_seed(TRAIN_SEED + seed)
        losses = optimise(
            model,
            corpus.splits["train"],
            config,
            steps=config.steps,
            learning_rate=config.learning_rate,
            length=config.train_length,
            generator=generator,
            bar=bar,
        )
    return model, losses


def fine_tune_text(
    model: TinyTransformer, name: str, config: TextConfig, corpus: Corpus, *, seed: int = 0, bar: Any = None
) -> TinyTransformer:
    """A copy of a RoPE model scaled by ``name`` for ``fine_tune_multiple * L`` and fine-tuned there.

    Data seed ``FINE_TUNE_SEED + seed`` for every variant (the same batches); the input model is untouched.
    """
    name = check_choice(name, "name", TEXT_FINE_TUNE)
    multiple = config.fine_tune_multiple
    scaling = None if name == "default" else scaling_for_length(name, multiple, config.train_length)
    tuned = with_rope_scaling(model, scaling)
    device = next(tuned.parameters()).device
    with _one_thread_on_cpu(device):
        optimise(
            tuned,
            corpus.splits["train"],
            config,
            steps=config.fine_tune_steps,
            learning_rate=config.fine_tune_learning_rate,
            length=multiple * config.train_length,
            generator=torch.Generator().manual_seed(FINE_TUNE_SEED + seed),
            bar=bar,
        )
    return tuned


# ----------------------------------------------------------------------------- zero-shot variants


def with_ntk(model: TinyTransformer, factor: float) -> TinyTransformer:
    """A copy of a RoPE model with static NTK-aware scaling: base ``theta * factor^(d / (d - 2))`` (bloc97, 2023)."""
    scaled = with_rope_scaling(model, None)
    old = scaled.rope
    assert old is not None
    scaled.rope = RotaryEmbedding(old.head_dim, old.theta, old.layout, kernel=old.kernel, theta_rescale_factor=factor)
    for block in scaled.blocks:
        assert isinstance(block, Block)
        block.attn.encoding = scaled.rope
    return scaled


def zero_shot_model(model: TinyTransformer, name: str, multiple: int) -> tuple[TinyTransformer, torch.Tensor | None]:
    """The RoPE model read at ``multiple * L`` with zero-shot variant ``name``, and its query scale (``logn``)."""
    name = check_choice(name, "name", TEXT_ZERO_SHOT)
    train_length = model.config.train_length
    if name == "ntk":
        return with_ntk(model, float(multiple)), None
    if name == "logn":
        return model, log_n_scale(multiple * train_length, train_length)
    if name == "yarn_no_temperature":
        scaling = {**scaling_for_length("yarn", multiple, train_length), "attention_factor": 1.0}
        return with_rope_scaling(model, scaling), None
    return with_rope_scaling(model, scaling_for_length(name, multiple, train_length)), None


# ----------------------------------------------------------------------------- evaluation


def nll_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position ``-ln p(target)``, float64 ``[batch, n]``."""
    return F.cross_entropy(logits.double().transpose(1, 2), targets, reduction="none")


def perplexity(nll: Sequence[float]) -> float:
    """``exp(mean NLL)``.

    Example:
        >>> round(perplexity([math.log(2.0), math.log(8.0)]), 9)
        4.0
    """
    if not nll:
        raise ValueError("perplexity needs at least one NLL")
    return math.exp(sum(nll) / len(nll))


def _eval_windows(corpus: Corpus, length: int, count: int, salt: int) -> torch.Tensor:
    return windows(corpus.splits["test"], length, count, torch.Generator().manual_seed(EVAL_SEED + salt + length))


@torch.no_grad()
def language_scores(
    model: TinyTransformer, corpus: Corpus, length: int, config: TextConfig, scale: torch.Tensor | None = None
) -> dict[str, float | None]:
    """``loss`` (mean NLL, nats) over every position and ``loss_beyond`` over positions ``>= L`` (``None`` at ``L``)."""
    device = next(model.parameters()).device
    data = _eval_windows(corpus, length, max(1, config.eval_tokens // length), 0)
    total = torch.zeros(length, dtype=torch.float64)
    for chunk in data.split(8):
        with query_scale(model, scale):
            logits = model(chunk[:, :-1].to(device)).cpu()
        total += nll_from_logits(logits, chunk[:, 1:]).sum(0)
    total /= data.shape[0]
    beyond = total[config.train_length :]
    return {"loss": float(total.mean()), "loss_beyond": float(beyond.mean()) if beyond.numel() else None}


@torch.no_grad()
def passkey_scores(
    model: TinyTransformer, corpus: Corpus, length: int, config: TextConfig, scale: torch.Tensor | None = None
) -> dict[str, float]:
    """Exact-match retrieval rate per depth (``{str(depth): rate}``) over ``passkey_trials`` examples of ``length`` bytes."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(EVAL_SEED + 7 + length)
    scores = {}
    for depth in config.passkey_depths:
        depths = torch.full((config.passkey_trials,), depth, dtype=torch.float64)
        tokens, _ = passkey_batch(corpus.splits["test"], length + 1, depths, generator)
        with query_scale(model, scale):
            logits = model(tokens[:, :-1].to(device)).cpu()
        scores[str(depth)] = float(retrieved(logits, tokens).double().mean())
    return scores


@torch.no_grad()
def entropy_scores(
    model: TinyTransformer, corpus: Corpus, length: int, config: TextConfig, scale: torch.Tensor | None = None
) -> list[float]:
    """Attention entropy per layer on ``entropy_windows`` test windows of ``length`` bytes."""
    device = next(model.parameters()).device
    data = _eval_windows(corpus, length, config.entropy_windows, 3)[:, :-1].to(device)
    with query_scale(model, scale):
        return attention_entropy(model, data)


# ----------------------------------------------------------------------------- the run and its record


def _new_row(label: str, kind: str, multiples: Sequence[int], config: TextConfig) -> dict[str, Any]:
    def per(empty: Callable[[], Any]) -> dict[str, Any]:
        return {str(m): (empty() if m in multiples else None) for m in config.multiples}

    return {
        "label": label,
        "kind": kind,
        "loss": per(list),
        "loss_beyond": per(list),
        "passkey": per(lambda: {str(d): [] for d in config.passkey_depths}),
        "entropy": per(list),
    }


def _score(
    row: dict[str, Any], key: str, model: TinyTransformer, corpus: Corpus, config: TextConfig, scale: Any
) -> None:
    length = int(key) * config.train_length
    with _one_thread_on_cpu(next(model.parameters()).device):
        lm = language_scores(model, corpus, length, config, scale)
        row["loss"][key].append(lm["loss"])
        if lm["loss_beyond"] is not None:
            row["loss_beyond"][key].append(lm["loss_beyond"])
        for depth, rate in passkey_scores(model, corpus, length, config, scale).items():
            row["passkey"][key][depth].append(rate)
        row["entropy"][key].append(entropy_scores(model, corpus, length, config, scale))


def _new_rows(config: TextConfig) -> dict[str, dict[str, Any]]:
    rows = {
        e: {**_new_row(label_of(e), "trained", config.multiples, config), "final_train_loss": []}
        for e in config.encodings
    }
    if "rope" in config.encodings:
        for s in config.zero_shot:
            rows[f"rope+{s}"] = _new_row(row_label(f"rope+{s}"), "zero-shot", config.multiples, config)
        for s in config.fine_tune:
            name = "rope+ft" if s == "default" else f"rope+{s}+ft"
            rows[name] = _new_row(row_label(name), "fine-tuned", (config.fine_tune_multiple,), config)
    return rows


def run_text(config: TextConfig = SMALL_TEXT, *, device: Any = None, progress: bool = True) -> dict[str, Any]:
    """Train and score every encoding and seed of ``config``; returns the record (JSON-serialisable).

    ``rows[name]`` holds per test multiple per-seed lists: ``loss``, ``loss_beyond`` (``[]`` at 1x),
    ``passkey`` (per depth), ``entropy`` (per seed, a list per layer); ``None`` where not tested.
    """
    device = _device(device)
    for e in config.encodings:
        check_choice(e, "encodings", ENCODINGS)
    for s in config.zero_shot:
        check_choice(s, "zero_shot", TEXT_ZERO_SHOT)
    for s in config.fine_tune:
        check_choice(s, "fine_tune", TEXT_FINE_TUNE)
    check_int(config.passkey_rows, "passkey_rows", minimum=0, maximum=config.batch_size - 1)
    corpus = load_corpus()
    start = time.perf_counter()
    rows = _new_rows(config)
    tuned_steps = config.fine_tune_steps * len(config.fine_tune) * ("rope" in config.encodings)
    bar = progress_bar(len(config.seeds) * (len(config.encodings) * config.steps + tuned_steps), progress)
    for seed in config.seeds:
        for encoding in config.encodings:
            model, losses = train_text(config, encoding, corpus, seed=seed, device=device, bar=bar)
            rows[encoding]["final_train_loss"].append(sum(losses[-50:]) / len(losses[-50:]))
            for m in config.multiples:
                _score(rows[encoding], str(m), model, corpus, config, None)
            if encoding == "rope":
                _extend_rope(rows, model, corpus, config, seed, bar)
    bar.close()
    return {
        "schema": SCHEMA,
        "kind": "lab_text",
        "config": json.loads(json.dumps(dataclasses.asdict(config))),
        "seeds": list(config.seeds),
        "corpus": corpus.summary(),
        "left_out": LEFT_OUT,
        "lab_encodings": list(ENCODINGS),
        "uniform_entropy": {str(m): uniform_causal_entropy(m * config.train_length) for m in config.multiples},
        "yarn_logit_scale": {str(m): (0.1 * math.log(m) + 1) ** 2 if m > 1 else 1.0 for m in config.multiples},
        "passkey": {"key_digits": KEY_DIGITS, "overhead_bytes": OVERHEAD, "chance": 10.0**-KEY_DIGITS},
        "rows": rows,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }


def _extend_rope(
    rows: dict[str, Any], model: TinyTransformer, corpus: Corpus, config: TextConfig, seed: int, bar: Any
) -> None:
    for s in config.zero_shot:
        for m in config.multiples:
            scaled, scale = zero_shot_model(model, s, m)
            _score(rows[f"rope+{s}"], str(m), scaled, corpus, config, scale)
    for s in config.fine_tune:
        name = "rope+ft" if s == "default" else f"rope+{s}+ft"
        tuned = fine_tune_text(model, s, config, corpus, seed=seed, bar=bar)
        _score(rows[name], str(config.fine_tune_multiple), tuned, corpus, config, None)


def text_provenance(command: str, corpus_sha256: str, device: Any = None) -> dict[str, Any]:
    """:func:`ropelib.lab.provenance` with this run's seed streams and the corpus hash."""
    return {
        **provenance(command, device),
        "seed_streams": {
            "model_init": "torch.manual_seed(seed)",
            "training_data": f"{TRAIN_SEED} + seed",
            "fine_tune_data": f"{FINE_TUNE_SEED} + seed (every variant)",
            "evaluation_data": f"{EVAL_SEED} + n (loss), + 3 + n (entropy), + 7 + n (passkey); same for every model",
        },
        "corpus_sha256": corpus_sha256,
    }


# ----------------------------------------------------------------------------- command line


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ropelib.lab --text", description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", action="store_true", help="this run (the flag that selects it)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smoke run of the whole protocol (seconds)")
    size.add_argument("--large", action="store_true", help="the larger configuration (meant for one GPU)")
    parser.add_argument("--json", metavar="PATH", help="write the record (results and provenance) to PATH")
    parser.add_argument("--steps", type=int, help="override the number of pre-training steps")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    return parser.parse_args(argv)


def format_text_table(record: dict[str, Any]) -> str:
    """Perplexity ``exp(mean loss over seeds)`` per row (named by :func:`~ropelib.lab.row_label`) and test length."""
    multiples = list(record["config"]["multiples"])
    lines = [f"{'':<34}" + "".join(f"{str(m) + 'L':>9}" for m in multiples)]
    for name, row in record["rows"].items():
        cells = [row["loss"][str(m)] for m in multiples]
        lines.append(f"{row_label(name):<34}" + "".join(f"{perplexity(c):>9.2f}" if c else f"{'-':>9}" for c in cells))
    return "perplexity (exp of the mean loss over seeds)\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line (see the module docstring); returns the record."""
    args = _parse(argv)
    config = QUICK_TEXT if args.quick else LARGE_TEXT if args.large else SMALL_TEXT
    if args.steps is not None:
        config = dataclasses.replace(config, steps=check_int(args.steps, "--steps", minimum=1))
    if args.seeds is not None:
        config = dataclasses.replace(config, seeds=tuple(args.seeds))
    words = sys.argv[1:] if argv is None else list(argv)
    command = "python -m ropelib.lab " + " ".join(["--text"] + [w for w in words if w != "--text"])
    record = run_text(config, progress=not args.quiet)
    record["provenance"] = {
        **text_provenance(command, record["corpus"]["sha256"]),
        "device": device_name(),
        "wall_seconds": record["wall_seconds"],
    }
    print(format_text_table(record))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return record
