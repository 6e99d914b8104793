"""The llama.cpp backend (`eval --engine llamacpp`): both models measured in llama.cpp's own tools, on GGUFs
(the original as given or re-typed, the converted checkpoint exported by `export-gguf`)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ...errors import UserError
from ..models import model_entry

GGUF_TYPES = ("native", "f32", "bf16", "q8_0")


def evaluate_in_llamacpp(name: str, path: str, gguf_file: str | None, settings, windows, tokenizer, tmp: str) -> dict:
    """One model measured in llama.cpp's tools. The original must be a GGUF (llama.cpp reads nothing
    else); the converted checkpoint is exported with `export-gguf` (f32 for a float32 eval, else bf16).
    Perplexity: llama-perplexity over the windows' text, one chunk per window (it scores the second
    half of each chunk); KV cache: the bytes llama-perplexity allocated per token per layer; decode:
    llama-bench tokens/s generating new_tokens after each context (mean of 3)."""
    from transformers import AutoConfig

    from ...engines.llamacpp import (
        decode_speed,
        llama_cpp_version,
        perplexity,
        perplexity_per_cache_type,
        quantize,
        split_types,
    )
    from ...gguf_export import GGUFSettings, export_gguf

    if not settings.gguf_file:
        raise UserError("--engine llamacpp reads the original as a GGUF: pass --original DIR --gguf-file FILE (make one "
                        "with llama.cpp's convert_hf_to_gguf.py)")
    if settings.gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {settings.gguf_type}")
    run_flags: list[str] = []
    if gguf_file:
        model_file, config = Path(path) / gguf_file, AutoConfig.from_pretrained(path, gguf_file=gguf_file)
        if settings.gguf_type != "native":  # same values, another storage type: a like-for-like speed comparison
            retyped = Path(tmp) / f"{name}-{settings.gguf_type}.gguf"
            quantize(model_file, retyped, settings.gguf_type.upper(), allow_requantize=True)
            model_file = retyped
    else:
        outtype = settings.gguf_type if settings.gguf_type != "native" else (
            "f32" if settings.dtype in ("float32", "auto") else "bf16")
        model_file = Path(tmp) / f"{name}-{outtype}.gguf"
        exported = export_gguf(GGUFSettings(checkpoint=path, output=str(model_file), outtype=outtype,
                                            tokenizer_gguf=str(Path(settings.original) / settings.gguf_file)))
        run_flags = exported["run_flags"]  # what the GGUF cannot carry (a Llama-3 mapping's YaRN ramp)
        config = AutoConfig.from_pretrained(path)
    text = Path(tmp) / "windows.txt"
    if not text.exists():
        text.write_text(tokenizer.decode(windows.reshape(-1).tolist(), skip_special_tokens=True))
    ppl = perplexity(model_file, text, settings.seq_len, len(windows), flags=run_flags)
    out = model_entry(path, gguf_file, config)
    layers, per_token_layer = out["num_layers"], out["values_per_token_per_layer"]
    out.update({
        "engine": {"name": "llama.cpp", "version": llama_cpp_version(), "cpu_kernels": ppl["cpu_kernels"],
                   "gguf": str(model_file), "run_flags": run_flags,
                   "file_type": _gguf_file_type(model_file),
                   "kv_cache": {k: ppl[k] for k in ("kv_cache_mib", "kv_cells", "kv_layers",
                                                     "kv_bytes_per_token_per_layer")}},
        "perplexity": {"perplexity": ppl["perplexity"], "nll_per_token": math.log(ppl["perplexity"]),
                       "tokens": ppl["chunks"] * (settings.seq_len - 1 - settings.seq_len // 2)},
        "contexts": {},
    })
    if settings.cache_types:
        types = list(settings.cache_types)
        if gguf_file and "f16" not in types:
            types.insert(0, "f16")  # the reference every ratio is taken to
        if not gguf_file:  # MLA: one type for keys and values (the values are a view of the cached latent)
            types = list(dict.fromkeys(split_types(t)[0] for t in types))
        out["cache_types"] = perplexity_per_cache_type(model_file, text, settings.seq_len, len(windows), types,
                                                       run_flags)
    if settings.tasks:  # lm-eval's tasks under each cache type the model will be served with (f16 when none given)
        out["lm_eval_by_cache"] = tasks_in_llamacpp(model_file, run_flags, settings, tokenizer, bool(gguf_file))
        out["lm_eval"] = next(iter(out["lm_eval_by_cache"].values()))
    element = 2  # llama.cpp caches f16 by default
    # llama.cpp prints the cache size in MiB with two decimals: round to whole values per token per layer
    values = round(ppl["kv_bytes_per_token_per_layer"] / element)
    for length in settings.contexts:
        speed = decode_speed(model_file, length, settings.new_tokens)
        out["engine"]["build"] = speed["build"]
        out["contexts"][str(length)] = {
            "context": length,
            "measured_bytes": values * element * layers * length,
            "analytic_bytes": per_token_layer * layers * length * element,
            "measured_values_per_token_per_layer": values,
            "analytic_values_per_token_per_layer": per_token_layer,
            "decode": {"": {"tokens_per_s": speed["tokens_per_s"], "step_ms_median": None, "step_ms_mean":
                            1e3 / speed["tokens_per_s"], "gpu_kernel_ms_per_step": None, "steps": settings.new_tokens,
                            "warmup_steps": 1, "peak_memory_mb": None}},
        }
    return out


def tasks_in_llamacpp(model_file, run_flags: list[str], settings, tokenizer, original: bool) -> dict:
    """{cache type: run_lm_eval's results} for one GGUF: lm-eval's tasks answered by llama.cpp (engines/llamacpp_lm.py)
    under each of --cache-types (an MLA model takes the K type of a K/V pair)."""
    from ...engines.llamacpp import split_types
    from ...engines.llamacpp_lm import LlamaCppLM, yarn_kwargs
    from ..lmeval import run_lm_eval

    yarn = yarn_kwargs(run_flags)
    out = {}
    for entry in settings.cache_types or ["f16"]:
        cache = entry if original else split_types(entry)[0]
        engine = LlamaCppLM(str(model_file), tokenizer, cache, n_ctx=4096, **yarn)
        try:
            out[entry] = run_lm_eval(engine, settings.tasks, settings.task_data, limit=settings.limit,
                                     num_fewshot=settings.num_fewshot, seed=settings.seed)
        finally:
            engine.close()
    return out


def _gguf_file_type(path) -> str:
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    return gguf.LlamaFileType(int(field.contents())).name if field else "unknown"


def prepare(settings) -> None:
    """Before any work: a cache type llama.cpp would refuse for the converted model is refused here, not after the
    original has been measured."""
    if settings.cache_types:
        from transformers import AutoConfig

        from ..frontier import check_mla_sizes

        config = AutoConfig.from_pretrained(settings.converted)
        check_mla_sizes(list(settings.cache_types), config.kv_lora_rank, config.qk_rope_head_dim,
                        f"the converted model (latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim})")


def evaluate_pair(settings, windows, tokenizer, dtype, device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {k: evaluate_in_llamacpp(k, path, gguf, settings, windows, tokenizer, tmp)
                for k, path, gguf in (("original", settings.original, settings.gguf_file),
                                      ("converted", settings.converted, None))}
