"""The vLLM backend (`eval --engine vllm`): the same measurements, taken inside vLLM.

Both models run in vLLM (its own venv, see transmla_tool.engines.vllm_engine) on the same token
windows: perplexity from vLLM's prompt logprobs, the KV cache from the cache tensors vLLM allocated
(bytes per token per layer, times layers and context), decode tokens/s from the time of generating
1 + N tokens minus 1 token after each context (median of 3, after a warm-up of that shape). The result
has the shape the transformers backend returns, so report.json/.md and the plots are the same.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ...errors import UserError
from ..models import context_ids, model_entry


def _as_directory(path: str, gguf_file: str | None, tmp: str) -> str:
    """vLLM reads safetensors directories: a GGUF source is dequantized once by transformers and saved."""
    if not gguf_file:
        return path
    import torch
    from transformers import AutoModelForCausalLM

    from ...gguf_tokenizer import load_gguf_tokenizer

    out = Path(tmp) / "original"
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    # transformers (5.24 at least) marks a GGUF-loaded model as quantized and refuses to save it, though its weights are
    # already dequantized: what is saved is exactly what it computes with
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    load_gguf_tokenizer(path, gguf_file).save_pretrained(out)
    return str(out)


def check_vllm_serves(path: str) -> None:
    """Refuse a converted checkpoint vLLM would load as another model (biases it drops, a rope type it turns
    into DeepSeek YaRN) or cannot run (a latent + rope size its MLA layer refuses): vLLM's perplexity would
    be that other model's, reported as the conversion's loss."""
    from transformers import AutoConfig

    from ...engines import servability

    config = AutoConfig.from_pretrained(path)
    if config.model_type != "deepseek_v3":
        return
    problems = servability(config)["vllm"]["problems"]
    if problems:
        raise UserError(f"vLLM does not serve {path} as converted: {'; '.join(problems)}; convert with --target vllm, or "
                        "evaluate with --engine transformers")


def evaluate_in_vllm(name: str, path: str, gguf_file: str | None, settings, windows, dtype) -> dict:
    from transformers import AutoConfig

    from ...engines.vllm_engine import run_vllm

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
    out = model_entry(path, gguf_file, config)
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


def prepare(settings) -> None:
    """Before any work (a GGUF original is dequantized to safetensors first): is vLLM installed, and does it
    serve the converted checkpoint as converted?"""
    from ...engines.vllm_engine import vllm_python

    vllm_python()
    check_vllm_serves(settings.converted)


def evaluate_pair(settings, windows, tokenizer, dtype, device) -> dict:
    return {"original": evaluate_in_vllm("original", settings.original, settings.gguf_file, settings, windows, dtype),
            "converted": evaluate_in_vllm("converted", settings.converted, None, settings, windows, dtype)}
