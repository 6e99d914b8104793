"""Perplexity through transformers' own KV caches: the exact DynamicCache and its quantized caches.

What a transformers user gets from one option (`QuantizedCache`, i.e. `generate(cache_implementation=
"quantized")`): backends quanto (int4, int2; `pip install optimum-quanto`), hqq (int8, int4, int3, int2;
`pip install hqq`) and fp8 (built in, one scale per tensor frozen at the first update). Names here are
`backend-intN` and `fp8`; `dynamic` is the exact cache in the model's dtype, the reference.

How it is measured: each window is fed in chunks of `chunk` tokens through one cache, so every chunk's queries
read the earlier chunks' keys and values back from the cache (quantized and dequantized) and their own in full
precision. The cache is built with no full-precision residual window (`residual_length=0`: on transformers
5.24 every update is flushed into the quantized store), like llama.cpp's cache where every cached token is
quantized; transformers' default keeps the last 128 tokens in full precision. (transformers 5.15 flushes only
every other update with that setting, so there a chunk now and then reads its predecessor in full precision.) A DeepSeek-V3 model caches its latent as the "keys" and
its rotary key as the "values" (transformers 5), so a converted model is scored through the same class.

Bytes per token per layer are counted from the tensors the cache holds at the end of each window (packed
codes, scales, zero points; a residual window would be counted too), divided by tokens x layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import UserError
from ..runtime.cache_args import cache_keyword

REFERENCE = "dynamic"
BACKEND_BITS = {"quanto": (4, 2), "hqq": (8, 4, 3, 2)}
TRANSFORMERS_CACHE_TYPES = (REFERENCE, "fp8", *(f"{b}-int{n}" for b, bits in BACKEND_BITS.items() for n in bits))
CACHE_CHUNK = 64  # tokens fed per forward: each chunk reads every earlier token back from the cache


def parse_transformers_cache_types(spec: list[str], flag: str = "--cache-types") -> list[str]:
    """Checked names, the exact reference first (added when missing); fails with the install fix when a
    backend's package is not installed."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available

    names = [s.strip() for s in spec if s.strip()]
    for name in names:
        if name not in TRANSFORMERS_CACHE_TYPES:
            raise UserError(f"{flag}: '{name}' is not one of transformers' caches we measure "
                            f"({', '.join(TRANSFORMERS_CACHE_TYPES)})")
        if name.startswith("quanto-") and not is_optimum_quanto_available():
            raise UserError(f"{flag} {name} needs optimum-quanto: pip install optimum-quanto")
        if name.startswith("hqq-") and not is_hqq_available():
            raise UserError(f"{flag} {name} needs hqq: pip install hqq")
        if name == "fp8" and not _has_fp8_backend():
            import transformers

            raise UserError(f"{flag} fp8: transformers {transformers.__version__} has no fp8 QuantizedCache backend; "
                            "upgrade transformers or leave fp8 out")
    if len(set(names)) != len(names):
        raise UserError(f"{flag} names a cache type twice")
    return [REFERENCE, *(n for n in names if n != REFERENCE)]


def _has_fp8_backend() -> bool:
    import transformers.cache_utils

    return hasattr(transformers.cache_utils, "Fp8QuantizedLayer")


def make_cache(name: str, config):
    from transformers import DynamicCache, QuantizedCache

    if name == REFERENCE:
        return DynamicCache(config=config)
    if name == "fp8":
        return QuantizedCache("fp8", config)
    backend, bits = name.split("-int")
    return QuantizedCache(backend, config, nbits=int(bits), residual_length=0)


def stored_bytes(obj) -> int:
    """Bytes of every tensor held by `obj`: plain tensors, tensor subclasses that flatten into inner tensors
    (quanto's packed codes and scales), and tuples, lists and dicts of them (hqq's codes and metadata)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            return sum(stored_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(stored_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(stored_bytes(x) for x in obj.values())
    return 0


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for attr in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += stored_bytes(getattr(layer, attr, None))
    return total


@torch.no_grad()
def cache_perplexity(model, windows: torch.Tensor, name: str, chunk: int = CACHE_CHUNK, progress: bool = True) -> dict:
    """Perplexity of `model` on windows (N, L) read through cache `name`, and the bytes per token per layer the
    cache held. Tokens are scored as in evaluate.perplexity (every position but the first of each window)."""
    device = next(model.parameters()).device
    layers = model.config.num_hidden_layers
    keyword = cache_keyword(model)
    nll, count, held, cached = 0.0, 0, 0, 0
    for window in tqdm(windows, desc=f"perplexity through a {name} cache", disable=not progress):
        ids = window[None].to(device)
        try:
            cache = make_cache(name, model.config)
        except ValueError as exc:  # e.g. QuantizedCache refuses a model with sliding-window layers
            raise UserError(f"transformers' {name} cache cannot hold this model's cache: {exc}") from None
        length = ids.shape[1]
        for start in range(0, length, chunk):
            piece = ids[:, start:start + chunk]
            logits = model(piece, use_cache=True, **{keyword: cache}).logits.float()  # (1, c, V)
            targets = ids[:, start + 1:start + chunk + 1]
            logits = logits[:, : targets.shape[1]]
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
            count += targets.numel()
        if cache.get_seq_length() != length:  # the cache did not see every token: its bytes would mean nothing
            raise RuntimeError(f"the {name} cache holds {cache.get_seq_length()} of {length} tokens")
        held += cache_bytes(cache)
        cached += length
    return {"perplexity": math.exp(nll / max(count, 1)), "tokens": count,
            "bytes": held / (cached * layers), "chunk": chunk}
