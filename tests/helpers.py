"""Reference computations shared by the tests."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from transmla_tool.data import iter_documents


def sample_ids(vocab: int, batch: int = 2, length: int = 48, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def logits(model_dir, ids) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def reference_logits(source_dir, natural: dict, output_dir, ids) -> torch.Tensor:
    """The source model with every attention replaced by the tool's reference MLA math on the
    natural-form weights: what the stock DeepSeek-V3 checkpoint must reproduce."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from transmla_tool.ops.mla import mla_attention

    target = AutoConfig.from_pretrained(output_dir)
    rotary = DeepseekV3RotaryEmbedding(target)
    cos, sin = (t[0] for t in rotary(torch.zeros(1), torch.arange(ids.shape[1])[None]))
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    for i, layer in enumerate(model.model.layers):
        weights = natural[i].to(torch.float32)

        def forward(hidden_states, *args, _w=weights, **kwargs):
            return mla_attention(hidden_states, _w, cos, sin), None

        layer.self_attn.forward = forward
    with torch.no_grad():
        return model(ids).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


# --- a user's own lm-eval task (a cloze task from any text): what --include-path tasks look like ------------

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
