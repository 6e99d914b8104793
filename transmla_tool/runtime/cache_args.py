"""How a transformers model takes its KV cache, on every version we support.

transformers 5.24 renamed the cache argument of models and attention layers from `past_key_values` to
`cache` (the old name is deprecated, to be removed in 5.40, where a model's `**kwargs` would swallow it
and run without a cache). Code that hands a cache over or looks for one goes through these two helpers.
"""

from __future__ import annotations

import functools
import inspect


def cache_keyword(model) -> str:
    """The keyword `model(...)` takes its cache by: `cache` where the signature has it, else `past_key_values`."""
    return _cache_keyword(type(model))


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class) -> str:
    # per class, once: eval calls this at every decode step, and inspecting a signature is not free
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def find_cache(args, kwargs):
    """The transformers Cache among a call's arguments, whatever keyword carries it (or None)."""
    from transformers.cache_utils import Cache

    return next((v for v in (*args, *kwargs.values()) if isinstance(v, Cache)), None)
