"""`transmla-tool sweep`: perplexity against cache size, to pick a latent dim (and a rope dim).

Calibrates once per rope dim (one pass through the source model produces every latent dim), then scores
each converted checkpoint and the original under the same perplexity protocol. A point is a latent dim at a
rope dim: `--rope-dim 32,64` converts every latent dim at both.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .convert import ConvertSettings, check_outputs, convert_many
from .data import token_windows
from .devices import resolve_device, resolve_eval_dtype
from .engines import VLLM, sglang_size_ok
from .errors import UserError
from .evaluate.cache import cache_tensors_bytes, cached_values_per_token_per_layer, prefill
from .evaluate.frontier import (
    DEFAULT_ORIGINAL_TYPES,
    MAX_RATIO,
    check_mla_sizes,
    markdown_table,
    parse_cache_types,
    point_key,
    points_from_sweep,
    recommend,
    reference_cache,
)
from .evaluate.frontier import plot as plot_frontier
from .evaluate.models import check_scoring, context_ids, load_model, load_tokenizer
from .evaluate.perplexity import perplexity
from .io.staging import check_target, local_paths, staged_directory
from .methods import resolve_method

CHECKPOINTS = "checkpoints"


@dataclass
class SweepSettings:
    model: str
    latent_dims: list[int]
    output_dir: str
    data: str
    gguf_file: str | None = None
    revision: str | None = None
    overwrite: bool = False
    keep_checkpoints: bool = False
    rope_dims: tuple[int, ...] = (64,)  # each latent dim is converted at each of these qk_rope_head_dims
    calib_data: str | None = None
    calib_samples: int = ConvertSettings.calib_samples
    calib_seq_len: int = 512
    text_field: str = "text"
    method: str = "default"
    overrides: tuple = ()
    seq_len: int = 512
    max_tokens: int = 32768
    eval_batch_size: int = 4
    batch_size: int = 8
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    ignore_sliding_window: bool = False
    # as `transmla-tool convert --target/--biases`: the same defaults, so each point is the conversion convert
    # writes (vllm: biases dropped, Llama-3 rope scaling as DeepSeek YaRN); a size the target's engine refuses
    # is converted anyway and marked in the table
    target: str = "vllm"
    biases: str = "auto"
    # "transformers" scores in transformers (a 16-bit cache); "llamacpp" in llama.cpp under each of `cache_types`
    # (the original as its GGUF re-typed to F32, each latent exported f32): quality per cache byte
    engine: str = "transformers"
    cache_types: str = ""
    max_cache_bytes: float | None = None  # recommend the best measured point at <= this many B/token/layer
    max_ratio: float = MAX_RATIO  # ... only where its perplexity ratio is at most this
    # lm-eval tasks every point is also scored on (same engine and cache types): their mean beside perplexity
    tasks: list = field(default_factory=list)
    limit: float | None = None
    task_data_source: str = "auto"
    progress: bool = True
    task_data: object = field(default=None, repr=False)  # filled by run_sweep: evaluate/tasks.py's resolution


def held_out_skip(settings: SweepSettings) -> int:
    """Evaluation windows to skip so scored text never overlaps the calibration text when both come
    from the same source (conservative: assumes every window loses one token to BOS)."""
    if settings.calib_data not in (None, settings.data):
        return 0
    return math.ceil(settings.calib_samples * settings.calib_seq_len / (settings.seq_len - 1))


def run_sweep(settings: SweepSettings) -> dict:
    start = time.time()
    if len(set(settings.latent_dims)) != len(settings.latent_dims):
        raise UserError("--latent-dims has duplicates")
    if not settings.rope_dims or len(set(settings.rope_dims)) != len(settings.rope_dims):
        raise UserError("--rope-dim needs one or more distinct values, e.g. 64 or 32,64")
    check_scoring(settings.eval_batch_size, settings.seq_len, settings.max_tokens)
    types = check_engine(settings)
    if settings.tasks and settings.engine == "llamacpp":
        from .engines.llamacpp_lm import bindings_installed

        if not bindings_installed():
            raise UserError("--tasks with --engine llamacpp needs llama.cpp's Python bindings; run `make engines`")
    inputs = local_paths(settings.model, settings.calib_data, settings.data)
    out = check_target(settings.output_dir, settings.overwrite, inputs)
    ropes, latents = sorted(settings.rope_dims, reverse=True), sorted(settings.latent_dims)
    convert_settings = ConvertSettings(
        model=settings.model, gguf_file=settings.gguf_file, revision=settings.revision, output="",
        latent_dim=latents[-1], rope_dim=ropes[0], calib_data=settings.calib_data or settings.data,
        calib_samples=settings.calib_samples, calib_seq_len=settings.calib_seq_len,
        text_field=settings.text_field, dtype=settings.dtype, device=settings.device, seed=settings.seed,
        overwrite=True, method=resolve_method(settings.method, list(settings.overrides)),
        method_name=settings.method, ignore_sliding_window=settings.ignore_sliding_window,
        batch_size=settings.batch_size, progress=settings.progress, target=settings.target, biases=settings.biases,
        refuse_unservable=False,
    )
    if types is not None and settings.engine == "llamacpp":
        for rope in ropes:
            for r in latents:
                check_mla_sizes(types, r, rope, f"latent {r} + rope {rope}")
    if len(ropes) > 1:  # every further rope dim checked before the first one converts (the first: by convert_many)
        check_outputs(convert_settings, latents, ropes[1:])
    suffix = (lambda p: "") if len(ropes) == 1 else (lambda p: f"-rope{p}")
    names = {(r, p): f"latent{r}{suffix(p)}" for p in ropes for r in latents}
    kept = [f"{CHECKPOINTS}/{name}" for name in names.values()] if settings.keep_checkpoints else []
    # staged like every output: a failed or interrupted sweep leaves nothing behind, a finished one replaces the
    # old output (this tool's only) as a whole
    with staged_directory(out, settings.overwrite, kind="sweep", inputs=inputs, parts=lambda _: kept) as staging:
        if settings.tasks:  # where each task reads its data, checked before any conversion
            from .evaluate.tasks import resolve

            settings.task_data = resolve(settings.tasks, staging / "tasks", settings.task_data_source)
        checkpoints = staging / CHECKPOINTS
        outputs = {key: str(checkpoints / name) for key, name in names.items()}
        summaries = {}
        for rope in ropes:
            done = convert_many(replace(convert_settings, rope_dim=rope), {r: outputs[(r, rope)] for r in latents})
            summaries.update({(r, rope): summary for r, summary in done.items()})
        result = _evaluate(settings, outputs, summaries, start, types)
        for point in result["points"]:  # where the checkpoint will be, not where it was staged
            point["model"] = str(out / CHECKPOINTS / Path(point["model"]).name)
        if not settings.keep_checkpoints:
            shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.rmtree(staging / "tasks", ignore_errors=True)
        (staging / "sweep.json").write_text(json.dumps(result, indent=2))
        (staging / "sweep.md").write_text(markdown(result))
        plot(result, staging / "sweep.png")
    return result


def check_engine(settings: SweepSettings) -> list[str] | None:
    """--engine/--cache-types/--max-cache-bytes checked before any work; the cache types to measure, or None."""
    if settings.engine not in ("transformers", "llamacpp"):
        raise UserError(f"--engine must be transformers or llamacpp, got {settings.engine}")
    if settings.max_cache_bytes is not None and settings.max_cache_bytes <= 0:
        raise UserError(f"--max-cache-bytes must be > 0 bytes per token per layer, got {settings.max_cache_bytes}")
    if not settings.max_ratio >= 1:
        raise UserError(f"--max-ratio must be >= 1 (a perplexity ratio to the original), got {settings.max_ratio}")
    if settings.engine == "transformers":
        if not settings.cache_types:
            return None
        from .evaluate.quantized_cache import parse_transformers_cache_types

        return parse_transformers_cache_types(settings.cache_types.split(","))
    if not settings.gguf_file:
        raise UserError("--engine llamacpp reads the original as a GGUF: pass --model DIR --gguf-file FILE")
    from .engines.llamacpp import llama_cpp_bin

    llama_cpp_bin("llama-perplexity")  # `make engines` has run, or a one-line error with the fix
    return parse_cache_types(settings.cache_types or DEFAULT_ORIGINAL_TYPES)


def _evaluate(settings: SweepSettings, outputs: dict, summaries: dict, start: float, types=None) -> dict:

    device = resolve_device(settings.device)
    dtype = resolve_eval_dtype(settings.dtype, device)
    tokenizer = load_tokenizer(settings.model, settings.gguf_file)
    skip = held_out_skip(settings)
    windows = token_windows(settings.data, tokenizer, settings.seq_len,
                            skip + max(1, settings.max_tokens // settings.seq_len), settings.text_field,
                            min_windows=skip + 1)[skip:]
    points = []
    in_transformers = types if settings.engine == "transformers" else None  # its caches, scored beside perplexity
    original = _score(settings.model, settings.gguf_file, windows, dtype, device, settings, "original", in_transformers,
                      tokenizer)
    cache_types = {"original": original.pop("cache_types")} if in_transformers else None
    for (r, rope), path in outputs.items():
        scored = _score(path, None, windows, dtype, device, settings, f"latent {r} + {rope}", in_transformers,
                        tokenizer)
        if in_transformers:
            cache_types[point_key(r, rope)] = scored.pop("cache_types")
        scored.update(latent_dim=r, rope_dim=rope, conversion_seconds=summaries[(r, rope)]["wall_time_s"],
                      vllm_size_ok=r + rope in VLLM.mla_sizes, sglang_size_ok=sglang_size_ok(r, rope))
        points.append(scored)
    if types is not None and settings.engine == "llamacpp":
        import tempfile

        from .evaluate.frontier import score_in_llamacpp

        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp) / "windows.txt"
            text.write_text(tokenizer.decode(windows.reshape(-1).tolist(), skip_special_tokens=True))
            cache_types = score_in_llamacpp(settings.model, settings.gguf_file,
                                            {point_key(*key): path for key, path in outputs.items()}, text,
                                            settings.seq_len, len(windows), types, types, tmp,
                                            tasks=_llamacpp_tasks(settings, tokenizer) if settings.tasks else None)
    result = {
        "original": original,
        "points": points,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()
                     if k != "task_data"},
        "eval_windows_skipped": skip,
        "eval_tokens": int(windows[:, 1:].numel()),
        "wall_time_s": round(time.time() - start, 1),
        "conversion": {"target": settings.target, "biases": settings.biases},
    }
    if settings.tasks:
        result["benchmark"] = {"tasks": settings.tasks, "limit": settings.limit,
                               "metric": "mean of each task's metric (evaluate/tasks.PRIMARY_METRIC, else acc)"}
    if types is not None:
        result["cache_types"] = cache_types
        result["engine"] = "llama.cpp" if settings.engine == "llamacpp" else "transformers"
    if settings.max_cache_bytes is not None:
        best, advice = recommend(points_from_sweep(result), settings.max_cache_bytes, settings.max_ratio)
        result["recommendation"] = {"max_cache_bytes": settings.max_cache_bytes, "max_ratio": settings.max_ratio,
                                    "advice": advice,
                                    "point": best.as_dict() if best else None}
    return result


def _llamacpp_tasks(settings: SweepSettings, tokenizer):
    """score(model_file, cache, run_flags) -> (mean, stderr) of the tasks' metrics, in llama.cpp under that cache."""
    from .engines.llamacpp_lm import LlamaCppLM, yarn_kwargs
    from .evaluate.lmeval import run_lm_eval, task_mean

    def score(model_file, cache, run_flags):
        engine = LlamaCppLM(str(model_file), tokenizer, cache, n_ctx=4096, **yarn_kwargs(run_flags))
        try:
            return task_mean(run_lm_eval(engine, settings.tasks, settings.task_data, limit=settings.limit,
                                         seed=settings.seed))
        finally:
            engine.close()

    return score


def _score(path, gguf_file, windows, dtype, device, settings, name, cache_types=None, tokenizer=None) -> dict:
    model = load_model(path, gguf_file, dtype, device)
    ppl = perplexity(model, windows, settings.eval_batch_size, settings.progress, desc=f"perplexity ({name})")
    benchmark = None
    if settings.tasks and settings.engine == "transformers":
        from .evaluate.lmeval import run_lm_eval, task_mean

        benchmark = task_mean(run_lm_eval(model, settings.tasks, settings.task_data, limit=settings.limit,
                                          seed=settings.seed, tokenizer=tokenizer, batch_size=settings.eval_batch_size))
    through = None
    if cache_types:
        from .evaluate.quantized_cache import cache_perplexity

        through = {t: cache_perplexity(model, windows, t, progress=settings.progress) for t in cache_types}
    cache, _ = prefill(model, context_ids(windows, 256).to(device), 256)
    measured = cache_tensors_bytes(cache) / (model.config.num_hidden_layers * 256 * model.dtype.itemsize)
    point = {
        "model": path if not gguf_file else f"{path}/{gguf_file}",
        "perplexity": ppl["perplexity"],
        "values_per_token_per_layer": cached_values_per_token_per_layer(model.config),
        "measured_values_per_token_per_layer": measured,
        "attention_bias": bool(getattr(model.config, "attention_bias", False)),
    }
    if through is not None:
        point["cache_types"] = through
    if benchmark is not None:
        point["benchmark"] = benchmark
    del model, cache
    gc.collect()
    return point


def markdown(result: dict) -> str:
    orig = result["original"]
    conv = result.get("conversion", {})
    lines = [
        f"# Perplexity vs KV cache ({result['eval_tokens']} held-out tokens)",
        "",
        f"Each latent converted as `transmla-tool convert --target {conv.get('target', '?')} --biases "
        f"{conv.get('biases', '?')}` writes it; a size that target's engine refuses is converted anyway and "
        "marked in its column.",
        "",
        "| latent + rope | cache values/token/layer | cache fraction | perplexity | ratio to original | vLLM MLA size | SGLang size (read, not run) |"
        + (" benchmark mean |" if "benchmark" in orig else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if "benchmark" in orig else ""),
        f"| original | {orig['values_per_token_per_layer']} | 1.000 | {orig['perplexity']:.3f} | 1.000 | | |"
        + _mean_cell(orig),
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['latent_dim']} + {p['rope_dim']} | {p['values_per_token_per_layer']} | "
            f"{p['values_per_token_per_layer'] / orig['values_per_token_per_layer']:.3f} | "
            f"{p['perplexity']:.3f} | {p['perplexity'] / orig['perplexity']:.3f} | "
            f"{'yes' if p.get('vllm_size_ok') else 'no'} | {'yes' if p.get('sglang_size_ok') else 'no'} |"
            + _mean_cell(p)
        )
    if "cache_types" in result:
        originals = result["cache_types"]["original"]
        reference = reference_cache(originals)
        if result.get("engine") == "transformers":
            lines += ["", "## Quality per cache byte in transformers (its exact and quantized caches)", "",
                      f"Ratio: perplexity read through each cache over the original's through the exact {reference} "
                      "cache on the same windows (evaluate/quantized_cache.py says how).", ""]
        else:
            lines += ["", "## Quality per cache byte in llama.cpp (its cache types, flash attention on)", "",
                      "Ratio: llama.cpp perplexity over the original's with an f16 cache on the same text (the "
                      "original as its GGUF re-typed to F32, each latent exported f32).", ""]
        lines += markdown_table(points_from_sweep(result), originals[reference]["bytes"], "ratio")
    if "benchmark" in result:
        limit = result["benchmark"]["limit"]
        rows = f" on their first {limit:g} rows" if limit else " on every row"
        lines += ["", f"Benchmark mean: lm-eval's {', '.join(result['benchmark']['tasks'])}{rows}, in the same engine "
                  "and cache."]
    if "recommendation" in result:
        lines += ["", f"**Recommendation:** {result['recommendation']['advice']}."]
    return "\n".join(lines) + "\n"


def _mean_cell(point: dict) -> str:
    mean = point.get("benchmark")
    return f" {mean[0]:.4f} ± {mean[1]:.4f} |" if mean else ""


def plot(result: dict, path: Path) -> None:
    if "cache_types" in result:
        originals = result["cache_types"]["original"]
        plot_frontier(points_from_sweep(result), originals[reference_cache(originals)]["bytes"], path,
                      f"perplexity per KV-cache byte in {result.get('engine', 'llama.cpp')}")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orig = result["original"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ropes = list(dict.fromkeys(p["rope_dim"] for p in result["points"]))
    for rope in ropes:
        mine = [p for p in result["points"] if p["rope_dim"] == rope]
        ax.plot([p["values_per_token_per_layer"] for p in mine], [p["perplexity"] for p in mine], marker="o",
                label="converted (training-free)" + (f", rope {rope}" if len(ropes) > 1 else ""))
    ax.axhline(orig["perplexity"], color="gray", linestyle="--", label="original")
    ax.axvline(orig["values_per_token_per_layer"], color="gray", linestyle=":", linewidth=0.8)
    for p in result["points"]:
        ax.annotate(f"{p['latent_dim']}+{p['rope_dim']}", (p["values_per_token_per_layer"], p["perplexity"]),
                    fontsize=8, textcoords="offset points", xytext=(3, 3))
    servable = [p for p in result["points"] if p.get("vllm_size_ok")]
    if servable:
        ax.scatter([p["values_per_token_per_layer"] for p in servable], [p["perplexity"] for p in servable], s=120,
                   facecolors="none", edgecolors="tab:green", zorder=3, label="a size vLLM's MLA serves")
    ax.set_xlabel("KV cache values per token per layer")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

