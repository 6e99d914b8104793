"""Build a local lm-eval multiple-choice task from any text file (no hub needed).

Cloze: each example is the first words of a sentence; the choices are its true ending and the
endings of other sentences from the same text. A model that predicts the text well picks the true
ending; its accuracy is comparable across models that share a tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ..data import iter_documents

TEMPLATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def sentences(text_spec: str) -> list[str]:
    out = []
    for doc in iter_documents(text_spec):
        for sent in re.split(r"(?<=[.!?])\s+", doc):
            words = sent.split()
            if 10 <= len(words) <= 40:
                out.append(" ".join(words))
    return out


def build_cloze_task(text_spec: str, directory: str | Path, name: str = "local_cloze", examples: int = 200,
                     choices: int = 4, seed: int = 0) -> Path:
    """Write `<directory>/<name>.yaml` and its data; return the directory (an lm-eval include path)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pool = sentences(text_spec)
    if len(pool) < choices + 1:
        raise ValueError(f"{text_spec} has too few sentences of 10-40 words for a cloze task")
    rng = random.Random(seed)
    picked = rng.sample(pool, min(examples, len(pool)))
    rows = []
    for sent in picked:
        words = sent.split()
        cut = len(words) // 2
        others = rng.sample([s for s in pool if s != sent], choices - 1)
        endings = [" ".join(words[cut:])] + [" ".join(o.split()[len(o.split()) // 2 :]) for o in others]
        order = list(range(choices))
        rng.shuffle(order)
        rows.append({"context": " ".join(words[:cut]), "choices": [endings[i] for i in order],
                     "answer": order.index(0)})
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / f"{name}.yaml").write_text(TEMPLATE.format(name=name, data=data.resolve()))
    return directory
