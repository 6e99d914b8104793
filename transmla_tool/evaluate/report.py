"""report.json, report.md and PNG plots from an evaluation report dict."""

from __future__ import annotations

import json
from pathlib import Path

from ..engines.llamacpp import build_label


def _fmt(value, digits=2):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _engine_line(env: dict) -> list[str]:
    """The serving engine that measured, when not transformers; llama.cpp's with the CPU kernels it was built for
    (a quantized cache's perplexity moves with them)."""
    if env.get("engine", "transformers") == "transformers":
        return []
    return [f"- engine: {build_label(env['engine'], env.get('engine_cpu_kernels'))}"]


def markdown(report: dict) -> str:
    ppl, cache = report["perplexity"], report["kv_cache"]
    vals = cache["values_per_token_per_layer"]
    lines = [
        "# transmla-tool evaluation",
        "",
        f"- original: `{report['models']['original']['model']}`",
        f"- converted: `{report['models']['converted']['model']}`",
        f"- device {report['environment']['device']}, dtype {report['environment']['dtype']}, "
        f"torch {report['environment']['torch']}, transformers {report['environment']['transformers']}, "
        f"{report['environment']['wall_time_s']} s",
        *_engine_line(report["environment"]),
        "",
        f"## Perplexity ({ppl['tokens']} tokens of `{ppl['data']}`, windows of {ppl['seq_len']})",
        "",
        "| original | converted | ratio |",
        "|---|---|---|",
        f"| {ppl['original']:.3f} | {ppl['converted']:.3f} | {ppl['ratio']:.3f} |",
        "",
        "## KV cache",
        "",
        f"Values per token per layer: original {vals['original']}, converted {vals['converted']} "
        f"({1 - vals['converted'] / vals['original']:.0%} saved).",
        "",
        "| context | original measured | original analytic | converted measured | converted analytic | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for ctx, measured in cache["measured_bytes"].items():
        analytic = cache["analytic_bytes"][ctx]
        lines.append(
            f"| {ctx} | {_mib(measured['original'])} | {_mib(analytic['original'])} | "
            f"{_mib(measured['converted'])} | {_mib(analytic['converted'])} | "
            f"{measured['converted'] / measured['original']:.3f} |"
        )
    for warning in cache["warnings"]:
        lines += ["", f"**WARNING:** {warning}"]
    runs = list(next(iter(report["decode_tokens_per_s"].values()), {}))
    lines += [
        "",
        "## Decode speed (greedy, batch 1, median tokens/s after the context) and peak memory",
        "",
        "| context | " + " | ".join(f"{r} tok/s" for r in runs) + " | "
        + " | ".join(f"{r} peak MiB" for r in runs) + " |",
        "|---" * (1 + 2 * len(runs)) + "|",
    ]
    for ctx, speed in report["decode_tokens_per_s"].items():
        peak = report["peak_memory_mb"][ctx]
        lines.append(f"| {ctx} | " + " | ".join(_fmt(speed[r]) for r in runs) + " | "
                     + " | ".join(_fmt(peak[r], 0) for r in runs) + " |")
    kernel = {ctx: steps for ctx, steps in report.get("decode_steps", {}).items()
              if any(v.get("gpu_kernel_ms_per_step") is not None for v in steps.values())}
    if kernel:
        lines += ["", "GPU kernel time per decode step (ms, torch.profiler) beside wall time:", "",
                  "| context | " + " | ".join(f"{r} kernel / wall" for r in runs) + " |",
                  "|---" * (1 + len(runs)) + "|"]
        for ctx, steps in kernel.items():
            lines.append(f"| {ctx} | " + " | ".join(
                f"{_fmt(steps[r]['gpu_kernel_ms_per_step'], 3)} / {_fmt(steps[r]['step_ms_median'], 3)}"
                for r in runs) + " |")
    if report.get("cache_types"):
        reference = report.get("cache_types_reference", "f16")
        engine = ("llama.cpp cache types, flash attention on" if reference == "f16"
                  else "transformers' caches: the exact dynamic cache and QuantizedCache backends")
        lines += ["", f"## Perplexity per KV-cache byte ({engine})", "",
                  f"| model | cache | bytes/token/layer | perplexity | ratio to original with {reference} cache |",
                  "|---|---|---|---|---|"]
        for row in sorted(report["cache_types"], key=lambda r: -r["bytes_per_token_per_layer"]):
            lines.append(f"| {row['model']} | {row['cache']} | {row['bytes_per_token_per_layer']:.0f} | "
                         f"{row['perplexity']:.3f} | {row['ratio']:.3f} |")
    for note in report.get("notes", []):
        lines += ["", f"Note: {note}"]
    by_cache = report.get("lm_eval_by_cache") or {}
    if len(by_cache) > 1:
        lines += ["", "## lm-eval (stock task definitions) in llama.cpp, under each cache type"]
        for entry, table in by_cache.items():
            lines += ["", f"### Under the {entry} cache (llama.cpp)", "",
                      *lm_eval_table(table, report.get("lm_eval_tasks", {}))[2:]]
    elif "lm_eval" in report:
        lines += ["", *lm_eval_table(report["lm_eval"], report.get("lm_eval_tasks", {}))]
    return "\n".join(lines) + "\n"


def _pm(value, stderr) -> str:
    return _fmt(value, 4) + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")


def lm_eval_table(table: dict, tasks: dict) -> list[str]:
    """Per task and metric: both models with lm-eval's stderr, the difference with its stderr (paired over the same
    rows), and a verdict that calls a difference a win or a loss only beyond 1.96 stderrs."""
    lines = ["## lm-eval (stock task definitions)", "",
             "| task | metric | rows | shots | original | converted | delta (converted - original) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for task, metrics in table.items():
        info = tasks.get(task, {})
        rows = info.get("rows", "?")
        if info.get("rows_available") not in (None, rows):
            rows = f"{rows} of {info['rows_available']}"
        shots = ",".join(str(n) for n in info.get("num_fewshot", [])) or "?"
        for metric, v in metrics.items():
            lines.append(f"| {task} | {metric} | {rows} | {shots} | {_pm(v['original'], v['original_stderr'])} | "
                         f"{_pm(v['converted'], v['converted_stderr'])} | {_pm(v['delta'], v['delta_stderr'])} | "
                         f"{v['verdict']} |")
        data = info.get("data", {})
        where = data.get("data", "?") + "".join(f"; {n}" for n in data.get("notes", []))
        notes.append(f"{task}: {where}" + (f"; --limit {info['limit']:g}" if info.get("limit") else ""))
    lines += ["", "Delta stderr: of the paired per-row differences where both models scored the same rows (else "
              "from the two stderrs); a delta is a win or a loss only beyond 1.96 of it (95%), otherwise within "
              "noise. Data: " + " | ".join(notes)]
    return lines


def plots(report: dict, directory: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    contexts = [int(c) for c in report["kv_cache"]["measured_bytes"]]
    keys = [str(c) for c in contexts]
    engine = report.get("environment", {}).get("engine", "transformers")  # "transformers", "vllm 0.32.0", ...
    for name, title, series, ylabel in (
        ("cache_bytes.png", f"KV cache held by {engine}",
         {k: [report["kv_cache"]["measured_bytes"][c][k] / 2**20 for c in keys] for k in ("original", "converted")},
         "MiB"),
        ("decode_speed.png", f"Greedy decode speed in {engine} (batch 1)",
         {k: [report["decode_tokens_per_s"][c][k] for c in keys] for k in report["decode_tokens_per_s"][keys[0]]},
         "tokens / s"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for label, ys in series.items():
            ax.plot(contexts, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        report.setdefault("plot_titles", {})[name] = title
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / name, dpi=120)
        plt.close(fig)
        written.append(name)

    bars = {"perplexity": (report["perplexity"]["original"], report["perplexity"]["converted"])}
    for task, metrics in report.get("lm_eval", {}).items():
        for metric, v in metrics.items():
            bars[f"{task}\n{metric}"] = (v["original"], v["converted"] if v["converted"] is not None else 0.0)
    fig, axes = plt.subplots(1, len(bars), figsize=(2.6 * len(bars) + 1, 3.5), squeeze=False)
    for ax, (label, (a, b)) in zip(axes[0], bars.items()):
        ax.bar(["original", "converted"], [a, b], color=["tab:blue", "tab:orange"])
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(directory / "scores.png", dpi=120)
    plt.close(fig)
    written.append("scores.png")
    return written


def write_report(report: dict, directory: Path) -> None:
    """report.json, report.md and the plots into `directory` (eval stages it and renames it when complete)."""
    directory.mkdir(parents=True, exist_ok=True)
    report["plots"] = plots(report, directory)
    (directory / "report.json").write_text(json.dumps(report, indent=2))
    (directory / "report.md").write_text(markdown(report))
