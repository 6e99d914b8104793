"""Benchmarks through lm-eval's own harness (HF backend), identical settings for both models."""

from __future__ import annotations

from ..errors import UserError


def run_lm_eval(model, tokenizer, tasks: list[str], *, limit: int | float | None = None,
                num_fewshot: int | None = None, include_path: str | None = None, batch_size: int = 4,
                seed: int = 0) -> dict:
    """{task: {metric: value}} for an already-loaded model (stderr entries dropped)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise UserError("lm-eval is not installed; pip install 'transmla-tool[eval]' or drop --tasks") from exc

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)}; check --tasks and --include-path")
    device = str(next(model.parameters()).device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        log_samples=False, bootstrap_iters=0,
    )
    out = {}
    for task, metrics in results["results"].items():
        clean = {}
        for key, value in metrics.items():
            name = key.split(",")[0]
            # lm-eval also reports bookkeeping (alias, sample_len): keep scores only
            if name.endswith("_stderr") or name in ("alias", "sample_len", "samples") or not isinstance(
                    value, (int, float)):
                continue
            clean[name] = float(value)
        out[task] = clean
    return out
