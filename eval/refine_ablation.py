"""Layer-local refinement settings compared on a few real layers, in seconds instead of a conversion.

The refinement is most of the default conversion's time (docs/speed.md). Judging a cheaper setting on the
cross-domain matrix costs one conversion per setting (10-35 minutes on 2 CPU cores); this script first
captures, once, the refinement problem of a few SmolLM2-135M layers as the default conversion poses it (128 +
64, news calibration: the closed-form start, the calibration inputs and the source block's outputs), plus the
source block's inputs and outputs on held-out windows of every domain. Then each configuration runs the same
`refine()` the conversion calls, on the same problem, and is scored by the layer-local relative error on each
domain's held-out windows (news: the refinement's own held-out calibration windows).

    python eval/refine_ablation.py --output-dir runs/refine-ablation --layers 3,15,25 \\
        --configs "default;batch1 300=refine_batch=1,refine_steps=300;q64=refine_queries=64"

A configuration is `NAME[=field=value,...]` over the Method's refine_* fields (the default method's values
otherwise). Rows go to <output-dir>/ablation.jsonl (resumable by layer and name); `--threads N` times a setting
under N torch threads. A layer-local error is not perplexity: a candidate that looks close here still needs
its cross-domain row (eval/crossdomain.py), which is what docs/quality.md reports.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quality import _append, _read  # noqa: E402

import transmla_tool.layer as layer_module  # noqa: E402
from transmla_tool.assets import DOMAINS, domain_splits, smollm2_gguf  # noqa: E402
from transmla_tool.convert import ConvertSettings, convert_many  # noqa: E402
from transmla_tool.data import token_windows  # noqa: E402
from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.methods import resolve_method  # noqa: E402
from transmla_tool.ops.refine import evaluate, refine  # noqa: E402

REFINE_FIELDS = {"refine_steps": "steps", "refine_lr": "lr", "refine_batch": "batch", "refine_queries": "queries"}
HELDOUT_WINDOWS = 16


def parse(text: str) -> tuple[str, dict, dict]:
    """NAME[=field=value,...] -> (name, the settings given, every refine() keyword of the default method with them);
    a field other than REFINE_FIELDS, or a value the Method refuses, stops the run."""
    name, _, sets = text.partition("=")
    overrides = [item for item in sets.split(",") if item]
    fields = [item.partition("=")[0] for item in overrides]
    for key in fields:
        if key not in REFINE_FIELDS:
            raise SystemExit(f"--configs {text!r}: {key!r} is not one of {', '.join(REFINE_FIELDS)}")
    try:
        method = resolve_method("default", overrides)
    except UserError as exc:
        raise SystemExit(f"--configs {text!r}: {exc}") from None
    given = {REFINE_FIELDS[key]: getattr(method, key) for key in fields}
    return name.strip(), given, {arg: getattr(method, key) for key, arg in REFINE_FIELDS.items()}


def capture(out: Path, layers: set[int], latent_dim: int, rope_dim: int, calib_samples: int) -> None:
    """Write <out>/L{i}.pt (the refinement problem) and <out>/L{i}-{domain}.pt (held-out inputs/targets)."""
    splits = domain_splits(out / "data")
    model_dir, gguf = smollm2_gguf()
    real_refine = layer_module.refine

    def closed_form_only(mla, x, y, cos, sin, **kwargs):
        index = kwargs["seed"]  # the conversion seeds each layer's refinement with its index (seed 0)
        if index in layers:
            keep = {k: v for k, v in kwargs.items() if k not in ("teacher", "cache_store")}
            torch.save({"mla": mla, "x": x.clone(), "y": y.clone(), "cos": cos, "sin": sin, "kwargs": keep},
                       out / f"L{index}.pt")
        return real_refine(mla, x, y, cos, sin, **{**kwargs, "steps": 0, "value_solve": 0})

    layer_module.refine = closed_form_only
    try:
        convert_many(ConvertSettings(
            model=model_dir, gguf_file=gguf, output="", latent_dim=latent_dim, rope_dim=rope_dim,
            calib_data=str(splits["news"][0]), calib_samples=calib_samples, calib_seq_len=512, dtype="float32",
            device="cpu", overwrite=True, target="transformers", method=resolve_method("default"),
            method_name="default"), {latent_dim: str(out / "converted")})
    finally:
        layer_module.refine = real_refine
        shutil.rmtree(out / "converted", ignore_errors=True)  # only the captured problems are kept
    from transformers import AutoModelForCausalLM

    from transmla_tool.gguf_tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(model_dir, gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, dtype=torch.float32).eval()
    for domain in DOMAINS:
        if domain == "news":
            continue  # news is scored on the refinement's own held-out calibration windows
        ids = token_windows(str(splits[domain][1]), tokenizer, 512, HELDOUT_WINDOWS)
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
            position = model.model.rotary_emb(hidden[0], torch.arange(ids.shape[1])[None])
            for i in layers:
                block = model.model.layers[i]
                x = block.input_layernorm(hidden[i])
                y = block.self_attn(x, position_embeddings=position, attention_mask=None)[0]
                torch.save({"x": x, "y": y}, out / f"L{i}-{domain}.pt")


def score(mla, problem: dict, heldout: dict) -> dict:
    """Relative error of the block output per domain."""
    hold = problem["kwargs"]["holdout"]
    cells = {"news": evaluate(mla, problem["x"][-hold:], problem["y"][-hold:], problem["cos"], problem["sin"], 4)}
    for domain, data in heldout.items():
        cells[domain] = evaluate(mla, data["x"], data["y"], problem["cos"], problem["sin"], 4)
    return {k: round(v, 5) for k, v in cells.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/refine-ablation")
    parser.add_argument("--layers", default="3,15,25")
    parser.add_argument("--configs", default="default", help="';'-separated NAME[=refine_field=value,...]")
    parser.add_argument("--latent-dim", type=int, default=128)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads while refining (0: torch's choice)")
    args = parser.parse_args()
    configs = [parse(c) for c in args.configs.split(";") if c.strip()]
    layers = sorted({int(i) for i in args.layers.split(",")})
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = {"latent_dim": args.latent_dim, "rope_dim": args.rope_dim, "calib_samples": args.calib_samples}
    record = out / "capture.json"
    if record.exists() and json.loads(record.read_text()) != made:
        raise SystemExit(f"{out} holds problems captured with {record.read_text().strip()}, not {json.dumps(made)}: "
                         "use another --output-dir")
    record.write_text(json.dumps(made))
    missing = {i for i in layers if not (out / f"L{i}.pt").exists()
               or any(not (out / f"L{i}-{d}.pt").exists() for d in DOMAINS if d != "news")}
    if missing:
        capture(out, missing, args.latent_dim, args.rope_dim, args.calib_samples)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = out / "ablation.jsonl"
    done = {(r["layer"], r["config"]) for r in _read(results)}
    for i in layers:
        problem = torch.load(out / f"L{i}.pt", weights_only=False)
        heldout = {d: torch.load(out / f"L{i}-{d}.pt") for d in DOMAINS if d != "news"}
        start = problem["mla"].to(torch.float32)
        if (i, "closed form") not in done:
            _append(results, {"layer": i, "config": "closed form", "seconds": 0.0, **score(start, problem, heldout)})
        for name, overrides, settings in configs:
            if (i, name) in done:
                continue
            kwargs = {**problem["kwargs"], **settings}
            began = time.time()
            refined, _ = refine(start, problem["x"], problem["y"], problem["cos"], problem["sin"], **kwargs)
            seconds = round(time.time() - began, 2)
            _append(results, {"layer": i, "config": name, "overrides": overrides, "threads": torch.get_num_threads(),
                              "seconds": seconds, **score(refined, problem, heldout)})
    write_table(results, out / "ablation.md")


def write_table(results: Path, table: Path) -> None:
    rows = _read(results)
    lines = ["| layer | config | seconds | " + " | ".join(DOMAINS) + " |", "|---" * (3 + len(DOMAINS)) + "|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['config']} | {r['seconds']:.1f} | "
                     + " | ".join(f"{r[d]:.4f}" for d in DOMAINS) + " |")
    table.write_text("\n".join(lines) + "\n")
    print(json.dumps({"table": str(table)}))


if __name__ == "__main__":
    main()
