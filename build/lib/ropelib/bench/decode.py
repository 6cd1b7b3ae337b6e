"""Where decoding spends its RoPE time: one call at a decode shape, and one step of a small model with a KV cache.

At a decode shape (one token: q ``[1, 1, 32, 128]``, k ``[1, 1, 8, 128]``) the rotation moves a few
kilobytes and the cost of a call is its overhead: Python, argument checks, dispatch. The peer is
Hugging Face's ``apply_rotary_pos_emb`` on tables computed beforehand (what every layer of a Llama
calls). The model step runs a tiny random Llama (built from a config, nothing downloaded) one token
at a time against a KV cache, patched with :func:`ropelib.patch_hf_rope` and unpatched, interleaved.
"""

from __future__ import annotations

import inspect
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ..kernels import rotary_qk
from ..rotary import RotaryEmbedding
from .harness import time_interleaved

DECODE_SHAPE = (1, 1, 32, 8, 128)


def _hf_apply() -> Callable[..., Any] | None:
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def decode_calls(device: torch.device, *, position: int = 1000) -> dict[str, Callable[[], Any]]:
    """Zero-argument calls rotating one decode token: ropelib's module and operator, and the Hugging Face peer."""
    batch, seq, q_heads, kv_heads, head_dim = DECODE_SHAPE
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device)
    positions = torch.tensor([[position]], device=device)
    rope = RotaryEmbedding(head_dim)
    cos, sin = rope.cos_sin_cache(position + 1, device)
    calls: dict[str, Callable[[], Any]] = {
        "ropelib RotaryEmbedding": lambda: rope(q, k, positions),
        "ropelib rotary_qk": lambda: rotary_qk(q, k, cos, sin, positions),
    }
    apply = _hf_apply()
    if apply is not None:
        wide_cos = torch.cat((cos[position], cos[position]))[None, None]  # [1, 1, d]: HF's precomputed table
        wide_sin = torch.cat((sin[position], sin[position]))[None, None]
        qh, kh = q.transpose(1, 2), k.transpose(1, 2)  # HF's [batch, heads, seq, d]
        calls["HF apply_rotary_pos_emb"] = lambda: apply(qh, kh, wide_cos, wide_sin)
    return calls


def decode_rows(device: torch.device, *, reps: int = 7, warmup: int = 2, calls_per_rep: int = 200) -> list[dict]:
    """Per-call microseconds of :func:`decode_calls`, median of ``reps`` rounds of ``calls_per_rep`` calls."""
    calls = decode_calls(device)

    def repeat(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls_per_rep):
                fn()

        return run

    with torch.no_grad():
        times = time_interleaved({n: repeat(f) for n, f in calls.items()}, device, reps=reps, warmup=warmup)
    peer = times.get("HF apply_rotary_pos_emb")
    rows = []
    for name, values in times.items():
        us = 1e6 * statistics.median(values) / calls_per_rep
        ratio = us / (1e6 * statistics.median(peer) / calls_per_rep) if peer else float("nan")
        rows.append({"impl": name, "shape": list(DECODE_SHAPE), "us_per_call": us, "ratio_to_hf": ratio})
    return rows


def tiny_llama(device: torch.device) -> Any:
    """A random 4-layer Llama (hidden 256, 8 heads of 32, 2 key/value heads), from a config: no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: Any = LlamaForCausalLM(config)
        return model.to(device).eval()


def model_step_rows(
    device: torch.device, *, reps: int = 7, warmup: int = 2, prefill: int = 128, steps: int = 16
) -> list[dict]:
    """Per-token milliseconds of a decoding step with a KV cache, the tiny Llama patched and unpatched.

    Each timed round decodes ``steps`` tokens after a ``prefill``-token prompt and then crops the
    cache back, for both models alike. Both produce the same greedy tokens (checked).
    """
    from transformers import DynamicCache

    from ..integrations.huggingface import patch_hf_rope

    plain, patched = tiny_llama(device), patch_hf_rope(tiny_llama(device))
    # the cache's keyword: ``cache`` in newer transformers, ``past_key_values`` (now deprecated) before
    cache_key = "cache" if "cache" in inspect.signature(plain.forward).parameters else "past_key_values"
    prompt = torch.arange(prefill, device=device)[None] % 512
    states = {}
    with torch.no_grad():
        for name, model in (("unpatched", plain), ("patched", patched)):
            cache = DynamicCache()
            out = model(input_ids=prompt, use_cache=True, **{cache_key: cache})
            states[name] = (model, cache, out.logits[:, -1:].argmax(-1))

    def decode(name: str) -> Callable[[], torch.Tensor]:
        model, cache, first = states[name]

        def run() -> torch.Tensor:
            token, tokens = first, []
            for i in range(steps):
                positions = torch.tensor([[prefill + i]], device=device)
                logits = model(input_ids=token, position_ids=positions, use_cache=True, **{cache_key: cache}).logits
                token = logits[:, -1:].argmax(-1)
                tokens.append(token)
            cache.crop(-steps)  # back to the prompt, for the next round
            return torch.cat(tokens, 1)

        return run

    calls = {name: decode(name) for name in states}
    with torch.no_grad():
        same = torch.equal(calls["unpatched"](), calls["patched"]())
        times = time_interleaved(calls, device, reps=reps, warmup=warmup)
    base = statistics.median(times["unpatched"])
    return [
        {
            "impl": f"tiny Llama, {name}",
            "ms_per_token": 1e3 * statistics.median(values) / steps,
            "ratio_to_unpatched": statistics.median(values) / base,
            "same_tokens": same,
            "prefill": prefill,
            "steps": steps,
        }
        for name, values in times.items()
    ]
