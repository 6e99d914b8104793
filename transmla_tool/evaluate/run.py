"""`transmla-tool eval`: the original and the converted model under one protocol.

Both models get the same tokenizer (the original's), the same token windows, dtype and device; they
are loaded one after the other so only one is in memory at a time.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import token_windows
from ..errors import UserError
from .cache import cached_values_per_token_per_layer, measure_context
from .lmeval import run_lm_eval
from .perplexity import perplexity
from .report import write_report


@dataclass
class EvalSettings:
    original: str
    converted: str
    output_dir: str
    gguf_file: str | None = None
    data: str = "wikitext:wikitext-2-raw-v1@test"
    text_field: str = "text"
    seq_len: int = 512
    max_tokens: int = 32768
    skip_windows: int = 0  # windows at the start of --data not scored (e.g. used for calibration)
    batch_size: int = 4
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    new_tokens: int = 16
    warmup_tokens: int = 2
    prefill_chunk: int = 1024
    # converted model's decode: "stock" (transformers' DeepseekV3Attention), "absorbed"
    # (transmla_tool.runtime.absorbed) or "both", side by side
    attention: str = "both"
    # where the models run: "transformers", or "vllm" (its own venv: `make engines`)
    engine: str = "transformers"
    # --engine llamacpp: file type of both GGUFs. "native": the original as given, the converted exported at
    # f32 (float32 eval) or bf16; "f32"/"bf16"/"q8_0": the original re-typed with llama-quantize
    # --allow-requantize and the converted exported at that type, so decode speeds compare like with like
    gguf_type: str = "native"
    tasks: list[str] = field(default_factory=list)
    limit: float | None = None
    num_fewshot: int | None = None
    include_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    progress: bool = True


def check_scoring(batch_size: int, seq_len: int, max_tokens: int) -> None:
    """The perplexity protocol's numbers, checked before any model is loaded."""
    if batch_size < 1:
        raise UserError(f"--eval-batch-size must be >= 1, got {batch_size}")
    if seq_len < 2:
        raise UserError(f"--seq-len must be >= 2 (a window scores its tokens after the first), got {seq_len}")
    if max_tokens < seq_len:
        raise UserError(f"--max-tokens {max_tokens} is less than one window of --seq-len {seq_len}")


def resolve_eval_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise UserError(f"--dtype must be auto, bfloat16 or float32 for eval, got {name}")
    return table[name]


def load_model(path: str, gguf_file: str | None, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if device.type == "cuda":
        kwargs["device_map"] = str(device)  # accelerate places the weights directly on the GPU
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise UserError(f"cannot load model {path}: {exc}") from exc
    return model.to(device).eval()


def load_tokenizer(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except OSError as exc:
        raise UserError(f"cannot load the tokenizer of {path}: {exc}") from exc


def context_ids(windows: torch.Tensor, length: int) -> torch.Tensor:
    """(1, length) real-text ids for a long context, cycling the evaluation windows as needed."""
    flat = windows.reshape(-1)
    reps = -(-length // flat.numel())
    return flat.repeat(reps)[:length][None]


ATTENTION_MODES = ("stock", "absorbed", "both")


def decode_modes(config, attention: str) -> dict:
    """How each model decodes in the speed measurement: {report key suffix: switch(model)}."""
    from ..runtime.absorbed import absorb

    if config.model_type != "deepseek_v3":
        return {"": lambda m: None}
    modes = {}
    if attention in ("stock", "both"):
        modes[""] = restore_stock
    if attention in ("absorbed", "both"):
        modes["_absorbed"] = absorb
    return modes


def _absorbed(model) -> bool:
    from ..runtime.absorbed import is_absorbed

    return is_absorbed(model)


def check_latent_path(model, decode_steps: int) -> None:
    """The absorbed timing must come from the absorbed computation: refuse to report it when the decode
    steps went through transformers' stock attention instead (a silent fallback times the stock path)."""
    from ..runtime.absorbed import latent_steps

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
        from ..runtime.absorbed import restore

        restore(model)


def evaluate_model(name: str, path: str, gguf_file, settings: EvalSettings, windows, tokenizer, dtype,
                   device) -> dict:
    model = load_model(path, gguf_file, dtype, device)
    config = model.config
    result = {
        "model": path if not gguf_file else f"{path}/{gguf_file}",
        "model_type": config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "values_per_token_per_layer": cached_values_per_token_per_layer(config),
        "num_layers": config.num_hidden_layers,
    }
    result["perplexity"] = perplexity(model, windows, settings.batch_size, settings.progress,
                                      desc=f"perplexity ({name})")
    result["contexts"] = {}
    modes = decode_modes(config, settings.attention)
    for length in tqdm(settings.contexts, desc=f"cache + decode ({name})", disable=not settings.progress):
        result["contexts"][str(length)] = measure_context(model, context_ids(windows, length), settings.new_tokens,
                                                          settings.prefill_chunk, settings.warmup_tokens, modes)
        if "_absorbed" in modes:
            check_latent_path(model, settings.new_tokens + settings.warmup_tokens)
    restore_stock(model)
    if settings.tasks:
        result["lm_eval"] = run_lm_eval(model, tokenizer, settings.tasks, limit=settings.limit,
                                        num_fewshot=settings.num_fewshot, include_path=settings.include_path,
                                        batch_size=settings.batch_size, seed=settings.seed)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def check_settings(settings: EvalSettings, converted_exists: bool = True):
    """Every flag checked before any model or text is loaded; returns (device, dtype).
    converted_exists=False: the converted model is still to be made (the demo checks before converting)."""
    from ..convert import resolve_device

    device = resolve_device(settings.device)
    dtype = resolve_eval_dtype(settings.dtype, device)
    if converted_exists and not Path(settings.converted).is_dir():
        raise UserError(f"--converted {settings.converted} is not a directory written by transmla-tool convert")
    if any(c < 1 for c in settings.contexts):
        raise UserError("--contexts must be positive token counts")
    if settings.attention not in ATTENTION_MODES:
        raise UserError(f"--attention must be one of {', '.join(ATTENTION_MODES)}, got {settings.attention}")
    if settings.engine not in ("transformers", "vllm", "llamacpp"):
        raise UserError(f"--engine must be transformers, vllm or llamacpp, got {settings.engine}")
    if settings.new_tokens < 1 or settings.warmup_tokens < 0:
        raise UserError("--new-tokens must be >= 1 and --warmup-tokens >= 0")
    check_scoring(settings.batch_size, settings.seq_len, settings.max_tokens)
    if settings.prefill_chunk < 1:
        raise UserError(f"--prefill-chunk must be >= 1 token, got {settings.prefill_chunk}")
    if settings.skip_windows < 0:
        raise UserError(f"--skip-windows must be >= 0, got {settings.skip_windows}")
    if settings.tasks and settings.engine != "transformers":
        raise UserError(f"--tasks (lm-eval) runs through transformers; drop --tasks or --engine {settings.engine}")
    return device, dtype


def run_eval(settings: EvalSettings) -> dict:
    start = time.time()
    torch.manual_seed(settings.seed)
    device, dtype = check_settings(settings)
    tokenizer = load_tokenizer(settings.original, settings.gguf_file)
    max_windows = settings.skip_windows + max(1, settings.max_tokens // settings.seq_len)
    windows = token_windows(settings.data, tokenizer, settings.seq_len, max_windows, settings.text_field,
                            min_windows=settings.skip_windows + 1)[settings.skip_windows :]
    if settings.engine == "vllm":
        from ..engines.vllm_engine import vllm_python
        from .engine import check_vllm_serves, evaluate_in_vllm

        vllm_python()  # before any work (a GGUF original is dequantized to safetensors first): is vLLM installed?
        check_vllm_serves(settings.converted)
        results = {
            "original": evaluate_in_vllm("original", settings.original, settings.gguf_file, settings, windows, dtype),
            "converted": evaluate_in_vllm("converted", settings.converted, None, settings, windows, dtype),
        }
    elif settings.engine == "llamacpp":
        import tempfile

        from .engine import evaluate_in_llamacpp

        with tempfile.TemporaryDirectory() as tmp:
            results = {k: evaluate_in_llamacpp(k, path, gguf, settings, windows, tokenizer, tmp)
                       for k, path, gguf in (("original", settings.original, settings.gguf_file),
                                             ("converted", settings.converted, None))}
    else:
        results = {
            "original": evaluate_model("original", settings.original, settings.gguf_file, settings, windows,
                                       tokenizer, dtype, device),
            "converted": evaluate_model("converted", settings.converted, None, settings, windows, tokenizer,
                                        dtype, device),
        }
    report = build_report(results, settings, device, dtype, time.time() - start)
    write_report(report, Path(settings.output_dir))
    return report


def build_report(results: dict, settings: EvalSettings, device, dtype, seconds: float) -> dict:
    import transformers

    orig, conv = results["original"], results["converted"]
    both = ("original", "converted")
    report = {
        "models": {k: {f: results[k][f] for f in ("model", "model_type", "parameters", "num_layers", "engine")
                       if f in results[k]} for k in both},
        "perplexity": {
            "original": orig["perplexity"]["perplexity"],
            "converted": conv["perplexity"]["perplexity"],
            "ratio": conv["perplexity"]["perplexity"] / orig["perplexity"]["perplexity"],
            "tokens": orig["perplexity"]["tokens"],
            "seq_len": settings.seq_len,
            "data": settings.data,
        },
        "kv_cache": {
            "values_per_token_per_layer": {k: results[k]["values_per_token_per_layer"] for k in both},
            "measured_bytes": {}, "analytic_bytes": {}, "measured_values_per_token_per_layer": {},
            "warnings": [],
        },
        "decode_tokens_per_s": {},
        "peak_memory_mb": {},
        "decode_steps": {},
    }
    cache = report["kv_cache"]
    for ctx in orig["contexts"]:
        for key in ("measured_bytes", "analytic_bytes", "measured_values_per_token_per_layer"):
            cache[key][ctx] = {k: results[k]["contexts"][ctx][key] for k in both}
        speed, peak, steps = {}, {}, {}
        for k in both:
            for mode, timing in results[k]["contexts"][ctx]["decode"].items():
                speed[k + mode] = timing["tokens_per_s"]
                peak[k + mode] = timing["peak_memory_mb"]
                steps[k + mode] = {f: timing[f] for f in ("step_ms_median", "step_ms_mean", "gpu_kernel_ms_per_step",
                                                          "steps", "warmup_steps")}
        report["decode_tokens_per_s"][ctx] = speed
        report["peak_memory_mb"][ctx] = peak
        report["decode_steps"][ctx] = steps
        for k in both:
            measured, analytic = cache["measured_bytes"][ctx][k], cache["analytic_bytes"][ctx][k]
            if measured != analytic:
                cache["warnings"].append(
                    f"{k} model at context {ctx}: the {settings.engine} cache holds {measured} bytes but the "
                    f"architecture needs {analytic}; the installed {settings.engine} does not store the "
                    "compressed cache this format allows, and the measured number is what it really holds"
                )
    if "lm_eval" in orig:
        report["lm_eval"] = {
            task: {
                metric: {"original": value, "converted": conv["lm_eval"][task].get(metric),
                         "delta": conv["lm_eval"][task].get(metric, float("nan")) - value}
                for metric, value in metrics.items()
            }
            for task, metrics in orig["lm_eval"].items()
        }
    report["notes"] = []
    if settings.engine == "vllm":
        report["notes"].append(
            f"Measured in vLLM {conv['engine']['version']}: perplexity from its prompt logprobs; KV cache = the bytes "
            "per token per layer of the cache tensors it allocated x layers x context; decode tokens/s = N / "
            "(time to generate 1 + N tokens - time to generate 1), median of 3 after a warm-up, batch 1.")
    elif settings.engine == "llamacpp":
        report["notes"].append(
            f"Measured in llama.cpp ({conv['engine']['version']}): the original GGUF "
            + ("as given" if settings.gguf_type == "native" else "re-typed by llama-quantize --allow-requantize")
            + f" ({orig['engine']['file_type']}), the converted checkpoint exported by `transmla-tool export-gguf` "
            f"({conv['engine']['file_type']}; decode speed compares these types); perplexity from "
            "llama-perplexity with one chunk per window (it scores the second half of each chunk, so it is not the "
            "transformers number); KV cache = the bytes per token per layer llama-perplexity allocated (f16 cache) x "
            "layers x context; decode tokens/s from llama-bench (N tokens after the context, mean of 3).")
    elif conv["model_type"] == "deepseek_v3" and settings.attention in ("stock", "both"):
        report["notes"].append(
            "`converted` decodes with transformers' stock DeepseekV3Attention: it caches the latent but "
            "re-expands the whole cache into per-head keys and values with kv_b_proj at every step, so its cost "
            "grows with the context. `converted_absorbed` is the same checkpoint and cache decoded by "
            "transmla_tool.runtime.absorbed (kv_b_proj folded into the query and output, attention over the "
            "latent), the computation serving engines' MLA kernels do."
        )
    if settings.engine == "transformers":
        report["notes"].append(
            f"Decode speed: median of {settings.new_tokens} timed greedy steps after {settings.warmup_tokens} "
            "untimed warm-up steps, batch 1; peak memory covers the prefill and the decode.")
    report["settings"] = {k: v for k, v in asdict(settings).items() if k != "progress"}
    report["environment"] = {
        "engine": (settings.engine if settings.engine == "transformers"
                   else f"{conv['engine']['name']} {conv['engine']['version']}"),
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "wall_time_s": round(seconds, 1),
    }
    return report


def save_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2))
