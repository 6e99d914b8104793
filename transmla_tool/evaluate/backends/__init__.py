"""Evaluation backends, peers chosen by name (`eval --engine`): each runs both models its own way and returns
results of one shape. A backend module has `evaluate_pair(settings, windows, tokenizer, dtype, device)` and
may have `prepare(settings)`, run before any model or text is loaded."""

from __future__ import annotations

import importlib

BACKENDS = ("transformers", "vllm", "llamacpp")


def backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown evaluation backend {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
