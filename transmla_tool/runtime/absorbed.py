"""Absorbed MLA decoding for a loaded stock `DeepseekV3ForCausalLM` (opt-in, per instance).

transformers' `DeepseekV3Attention` caches the normalized latent and the rotated rotary key, then
re-expands the *whole* cache through `kv_b_proj` into per-head keys and values at every step: its
cost per generated token grows with context x heads x (nope + v) x latent. Serving kernels instead
absorb `kv_b_proj` into the query and the output:

    score(h, t) = q_nope[h] . (W_uk[h] c_t) + q_rope[h] . k_rope_t = (W_uk[h]^T q_nope[h]) . c_t + ...
    out[h]      = sum_t p(h, t) W_uv[h] c_t = W_uv[h] (sum_t p(h, t) c_t)

so a step reads only the cached latent c_t and rotary key (kv_lora_rank + qk_rope_head_dim values
per token), once for all heads. `absorb(model)` switches every attention layer of a loaded model to
that computation; the checkpoint, the cache object and the logits stay the same (fp32: relative
difference ~1e-6). Prefill (more than `absorb_max_query` new tokens) keeps the expanded path, which
needs fewer FLOPs there; decode steps use the absorbed path. `restore(model)` undoes it.

Nothing is patched globally: only the `forward` of the given model's attention instances changes.

Guards against a silent fallback (transformers renamed the cache argument once, from `past_key_values`
to `cache`, and an absorbed forward that missed it decoded through the stock path with equal logits):
- the cache is found by its type (a `transformers.Cache` among the arguments), not by a keyword name;
- `absorb()` refuses a transformers whose `DeepseekV3Attention` does not cache the latent (before 5.15
  it cached expanded per-head K/V, which absorbed decoding cannot read);
- every decode step taken on the latent path is counted per layer (`latent_steps(model)`), so callers
  and tests check that the absorbed computation ran rather than only that the logits agree.
"""

from __future__ import annotations

import types

import torch

from .cache_args import find_cache

# Steps with at most this many new tokens per sequence use the absorbed path (decode, short
# speculative chunks); longer ones are prefill and keep the expanded path.
ABSORB_MAX_QUERY = 16


class AbsorbError(RuntimeError):
    """The absorbed runtime cannot take over this model on the installed transformers."""


def _attention_modules(model):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    found = [m for m in model.modules() if isinstance(m, DeepseekV3Attention)]
    if not found:
        raise ValueError("absorb() needs a DeepseekV3 model (no DeepseekV3Attention layer found)")
    return found


def check_runtime_support() -> None:
    """Raise AbsorbError when the installed transformers' DeepSeek-V3 attention does not cache the latent."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    # expand_kv (5.15+) is the step that turns the cached latent into per-head keys and values: its presence
    # means the cache holds the latent; without it, the cache holds expanded K/V and nothing can be absorbed
    if not hasattr(DeepseekV3Attention, "expand_kv"):
        raise AbsorbError(
            f"transformers {transformers.__version__} caches expanded per-head keys and values for DeepSeek-V3, "
            "not the latent, so absorbed decoding cannot run on it; install transformers>=5.15,<6 (what "
            "transmla-tool's pyproject requires)")


def absorb(model, max_query: int = ABSORB_MAX_QUERY):
    """Make every DeepSeek-V3 attention layer of `model` decode over the latent cache. Returns model."""
    modules = _attention_modules(model)
    check_runtime_support()
    for module in modules:
        if not hasattr(module, "_stock_forward"):
            module._stock_forward = module.forward
        module._absorb_max_query = max_query
        module._latent_steps = 0
        module.forward = types.MethodType(_absorbed_forward, module)
    return model


def restore(model):
    """Undo absorb(): the stock forward again."""
    for module in _attention_modules(model):
        if hasattr(module, "_stock_forward"):
            module.forward = module._stock_forward
            del module._stock_forward
    return model


def is_absorbed(model) -> bool:
    return all(hasattr(m, "_stock_forward") for m in _attention_modules(model))


def latent_steps(model) -> int:
    """Forward calls that took the absorbed latent path since absorb(), summed over layers."""
    return sum(getattr(m, "_latent_steps", 0) for m in _attention_modules(model))


def _split_kv_b(module) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj per head: W_uk (H, dn, r) and W_uv (H, dv, r), views of the weight."""
    heads, dn, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    w = module.kv_b_proj.weight.view(heads, dn + dv, module.kv_lora_rank)  # (H, dn+dv, r)
    return w[:, :dn], w[:, dn:]


def _queries(module, hidden_states):
    if module.q_lora_rank is None:
        return module.q_proj(hidden_states)
    return module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))


def _absorbed_forward(self, hidden_states, *args, **kwargs):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    bsz, length = hidden_states.shape[:-1]
    cache = find_cache(args, kwargs)
    if cache is None or length > self._absorb_max_query:
        return self._stock_forward(hidden_states, *args, **kwargs)
    # the stock signature, (hidden_states, position_embeddings, attention_mask, cache, ...), positional or not
    position_embeddings = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[0]
    attention_mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[1] if len(args) > 1 else None)
    self._latent_steps += 1
    heads, dn, dr, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank

    q = _queries(self, hidden_states).view(bsz, length, heads, dn + dr).transpose(1, 2)  # (B, H, S, dn+dr)
    q_nope, q_rot = q.split([dn, dr], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)  # (B, S, r+dr)
    latent, k_rot = compressed.split([r, dr], dim=-1)
    latent = self.kv_a_layernorm(latent).view(bsz, 1, length, r)
    k_rot = k_rot.view(bsz, 1, length, dr)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    latent, k_rot = cache.update(latent, k_rot, self.layer_idx)  # (B, 1, T, r), (B, 1, T, dr)
    total = latent.shape[2]

    w_uk, w_uv = _split_kv_b(self)
    q_latent = torch.matmul(q_nope, w_uk.unsqueeze(0))  # (B, H, S, dn) @ (1, H, dn, r) -> (B, H, S, r)
    # All heads share one latent and one rotary key: attend with the H*S queries as one head.
    q_latent = q_latent.reshape(bsz, heads * length, r)
    q_rot = q_rot.reshape(bsz, heads * length, dr)
    mask = _mask(attention_mask, bsz, heads, length, total, q_latent.device)
    out_latent = _latent_attention(q_latent, q_rot, latent[:, 0], k_rot[:, 0], mask, self.scaling)
    out_latent = out_latent.view(bsz, heads, length, r)  # (B, H, S, r)
    out = torch.matmul(out_latent, w_uv.transpose(1, 2).unsqueeze(0))  # (B, H, S, r) @ (1, H, r, dv)
    out = out.transpose(1, 2).reshape(bsz, length, heads * self.v_head_dim)
    return self.o_proj(out), None


# Keys per block of the online softmax: a block's latent stays in the CPU cache between the score and
# the output product instead of being read from memory twice (measured 2.9 -> 2.2 ms per layer at 16K
# on 2 CPU cores); on a GPU the block count is small and the same code runs.
KEY_BLOCK = 4096


def _latent_attention(q_latent, q_rot, latent, k_rot, mask, scale):
    """softmax(scale * (q_latent latent^T + q_rot k_rot^T) + mask) latent, blockwise over keys.

    q_latent (B, Q, r), q_rot (B, Q, dr), latent (B, T, r), k_rot (B, T, dr), mask None or (B, Q, T)
    bool / additive. Returns (B, Q, r) in the inputs' dtype; softmax statistics in fp32.
    """
    total = latent.shape[1]
    m = den = acc = None
    for start in range(0, total, KEY_BLOCK):
        block = slice(start, min(start + KEY_BLOCK, total))
        lat = latent[:, block]
        scores = torch.baddbmm(torch.bmm(q_rot, k_rot[:, block].transpose(1, 2)), q_latent, lat.transpose(1, 2))
        scores = scores.float() * scale  # (B, Q, t)
        if mask is not None:
            part = mask[..., block]
            # the dtype's minimum, not -inf: a fully masked row (left padding) stays finite, as in transformers
            scores = scores.masked_fill(~part, torch.finfo(scores.dtype).min) if part.dtype == torch.bool \
                else scores + part.float()
        block_max = scores.amax(-1, keepdim=True)
        if m is None:
            m = block_max
            weights = torch.exp(scores - m)
            den = weights.sum(-1, keepdim=True)
            acc = torch.bmm(weights.to(lat.dtype), lat).float()
        else:
            new_m = torch.maximum(m, block_max)
            rescale = torch.exp(m - new_m)
            weights = torch.exp(scores - new_m)
            den = den * rescale + weights.sum(-1, keepdim=True)
            acc = acc * rescale + torch.bmm(weights.to(lat.dtype), lat).float()
            m = new_m
    return (acc / den).to(latent.dtype)


def _mask(attention_mask, bsz, heads, length, total, device):
    """The mask for the (B, H*S, T) scores: transformers' (B, 1, S, T) mask repeated over heads, or the
    causal mask of the last S positions when transformers passes none."""
    if attention_mask is not None:
        return attention_mask.expand(bsz, 1, length, total).repeat(1, heads, 1, 1).reshape(bsz, heads * length, total)
    if length == 1:
        return None
    query_pos = torch.arange(total - length, total, device=device)
    causal = torch.arange(total, device=device)[None, :] <= query_pos[:, None]  # (S, T)
    return causal.repeat(heads, 1)[None]
