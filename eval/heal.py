"""Healing benchmark: SmolLM2-135M converted at 128 + 64 of 384 cache values (--latent-dim, --rope-dim), distilled
from the original.

    python eval/heal.py --output-dir runs/heal-news --max-tokens 81920 --eval-every 10
    python eval/prepare_heal_data.py                 # once: Debian's linux-doc-6.1 text -> .data/linux-doc.jsonl
    python eval/heal.py --output-dir runs/heal-linux-doc --data .data/linux-doc.jsonl --max-tokens 81920 --eval-every 10
    python eval/heal.py --output-dir runs/heal-mix-code --data mix-code --max-tokens 40960 --eval-every 10

The conversion uses `transmla-tool convert`'s defaults (method `default`, 128 calibration windows);
`--calib-samples N` and `--set NAME=VALUE` (repeatable, as in `transmla-tool convert`) change them, e.g.
`--calib-samples 64 --set moment_shrinkage=0 --set refine_steps=100 --set refine_windows=64` for the
earlier default the README's "that default" rows were measured with. The settings are recorded in
<output-dir>/conversion.json; rerunning in the same directory with other settings is refused. A conversion made
elsewhere with the same settings and calibration text (eval/length.py's, 2 h at 8192-token windows on 2 cores) is
healed without converting again with `--converted DIR` (its record is checked against these flags first):

    python eval/heal.py --output-dir runs/heal8k --data mix-docs --latent-dim 128 --calib-seq-len 8192 \\
        --calib-samples 8 --set refine_batch=1 --target llamacpp --converted runs/length/ckpt/default-rope64-calib8192

`--data mix-DOMAIN` (DOMAIN one of news, forum, code, docs; see eval/crossdomain.py): the conversion
calibrates and the healing trains on an equal mix of the other three domains' calibration documents,
and the held-out perplexity is measured on DOMAIN's held-out documents, a kind of text neither step saw.

Training text: `news` (default) is the first 75% of gensim's lee_background articles, the split the
conversion calibrates on; any other local file or datasets spec works, e.g. Debian's linux-doc text
(technical prose, another domain). Held-out evaluation: the last 25% of the articles (the same split
as the demo and eval/quality.py), never trained on.
Writes <output-dir>/heal.md and heal.png (held-out perplexity vs tokens seen, original as a line)
from the training log; `--resume` continues an interrupted run from its last checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from transmla_tool.assets import DOMAINS, domain_splits, lee_corpus, split_documents
from transmla_tool.convert import ConvertSettings, convert
from transmla_tool.data import token_windows
from transmla_tool.devices import resolve_device
from transmla_tool.errors import UserError
from transmla_tool.evaluate.frontier import parse_cache_types
from transmla_tool.evaluate.models import load_model, load_tokenizer
from transmla_tool.evaluate.perplexity import perplexity
from transmla_tool.heal.settings import check_cache_type, check_repeat_share
from transmla_tool.heal.train import HealSettings, heal
from transmla_tool.io.resume import result_settings
from transmla_tool.methods import recorded_method, resolve_method
from transmla_tool.provenance import calibrated_on, converted_from
from transmla_tool.registry import MODELS, model_gguf



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/heal")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS),
                        help="the real model (transmla_tool/registry.py; `make models` fetches the ones not installed)")
    parser.add_argument("--target", default="transformers", choices=["transformers", "llamacpp", "vllm"],
                        help="as `convert --target`: llamacpp drops attention biases (Qwen2) for a checkpoint the "
                        "engines serve, the refinement absorbing them")
    parser.add_argument("--data", default="news", help="training text: `news` or a local file / datasets spec")
    parser.add_argument("--latent-dim", type=int, default=128)
    parser.add_argument("--rope-dim", type=int, default=64,
                        help="qk_rope_head_dim of the conversion (32 leaves the latent 32 more values at equal bytes)")
    parser.add_argument("--calib-samples", type=int, default=ConvertSettings.calib_samples)
    parser.add_argument("--calib-seq-len", type=int, default=ConvertSettings.calib_seq_len,
                        help="calibration window length of the conversion (`convert --calib-seq-len`): e.g. 8192 "
                        "with --calib-samples 8 and --set refine_batch=1 refines on queries at every distance "
                        "to 8192 (docs/long-context.md)")
    parser.add_argument("--converted", default=None, metavar="DIR",
                        help="a finished conversion of --model made with exactly this run's conversion settings and "
                        "calibration text (e.g. by eval/length.py, or frontier.py --keep-checkpoints), healed instead "
                        "of converting again: checked against its record, then copied into the run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                        help="override one setting of the `default` conversion method (repeatable)")
    parser.add_argument("--repeat-share", type=float, default=0.0,
                        help="share of the training windows rebuilt as their first half twice (heal --repeat-share)")
    parser.add_argument("--max-tokens", type=int, default=2_000_000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step: --batch-size 4 --grad-accum 4 is batch 16 in the "
                             "memory of 4")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations in the backward (heal --gradient-checkpointing): what keeps an "
                             "8192-token window in ~6 GB on SmolLM2 (docs/long-context.md)")
    parser.add_argument("--train", default="attention")
    parser.add_argument("--lm-weight", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0,
                        help="healing seed (the training text's shuffle order): another seed is a replicate run")
    parser.add_argument("--cache-type", default=None,
                        help="quantization-aware healing through this llama.cpp cache type (heal --cache-type); the "
                        "held-out perplexities logged during healing then read the same simulated cache")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--cache-types", default="",
                        help="after healing, place the conversion and the healed model on the frontier: llama.cpp "
                        "perplexity on the held-out text under these cache types (e.g. f16,q8_0,q4_0; the original "
                        "under the same types), beside the bytes each allocates (needs `make engines`)")
    parser.add_argument("--frontier-original-types", default=None,
                        help="the original's cache types on the frontier (default: --cache-types; f16, the "
                        "reference, always): e.g. f16 alone where its quantized caches were scored elsewhere")
    parser.add_argument("--frontier-chunks", type=int, default=16, help="llama-perplexity windows of --frontier-ctx")
    parser.add_argument("--frontier-ctx", type=int, default=512,
                        help="llama-perplexity window length of the frontier placement (the serving length); "
                             "kept in frontier.json at 512, frontier-<ctx>.json at any other length")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--eval-seq-len", type=int, default=None,
                        help="length of the held-out windows, the original's included (default: --seq-len): e.g. "
                        "heal at 512 and score at 8192, beside a run healed at 8192")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--save-total-limit", type=int, default=2,
                        help="resumable checkpoints kept, the newest (each holds the trained tensors and their "
                        "optimizer state: ~390 MB for SmolLM2's attention at fp32)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--rebalance", default=None, choices=["partial", "energy"],
                        help="also place the conversion and the healed model with their rotary keys brought to this "
                        "balance after the fact (`transmla-tool rebalance`, measured on the run's calibration text), "
                        "as extra rows (the same model again when the conversion already carries it, as the default "
                        "does)")
    parser.add_argument("--rebalanced-only", action="store_true",
                        help="with --rebalance, place only the balanced copies (e.g. a 4-bit cache at 8192 tokens, "
                        "where the balanced copy is the one served and each model costs ~18 minutes on 2 cores)")
    parser.add_argument("--device", default="auto",
                        help="where the conversion, the reference perplexity and the rebalancing run (auto: a GPU when "
                        "there is one); the healing itself runs where accelerate puts it")
    parser.add_argument("--frontier-models", default="converted,healed",
                        help="which of the run's models the llama.cpp placement scores beside the original (e.g. "
                        "`healed` alone: a 4-bit cache at 8192 tokens is ~18 minutes a model on 2 cores)")
    parser.add_argument("--frontier-only", action="store_true",
                        help="score a finished run's conversion and healed model under --cache-types again (e.g. a "
                        "cache type added later), without converting or healing")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.frontier_only and not args.cache_types:
        raise SystemExit("--frontier-only needs --cache-types")
    placed = [m for m in args.frontier_models.split(",") if m]
    if args.rebalanced_only and args.rebalance is None:
        raise SystemExit("--rebalanced-only needs --rebalance (partial or energy)")
    if not placed or set(placed) - {"converted", "healed"}:
        raise SystemExit(f"--frontier-models {args.frontier_models!r}: give converted, healed or both "
                         "(comma-separated)")
    for name in ("batch_size", "grad_accum", "save_total_limit"):  # not after the minutes of conversion
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    budget = args.latent_dim + args.rope_dim  # cached values per token per layer
    healed = healed_dir(Path(args.output_dir), budget)
    if args.frontier_only and not (healed / "healing.json").exists():
        raise SystemExit(f"--frontier-only: {healed} is not a finished healing run; run without --frontier-only")
    try:
        device = resolve_device(args.device)
        method = resolve_method("default", args.overrides)  # a bad --set fails here, before any work
        check_cache_type(args.cache_type)
        check_repeat_share(args.repeat_share)
        cache_types = parse_cache_types(args.cache_types) if args.cache_types else []
        original_types = parse_cache_types(args.frontier_original_types) if args.frontier_original_types else None
        if cache_types:
            from transmla_tool.engines.llamacpp import llama_cpp_bin

            llama_cpp_bin("llama-perplexity")  # before the conversion and the healing, not after
    except UserError as exc:
        raise SystemExit(str(exc)) from None

    # Fail before the minutes of conversion, not after: a local training file that is not there yet.
    if Path(args.data).suffix in {".txt", ".jsonl", ".json", ".parquet"} and not Path(args.data).exists():
        raise SystemExit(f"{args.data} is missing (for Debian's linux-doc text run "
                         f"`python eval/prepare_heal_data.py --output {args.data}`)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        model_dir, gguf = model_gguf(args.model)
    except UserError as exc:
        raise SystemExit(str(exc)) from None
    left_out = args.data[4:] if args.data.startswith("mix-") else None
    if left_out is not None and left_out not in DOMAINS:
        raise SystemExit(f"--data {args.data}: the domain left out must be one of {', '.join(DOMAINS)}")
    calib, heldout = run_splits(out / "data", left_out)
    data = args.data if args.data != "news" and left_out is None else calib
    converted = out / f"converted-{budget}"

    def place(tokens: int) -> None:
        """The training-free and healed checkpoints (and their balanced copies) on the llama.cpp frontier."""
        checkpoints = frontier_models(converted, healed, tokens, placed)
        checkpoints = with_rebalanced(checkpoints, args.rebalance, calib, str(device), args.rebalanced_only)
        place_on_frontier(out, model_dir, gguf, checkpoints, heldout, cache_types, args.frontier_chunks,
                          args.frontier_ctx, original_types)

    if args.frontier_only:
        place(json.loads((healed / "healing.json").read_text())["tokens"])
        return
    record = out / "conversion.json"
    # the resolved method too: `default` changes between releases, and a rerun must not reuse an older default's
    # conversion under the same (empty) overrides
    wanted = {"latent_dim": args.latent_dim, "calib_samples": args.calib_samples, "overrides": args.overrides,
              "method": method.as_dict()}
    if args.rope_dim != 64:  # recorded only when not the default, so earlier run directories still resume
        wanted["rope_dim"] = args.rope_dim
    if args.calib_seq_len != ConvertSettings.calib_seq_len:  # likewise
        wanted["calib_seq_len"] = args.calib_seq_len
    if args.model != "smollm2-135m":  # likewise
        wanted["model"] = args.model
    if args.target != "transformers":
        wanted["target"] = args.target
    if left_out is not None:  # the calibration text: the other three domains (news, the default, is not recorded)
        wanted["calib"] = f"mix-{left_out}"
    recorded = json.loads(record.read_text()) if record.exists() else None
    if recorded is not None and "method" in recorded:
        recorded["method"] = recorded_method(recorded["method"])
    if recorded is not None and recorded != wanted:
        raise SystemExit(f"{out} holds a conversion made with {record.read_text().strip()}, not {json.dumps(wanted)}; "
                         "use another --output-dir")
    if not (converted / "config.json").exists():
        settings = ConvertSettings(model=model_dir, gguf_file=gguf, output=str(converted), latent_dim=args.latent_dim,
                                   rope_dim=args.rope_dim, calib_data=str(calib), calib_samples=args.calib_samples,
                                   calib_seq_len=args.calib_seq_len, method=method, target=args.target,
                                   dtype="float32", device=str(device), overwrite=True)
        if args.converted:
            done = adopt_conversion(Path(args.converted), settings, converted)
            where = {"device": done["settings"]["device"], "adopted_from": args.converted}
        else:
            done, where = convert(settings), {"device": str(device)}
        record.write_text(json.dumps(wanted) + "\n")
        timing = {k: done.get(k) for k in ("wall_time_s", "peak_rss_mb", "peak_gpu_mb", "stages")}
        (out / "conversion-time.json").write_text(json.dumps({**timing, **where}, indent=2))

    eval_seq_len = args.eval_seq_len or args.seq_len
    original = original_perplexity(out / "original.json", model_dir, gguf, heldout, eval_seq_len, args.eval_windows,
                                   device)

    summary = heal(HealSettings(
        model=str(converted), output=str(healed), data=data, teacher=model_dir, teacher_gguf_file=gguf,
        repeat_share=args.repeat_share,
        max_tokens=args.max_tokens, seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum,
        lr=args.lr, train=args.train, lm_weight=args.lm_weight, cache_type=args.cache_type, eval_data=str(heldout),
        gradient_checkpointing=args.gradient_checkpointing,
        seed=args.seed, eval_every=args.eval_every, eval_windows=args.eval_windows, eval_seq_len=args.eval_seq_len,
        save_every=args.save_every,
        save_total_limit=args.save_total_limit, resume=args.resume, overwrite=not args.resume,
    ))
    rows = [json.loads(line) for line in (Path(f"{healed}.ckpt") / "log.jsonl").read_text().splitlines()]
    scored = f"held-out {heldout.name}" if args.data.startswith("mix-") else "held-out news"
    setup = (f"{args.data} ({scored}, {args.eval_windows} windows of {eval_seq_len} tokens), windows of "
             f"{args.seq_len} tokens, lr {args.lr:g}, train {args.train}")
    if args.seed:
        setup += f", seed {args.seed}"
    if args.repeat_share:
        setup += f", {args.repeat_share:g} of the windows their first half twice"
    if args.cache_type:
        setup += (f", trained through a simulated {args.cache_type} KV cache (the perplexities below read it too; "
                  "the original's is exact)")
    write_report(out, rows, original, summary, setup, f"{args.latent_dim} + {args.rope_dim}", args.model)
    if cache_types:
        place(summary["tokens"])


def adopt_conversion(source: Path, settings: ConvertSettings, converted: Path) -> dict:
    """Copy a finished conversion into the run as its `converted` checkpoint, once its record says it is what
    `settings` would make: converted from the same weights, every setting that changes the result the same, and
    calibrated on the same documents (by name and, where the recorded files are still there, by content). Returns its
    conversion.json. Copied whole before it takes the name the run looks for: a copy cut short is not a conversion."""
    import shutil

    flag = f"--converted {source}"
    try:
        record = converted_from(str(source), "--converted", settings.model, settings.gguf_file)
        made = dict(record["settings"])
        made["method"] = recorded_method(made.get("method", {}))
        wanted = result_settings(settings)
        wanted["method"] = settings.method.as_dict()
        differs = [k for k in wanted if k not in ("calib_data", "device") and made.get(k) != wanted[k]]
        if differs:
            raise UserError(f"{flag} was made with other " + ", ".join(
                f"{k} ({made.get(k)!r}, this run asks {wanted[k]!r})" for k in differs[:3]) +
                ": pass the flags it was made with (--latent-dim, --rope-dim, --calib-samples, --calib-seq-len, "
                "--set, --target) or convert in this run")
        if not calibrated_on(made["calib_data"], settings.calib_data, flag):
            raise UserError(f"{flag} was calibrated on {made['calib_data']}, not on this run's --data text "
                            f"({settings.calib_data}): convert in this run, or pass the --data it was calibrated on")
    except UserError as exc:
        raise SystemExit(str(exc)) from None
    staging = converted.with_name(f".{converted.name}.copying")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    staging.rename(converted)
    return record


def original_perplexity(reference: Path, model_dir: str, gguf: str | None, heldout: Path, seq_len: int, windows: int,
                        device) -> float:
    """The original's held-out perplexity on the windows healing is scored on, kept in `reference`. Measured again
    whenever the windows differ from the recorded ones: another --seq-len or --eval-windows in the same directory
    would otherwise divide every logged perplexity by another length's number."""
    scored_on = {"seq_len": seq_len, "windows": windows, "heldout": heldout.name}
    measured = json.loads(reference.read_text()) if reference.exists() else {}
    if {k: measured.get(k) for k in scored_on} != scored_on:
        tokenizer = load_tokenizer(model_dir, gguf)
        model = load_model(model_dir, gguf, torch.float32, device)
        # one 8192-token window at a time: a batch of them holds GBs of whole-window logits
        batch = max(1, min(4, 4096 // seq_len))
        measured = {"perplexity": perplexity(model, token_windows(str(heldout), tokenizer, seq_len, windows),
                                             batch_size=batch)["perplexity"], **scored_on}
        reference.write_text(json.dumps(measured))
        del model
    return measured["perplexity"]


def run_splits(data_dir: Path, left_out: str | None) -> tuple[str, Path]:
    """(calibration and training text, held-out file) of a run: gensim's news split, or with `left_out` the other
    three domains' calibration documents (comma-joined) and that domain's held-out ones. Written into the run's
    data/ once and read from there afterwards, so a run resumed or rescored elsewhere keeps its text: the code and
    docs domains are the running interpreter's standard library, which another Python version changes."""
    if left_out is None:
        calib, heldout = data_dir / "calib.txt", data_dir / "heldout.txt"
        if not (calib.exists() and heldout.exists()):
            calib, heldout = split_documents(lee_corpus(), data_dir)
        return str(calib), heldout
    others = [d for d in DOMAINS if d != left_out]
    wanted = [data_dir / f"{d}-calib.jsonl" for d in others] + [data_dir / f"{left_out}-heldout.jsonl"]
    if not all(path.exists() for path in wanted):
        domain_splits(data_dir)
    return ",".join(str(path) for path in wanted[:-1]), wanted[-1]


def healed_dir(out: Path, budget: int) -> Path:
    """Where a run in `out` writes its healed model of `budget` cached values per token per layer."""
    return out / f"healed-{budget}"


def balanced_dir(path: Path, balance: str) -> Path:
    """Where --rebalance writes a checkpoint's rotary-key-balanced copy."""
    return Path(f"{path}-{balance}")


def with_rebalanced(checkpoints: dict, balance: str | None, calib: str, device: str = "cpu",
                    only: bool = False) -> dict:
    """The checkpoints, plus each one's rotary key balanced (`<dir>-<balance>`, labelled `+<balance>`) when asked
    (only the balanced copies with `only`); balanced on the calibration text, never on the held-out domain. A balanced
    directory already there is reused."""
    if balance is None:
        return checkpoints
    from transmla_tool.rebalance import RebalanceSettings, rebalance

    out = {} if only else dict(checkpoints)
    for label, path in checkpoints.items():
        target = balanced_dir(path, balance)
        if not (target / "rebalance.json").exists():
            rebalance(RebalanceSettings(model=str(path), output=str(target), balance=balance, calib_data=calib,
                                        device=device, overwrite=True))
        out[f"{label} +{balance}"] = target
    return out


def frontier_models(converted: Path, healed: Path, tokens: int, placed: list[str]) -> dict:
    """The run's models the placement scores, by label (--frontier-models): the conversion, the healed model."""
    models = {"converted": ("converted", converted), "healed": (f"healed {tokens} tokens", healed)}
    return dict(models[name] for name in ("converted", "healed") if name in placed)


def frontier_record(out: Path, ctx: int) -> Path:
    """Where a heal's llama.cpp placement at `ctx` tokens is kept: frontier.json at 512 (the name runs made before
    other lengths were scored keep), frontier-<ctx>.json otherwise. Scores of two lengths never share a record."""
    return out / ("frontier.json" if ctx == 512 else f"frontier-{ctx}.json")


def place_on_frontier(out: Path, model_dir: str, gguf: str, checkpoints: dict, heldout: Path, cache_types: list[str],
                      chunks: int, ctx: int = 512, original_types: list[str] | None = None) -> None:
    """llama.cpp perplexity of the original and of each checkpoint on the held-out documents under each cache type
    (the original under original_types, default the same, f16 always): where healing moves the model on the
    quality-per-byte frontier. Appends a table to heal.md; the record of this length (frontier_record) keeps the
    types scored before and adds these. Each length has its own record: scoring at 8192 leaves the 512 one alone."""
    import tempfile

    from transmla_tool.engines.llamacpp import build_label, llama_cpp_version
    from transmla_tool.evaluate.frontier import Point, markdown_table, score_in_llamacpp

    text = out / "heldout.txt"
    text.write_text("\n\n".join(json.loads(line)["text"] for line in heldout.read_text().splitlines() if line.strip()))
    # each score is kept as it comes (one 4-bit run at 8192 tokens takes 10-18 minutes on 2 cores): a rerun of the
    # same placement, same build, windows and text, measures only what the interrupted one had not
    record_path = frontier_record(out, ctx)
    partial = record_path.with_suffix(".partial.json")
    run = {"version": llama_cpp_version(), "chunks": chunks, "ctx": ctx,
           "text_sha256": hashlib.sha256(text.read_bytes()).hexdigest()}
    known = {}
    if partial.exists():
        record = json.loads(partial.read_text())
        if all(record.get(k) == v for k, v in run.items()):
            known = record["scored"]
            print(f"{partial}: {sum(map(len, known.values()))} score(s) of an interrupted placement kept")

    def keep(key: str, entry: str, measured: dict) -> None:
        known.setdefault(key, {})[entry] = measured
        partial.write_text(json.dumps({**run, "scored": known}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        scored = score_in_llamacpp(model_dir, gguf, checkpoints, text, ctx, chunks, original_types or cache_types,
                                   cache_types, tmp, known=known, on_scored=keep)
    engine = {"version": llama_cpp_version(),
              "cpu_kernels": sorted({m["cpu_kernels"] for types in scored.values() for m in types.values()})}
    earlier = json.loads(record_path.read_text()) if record_path.exists() else {}
    # keep the cache types scored before (a rerun adds types, it does not drop them), but only when the same
    # llama.cpp build on the same CPU kernels scored them: a quantized cache's perplexity moves between builds
    if earlier.get("chunks") == chunks and earlier.get("ctx", 512) == ctx and earlier.get("engine") == engine:
        for key, types in scored.items():
            earlier["scored"].setdefault(key, {}).update(types)
        scored = earlier["scored"]
    elif earlier:
        print(f"note: {record_path} was scored by {earlier.get('engine', 'an unrecorded llama.cpp build')} "
              f"with {earlier.get('chunks')} windows of {earlier.get('ctx', 512)}; this is {engine} with {chunks} of "
              f"{ctx}: its scores are replaced, not merged (a rerun scores every cache type it should keep)")
    reference = scored["original"]["f16"]["perplexity"]
    points = [Point(label=key, kind="original" if key == "original" else "converted", cache=entry,
                    bytes=round(m["bytes"], 1), ratio=m["perplexity"] / reference)
              for key, types in scored.items() for entry, m in types.items()]
    record_path.write_text(json.dumps({"scored": scored, "chunks": chunks, "ctx": ctx, "engine": engine}, indent=2))
    partial.unlink(missing_ok=True)
    lines = ["", f"## Where it lands: llama.cpp perplexity on {heldout.name} per cache byte ({chunks} windows of {ctx})",
             "", f"({build_label(engine['version'], engine['cpu_kernels'])})",
             "", *markdown_table(points, scored["original"]["f16"]["bytes"], f"ratio on {heldout.stem}")]
    with open(out / "heal.md", "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def write_report(out: Path, rows: list[dict], original: float, summary: dict, setup: str, size: str,
                 model: str = "smollm2-135m") -> None:
    evals = [(r["tokens"], r["eval_perplexity"]) for r in rows if "eval_perplexity" in r]
    # steady-state speed over the run (optimizer steps after each process's first); None when no step was timed
    speed = (f"{summary['tokens_per_s']:.0f} tokens/s steady state" if summary.get("tokens_per_s")
             else "speed not measured (no timed step: each process's first step is not timed)")
    lines = [
        (f"# Healing {MODELS[model].title} converted at {size} cache values per token per layer (original "
         f"held-out perplexity {original:.3f})"),
        "",
        (f"Training text {setup}; {summary['tokens']} training tokens, {speed} "
         f"({summary['processes']} process(es), mixed precision {summary['mixed_precision']})."),
        "",
        "| tokens seen | held-out perplexity | ratio to original |",
        "|---|---|---|",
    ]
    lines += [f"| {t} | {p:.3f} | {p / original:.3f} |" for t, p in evals]
    within = next((t for t, p in evals if p <= 1.05 * original), None)
    reached = f"{within} tokens" if within is not None else "not reached"
    lines += ["", f"First evaluation within 5% of the original: {reached}."]
    (out / "heal.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot([t for t, _ in evals], [p for _, p in evals], marker="o", label="converted, healing")
    ax.axhline(original, color="gray", linestyle="--", label="original")
    ax.axhline(1.05 * original, color="gray", linestyle=":", label="original + 5%")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("held-out perplexity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "heal.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
