"""The patch-time probes on models that are unusual but valid: a dynamic-NTK model that has already
grown its frequencies past ``max_position_embeddings``, and a model on the meta device."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelib import patch_hf_rope, unpatch_hf_rope  # noqa: E402

CONFIG = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50,
    max_position_embeddings=32,
)  # fmt: skip


def llama(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, **overrides)).eval()


def test_dynamic_model_that_generated_past_its_context_patches() -> None:
    # Running 48 > 32 tokens grows transformers' dynamic-NTK frequencies; the probe then compares at
    # positions below max_position_embeddings - 1, where both reset to the original frequencies.
    model = llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    tokens = torch.arange(48)[None] % 50
    with torch.no_grad():
        model(tokens)
        short = torch.arange(20)[None] % 50
        want = model(short).logits
        patch_hf_rope(model)
        got = model(short).logits
    # float32 logits of a 1-layer model; transformers' float32 angles differ from ropelib's float64
    # ones by <= 20 * 2^-23 rad, far below this bound.
    assert (want - got).abs().max().item() <= 1e-4
    unpatch_hf_rope(model)


def test_meta_model_is_refused_with_a_clear_error() -> None:
    with torch.device("meta"):
        model = llama()
    with pytest.raises(ValueError, match="meta device .* materialise the model"):
        patch_hf_rope(model)
