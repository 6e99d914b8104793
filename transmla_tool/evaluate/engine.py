"""`eval --engine vllm`: the same measurements, taken inside a serving engine.

Both models run in vLLM (its own venv, see transmla_tool.engines.vllm_engine) on the same token
windows: perplexity from vLLM's prompt logprobs, the KV cache from the cache tensors vLLM allocated
(bytes per token per layer, times layers and context), decode tokens/s from the time of generating
1 + N tokens minus 1 token after each context (median of 3, after a warm-up of that shape). The result
has the shape `evaluate_model` returns, so report.json/.md and the plots are the same.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ..errors import UserError
from .cache import cached_values_per_token_per_layer
from .run import context_ids

ENGINES = ("transformers", "vllm", "llamacpp")


def _model_entry(path: str, gguf_file: str | None, config) -> dict:
    """The fields every engine's result starts with (the shape `evaluate_model` returns)."""
    return {
        "model": path if not gguf_file else f"{path}/{gguf_file}",
        "model_type": config.model_type,
        "parameters": None,
        "values_per_token_per_layer": cached_values_per_token_per_layer(config),
        "num_layers": config.num_hidden_layers,
    }


def _as_directory(path: str, gguf_file: str | None, tmp: str) -> str:
    """vLLM reads safetensors directories: a GGUF source is dequantized once by transformers and saved."""
    if not gguf_file:
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(tmp) / "original"
    AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(path, gguf_file=gguf_file).save_pretrained(out)
    return str(out)


def check_vllm_serves(path: str) -> None:
    """Refuse a converted checkpoint vLLM would load as another model (biases it drops, a rope type it turns
    into DeepSeek YaRN) or cannot run (a latent + rope size its MLA layer refuses): vLLM's perplexity would
    be that other model's, reported as the conversion's loss."""
    from transformers import AutoConfig

    from ..engines import servability

    config = AutoConfig.from_pretrained(path)
    if config.model_type != "deepseek_v3":
        return
    problems = servability(config)["vllm"]["problems"]
    if problems:
        raise UserError(f"vLLM does not serve {path} as converted: {'; '.join(problems)}; convert with --target vllm, or "
                        "evaluate with --engine transformers")


def evaluate_in_vllm(name: str, path: str, gguf_file: str | None, settings, windows, dtype) -> dict:
    from transformers import AutoConfig

    from ..engines.vllm_engine import run_vllm

    dtype_name = str(dtype).replace("torch.", "")
    contexts = [context_ids(windows, length)[0].tolist() for length in settings.contexts]
    max_len = max([settings.seq_len, *settings.contexts]) + settings.new_tokens + 16
    with tempfile.TemporaryDirectory() as tmp:
        directory = _as_directory(path, gguf_file, tmp)
        config = AutoConfig.from_pretrained(directory)
        try:
            result = run_vllm(directory, perplexity=windows.tolist(), contexts=contexts,
                              decode_tokens=settings.new_tokens, dtype=dtype_name, max_model_len=max_len)
        except RuntimeError as exc:
            raise UserError(f"vLLM could not run the {name} model: {str(exc).splitlines()[-1]}") from exc
    kv = result["kv_cache"]
    if "error" in kv:
        raise UserError(f"could not read vLLM's KV cache for the {name} model ({kv['error']})")
    element = 4 if dtype_name == "float32" else 2
    out = _model_entry(path, gguf_file, config)
    layers, per_token_layer = out["num_layers"], out["values_per_token_per_layer"]
    out.update({
        "engine": {"name": "vllm", "version": result["vllm"], "kv_cache": kv},
        "perplexity": {"perplexity": math.exp(result["nll_sum"] / result["nll_tokens"]),
                       "nll_per_token": result["nll_sum"] / result["nll_tokens"], "tokens": result["nll_tokens"]},
        "contexts": {},
    })
    for length in settings.contexts:
        timing = result["decode"][str(length)]
        measured = kv["bytes_per_token_per_layer"] * layers * length
        out["contexts"][str(length)] = {
            "context": length,
            "measured_bytes": int(round(measured)),
            "analytic_bytes": per_token_layer * layers * length * element,
            "measured_values_per_token_per_layer": kv["bytes_per_token_per_layer"] / element,
            "analytic_values_per_token_per_layer": per_token_layer,
            "decode": {"": {"tokens_per_s": timing["tokens_per_s"], "step_ms_median": (None if timing["decode_s_per_token"] is None
                                                                      else 1e3 * timing["decode_s_per_token"]),
                            "step_ms_mean": None, "gpu_kernel_ms_per_step": None, "steps": settings.new_tokens,
                            "warmup_steps": 1, "peak_memory_mb": None}},
        }
    return out


GGUF_TYPES = ("native", "f32", "bf16", "q8_0")


def evaluate_in_llamacpp(name: str, path: str, gguf_file: str | None, settings, windows, tokenizer, tmp: str) -> dict:
    """One model measured in llama.cpp's tools. The original must be a GGUF (llama.cpp reads nothing
    else); the converted checkpoint is exported with `export-gguf` (f32 for a float32 eval, else bf16).
    Perplexity: llama-perplexity over the windows' text, one chunk per window (it scores the second
    half of each chunk); KV cache: the bytes llama-perplexity allocated per token per layer; decode:
    llama-bench tokens/s generating new_tokens after each context (mean of 3)."""
    from transformers import AutoConfig

    from ..engines.llamacpp import decode_speed, llama_cpp_version, perplexity, quantize
    from ..gguf_export import GGUFSettings, export_gguf

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
    out = _model_entry(path, gguf_file, config)
    layers, per_token_layer = out["num_layers"], out["values_per_token_per_layer"]
    out.update({
        "engine": {"name": "llama.cpp", "version": llama_cpp_version(), "gguf": str(model_file), "run_flags": run_flags,
                   "file_type": _gguf_file_type(model_file),
                   "kv_cache": {k: ppl[k] for k in ("kv_cache_mib", "kv_cells", "kv_layers",
                                                     "kv_bytes_per_token_per_layer")}},
        "perplexity": {"perplexity": ppl["perplexity"], "nll_per_token": math.log(ppl["perplexity"]),
                       "tokens": ppl["chunks"] * (settings.seq_len - 1 - settings.seq_len // 2)},
        "contexts": {},
    })
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


def _gguf_file_type(path) -> str:
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    return gguf.LlamaFileType(int(field.contents())).name if field else "unknown"
