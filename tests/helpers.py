"""Reference computations shared by the tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def sample_ids(vocab: int, batch: int = 2, length: int = 48, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def logits(model_dir, ids) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def reference_logits(source_dir, natural: dict, output_dir, ids) -> torch.Tensor:
    """The source model with every attention replaced by the tool's reference MLA math on the
    natural-form weights: what the stock DeepSeek-V3 checkpoint must reproduce."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from transmla_tool.ops.mla import mla_attention

    target = AutoConfig.from_pretrained(output_dir)
    rotary = DeepseekV3RotaryEmbedding(target)
    cos, sin = (t[0] for t in rotary(torch.zeros(1), torch.arange(ids.shape[1])[None]))
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        weights = natural[i].to(torch.float32)

        def forward(hidden_states, *args, _w=weights, **kwargs):
            return mla_attention(hidden_states, _w, cos, sin), None

        layer.self_attn.forward = forward
    with torch.no_grad():
        return model(ids).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())
