"""Measured KV cache and decode speed.

The cache is measured, not computed: prefill a context through the model with transformers' real
cache object and sum the bytes of every tensor it holds. The analytic value sits beside it; a
mismatch (e.g. an implementation that stores expanded K/V for MLA) is reported loudly.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from ..memory import reset_rss_peak, vm_hwm_mb
from ..runtime.cache_args import cache_keyword


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
            reset_rss_peak()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self.peak_mb = vm_hwm_mb()
        return False


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int):
    """Feed (1, T) ids through the model in chunks of `chunk` tokens, filling a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = step(model, ids[:, start : start + chunk], cache)
    return cache, logits


def step(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward over `ids` that appends to `cache` (handed over under the keyword this transformers
    takes); returns the last position's logits (B, 1, V)."""
    return model(ids, use_cache=True, **{cache_keyword(model): cache}).logits[:, -1:]


def decode_timing(model, cache, logits, steps: int, warmup: int) -> dict:
    """Greedy decode `warmup` untimed then `steps` timed tokens, one at a time, from (cache, logits).

    Reports the median step (the steady state: one-off costs such as allocator growth or lazy kernel
    setup land in the warm-up or the tail) beside the mean, and on a GPU the summed kernel time per
    step from the profiler: at batch 1 the host often dominates wall time and hides the attention.
    """
    device = logits.device
    token = logits.argmax(-1)
    for _ in range(warmup):
        token = step(model, token, cache).argmax(-1)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        token = step(model, token, cache).argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - start)
    result = {
        "steps": steps,
        "warmup_steps": warmup,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_mean": 1e3 * statistics.fmean(times),
        "tokens_per_s": 1.0 / statistics.median(times),
        "gpu_kernel_ms_per_step": None,
    }
    if device.type == "cuda":
        result["gpu_kernel_ms_per_step"] = _kernel_ms_per_step(model, cache, token, min(steps, 4))
    return result


def _kernel_ms_per_step(model, cache, token, steps: int) -> float:
    """Summed CUDA kernel time of a few decode steps, per step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(model, token, cache).argmax(-1)
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / steps


@torch.no_grad()
def measure_context(model, ids: torch.Tensor, new_tokens: int, chunk: int, warmup: int = 2,
                    modes: dict | None = None) -> dict:
    """Prefill `ids` (1, T), measure the cache, then time greedy decoding.

    modes: {name: callable(model) -> None} run before each decode measurement (e.g. switching the
    attention to the absorbed path); every mode decodes from its own copy of the same prefilled
    cache. Default: one mode, "default", the model as loaded.
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    modes = modes or {"default": lambda m: None}
    with PeakMemory(device) as prefill_peak:
        cache, logits = prefill(model, ids, chunk)
        measured = cache_tensors_bytes(cache)
        seq = cache.get_seq_length()
    config = model.config
    dtype_bytes = next(model.parameters()).element_size()
    per_token_layer = cached_values_per_token_per_layer(config)
    analytic = per_token_layer * config.num_hidden_layers * seq * dtype_bytes
    result = {
        "context": int(ids.shape[1]),
        "measured_bytes": int(measured),
        "analytic_bytes": int(analytic),
        "measured_values_per_token_per_layer": measured / (config.num_hidden_layers * seq * dtype_bytes),
        "analytic_values_per_token_per_layer": per_token_layer,
        "prefill_peak_memory_mb": prefill_peak.peak_mb,
        "decode": {},
    }
    names = list(modes)
    for i, name in enumerate(names):
        modes[name](model)
        own = cache if i == len(names) - 1 else copy.deepcopy(cache)
        with PeakMemory(device) as peak:
            timing = decode_timing(model, own, logits, new_tokens, warmup)
        timing["peak_memory_mb"] = _max(prefill_peak.peak_mb, peak.peak_mb)
        result["decode"][name] = timing
        del own
    return result


def _max(a, b):
    return None if a is None and b is None else max(x for x in (a, b) if x is not None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
