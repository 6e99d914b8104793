"""Benchmarks through lm-eval's own harness, identical settings for both models, and their comparison.

Each requested task (or group, e.g. mmlu) gives its metrics, lm-eval's stderr of each, the number of rows
scored, the few-shot count and where its data came from (evaluate/tasks.py), and the per-row scores of its
leaf tasks: with those, a difference between two models scored on the same rows gets the stderr of the paired
difference, and is called a loss or a win only where it exceeds 1.96 of those (95%).
"""

from __future__ import annotations

import inspect
import math

from ..errors import UserError

Z95 = 1.96


def run_lm_eval(lm, tasks: list[str], task_data, *, limit: int | float | None = None, num_fewshot: int | None = None,
                seed: int = 0, tokenizer=None, batch_size: int = 4, metadata: dict | None = None,
                indices: list[int] | None = None) -> dict:
    """{task: {"metrics", "stderr", "rows", "num_fewshot", "higher_is_better", "samples", "doc_ids", "data"}}.

    lm: an lm-eval LM, or a transformers model (wrapped in lm-eval's HFLM with `tokenizer`). task_data: the
    evaluate/tasks.py resolution (include paths and each task's provenance). samples: per metric, each row's 0/1
    score in row order (any metric whose rows all score 0 or 1: accuracies, RULER's per-length matches); doc_ids:
    the rows' indices in that order. `indices` (instead of `limit`): score those rows of every task, e.g. the next
    ten after a first run's ten; tasks must then be leaf tasks (lm-eval indexes rows per leaf)."""
    try:
        import lm_eval
        from lm_eval.api.model import LM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise UserError("lm-eval is not installed; pip install 'transmla-tool[eval]' or drop --tasks") from exc

    if not isinstance(lm, LM):
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=lm, tokenizer=tokenizer, batch_size=batch_size, device=str(next(lm.parameters()).device))
    # metadata: what synthetic tasks are built from (RULER: max_seq_lengths, the tokenizer that sizes them)
    manager = TaskManager(include_path=task_data.include_paths or None, metadata=metadata)
    chosen = {}
    if indices is not None:
        if limit is not None:
            raise ValueError("run_lm_eval: give limit or indices, not both")
        if "samples" not in inspect.signature(lm_eval.simple_evaluate).parameters:
            raise UserError(f"lm-eval {getattr(lm_eval, '__version__', '')} cannot score chosen rows; "
                            "pip install -U 'lm-eval[ruler]'")
        chosen = {"samples": {task: list(indices) for task in tasks}}
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            log_samples=True, bootstrap_iters=1000, **chosen,
        )
    except (ValueError, FileNotFoundError, KeyError) as exc:  # a task's data: empty, missing split, bad file
        detail = " ".join(str(exc).split())[:300]
        sources = ", ".join(sorted({str(v.get("data")) for v in task_data.provenance.values()}))
        raise UserError(f"lm-eval could not read the data of {', '.join(tasks)} ({type(exc).__name__}: {detail}); "
                        f"check --task-data ({sources})") from exc
    out = {}
    for task in tasks:
        leaves = _leaves(results, task)
        scores = results.get("groups", {}).get(task) or results["results"][task]
        metrics, stderr = {}, {}
        for key, value in scores.items():
            name, _, _ = key.partition(",")
            if name.endswith("_stderr"):
                stderr[name[: -len("_stderr")]] = value if isinstance(value, (int, float)) else None
            elif name not in ("alias", "sample_len", "samples", "name") and isinstance(value, (int, float)):
                metrics[name] = float(value)
        rows = sum(results["n-samples"][leaf]["effective"] for leaf in leaves)
        if rows == 0:
            raise UserError(f"lm-eval scored no rows of {task}: its data is empty or the limit is 0")
        out[task] = {
            "metrics": metrics, "stderr": {k: v for k, v in stderr.items() if k in metrics},
            "rows": rows, "rows_available": sum(results["n-samples"][leaf]["original"] for leaf in leaves),
            "num_fewshot": sorted({results["n-shot"].get(leaf) for leaf in leaves} - {None}),
            "higher_is_better": {m: results["higher_is_better"].get(leaves[0], {}).get(m) for m in metrics},
            "samples": _samples(results, leaves),
            "doc_ids": [sample["doc_id"] for sample in _logged(results, leaves)],
            "data": task_data.provenance.get(task, {}),
            "dataset": sorted({str(results["configs"][leaf].get("dataset_path")) for leaf in leaves}),
        }
    return out


def _leaves(results: dict, task: str) -> list[str]:
    """The leaf tasks lm-eval ran for a requested name (itself, or a group's subtasks, recursively)."""
    children = results.get("group_subtasks", {}).get(task)
    if not children:
        return [task]
    return [leaf for child in children for leaf in _leaves(results, child)]


def _logged(results: dict, leaves: list[str]):
    """The logged rows of the leaf tasks in (leaf, doc_id) order: the order of both `samples` and `doc_ids`."""
    for leaf in leaves:
        yield from sorted(results.get("samples", {}).get(leaf, []), key=lambda s: s["doc_id"])


def _samples(results: dict, leaves: list[str]) -> dict[str, str]:
    """Per-row 0/1 scores, as strings of '0'/'1' in (leaf, doc_id) order, for every metric whose rows all score 0 or
    1 (a metric with other values, or -1 for 'not this row' as RULER marks other lengths, is left out)."""
    out: dict[str, list[str]] = {}
    rejected: set[str] = set()
    for sample in _logged(results, leaves):
        for metric in set(sample) - {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps"}:
            value = sample.get(metric)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1):
                rejected.add(metric)
                continue
            out.setdefault(metric, []).append(str(int(value)))
    return {metric: "".join(values) for metric, values in out.items() if metric not in rejected}


def compare(original: dict, converted: dict) -> dict:
    """{task: {metric: {original, original_stderr, converted, converted_stderr, delta, delta_stderr, paired, verdict}}}
    for two runs of run_lm_eval on the same tasks and rows."""
    table = {}
    for task, a in original.items():
        b = converted.get(task)
        if b is None:
            continue
        if a["rows"] != b["rows"]:
            raise UserError(f"{task}: the models were scored on {a['rows']} and {b['rows']} rows; compare like with "
                            "like")
        table[task] = {}
        for metric, value in a["metrics"].items():
            if metric not in b["metrics"]:
                continue
            table[task][metric] = delta_entry(value, a["stderr"].get(metric), b["metrics"][metric],
                                              b["stderr"].get(metric), a["samples"].get(metric),
                                              b["samples"].get(metric), a["higher_is_better"].get(metric, True))
    return table


def delta_entry(a: float, se_a, b: float, se_b, rows_a: str | None, rows_b: str | None, higher_is_better) -> dict:
    """The difference b - a with its stderr: paired over rows when both per-row scores are known (the same rows),
    else from the two stderrs as if independent; called a win or loss only beyond 1.96 stderrs."""
    delta = b - a
    paired = bool(rows_a and rows_b and len(rows_a) == len(rows_b) and len(rows_a) > 1)
    if paired:
        diffs = [int(y) - int(x) for x, y in zip(rows_a, rows_b)]
        mean = sum(diffs) / len(diffs)
        var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        se = math.sqrt(var / len(diffs))
    elif se_a is not None and se_b is not None:
        se = math.sqrt(se_a**2 + se_b**2)
    else:
        se = None
    return {"original": a, "original_stderr": se_a, "converted": b, "converted_stderr": se_b, "delta": delta,
            "delta_stderr": se, "paired": paired, "verdict": verdict(delta, se, higher_is_better)}


def verdict(delta: float, se: float | None, higher_is_better) -> str:
    if se is None or not math.isfinite(delta):
        return "no stderr"
    if abs(delta) <= Z95 * se:
        return "within noise"
    better = delta > 0 if higher_is_better is not False else delta < 0
    return "win" if better else "loss"


def task_mean(results: dict) -> tuple[float, float]:
    """(mean, stderr) over run_lm_eval's tasks of each one's headline metric (evaluate/tasks.PRIMARY_METRIC; acc for
    others), the stderr treating the tasks as independent."""
    from .tasks import PRIMARY_METRIC

    values, errors = [], []
    for task, run in results.items():
        metric = PRIMARY_METRIC.get(task, "acc")
        if metric not in run["metrics"]:
            metric = next(m for m in ("acc", "acc_norm", "exact_match") if m in run["metrics"])
        values.append(run["metrics"][metric])
        errors.append(run["stderr"].get(metric) or 0.0)
    return sum(values) / len(values), math.sqrt(sum(e * e for e in errors)) / len(values)
