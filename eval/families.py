"""Qwen3's q/k-norm approximation, measured: small Qwen3 and Llama models trained here, converted alike.

No real Qwen3 checkpoint installs offline, so this trains two small models of the same shape on the same
offline text (the calibration halves of the four domains of transmla_tool.assets: news, forum, code, docs)
with the same seed and steps: a Qwen3 (per-head q/k RMSNorms before RoPE) and a Llama control (none).
Both are converted with the same method and calibration (news only), at full rank and at half the cache,
and scored on the held-out halves of forum, code and docs (text the calibration never saw; news is shown,
labelled in-domain). The q/k-norm cost is Qwen3's ratio divided by the Llama control's ratio.

    python eval/families.py --output-dir runs/families              # ~20 min on 2 CPU cores
    python eval/families.py --output-dir runs/families --methods default+query_norm=fold   # the query norm folded too
    python eval/families.py --output-dir runs/families --table-only

Models and the tokenizer are cached under <output-dir>; rows are appended to <output-dir>/families.jsonl
keyed by (family, cache, method, domain), so a rerun resumes.
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

from transmla_tool.assets import DOMAINS, domain_splits  # noqa: E402
from transmla_tool.convert import ConvertSettings, convert  # noqa: E402
from transmla_tool.data import token_windows  # noqa: E402
from transmla_tool.evaluate.perplexity import perplexity  # noqa: E402
from transmla_tool.methods import resolve_method  # noqa: E402

FAMILIES = ("llama", "qwen3")
SCORED = ("forum", "code", "docs")  # never in the calibration text
# One KV head, so that at full rank with rope_dim = head_dim the Llama control converts exactly (the rotary key
# is its key): Qwen3's full-rank ratio is then the cost of the q/k-norm approximation alone.
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64)
HEAD_DIM, CACHE = SHAPE["head_dim"], 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
BUDGETS = {"full": (CACHE - HEAD_DIM, HEAD_DIM), "half": (CACHE // 2 - HEAD_DIM // 2, HEAD_DIM // 2)}  # (latent, rope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/families")
    parser.add_argument("--steps", type=int, default=600,
                        help="training steps per model (batch 16 x 128: ~3 passes over the text; more overfits)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--methods", default="default,closed-form",
                        help="comma-separated methods, each a preset with optional settings after '+', e.g. "
                             "default+query_norm=fold (rows are keyed by this spelling)")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--eval-windows", type=int, default=48, help="held-out windows of 256 tokens per domain")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--probe-query-norm", action="store_true",
                        help="print, per layer of the trained Qwen3, the query fold error with per-head scales alone "
                             "and after one RMSNorm over the whole query (what the q_lora path of query_norm=keep does)")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "families.jsonl"
    if not args.table_only:
        splits = domain_splits(out / "data")
        tokenizer = _tokenizer(out / "tokenizer", splits, args.vocab)
        for family in FAMILIES:
            model_dir = _trained(out / "models" / family, family, tokenizer, splits, args.steps)
            for method in args.methods.split(","):
                for cache, (latent, rope) in BUDGETS.items():
                    _measure(results, out, family, model_dir, tokenizer, splits, method, cache, latent, rope, args)
    print(table(_read(results)))
    if args.probe_query_norm:
        probe_query_norm(out / "models" / "qwen3", domain_splits(out / "data")["forum"][1])


@torch.no_grad()
def probe_query_norm(model_dir: Path, text: Path, windows: int = 16) -> None:
    """Relative error of the folded query against Qwen3's per-head-normalized query on `text`, per layer:
    per-head scales alone (what convert does) and a global RMSNorm over all heads first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = token_windows(str(text), AutoTokenizer.from_pretrained(model_dir), 256, windows)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: inputs.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    model(ids)
    for hook in hooks:
        hook.remove()
    heads, dim = model.config.num_attention_heads, model.config.head_dim
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q = (inputs[i].reshape(-1, inputs[i].shape[-1]) @ attn.q_proj.weight.T).view(-1, heads, dim)  # (T, H, D)
        eps = attn.q_norm.variance_epsilon
        true = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * attn.q_norm.weight
        errors = []
        for base in (q, q * torch.rsqrt(q.pow(2).mean((-1, -2), keepdim=True) + eps)):
            u = base * attn.q_norm.weight
            scale = (u * true).sum((0, 2)) / u.pow(2).sum((0, 2))  # least-squares per-head scale
            errors.append(float((u * scale[None, :, None] - true).norm() / true.norm()))
        print(f"layer {i}: query fold error, per-head scales {errors[0]:.3f}; global norm first {errors[1]:.3f}")


def _tokenizer(path: Path, splits, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not (path / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        texts = [json.loads(line)["text"] for calib, _ in splits.values() for line in calib.read_text().splitlines()]
        tok.train_from_iterator(texts, trainer)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _config(family: str, vocab: int):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(SHAPE, vocab_size=vocab, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3":
        return Qwen3Config(**common, use_sliding_window=False)
    return LlamaConfig(**common)


def _trained(path: Path, family: str, tokenizer, splits, steps: int) -> Path:
    """A model of `family` trained on the calibration halves of every domain (same seed, data, steps)."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    spec = ",".join(f"{calib}=1" for calib, _ in splits.values())
    windows = token_windows(spec, tokenizer, 128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, len(tokenizer)), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    for step in range(steps):
        batch = windows[torch.randint(0, windows.shape[0], (16,), generator=gen)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"{family} step {step}: loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _scores(model_dir, tokenizer, splits, windows: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {d: perplexity(model, token_windows(str(splits[d][1]), tokenizer, 256, windows), progress=False)["perplexity"]
            for d in DOMAINS}


def _method(spec: str):
    """A method spelled PRESET[+NAME=VALUE...] (the --set overrides of `transmla-tool convert`)."""
    name, *overrides = spec.split("+")
    return resolve_method(name, overrides)


def _measure(results, out, family, model_dir, tokenizer, splits, method, cache, latent, rope, args) -> None:
    done = {(r["family"], r["cache"], r["method"], r["domain"]) for r in _read(results)}
    if all((family, cache, method, d) in done for d in DOMAINS):
        return
    original = _scores(model_dir, tokenizer, splits, args.eval_windows)
    target = out / "converted" / f"{family}-{method}-{cache}"
    start = time.time()
    summary = convert(ConvertSettings(
        model=str(model_dir), output=str(target), latent_dim=latent, rope_dim=rope,
        calib_data=str(splits["news"][0]), calib_samples=args.calib_samples, calib_seq_len=256, dtype="float32",
        device="cpu", method=_method(method), method_name=method.split("+")[0], overwrite=True, progress=False,
        target="transformers"))
    seconds = time.time() - start
    converted = _scores(target, tokenizer, splits, args.eval_windows)
    folds = [layer["qk_norm_fold"]["fold_error"] for layer in summary["layers"] if "qk_norm_fold" in layer]
    for domain in DOMAINS:
        _append(results, {
            "family": family, "cache": cache, "method": method, "domain": domain,
            "latent": latent, "rope_dim": rope, "steps": args.steps,
            "cache_values": summary["cache_values_per_token_per_layer"],
            "original_ppl": round(original[domain], 4), "converted_ppl": round(converted[domain], 4),
            "ratio": round(converted[domain] / original[domain], 4),
            "in_domain": domain == "news", "convert_seconds": round(seconds, 1),
            "q_fold_error_mean": round(sum(folds) / len(folds), 4) if folds else None,
        })
    shutil.rmtree(target, ignore_errors=True)


def table(rows: list[dict]) -> str:
    """Ratio per family, cache and domain, and Qwen3's cost over the Llama control on unseen text."""
    by = {(r["family"], r["cache"], r["method"], r["domain"]): r for r in rows}
    lines = ["| method | cache | family | original ppl (forum / code / docs) | ratio news (in-domain) | "
             "ratio forum | ratio code | ratio docs | worst unseen |", "|---|---|---|---|---|---|---|---|---|"]
    costs = []
    for method in sorted({r["method"] for r in rows}):
        for cache in ("full", "half"):
            worst = {}
            for family in FAMILIES:
                cells = [by.get((family, cache, method, d)) for d in DOMAINS]
                if None in cells:
                    continue
                worst[family] = max(c["ratio"] for c in cells if c["domain"] in SCORED)
                values = cells[0]["cache_values"]
                lines.append(
                    f"| {method} | {cache} ({values['converted']} of {values['original']}) | {family} | "
                    + " / ".join(f"{c['original_ppl']:.2f}" for c in cells if c["domain"] in SCORED)
                    + f" | {cells[0]['ratio']:.3f} | "
                    + " | ".join(f"{c['ratio']:.3f}" for c in cells if c["domain"] in SCORED)
                    + f" | {worst[family]:.3f} |")
            if len(worst) == 2:
                costs.append(f"- {method}, {cache} cache: Qwen3 worst unseen ratio / Llama control's = "
                             f"{worst['qwen3']:.3f} / {worst['llama']:.3f} = {worst['qwen3'] / worst['llama']:.3f}x")
    return "\n".join(lines + [""] + costs)


if __name__ == "__main__":
    main()
