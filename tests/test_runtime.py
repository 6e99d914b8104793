"""Absorbed MLA decoding: same logits as the stock path, same cache object, every family."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from helpers import rel_err
from transmla_tool.runtime.absorbed import absorb, is_absorbed, latent_steps, restore
from transmla_tool.runtime.cache_args import cache_keyword


def _decode_logits(model, ids, steps: int, attention_mask=None):
    """Prefill ids (B, T) then feed `steps` greedy tokens one at a time; logits of every step."""
    cache = DynamicCache(config=model.config)
    out = model(ids, **{cache_keyword(model): cache}, use_cache=True, attention_mask=attention_mask)
    logits = [out.logits[:, -1]]
    token = out.logits[:, -1:].argmax(-1)
    mask = attention_mask
    for _ in range(steps):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(token, **{cache_keyword(model): out.past_key_values}, use_cache=True, attention_mask=mask)
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), out.past_key_values


@pytest.mark.parametrize(
    "family,kwargs",
    [
        ("llama", dict(kv_heads=2)),
        ("llama", dict(kv_heads=1)),
        ("mistral", dict(kv_heads=2)),
        ("qwen2", dict(kv_heads=2)),  # q_lora path with biases
        ("llama", dict(kv_heads=2, rope_scaling=True)),
    ],
)
def test_absorbed_decode_equals_stock(make_model, convert_tiny, family, kwargs):
    src = make_model(family, **kwargs)
    out, _, _ = convert_tiny(src, latent_dim=24, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock, stock_cache = _decode_logits(model, ids, steps=6)
        absorb(model)
        assert is_absorbed(model)
        absorbed, absorbed_cache = _decode_logits(model, ids, steps=6)
    # the 20-token prefill takes the expanded path; each of the 6 decode steps the latent path, in every layer
    assert latent_steps(model) == 6 * model.config.num_hidden_layers
    assert rel_err(absorbed, stock) < 1e-5
    assert torch.equal(absorbed.argmax(-1), stock.argmax(-1))
    # the same cache object holds the same latent: the cache format is untouched
    for a, b in zip(absorbed_cache.layers, stock_cache.layers):
        assert a.keys.shape == b.keys.shape and rel_err(a.keys, b.keys) < 1e-5
    restore(model)
    assert not hasattr(model.model.layers[0].self_attn, "_stock_forward")


def test_absorbed_padded_batch_and_chunks(make_model, convert_tiny):
    """Left-padded batch (an explicit attention mask) and multi-token steps through the absorbed path
    (chunks of up to ABSORB_MAX_QUERY tokens after a prefill): logits equal the stock path's."""
    src = make_model("llama", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=16, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (3, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, :2] = 0
    chunks = [ids[:, :12], ids[:, 12:16], ids[:, 16:24]]

    def run():
        cache = DynamicCache(config=model.config)
        outs = []
        seen = 0
        for chunk in chunks:
            seen += chunk.shape[1]
            res = model(chunk, **{cache_keyword(model): cache}, use_cache=True, attention_mask=mask[:, :seen])
            cache = res.past_key_values
            outs.append(res.logits)
        steps, _ = _decode_logits_from(model, cache, res.logits, mask, 4)
        return torch.cat(outs, 1), steps

    with torch.no_grad():
        stock_prefill, stock_steps = run()
        absorb(model)
        absorbed_prefill, absorbed_steps = run()
    # chunks of 12, 4 and 8 tokens (all <= ABSORB_MAX_QUERY) and 4 decode steps: 7 latent calls per layer
    assert latent_steps(model) == 7 * model.config.num_hidden_layers
    keep = mask.bool()
    assert rel_err(absorbed_prefill[keep], stock_prefill[keep]) < 1e-5
    assert rel_err(absorbed_steps, stock_steps) < 1e-5


def _decode_logits_from(model, cache, logits, mask, steps):
    token = logits[:, -1:].argmax(-1)
    collected = []
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        res = model(token, **{cache_keyword(model): cache}, use_cache=True, attention_mask=mask)
        cache = res.past_key_values
        collected.append(res.logits[:, -1])
        token = res.logits[:, -1:].argmax(-1)
    return torch.stack(collected, 1), cache


def test_blockwise_softmax_equals_one_block(make_model, convert_tiny, monkeypatch):
    """Keys processed in blocks (online softmax, as at long contexts) give the same logits as one block."""
    from transmla_tool.runtime import absorbed

    src = make_model("llama", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=16, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(3))
    absorb(model)
    with torch.no_grad():
        whole, _ = _decode_logits(model, ids, steps=5)
        monkeypatch.setattr(absorbed, "KEY_BLOCK", 7)
        blocks, _ = _decode_logits(model, ids, steps=5)
    assert rel_err(blocks, whole) < 1e-6


def test_absorbed_generate_matches(make_model, convert_tiny):
    """model.generate() with the absorbed runtime gives the same greedy tokens."""
    src = make_model("llama", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=16, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    stock = model.generate(ids, max_new_tokens=12, do_sample=False)
    absorb(model)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), stock)
    # generate() hands the cache to attention under whatever name this transformers uses: the prompt (10 tokens)
    # and the 11 steps after it all ran on the latent path
    assert latent_steps(model) == 12 * model.config.num_hidden_layers


def test_absorb_refuses_other_models(make_model):
    model = AutoModelForCausalLM.from_pretrained(make_model("llama", kv_heads=2))
    with pytest.raises(ValueError, match="DeepseekV3"):
        absorb(model)


def test_absorb_refuses_a_transformers_without_latent_cache(make_model, convert_tiny, monkeypatch):
    """Before 5.15 transformers cached expanded per-head K/V for DeepSeek-V3: absorb() must refuse, not run."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    from transmla_tool.runtime.absorbed import AbsorbError

    out, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=16, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    monkeypatch.delattr(modeling_deepseek_v3.DeepseekV3Attention, "expand_kv")
    with pytest.raises(AbsorbError, match="transformers>=5.15"):
        absorb(model)
    assert not hasattr(model.model.layers[0].self_attn, "_stock_forward")


@pytest.mark.parametrize("keyword", ["cache", "past_key_values", "some_future_name"])
def test_cache_found_whatever_its_keyword(make_model, convert_tiny, keyword):
    """The absorbed forward finds the cache by its type: handed over as `cache=`, `past_key_values=` or under
    another name, a decode step runs on the latent path and gives the stock attention's output."""
    out, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=16, rope_dim=8)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    attn = model.model.layers[0].self_attn
    captured = {}
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).past_key_values  # stock prefill
        hook = attn.register_forward_hook(lambda m, a, kw, out: captured.update(out=out[0]), with_kwargs=True)
        # stock decode step: the reference
        model(ids[:, 5:], **{cache_keyword(model): copy.deepcopy(cache)}, use_cache=True)
        hook.remove()
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[:, 5:]))
        position_embeddings = model.model.rotary_emb(hidden, torch.tensor([[5]]))
        absorb(model)
        out = attn(hidden, position_embeddings=position_embeddings, attention_mask=None, **{keyword: cache})[0]
    assert latent_steps(model) == 1
    assert rel_err(out, captured["out"]) < 1e-5
