"""Measured KV cache and decode speed.

The cache is measured, not computed: prefill a context through the model with transformers' real
cache object and sum the bytes of every tensor it holds. The analytic value sits beside it; a
mismatch (e.g. an implementation that stores expanded K/V for MLA) is reported loudly.
"""

from __future__ import annotations

import os
import time

import torch


def cache_tensors_bytes(cache) -> int:
    """Bytes of the distinct tensors referenced by a transformers Cache (walks its layers)."""
    seen, total = set(), 0
    layers = getattr(cache, "layers", None)
    objects = list(layers) if layers is not None else [cache]
    for obj in objects:
        for value in vars(obj).values():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.numel():
                    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    if key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
    return total


def cached_values_per_token_per_layer(config) -> int:
    """What the architecture should cache per token per layer (analytic)."""
    if getattr(config, "kv_lora_rank", None):
        return config.kv_lora_rank + config.qk_rope_head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * kv_heads * head_dim


class PeakMemory:
    """Peak memory of a block: CUDA allocator peak on GPU; on Linux CPUs the process peak RSS
    (VmHWM), reset at entry through /proc/self/clear_refs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_mb = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.peak_mb = _vm_hwm_mb()
        return False


def _vm_hwm_mb() -> float | None:
    if not os.path.exists("/proc/self/status"):
        return None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int):
    """Feed (1, T) ids through the model in chunks of `chunk` tokens, filling a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = None
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start : start + chunk], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1:]
    return cache, logits


@torch.no_grad()
def measure_context(model, ids: torch.Tensor, new_tokens: int, chunk: int) -> dict:
    """Prefill `ids` (1, T), measure the cache, then greedily decode `new_tokens` tokens."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    with PeakMemory(device) as peak:
        cache, logits = prefill(model, ids, chunk)
        measured = cache_tensors_bytes(cache)
        seq = cache.get_seq_length()
        token = logits.argmax(-1)
        _sync(device)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        elapsed = time.perf_counter() - start
    config = model.config
    dtype_bytes = next(model.parameters()).element_size()
    per_token_layer = cached_values_per_token_per_layer(config)
    analytic = per_token_layer * config.num_hidden_layers * seq * dtype_bytes
    return {
        "context": int(ids.shape[1]),
        "measured_bytes": int(measured),
        "analytic_bytes": int(analytic),
        "measured_values_per_token_per_layer": measured / (config.num_hidden_layers * seq * dtype_bytes),
        "analytic_values_per_token_per_layer": per_token_layer,
        "decode_tokens_per_s": new_tokens / elapsed if elapsed > 0 else float("inf"),
        "peak_memory_mb": peak.peak_mb,
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
