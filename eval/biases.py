"""How much a model's attention biases carry, and how far from constant its attention inputs are.

No stock engine path holds attention biases (vLLM's and llama.cpp's DeepSeek attention have none), so a bias-free
output of a biased source (Qwen2.5) must do without them. This measures, in transformers on held-out text:
1. the original's perplexity with its q, k or v biases (or all three) set to zero: what dropping them costs;
2. per layer, how well a linear map of the attention input reproduces the constant 1 (the least-squares direction
   u, fitted on calibration text, scored on held-out text): what ops/bias_fold.py can fold exactly.

    python eval/biases.py --model qwen2.5-coder-1.5b --output-dir runs/biases
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transmla_tool.data import token_windows
from transmla_tool.evaluate.models import load_model, load_tokenizer
from transmla_tool.evaluate.perplexity import perplexity
from transmla_tool.ops.bias_fold import RIDGE
from transmla_tool.registry import MODELS, model_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(MODELS))
    parser.add_argument("--output-dir", default="runs/biases")
    parser.add_argument("--data-dir", default=None, help="domain splits of an earlier run (default <output-dir>/data)")
    parser.add_argument("--windows", type=int, default=6, help="held-out windows of 512 tokens per domain")
    args = parser.parse_args()
    from transmla_tool.assets import domain_splits

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir) if args.data_dir else out / "data"
    if not (data / "docs-heldout.jsonl").exists():
        domain_splits(data)
    directory, gguf = model_gguf(args.model)
    tokenizer = load_tokenizer(directory, gguf)
    model = load_model(directory, gguf, torch.float32, torch.device("cpu"))
    heldout = {d: token_windows(str(data / f"{d}-heldout.jsonl"), tokenizer, 512, args.windows)
               for d in ("docs", "news")}
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias") and "self_attn" in n}
    if not saved:
        raise SystemExit(f"{args.model} has no attention biases")
    largest = {k: max(float(saved[n].abs().max()) for n in saved if f"{k}_proj" in n)
               for k in ("q", "k", "v") if any(f"{k}_proj" in n for n in saved)}
    result = {"model": args.model, "max_abs_bias": largest}
    result["perplexity"] = {}
    for label, drop in (("all biases", ()), ("no v bias", ("v",)), ("no k bias", ("k",)), ("no q bias", ("q",)),
                        ("no biases", ("q", "k", "v"))):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in saved:
                    param.copy_(torch.zeros_like(param) if any(f"{x}_proj" in name for x in drop) else saved[name])
        result["perplexity"][label] = {d: perplexity(model, w, 2, False)["perplexity"] for d, w in heldout.items()}
        print(label, json.dumps(result["perplexity"][label]), flush=True)
    result["constant_direction"] = constant_direction_fit(model, tokenizer, data)
    (out / "biases.json").write_text(json.dumps(result, indent=2))


def constant_direction_fit(model, tokenizer, data: Path) -> list[dict]:
    """Per layer: u fitted on 18 calibration windows (news, forum, code; the ridge of ops/bias_fold.py), then
    E[(u.x - 1)^2] on them and on 3 held-out docs windows, and the held-out spread of u.x."""
    calib = torch.cat([token_windows(str(data / f"{d}-calib.jsonl"), tokenizer, 512, 6)
                       for d in ("news", "forum", "code")])
    held = token_windows(str(data / "docs-heldout.jsonl"), tokenizer, 512, 3)
    captured: dict[int, list] = {}
    hooks = [layer.input_layernorm.register_forward_hook(
        lambda mod, inp, out, i=i: captured.setdefault(i, []).append(out.reshape(-1, out.shape[-1]).double()))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for batch in calib.split(3):
            model(batch)
        n_calib = len(captured[0])
        for batch in held.split(3):
            model(batch)
    for hook in hooks:
        hook.remove()
    rows = []
    for i in sorted(captured):
        xs, xh = torch.cat(captured[i][:n_calib]), torch.cat(captured[i][n_calib:])
        second, mean = xs.T @ xs / len(xs), xs.mean(0)
        u = torch.linalg.solve(second + RIDGE * second.diagonal().mean() * torch.eye(len(mean), dtype=xs.dtype), mean)
        rows.append({"layer": i, "calib_mse": float(((xs @ u - 1) ** 2).mean()),
                     "heldout_mse": float(((xh @ u - 1) ** 2).mean()), "heldout_std": float((xh @ u).std())})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
