r"""The extrapolation lab: train tiny transformers at length ``L``, test them at 1x, 2x, 4x and 8x ``L``.

One small causal transformer per position encoding (``none`` = NoPE, ``sinusoidal``, ``learned``,
``t5``, ``alibi``, ``rope``), built from :class:`ropelib.MultiHeadAttention`, is trained on each
task of :mod:`ropelib.lab.tasks` (``repeat``: a long-range lookup; ``lag``: an exact local offset),
from every seed of the configuration (each seed sets the model's initialisation and its training
data). Every model is scored at every test length by next-token accuracy and cross-entropy.

Each trained RoPE model is then extended to longer contexts in the two ways the papers use:

* **zero-shot**: a scaling of :mod:`ropelib.scaling` switched on at test time: position
  interpolation (``linear``, Chen et al., 2023), YaRN (Peng et al., 2024), Llama 3's rule and
  dynamic NTK, with ``factor = m`` and ``original_max_position_embeddings = L`` at ``n = mL``. Dynamic
  NTK is applied as Hugging Face does, ``alpha = s n / L - (s - 1)`` with the configured factor
  ``s`` and the current length ``n``; the lab configures ``s = 1`` (:data:`DYNAMIC_FACTOR_RULE`), so
  the slowest pair is stretched exactly to the test length, ``alpha = n / L``;
* **fine-tuned**: a short fine-tune at the target length ``mL`` (``m`` in ``fine_tune_multiples``)
  with PI or YaRN switched on, ``fine_tune_steps`` steps (a small fraction of pre-training), the
  same data for both, and the same fine-tune without any scaling as the control.

A learned position table has no row past ``L``: it is reported as not applicable there (``None``),
never clamped.

Command line::

    python -m ropelib.lab --json results/lab_cpu.json   # the committed CPU record (about 25 minutes, 1 thread)
    python -m ropelib.lab --quick                       # the chapter's live cell (under a minute)
    python -m ropelib.lab --large                       # the larger run, meant for one GPU
    python -m ropelib.lab --large --dry-run             # build every model and batch, train nothing
    python -m ropelib.lab --text --help                 # the lab on real text (ropelib.lab.text)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import __version__
from .._device import default_device, device_name
from .._provenance import git_state
from .._validation import check_choice, check_int
from ..attention.hybrid import HYBRIDS, hybrid_layers
from ..attention.mha import MultiHeadAttention
from ..attention.plugs import PLUGS
from ..encodings.absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from ..encodings.relative import t5_relative_bucket
from ..rotary import RotaryEmbedding, Rotation
from ..scaling import ROPE_SCALINGS
from .stats import format_mean_std
from .tasks import IGNORE, TASKS

#: The encodings of the book's first parts, then every other encoding :class:`~ropelib.MultiHeadAttention`
#: takes (its :data:`~ropelib.attention.plugs.PLUGS`, with its default options), except Shaw's.
CLASSIC_ENCODINGS = ("none", "sinusoidal", "learned", "t5", "alibi", "rope")
ENCODINGS = (
    CLASSIC_ENCODINGS
    + tuple(name for name in PLUGS if name not in (*CLASSIC_ENCODINGS, "shaw"))
    + tuple(HYBRIDS)  # a pattern of plugs over the layers (Llama 4's iRoPE, RNoPE-SWA)
)
LABELS = {
    "none": "NoPE",
    "sinusoidal": "sinusoidal",
    "learned": "learned",
    "t5": "T5 bias",
    "alibi": "ALiBi",
    "rope": "RoPE",
    "irope": "iRoPE",
    "rnope_swa": "RNoPE-SWA",
}


def label_of(encoding: str) -> str:
    """The name of an encoding in the lab's tables and figures (:data:`LABELS`, else its plug's label)."""
    return LABELS.get(encoding) or PLUGS[encoding].label or encoding


#: The method names of the RoPE rows' scalings (the row codes ``rope+<scaling>`` use the registry's keys).
SCALING_LABELS = {
    "linear": "PI",
    "ntk": "NTK-aware",
    "dynamic": "dynamic NTK",
    "yarn": "YaRN",
    "yarn_no_temperature": "YaRN, no temperature",
    "llama3": "Llama 3.1",
    "logn": "log-n scaling",
}


def row_label(row: str) -> str:
    """The name of a row of a lab record in tables and figures: a method's name, never the row's code.

    An encoding's row is :func:`label_of`; ``rope+<scaling>`` (RoPE read zero-shot with a scaling)
    is the scaling's method name; ``rope+<scaling>+ft`` and ``rope+ft`` are the fine-tuned ones.

    Example:
        >>> [row_label(r) for r in ("alibi", "rope+linear", "rope+yarn+ft", "rope+ft")]
        ['ALiBi', 'PI', 'YaRN, fine-tuned', 'RoPE, fine-tuned']
    """
    if row == "rope+ft":
        return "RoPE, fine-tuned"
    if row.startswith("rope+"):
        scaling, _, tuned = row[len("rope+") :].partition("+")
        if scaling not in SCALING_LABELS or tuned not in ("", "ft"):
            raise ValueError(f"not a row of a lab record: {row!r}")
        return SCALING_LABELS[scaling] + (", fine-tuned" if tuned else "")
    if row not in PLUGS and row not in LABELS:
        raise ValueError(f"not a row of a lab record: {row!r}")
    return label_of(row)


#: The registered scalings that can be built from a factor and the training length alone.
TEST_TIME_SCALINGS = tuple(name for name, entry in ROPE_SCALINGS.items() if entry.for_factor is not None)
#: The zero-shot rows: PI, YaRN, Llama 3, dynamic NTK (those of them registered with a ``for_factor``).
ZERO_SHOT = tuple(name for name in ("linear", "yarn", "llama3", "dynamic") if name in TEST_TIME_SCALINGS)
#: Fine-tune variants: ``"default"`` (no scaling, the control), PI and YaRN.
FINE_TUNE_SCALINGS = ("default", "linear", "yarn")
EVAL_SEED = 12345  # evaluation data of task index i at length n: seed EVAL_SEED + 1_000_000 i + n
TRAIN_DATA_SEED = 1000  # training data of seed s: generator seed TRAIN_DATA_SEED + s (model init: s)
FINE_TUNE_DATA_SEED = 2000  # fine-tune data of seed s at m L: FINE_TUNE_DATA_SEED + 10 s + m (same for every variant)
DYNAMIC_FACTOR_RULE = (
    "Hugging Face's dynamic NTK rule alpha = s * n / L - (s - 1) at the current length n, with the configured "
    "factor s = dynamic_factor (1.0): alpha = n / L, so the slowest pair is stretched exactly to the test length"
)
SCHEMA = 2


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """Everything that defines a run (saved with its results).

    ``t5_max_distance`` is at most ``train_length`` by default, so that every bucket a longer test
    uses was trained (distances beyond it share the last bucket). ``dynamic_factor`` is the
    configured ``s`` of dynamic NTK (see :data:`DYNAMIC_FACTOR_RULE`).
    """

    train_length: int = 32
    multiples: tuple[int, ...] = (1, 2, 4, 8)
    vocab_size: int = 128
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    steps: int = 1500
    batch_size: int = 32
    learning_rate: float = 3e-3
    eval_sequences: int = 256
    theta: float = 10000.0
    seeds: tuple[int, ...] = (0, 1, 2)
    tasks: tuple[str, ...] = ("repeat", "lag")
    encodings: tuple[str, ...] = CLASSIC_ENCODINGS
    lag: int = 3
    t5_num_buckets: int = 32
    t5_max_distance: int = 32
    zero_shot: tuple[str, ...] = ZERO_SHOT
    dynamic_factor: float = 1.0
    fine_tune: tuple[str, ...] = FINE_TUNE_SCALINGS
    fine_tune_multiples: tuple[int, ...] = (2, 4)
    fine_tune_steps: int = 150
    fine_tune_learning_rate: float = 1e-3


SMALL = LabConfig()
#: The chapter's live cell: two encodings on the lag task, three seeds, a minute on one CPU thread.
QUICK = LabConfig(
    train_length=16,
    multiples=(1, 2, 4),
    vocab_size=32,
    embed_dim=32,
    num_heads=2,
    num_layers=2,
    steps=300,
    batch_size=32,
    eval_sequences=64,
    tasks=("lag",),
    encodings=("alibi", "rope"),
    t5_num_buckets=16,
    t5_max_distance=16,
    zero_shot=("linear", "yarn"),
    fine_tune=("linear", "yarn"),
    fine_tune_multiples=(2,),
    fine_tune_steps=30,
)
#: Meant for one GPU: wider, deeper, longer contexts, the same protocol. Sized (not measured) for about
#: 5 minutes on one H200: 36 trainings of 1200 steps plus 36 fine-tunes of 120 steps, at an estimated
#: 5 ms per launch-bound step.
LARGE = LabConfig(
    train_length=64,
    vocab_size=512,
    embed_dim=256,
    num_heads=8,
    num_layers=4,
    steps=1200,
    batch_size=64,
    learning_rate=1e-3,
    eval_sequences=512,
    t5_max_distance=64,
    fine_tune_steps=120,
    fine_tune_learning_rate=3e-4,
)


# ----------------------------------------------------------------------------- the tasks


def task_batch(
    task: str, batch_size: int, length: int, config: LabConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``task`` (see :mod:`ropelib.lab.tasks`): int64 ``(tokens, targets)``, ``[batch_size, length]``."""
    task = check_choice(task, "task", tuple(TASKS))
    return TASKS[task](batch_size, length, config.vocab_size, config.lag, generator)


def repeat_batch(
    batch_size: int, length: int, config: LabConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of repeat-the-sequence examples of ``length`` tokens, with their targets.

    Each row is ``x_1 .. x_n x_1 .. x_n`` with ``n = length / 2`` distinct tokens drawn uniformly from
    the vocabulary. The target at position ``n + j`` (the ``j``-th token of the copy, ``j = 0 .. n-2``)
    is ``x_{j+2}``, the next token of the copy; every other target is ``-100`` (no loss): the first
    copy is unpredictable, and its last token has nothing after it.

    Returns:
        ``(tokens, targets)``, both int64 ``[batch_size, length]``.

    Example:
        >>> tokens, targets = repeat_batch(1, 6, LabConfig(vocab_size=8), torch.Generator().manual_seed(0))
        >>> bool((tokens[0, :3] == tokens[0, 3:]).all()), targets[0, 3:5].tolist() == tokens[0, 1:3].tolist()
        (True, True)
    """
    return task_batch("repeat", batch_size, length, config, generator)


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: LabConfig, position: str, rotary: RotaryEmbedding | None = None) -> None:
        super().__init__()
        options: dict[str, Any] = {}
        local = max(1, config.train_length // 4)  # the hybrids' chunk, window and temperature step
        if position == "rope":
            options = {"rotary": rotary}
        elif position == "t5":
            options = {"num_buckets": config.t5_num_buckets, "max_distance": config.t5_max_distance}
        elif position in ("rope_chunked", "rope_swa"):
            size = {"rope_chunked": "chunk_size", "rope_swa": "window"}[position]
            options = {size: local} if rotary is None else {size: local, "rotary": rotary}
        elif position == "nope_temperature":
            options = {"floor_scale": local}
        if "train_length" in PLUGS[position].options:  # FoPE clips the frequencies it cannot have learned
            options["train_length"] = config.train_length
        self.norm1 = nn.LayerNorm(config.embed_dim)
        self.attn = MultiHeadAttention(config.embed_dim, config.num_heads, position, causal=True, **options)
        self.norm2 = nn.LayerNorm(config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.embed_dim, 4 * config.embed_dim),
            nn.GELU(),
            nn.Linear(4 * config.embed_dim, config.embed_dim),
        )

    def forward(self, x: torch.Tensor, rotation: Rotation | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotation=rotation)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A causal transformer whose only difference between runs is the
    position encoding.

    Absolute encodings (``sinusoidal``, ``learned``) are added once to the
    token embeddings (Vaswani et al., 2017); relative biases (``t5``,
    ``alibi``) and ``rope`` act in every attention layer; ``none`` (NoPE,
    Kazemnejad et al., 2023) relies on the causal mask alone. A hybrid
    (``irope``, ``rnope_swa``: :func:`~ropelib.attention.hybrid.hybrid_layers`)
    gives each layer its own encoding, one global NoPE layer in every
    ``min(4, num_layers)``, the local RoPE layers sharing one rotary module;
    chunk, window and temperature step are ``train_length // 4``.

    Shapes:
        ``forward(tokens)``: int64 ``[batch, seq]`` -> logits
        ``[batch, seq, vocab_size]``.
    """

    def __init__(self, config: LabConfig, encoding: str) -> None:
        super().__init__()
        self.encoding = check_choice(encoding, "encoding", ENCODINGS + tuple(HYBRIDS))
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.absolute: nn.Module | None = None
        if encoding == "sinusoidal":
            self.absolute = SinusoidalPositionalEncoding(config.embed_dim)
        elif encoding == "learned":
            self.absolute = LearnedPositionalEmbedding(
                config.train_length,
                config.embed_dim,
            )
        in_attention = "none" if encoding in ("sinusoidal", "learned") else encoding
        # one rotary module for the model: one cache, one rotation a forward
        head_dim = config.embed_dim // config.num_heads
        self.rope = None
        if encoding == "rope":
            self.rope = RotaryEmbedding(head_dim, config.theta)
        self.layer_positions = (in_attention,) * config.num_layers
        shared = self.rope
        if encoding in HYBRIDS:  # one encoding per layer; the rotations are the layers' own
            interval = min(4, config.num_layers)
            self.layer_positions = hybrid_layers(encoding, config.num_layers, interval=interval)
            shared = RotaryEmbedding(head_dim, config.theta)
        blocks = [Block(config, p, shared) for p in self.layer_positions]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(config.embed_dim)
        self.head = nn.Linear(config.embed_dim, config.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.absolute is not None:
            x = self.absolute(x)
        rotation = None if self.rope is None else self.rope.rotation(x)
        for block in self.blocks:
            x = block(x, rotation)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------- context extension


def with_rope_scaling(model: TinyTransformer, scaling: dict[str, Any] | None) -> TinyTransformer:
    """A copy of a RoPE model whose rotary embeddings use ``scaling`` (``None``: plain RoPE).

    ``max_position_embeddings`` is the training length, the length the frequencies were trained for.
    At a test length of ``L`` itself the dicts have ``factor = 1`` and ``original = L``, which
    ``transformers`` (and ropelib) warn about for Llama 3 scaling; the lab builds them on purpose
    (the 1x column), so that warning is silenced here.
    """
    if model.encoding != "rope":
        raise ValueError(f"test-time scaling applies to a RoPE model, got encoding={model.encoding!r}")
    scaled = copy.deepcopy(model)
    old = cast(RotaryEmbedding, scaled.rope)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scaled.rope = RotaryEmbedding(
            old.head_dim,
            old.theta,
            old.layout,
            scaling=scaling,
            max_position_embeddings=model.config.train_length,
            kernel=old.kernel,
        )
    for block in scaled.blocks:
        cast(Block, block).attn.encoding = scaled.rope
    return scaled


def scaling_for_length(name: str, multiple: int, train_length: int, dynamic_factor: float = 1.0) -> dict[str, Any]:
    """The scaling dict used at ``n = multiple * train_length``.

    ``factor = multiple`` and ``original_max_position_embeddings = train_length``, except for the
    scalings that follow the length themselves (dynamic NTK), which get the configured
    ``dynamic_factor`` ``s``: their ``alpha`` already grows with ``n`` (:func:`dynamic_alpha`).
    """
    name = check_choice(name, "name", TEST_TIME_SCALINGS)
    entry = ROPE_SCALINGS[name]
    assert entry.for_factor is not None
    return entry.for_factor(float(dynamic_factor) if entry.follows_length else float(multiple), train_length)


def dynamic_alpha(factor: float, length: int, train_length: int) -> float:
    r"""Dynamic NTK's stretch of the slowest pair at length ``n`` (Hugging Face's rule, emozilla 2023).

    .. math:: \alpha = \frac{s\,n}{L} - (s - 1), \qquad n = \max(n, L),

    the base becoming ``b alpha^{d/(d-2)}``, which divides the slowest frequency by exactly ``alpha``.
    ``s = 1`` gives ``alpha = n / L``: a stretch to the test length. ``s = m`` at ``n = mL`` would give
    ``m^2 - m + 1``.

    Example:
        >>> dynamic_alpha(1.0, 128, 32), dynamic_alpha(4.0, 128, 32)
        (4.0, 13.0)
    """
    n = max(length, train_length)
    return factor * n / train_length - (factor - 1)


def t5_untrained_buckets(num_buckets: int, max_distance: int, train_length: int, test_length: int) -> int:
    """How many causal T5 buckets a test at ``test_length`` uses that training at ``<= train_length`` never did.

    Training sees distances ``0 .. L-1``, a test ``0 .. n-1``; a bucket no training distance maps to
    never received a gradient and keeps its initial (random) bias.

    Example:
        >>> t5_untrained_buckets(32, 128, 32, 128), t5_untrained_buckets(32, 32, 32, 256)
        (10, 0)
    """
    distances = -torch.arange(max(train_length, test_length))  # j - i <= 0 in a causal model
    buckets = t5_relative_bucket(distances, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance)
    trained = set(buckets[:train_length].tolist())
    return len(set(buckets[:test_length].tolist()) - trained)


# ----------------------------------------------------------------------------- training


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """On a CPU, run on one thread: for matrices this small, threads cost more in sync than they gain."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else default_device()


def train_lengths(steps: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Per-step sequence lengths: uniform over the even numbers in ``[max(4, length / 2), length]``."""
    shortest = max(4, length // 2)
    return torch.randint(shortest // 2, length // 2 + 1, (steps,), generator=generator) * 2


def warmup_cosine(steps: int) -> Any:
    """The learning-rate multiplier: linear warm-up over the first 10% of ``steps``, then a cosine to 0."""
    warmup = max(1, steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return schedule


def _optimise(
    model: TinyTransformer,
    task: str,
    config: LabConfig,
    *,
    steps: int,
    learning_rate: float,
    length: int,
    generator: torch.Generator,
    device: torch.device,
) -> list[float]:
    """AdamW (weight decay 0.01, gradients clipped to norm 1) with :func:`warmup_cosine`; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    lengths = train_lengths(steps, length, generator)
    losses = []
    model.train()
    for step in range(steps):
        tokens, targets = task_batch(task, config.batch_size, int(lengths[step]), config, generator)
        logits = model(tokens.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses


def train(
    config: LabConfig,
    encoding: str,
    *,
    task: str = "repeat",
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[TinyTransformer, list[float]]:
    """Train one model on ``task`` at lengths up to ``L`` (see :func:`train_lengths`), ``config.steps`` steps.

    Seeded: ``torch.manual_seed(seed)`` before the model is built (its initialisation) and a
    generator seeded ``TRAIN_DATA_SEED + seed`` for the data, so the same ``(config, encoding, task,
    seed)`` gives the same model on the same device, and two seeds differ in both.

    Returns:
        ``(model, losses)``: the trained model (in eval mode) and the loss of every step.
    """
    device = _device(device)
    with _one_thread_on_cpu(device):
        torch.manual_seed(seed)
        model = TinyTransformer(config, encoding).to(device)
        generator = torch.Generator().manual_seed(TRAIN_DATA_SEED + seed)
        losses = _optimise(
            model,
            task,
            config,
            steps=config.steps,
            learning_rate=config.learning_rate,
            length=config.train_length,
            generator=generator,
            device=device,
        )
    return model, losses


def fine_tune_scaling(name: str, multiple: int, train_length: int) -> dict[str, Any] | None:
    """The scaling a fine-tune at ``multiple * L`` runs with: ``None`` for ``"default"`` (plain RoPE)."""
    name = check_choice(name, "name", FINE_TUNE_SCALINGS)
    return None if name == "default" else scaling_for_length(name, multiple, train_length)


def fine_tune(
    model: TinyTransformer,
    name: str,
    multiple: int,
    config: LabConfig,
    *,
    task: str = "repeat",
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[TinyTransformer, list[float]]:
    """A copy of a trained RoPE model, scaled by ``name`` for ``multiple`` x ``L`` and fine-tuned there.

    ``config.fine_tune_steps`` steps of :func:`_optimise` at lengths up to ``multiple * L`` with peak
    learning rate ``config.fine_tune_learning_rate``, as PI (Chen et al., 2023) and YaRN (Peng et al.,
    2024) fine-tune briefly at the target length. The data generator is seeded
    ``FINE_TUNE_DATA_SEED + 10 seed + multiple`` whatever ``name`` is: every variant sees the same batches.
    The input model is left untouched.
    """
    multiple = check_int(multiple, "multiple", minimum=1)
    device = _device(device)
    tuned = with_rope_scaling(model, fine_tune_scaling(name, multiple, config.train_length)).to(device)
    with _one_thread_on_cpu(device):
        generator = torch.Generator().manual_seed(FINE_TUNE_DATA_SEED + 10 * seed + multiple)
        losses = _optimise(
            tuned,
            task,
            config,
            steps=config.fine_tune_steps,
            learning_rate=config.fine_tune_learning_rate,
            length=multiple * config.train_length,
            generator=generator,
            device=device,
        )
    return tuned, losses


# ----------------------------------------------------------------------------- evaluation


def eval_seed(task: str, length: int) -> int:
    """The evaluation data's seed: ``EVAL_SEED + 1_000_000 * (index of task in TASKS) + length``."""
    return EVAL_SEED + 1_000_000 * list(TASKS).index(task) + length


@torch.no_grad()
def evaluate(
    model: TinyTransformer,
    length: int,
    config: LabConfig,
    *,
    task: str = "repeat",
    device: torch.device | str | None = None,
) -> dict[str, float] | None:
    r"""Accuracy and cross-entropy on ``config.eval_sequences`` fresh sequences of ``length`` tokens.

    ``accuracy`` is the fraction of scored targets predicted by the argmax; ``loss`` the mean
    ``-\log p(target)`` over them (nats; ``exp(loss)`` is the perplexity). The data depend only on
    ``(task, length)`` (:func:`eval_seed`), so every model is tested on the same sequences.
    Returns ``None`` (not applicable) when the model's learned position table is shorter than ``length``.
    """
    if isinstance(model.absolute, LearnedPositionalEmbedding) and length > model.absolute.num_positions:
        return None
    device = torch.device(device) if device is not None else next(model.parameters()).device
    generator = torch.Generator().manual_seed(eval_seed(task, length))
    correct = total = 0
    nll = 0.0
    batch = min(config.eval_sequences, 128)
    with _one_thread_on_cpu(device):
        for start in range(0, config.eval_sequences, batch):
            size = min(batch, config.eval_sequences - start)
            tokens, targets = task_batch(task, size, length, config, generator)
            logits = model(tokens.to(device)).float().cpu()
            asked = targets != IGNORE
            correct += int((logits.argmax(-1)[asked] == targets[asked]).sum())
            nll += float(F.cross_entropy(logits[asked], targets[asked], reduction="sum"))
            total += int(asked.sum())
    return {"accuracy": correct / total, "loss": nll / total}


def accuracy(
    model: TinyTransformer,
    length: int,
    config: LabConfig,
    *,
    task: str = "repeat",
    device: torch.device | str | None = None,
) -> float | None:
    """The ``accuracy`` of :func:`evaluate` (``None`` where not applicable)."""
    scores = evaluate(model, length, config, task=task, device=device)
    return None if scores is None else scores["accuracy"]


# ----------------------------------------------------------------------------- the run and its record


def _new_row(label: str, kind: str, config: LabConfig, multiples: Sequence[int] | None = None) -> dict[str, Any]:
    """An empty row; ``accuracy`` and ``loss`` map every test multiple to per-seed lists (``None``: not applicable)."""
    applicable = config.multiples if multiples is None else multiples
    empty: dict[str, list[float] | None] = {str(m): ([] if m in applicable else None) for m in config.multiples}
    return {"label": label, "kind": kind, "accuracy": copy.deepcopy(empty), "loss": copy.deepcopy(empty)}


def row_names(config: LabConfig) -> list[str]:
    """The rows of each task: the encodings, ``rope+<zero-shot scaling>``, ``rope+<scaling>+ft`` and ``rope+ft``."""
    names = list(config.encodings)
    if "rope" in config.encodings:
        names += [f"rope+{s}" for s in config.zero_shot]
        names += ["rope+ft" if s == "default" else f"rope+{s}+ft" for s in config.fine_tune]
    return names


def _new_rows(config: LabConfig) -> dict[str, dict[str, Any]]:
    rows = {}
    for e in config.encodings:
        table_fits = [m for m in config.multiples if e != "learned" or m <= 1]  # the learned table has L rows
        rows[e] = {**_new_row(label_of(e), "trained", config, table_fits), "final_train_loss": [], "train_seconds": []}
    if "rope" not in config.encodings:
        return rows
    for s in config.zero_shot:
        row = _new_row(row_label(f"rope+{s}"), "zero-shot", config)
        row["scaling"] = {
            str(m): scaling_for_length(s, m, config.train_length, config.dynamic_factor) for m in config.multiples
        }
        rows[f"rope+{s}"] = row
    for s in config.fine_tune:
        name = "rope+ft" if s == "default" else f"rope+{s}+ft"
        rows[name] = {
            **_new_row(row_label(name), "fine-tuned", config, config.fine_tune_multiples),
            "fine_tune_seconds": [],
        }
    return rows


def _add(row: dict[str, Any], length_key: str, scores: dict[str, float] | None) -> None:
    """Append one seed's scores at one test multiple (a not-applicable entry must stay so)."""
    if (scores is None) != (row["accuracy"][length_key] is None):
        raise AssertionError(f"{row['label']} at {length_key}x: applicability changed between seeds")
    if scores is not None:
        row["accuracy"][length_key].append(scores["accuracy"])
        row["loss"][length_key].append(scores["loss"])


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _run_seed(
    rows: dict[str, dict[str, Any]], config: LabConfig, task: str, seed: int, device: torch.device, progress: bool
) -> None:
    """Train every encoding from ``seed``, evaluate it, and extend the RoPE model (zero-shot and fine-tuned)."""
    lengths = {str(m): m * config.train_length for m in config.multiples}
    for encoding in config.encodings:
        start = time.perf_counter()
        model, losses = train(config, encoding, task=task, seed=seed, device=device)
        seconds = time.perf_counter() - start
        rows[encoding]["train_seconds"].append(round(seconds, 2))
        rows[encoding]["final_train_loss"].append(sum(losses[-50:]) / len(losses[-50:]))
        for key, n in lengths.items():
            _add(rows[encoding], key, evaluate(model, n, config, task=task, device=device))
        _log(progress, f"{task} seed {seed} {encoding}: {seconds:.1f} s, final loss {losses[-1]:.3f}")
        if encoding == "rope":
            _extend_rope(rows, model, config, task, seed, device, progress)


def _extend_rope(
    rows: dict[str, dict[str, Any]],
    model: TinyTransformer,
    config: LabConfig,
    task: str,
    seed: int,
    device: torch.device,
    progress: bool,
) -> None:
    """Zero-shot scalings at every multiple; fine-tunes at each ``fine_tune_multiples``, tested at that length."""
    for s in config.zero_shot:
        for key, scaling in rows[f"rope+{s}"]["scaling"].items():
            scaled = with_rope_scaling(model, scaling)
            _add(rows[f"rope+{s}"], key, evaluate(scaled, int(key) * config.train_length, config, task=task))
    for s in config.fine_tune:
        name = "rope+ft" if s == "default" else f"rope+{s}+ft"
        start = time.perf_counter()
        for m in config.multiples:
            if m not in config.fine_tune_multiples:
                continue
            tuned, _ = fine_tune(model, s, m, config, task=task, seed=seed, device=device)
            _add(rows[name], str(m), evaluate(tuned, m * config.train_length, config, task=task))
        rows[name]["fine_tune_seconds"].append(round(time.perf_counter() - start, 2))
        _log(progress, f"{task} seed {seed} {name}: {time.perf_counter() - start:.1f} s")


def run(
    config: LabConfig = SMALL, *, device: torch.device | str | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run the whole protocol of ``config``: every task, seed and encoding, zero-shot and fine-tuned RoPE.

    Returns the record (JSON-serialisable): ``config``, ``chance``, ``t5`` (buckets, max distance and
    the untrained buckets per test multiple), ``dynamic_factor_rule``, ``fine_tune`` (steps, fraction,
    learning rate), ``tasks`` (``{task: {row: {"label", "kind", "accuracy", "loss", ...}}}`` with
    per-seed lists per test multiple, ``None`` where not applicable) and ``wall_seconds``.
    ``progress`` prints one line per trained model to stderr.
    """
    device = _device(device)
    for encoding in config.encodings:
        check_choice(encoding, "encodings", ENCODINGS)
    start = time.perf_counter()
    tasks = {}
    for task in config.tasks:
        rows = _new_rows(config)
        for seed in config.seeds:
            _run_seed(rows, config, task, seed, device, progress)
        tasks[task] = rows
    return {
        "schema": SCHEMA,
        "config": json.loads(json.dumps(dataclasses.asdict(config))),
        "seeds": list(config.seeds),
        "chance": 1.0 / config.vocab_size,
        "t5": t5_report(config),
        "dynamic_factor_rule": DYNAMIC_FACTOR_RULE,
        "fine_tune": fine_tune_report(config),
        "tasks": tasks,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }


def t5_report(config: LabConfig) -> dict[str, Any]:
    """T5's settings and, per test multiple, the number of buckets the test uses that training never reached."""
    untrained = {
        str(m): t5_untrained_buckets(
            config.t5_num_buckets, config.t5_max_distance, config.train_length, m * config.train_length
        )
        for m in config.multiples
    }
    return {
        "num_buckets": config.t5_num_buckets,
        "max_distance": config.t5_max_distance,
        "untrained_buckets": untrained,
    }


def fine_tune_report(config: LabConfig) -> dict[str, Any]:
    """The fine-tune protocol as recorded: steps, their fraction of pre-training, rate, lengths, data seeds."""
    return {
        "steps": config.fine_tune_steps,
        "fraction_of_pretraining": config.fine_tune_steps / config.steps,
        "learning_rate": config.fine_tune_learning_rate,
        "multiples": list(config.fine_tune_multiples),
        "scalings": list(config.fine_tune),
        "lengths": "even lengths in [mL/2, mL], as in pre-training with L replaced by mL; tested at mL",
        "data_seed": f"{FINE_TUNE_DATA_SEED} + 10 * seed + m (the same batches for every variant)",
    }


def provenance(command: str, device: torch.device | str | None = None) -> dict[str, Any]:
    """Where and how a run was made: command, device, versions, git commit, date (UTC), seed streams and threads."""
    return {
        "command": command,
        "seed_streams": {
            "model_init": "torch.manual_seed(seed)",
            "training_data": f"{TRAIN_DATA_SEED} + seed",
            "fine_tune_data": f"{FINE_TUNE_DATA_SEED} + 10 * seed + m",
            "evaluation_data": f"{EVAL_SEED} + 1000000 * task index + test length (same for every model)",
        },
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ropelib": __version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "threads": 1 if _device(device).type == "cpu" else None,  # see _one_thread_on_cpu
        **git_state(),
    }


def format_table(record: dict[str, Any], task: str | None = None, metric: str = "accuracy") -> str:
    """One task's ``metric`` (``"accuracy"`` or ``"loss"``) as mean ± std over seeds, fixed-width text.

    Rows are named by :func:`row_label` (``PI``, ``YaRN, fine-tuned``, ...), columns by test length.
    """
    task = next(iter(record["tasks"])) if task is None else task
    rows = record["tasks"][task]
    multiples = list(next(iter(rows.values()))[metric])
    lines = [f"{task} ({metric}, mean ± std over {len(record['seeds'])} seeds)"]
    lines.append(f"{'':<16}" + "".join(f"{m + 'L':>15}" for m in multiples))
    for name, row in rows.items():
        lines.append(f"{row_label(name):<16}" + "".join(f"{format_mean_std(v, 3):>15}" for v in row[metric].values()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def dry_run(config: LabConfig, device: torch.device | str | None = None) -> dict[str, int]:
    """Build every model and one batch of every task at every test length; train nothing.

    Returns the parameter count per encoding. Checks that a configuration parses and builds (for
    ``--large``, which is meant for a GPU) without spending the run.
    """
    device = _device(device)
    counts = {}
    for encoding in config.encodings:
        model = TinyTransformer(config, encoding).to(device)
        counts[encoding] = sum(p.numel() for p in model.parameters())
    for task in config.tasks:
        for m in config.multiples:
            task_batch(task, 1, m * config.train_length, config, torch.Generator().manual_seed(0))
    if "rope" in config.encodings:
        rope = TinyTransformer(config, "rope")
        for s in config.zero_shot:
            for m in config.multiples:
                with_rope_scaling(rope, scaling_for_length(s, m, config.train_length, config.dynamic_factor))
    return counts


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ropelib.lab",
        description=__doc__.split("\n\n")[0],
        epilog="The lab on real text (byte-level models on Python's standard library, passkey retrieval, "
        "attention entropy) is the other run: python -m ropelib.lab --text --help lists its options.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the chapter's live configuration (under a minute)")
    size.add_argument("--large", action="store_true", help="the larger configuration (meant for one GPU)")
    parser.add_argument("--json", metavar="PATH", help="write the record (results and provenance) to PATH")
    parser.add_argument("--steps", type=int, help="override the number of pre-training steps")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--dry-run", action="store_true", help="build every model and batch, train nothing")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> LabConfig:
    """``SMALL``, ``QUICK`` or ``LARGE``, with ``--steps`` and ``--seeds`` applied."""
    config = QUICK if args.quick else LARGE if args.large else SMALL
    if args.steps is not None:
        config = dataclasses.replace(config, steps=check_int(args.steps, "--steps", minimum=1))
    if args.seeds is not None:
        config = dataclasses.replace(config, seeds=tuple(args.seeds))
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line (see the module docstring); returns the record (or the dry run's parameter counts)."""
    args = _parse(argv)
    config = config_from_args(args)
    if args.dry_run:
        counts = dry_run(config)
        print(f"builds: {counts} parameters; {len(config.tasks) * len(config.seeds) * len(config.encodings)} trainings")
        return {"parameters": counts}
    command = ("python -m ropelib.lab " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    _log(not args.quiet, f"device: {device_name()}")
    record = run(config, progress=not args.quiet)
    record["provenance"] = {**provenance(command), "wall_seconds": record["wall_seconds"]}
    for task in record["tasks"]:
        print(format_table(record, task))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return record
