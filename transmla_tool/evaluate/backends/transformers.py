"""The transformers backend: both models loaded with AutoModelForCausalLM, perplexity, the cache transformers
holds at each context, decode speed (stock and absorbed attention for a converted model) and lm-eval."""

from __future__ import annotations

import gc

import torch
from tqdm.auto import tqdm

from ..cache import measure_context
from ..lmeval import run_lm_eval
from ..models import context_ids, load_model, model_entry
from ..perplexity import perplexity

ATTENTION_MODES = ("stock", "absorbed", "both")


def decode_modes(config, attention: str) -> dict:
    """How each model decodes in the speed measurement: {report key suffix: switch(model)}."""
    from ...runtime.absorbed import absorb

    if config.model_type != "deepseek_v3":
        return {"": lambda m: None}
    modes = {}
    if attention in ("stock", "both"):
        modes[""] = restore_stock
    if attention in ("absorbed", "both"):
        modes["_absorbed"] = absorb
    return modes


def _absorbed(model) -> bool:
    from ...runtime.absorbed import is_absorbed

    return is_absorbed(model)


def check_latent_path(model, decode_steps: int) -> None:
    """The absorbed timing must come from the absorbed computation: refuse to report it when the decode
    steps went through transformers' stock attention instead (a silent fallback times the stock path)."""
    from ...runtime.absorbed import latent_steps

    expected = decode_steps * model.config.num_hidden_layers
    ran = latent_steps(model)
    if ran < expected:
        import transformers

        raise RuntimeError(
            f"the absorbed runtime took the latent path in {ran} of {expected} layer steps on transformers "
            f"{transformers.__version__}: its decode timing would be the stock path's; run with --attention stock "
            "and report this as a bug")


def restore_stock(model) -> None:
    if model.config.model_type == "deepseek_v3" and _absorbed(model):
        from ...runtime.absorbed import restore

        restore(model)


def evaluate_model(name: str, path: str, gguf_file, settings, windows, tokenizer, dtype,
                   device) -> dict:
    model = load_model(path, gguf_file, dtype, device)
    config = model.config
    result = model_entry(path, gguf_file, config, sum(p.numel() for p in model.parameters()))
    result["perplexity"] = perplexity(model, windows, settings.batch_size, settings.progress,
                                      desc=f"perplexity ({name})")
    if settings.cache_types:
        from ..quantized_cache import cache_perplexity, parse_transformers_cache_types

        result["cache_types"] = {name: cache_perplexity(model, windows, name, progress=settings.progress)
                                 for name in parse_transformers_cache_types(settings.cache_types)}
    result["contexts"] = {}
    modes = decode_modes(config, settings.attention)
    for length in tqdm(settings.contexts, desc=f"cache + decode ({name})", disable=not settings.progress):
        result["contexts"][str(length)] = measure_context(model, context_ids(windows, length), settings.new_tokens,
                                                          settings.prefill_chunk, settings.warmup_tokens, modes)
        if "_absorbed" in modes:
            check_latent_path(model, settings.new_tokens + settings.warmup_tokens)
    restore_stock(model)
    if settings.tasks:
        result["lm_eval"] = run_lm_eval(model, settings.tasks, settings.task_data, limit=settings.limit,
                                        num_fewshot=settings.num_fewshot, seed=settings.seed, tokenizer=tokenizer,
                                        batch_size=settings.batch_size)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def evaluate_pair(settings, windows, tokenizer, dtype, device) -> dict:
    return {
        "original": evaluate_model("original", settings.original, settings.gguf_file, settings, windows, tokenizer,
                                   dtype, device),
        "converted": evaluate_model("converted", settings.converted, None, settings, windows, tokenizer, dtype, device),
    }
