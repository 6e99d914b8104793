"""conversion.json: what was converted, with which settings, how each layer went, and what it cost."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, replace
from pathlib import Path

from . import __version__
from .arch.families import approximation
from .engines import servability
from .export import residual_scale


def conversion_summary(settings, geometry, target, ids, out_dtype, warnings: list, stage, device, start: float,
                       source_identity: str | None = None) -> dict:
    """The summary of one output of a conversion (target: convert's per-output record)."""
    return {
        "tool": "transmla_tool",
        "version": __version__,
        "source": _source_name(settings),
        # the weights' content digest (io/source.py identity): eval and heal check their original / teacher by it
        "source_identity": source_identity,
        "family": geometry.family.name,
        # how the family maps onto the stock layout: folded exactly (Granite, Phi-3, Gemma), or approximated
        "family_notes": list(geometry.family.notes),
        "exact_at_full_rank": geometry.family.approximation is None,
        "approximation": approximation(geometry.family, settings.method.query_norm),
        "settings": _settings_dict(replace(settings, latent_dim=target.latent_dim, output=target.output), ids),
        "dtype": str(out_dtype).replace("torch.", ""),
        "cache_values_per_token_per_layer": {
            "original": geometry.cache_values_per_token_per_layer,
            "converted": target.config.kv_lora_rank + settings.rope_dim,
        },
        "original_kv_heads": geometry.num_kv_heads,
        "original_head_dim": geometry.head_dim,
        # every output norm uses eps 1e-6; the source's own eps is kept exactly by scaling the residual
        # stream (export.residual_scale)
        "source_rms_norm_eps": geometry.rms_norm_eps,
        "residual_scale": residual_scale(geometry.rms_norm_eps),
        "servable": servability(target.config),
        "warnings": warnings,
        # 0 when every rotary slot turns at its source frequency; > 0 for a scaled rope mapped onto
        # DeepSeek YaRN (--target vllm): the largest |log(frequency ratio)| over the slots
        "rope_slot_max_log_error": round(target.rope_slot_max_log_error, 6),
        # the embedding channel a bias-free output's first layer folds its biases through (ops/bias_fold.py)
        "constant_channel": target.constant_channel,
        "layers": target.reports,
        "wall_time_s": round(time.time() - start, 1),
        # the stages reset the kernel's peak RSS counter: the overall peak is the max over them
        "peak_rss_mb": round(max(stage.overall_rss_mb, peak_rss_mb()), 1),
        "peak_gpu_mb": (round(max(stage.peak_gpu_mb.values(), default=0.0), 1) if device.type == "cuda" else None),
        "stages": stage.as_dict(),
    }


def _settings_dict(settings, ids) -> dict:
    out = {k: v for k, v in asdict(settings).items() if k not in ("method", "progress", "overwrite")}
    out["method"] = settings.method.as_dict()
    out["calib_tokens"] = int(ids.numel())
    out["calib_windows"] = int(ids.shape[0])  # what the text gave: calib_samples is what was asked for
    return out


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _source_name(settings) -> str:
    """The source as recorded in conversion.json: a hub id as given, a local path made absolute (so
    export-gguf finds a source GGUF from any working directory)."""
    model = str(Path(settings.model).resolve()) if Path(settings.model).exists() else settings.model
    return f"{model}/{settings.gguf_file}" if settings.gguf_file else model
