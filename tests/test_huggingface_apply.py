"""The patched ``apply_rotary_pos_emb`` under :func:`torch.compile`: no more graph breaks than the
unpatched model, and the same logits. Tiny random models from configs, nothing downloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelib import choose_kernel, patch_hf_rope, unpatch_hf_rope  # noqa: E402

from hot_path import graph_breaks  # noqa: E402

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=50)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, num_key_value_heads=2)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE, num_key_value_heads=1)),
    "phi (partial rotary)": lambda: transformers.PhiForCausalLM(
        transformers.PhiConfig(**BASE, partial_rotary_factor=0.5)
    ),
}


@pytest.mark.parametrize("length", [8, 1])  # 1: one position, the decoding path
@pytest.mark.parametrize("family", list(MODELS))
def test_patched_model_compiles_with_no_more_graph_breaks(family: str, length: int) -> None:
    choose_kernel("auto", "cpu")  # builds (or loads) the CPU's C loop where there is a compiler, outside the timing
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    tokens = torch.arange(1, 1 + length)[None]
    with torch.no_grad():
        plain_breaks, _ = graph_breaks(lambda t: model(t).logits, tokens)
        want = model(tokens).logits
        patch_hf_rope(model)
        breaks, reasons = graph_breaks(lambda t: model(t).logits, tokens)
        assert breaks <= plain_breaks, reasons
        if plain_breaks == 0:
            torch._dynamo.reset()
            got = torch.compile(lambda t: model(t).logits, fullgraph=True)(tokens)
            # float32 logits of a 2-layer model: ropelib's float64 angles differ from transformers'
            # float32 ones by <= 8 * 2^-23 rad; Inductor's fused arithmetic adds a few ulps.
            assert (got - want).abs().max().item() <= 1e-4
    unpatch_hf_rope(model)
