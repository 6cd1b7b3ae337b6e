"""The extrapolation lab: train tiny transformers at length ``L``, test them at 1x, 2x, 4x and 8x ``L``.

One small causal transformer per position encoding (``none``, ``sinusoidal``, ``learned``, ``t5``,
``alibi``, ``rope``), built from :class:`ropelib.MultiHeadAttention`, is trained to *repeat*: a
sequence of ``n`` distinct random tokens is followed by the same ``n`` tokens again, and in the
second copy every next token is to be predicted. It is solved by an induction circuit (find the
earlier occurrence of the current token, copy the token after it): a local step (which token
came before) and a content lookup, the make-up of in-context retrieval. Chance is ``1/vocab``
at most. The trained RoPE model is then also evaluated
with each context-extension scaling of :mod:`ropelib.scaling` switched on at test time, with
``factor = test length / L`` and ``original_max_position_embeddings = L``.

A learned position table has no row past ``L``: it is reported as not applicable there (``None``),
never clamped.

Command line::

    python -m ropelib.lab                  # the small CPU run (a few minutes on 2 cores)
    python -m ropelib.lab --large          # the larger run (meant for a GPU)
    python -m ropelib.lab --json results/lab_cpu.json
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
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import __version__
from .._device import default_device, device_name
from .._validation import check_choice, check_int
from ..attention.mha import MultiHeadAttention
from ..encodings.absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from ..rotary import RotaryEmbedding
from ..scaling import ROPE_SCALINGS

ENCODINGS = ("none", "sinusoidal", "learned", "t5", "alibi", "rope")
#: The registered scalings that can be built from a factor and the training length alone.
TEST_TIME_SCALINGS = tuple(name for name, entry in ROPE_SCALINGS.items() if entry.for_factor is not None)
IGNORE = -100  # target of positions without a loss
EVAL_SEED = 12345  # evaluation data at length n is drawn with seed EVAL_SEED + n


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """Everything that defines a run (saved with its results)."""

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
    seed: int = 0


SMALL = LabConfig()
LARGE = LabConfig(
    train_length=64,
    vocab_size=512,
    embed_dim=256,
    num_heads=8,
    num_layers=4,
    steps=4000,
    batch_size=128,
    learning_rate=1e-3,
    eval_sequences=1024,
)


# ----------------------------------------------------------------------------- the task


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
    length = check_int(length, "length", minimum=4)
    half = length // 2
    if length % 2:
        raise ValueError(f"length must be even (two copies), got {length}")
    if half > config.vocab_size:
        raise ValueError(f"length {length} needs {half} distinct tokens but vocab_size={config.vocab_size}")
    first = torch.rand(batch_size, config.vocab_size, generator=generator).argsort(-1)[:, :half]
    tokens = torch.cat((first, first), dim=1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, half:-1] = first[:, 1:]
    return tokens, targets


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: LabConfig, position: str) -> None:
        super().__init__()
        options: dict[str, Any] = {"theta": config.theta} if position == "rope" else {}
        self.norm1 = nn.LayerNorm(config.embed_dim)
        self.attn = MultiHeadAttention(config.embed_dim, config.num_heads, position, causal=True, **options)
        self.norm2 = nn.LayerNorm(config.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.embed_dim, 4 * config.embed_dim),
            nn.GELU(),
            nn.Linear(4 * config.embed_dim, config.embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A causal transformer whose only difference between runs is the position encoding.

    Absolute encodings (``sinusoidal``, ``learned``) are added once to the token embeddings
    (Vaswani et al., 2017); relative biases (``t5``, ``alibi``) and ``rope`` act in every attention
    layer; ``none`` relies on the causal mask alone.

    Shapes:
        ``forward(tokens)``: int64 ``[batch, seq]`` -> logits ``[batch, seq, vocab_size]``.
    """

    def __init__(self, config: LabConfig, encoding: str) -> None:
        super().__init__()
        self.encoding = check_choice(encoding, "encoding", ENCODINGS)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.absolute: nn.Module | None = None
        if encoding == "sinusoidal":
            self.absolute = SinusoidalPositionalEncoding(config.embed_dim)
        elif encoding == "learned":
            self.absolute = LearnedPositionalEmbedding(config.train_length, config.embed_dim)
        in_attention = encoding if encoding in ("t5", "alibi", "rope") else "none"
        self.blocks = nn.ModuleList(Block(config, in_attention) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.embed_dim)
        self.head = nn.Linear(config.embed_dim, config.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.absolute is not None:
            x = self.absolute(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def with_rope_scaling(model: TinyTransformer, scaling: dict[str, Any]) -> TinyTransformer:
    """A copy of a trained RoPE model whose rotary embeddings use ``scaling`` (test-time context extension).

    ``max_position_embeddings`` is the training length, the length the frequencies were trained for.
    At a test length of ``L`` itself the dicts have ``factor = 1`` and ``original = L``, which
    ``transformers`` (and ropelib) warn about for Llama 3 scaling; the lab builds them on purpose
    (the 1x column), so that warning is silenced here.
    """
    if model.encoding != "rope":
        raise ValueError(f"test-time scaling applies to a RoPE model, got encoding={model.encoding!r}")
    scaled = copy.deepcopy(model)
    for block in scaled.blocks:
        attention = cast(Block, block).attn
        old = cast(RotaryEmbedding, attention.encoding)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            attention.encoding = RotaryEmbedding(
                old.head_dim,
                old.theta,
                old.layout,
                scaling=scaling,
                max_position_embeddings=model.config.train_length,
                backend=old.backend,
            )
    return scaled


def scaling_for_length(name: str, multiple: int, train_length: int) -> dict[str, Any]:
    """The scaling dict used at ``multiple`` x the training length: ``factor = multiple``, ``L = train_length``."""
    name = check_choice(name, "name", TEST_TIME_SCALINGS)
    build = ROPE_SCALINGS[name].for_factor
    assert build is not None
    return build(float(multiple), train_length)


# ----------------------------------------------------------------------------- training and evaluation


def train(
    config: LabConfig, encoding: str, *, device: torch.device | str | None = None, progress: bool = True
) -> tuple[TinyTransformer, list[float]]:
    """Train one model; lengths are drawn per step from the even numbers in ``[L/2, L]``.

    AdamW with a linear warm-up over the first 10% of the steps and a cosine decay. Seeded by
    ``config.seed``: the same config gives the same model on the same device.

    Returns:
        ``(model, losses)``: the trained model (in eval mode) and the loss of every step.
    """
    device = torch.device(device) if device is not None else default_device()
    with _one_thread_on_cpu(device):
        return _train(config, encoding, device, progress)


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


def _train(
    config: LabConfig, encoding: str, device: torch.device, progress: bool
) -> tuple[TinyTransformer, list[float]]:
    from tqdm.auto import tqdm

    torch.manual_seed(config.seed)
    model = TinyTransformer(config, encoding).to(device)
    generator = torch.Generator().manual_seed(config.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01)
    warmup = max(1, config.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    shortest = max(4, config.train_length // 2)
    lengths = torch.randint(shortest // 2, config.train_length // 2 + 1, (config.steps,), generator=generator) * 2
    losses = []
    model.train()
    bar = tqdm(range(config.steps), desc=f"train {encoding}", disable=not progress, leave=False)
    for step in bar:
        tokens, targets = repeat_batch(config.batch_size, int(lengths[step]), config, generator)
        tokens, targets = tokens.to(device), targets.to(device)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return model, losses


@torch.no_grad()
def accuracy(
    model: TinyTransformer,
    length: int,
    config: LabConfig,
    *,
    device: torch.device | str | None = None,
    seed: int = EVAL_SEED,
) -> float | None:
    """Next-token accuracy over the second copy of ``config.eval_sequences`` fresh sequences of ``length`` tokens.

    Returns ``None`` (not applicable) when the model's learned position table is shorter than ``length``.
    """
    if isinstance(model.absolute, LearnedPositionalEmbedding) and length > model.absolute.num_positions:
        return None
    device = torch.device(device) if device is not None else next(model.parameters()).device
    with _one_thread_on_cpu(device):
        return _accuracy(model, length, config, device, seed)


def _accuracy(model: TinyTransformer, length: int, config: LabConfig, device: torch.device, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed + length)
    correct = total = 0
    batch = min(config.eval_sequences, 128)
    for start in range(0, config.eval_sequences, batch):
        tokens, targets = repeat_batch(min(batch, config.eval_sequences - start), length, config, generator)
        predictions = model(tokens.to(device)).argmax(-1).cpu()
        asked = targets != IGNORE
        correct += int((predictions[asked] == targets[asked]).sum())
        total += int(asked.sum())
    return correct / total


def run(
    config: LabConfig = SMALL,
    encodings: Sequence[str] = ENCODINGS,
    scalings: Iterable[str] = TEST_TIME_SCALINGS,
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train each encoding, evaluate at every multiple of ``L``; RoPE also with each test-time scaling.

    Returns:
        ``{"config": ..., "accuracy": {name: {multiple: acc or None}}, "final_loss": {...},
        "train_seconds": {...}, "chance": 1 / vocab_size}``; names are the encodings and
        ``"rope+<scaling>"``. Multiples are string keys (as in JSON).
    """
    device = torch.device(device) if device is not None else default_device()
    for encoding in encodings:
        check_choice(encoding, "encodings", ENCODINGS)
    scalings = list(scalings)
    lengths = {m: m * config.train_length for m in config.multiples}
    results: dict[str, Any] = {"accuracy": {}, "final_loss": {}, "train_seconds": {}}
    for encoding in encodings:
        start = time.perf_counter()
        model, losses = train(config, encoding, device=device, progress=progress)
        results["train_seconds"][encoding] = round(time.perf_counter() - start, 2)
        results["final_loss"][encoding] = round(sum(losses[-50:]) / len(losses[-50:]), 4)
        results["accuracy"][encoding] = {str(m): accuracy(model, n, config, device=device) for m, n in lengths.items()}
        if encoding == "rope":
            for name in scalings:
                results["accuracy"][f"rope+{name}"] = {
                    str(m): accuracy(
                        with_rope_scaling(model, scaling_for_length(name, m, config.train_length)),
                        n,
                        config,
                        device=device,
                    )
                    for m, n in lengths.items()
                }
    results["chance"] = 1.0 / config.vocab_size
    results["config"] = dataclasses.asdict(config)
    return results


def provenance(command: str, config: LabConfig, device: torch.device | str | None = None) -> dict[str, Any]:
    """Where and how a run was made: command, device, versions, date (UTC) and seeds."""

    return {
        "command": command,
        "seeds": {
            "model_init": config.seed,
            "training_data": config.seed + 1,
            "evaluation_data": f"{EVAL_SEED} + test length",
        },
        "device": device_name(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ropelib": __version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "threads": 1 if torch.device(device or default_device()).type == "cpu" else None,  # see _one_thread_on_cpu
    }


def format_table(results: dict[str, Any]) -> str:
    """The accuracy table as fixed-width text (``n/a`` where not applicable)."""
    multiples = list(next(iter(results["accuracy"].values())))
    lines = [f"{'encoding':<16}" + "".join(f"{m + 'x':>8}" for m in multiples)]
    for name, row in results["accuracy"].items():
        lines.append(f"{name:<16}" + "".join(f"{'n/a' if v is None else f'{v:.3f}':>8}" for v in row.values()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m ropelib.lab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", action="store_true", help="the larger configuration (meant for a GPU)")
    parser.add_argument("--json", metavar="PATH", help="write the results and their provenance to PATH")
    parser.add_argument("--encodings", nargs="+", default=list(ENCODINGS), choices=ENCODINGS)
    parser.add_argument("--steps", type=int, help="override the number of training steps")
    args = parser.parse_args(argv)
    config = LARGE if args.large else SMALL
    if args.steps is not None:
        config = dataclasses.replace(config, steps=check_int(args.steps, "--steps", minimum=1))
    command = "python -m ropelib.lab " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"device: {device_name()}", flush=True)
    results = run(config, args.encodings)
    results["provenance"] = provenance(command.strip(), config)
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return results
