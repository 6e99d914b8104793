"""Quality per KV-cache byte in llama.cpp: the original under every cache type beside converted checkpoints.

What a user weighing "convert" against "one cache flag" would measure, in the engine they would serve with:
a real model (`--model`: SmolLM2-135M by default, Qwen2.5-Coder-1.5B; the original as F32 GGUF: the same values
transformers converts from) under llama.cpp's
cache types (`-ctk/-ctv`, flash attention on, mixed K/V included), and conversions calibrated on one
source at several budgets, exported with `export-gguf` (f32) and run under the same types. Perplexity from
llama-perplexity on each domain's held-out text (transmla_tool.assets.DOMAINS; --chunks windows of --ctx
tokens, the second half of each scored), bytes from the cache llama.cpp allocated. A point's ratio is its
perplexity over the original's with an f16 cache on the same text; the headline is the worst ratio over
the domains the calibration never saw.

    python eval/frontier.py --output-dir runs/frontier                          # original + default
    python eval/frontier.py --output-dir runs/frontier --budgets 192,320 \\
        --configs "pca=default:latent_basis=pca,rope_key_balance=none"          # more rows, same file
    python eval/frontier.py --output-dir runs/frontier --calib mix-news,mix-forum,mix-code,mix-docs  # leave-one-out
    python eval/frontier.py --output-dir runs/frontier --table-only --max-cache-bytes 216
    python eval/frontier.py --output-dir runs/frontier-8192 --ctx 8192 --chunks 2 --data-dir runs/length/data \\
        --configs '' --checkpoint "calib8192=runs/length/ckpt/default-rope64-calib8192"  # a finished conversion

A finished conversion or heal of --model (convert, eval/length.py, eval/heal.py) is scored as it is with
`--checkpoint NAME=DIR`: its calibration source is read from its record (files of this run's domain splits, so that
the text it is scored on is text it never saw), its budget from its config.

Resumable: rows go to <output-dir>/frontier.jsonl keyed by (model, calibration, config, budget, cache type,
domain); a rerun measures only what is missing (a configuration name whose rows were made with other
settings is refused, and so is a rerun with another --ctx or --chunks); a conversion killed part way continues
from its last finished layer (`convert --resume`), and one killed while being scored is scored again from its
finished checkpoint, not converted again. frontier.md and the plots are rebuilt
from the file: one section per calibration source, and once a configuration is measured under all four mix-D
calibrations (each scored on the D it left out) a leave-one-out section whose ratio is the worst of the four.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from crossdomain import calib_spec, reuse_splits  # noqa: E402
from quality import (  # noqa: E402
    _append, _read, check_resumable, check_same_scoring, made_with, parse_config, remaking_overrides,
)

from transmla_tool.assets import DOMAINS, domain_splits  # noqa: E402
from transmla_tool.convert import ConvertSettings, convert_many  # noqa: E402
from transmla_tool.engines.llamacpp import build_label  # noqa: E402
from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.evaluate.frontier import (  # noqa: E402
    DEFAULT_CONVERTED_TYPES,
    DEFAULT_ORIGINAL_TYPES,
    MAX_RATIO,
    Point,
    analytic_bytes,
    check_mla_sizes,
    check_mla_types,
    markdown_table,
    parse_cache_types,
    plot,
    recommend,
)
from transmla_tool.io.resume import result_settings  # noqa: E402
from transmla_tool.methods import recorded_method, resolve_method  # noqa: E402
from transmla_tool.provenance import calibrated_on, labelled_checkpoint  # noqa: E402
from transmla_tool.registry import MODELS, model_gguf  # noqa: E402

# rows written before --model existed were all SmolLM2's
DEFAULT_MODEL = "smollm2-135m"


def kv_values(model_dir: str, gguf: str) -> int:
    """Keys (and as many values) the original caches per token per layer: KV heads x head_dim."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, gguf_file=gguf)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads * head_dim


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/frontier")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                        help="the real model (transmla_tool/registry.py; `make models` fetches the ones not installed)")
    parser.add_argument("--data-dir", help="domain splits of an earlier run (default <output-dir>/data, built)")
    parser.add_argument("--calib", default="news", help="comma-separated calibration sources (crossdomain.py's names)")
    parser.add_argument("--budgets", default="192,256,320,384", help="latent + rope values per token per layer")
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--configs", default="default", help="';'-separated NAME[=PRESET[:k=v,...]]")
    parser.add_argument("--calib-samples", type=int, default=ConvertSettings.calib_samples)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--original-cache-types", default=DEFAULT_ORIGINAL_TYPES)
    parser.add_argument("--cache-types", default=DEFAULT_CONVERTED_TYPES, help="cache types of converted models")
    parser.add_argument("--in-domain", action="store_true",
                        help="also score converted models on their calibration domain (labelled in-domain, never the "
                        "headline); by default they are scored only on the domains the calibration never saw")
    parser.add_argument("--all-domains", action="store_true",
                        help="score the original on every kind of text, not only those the calibrations leave out")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=24, help="windows of --ctx tokens per domain")
    parser.add_argument("--device", default="auto", help="conversion device")
    parser.add_argument("--keep-gguf", action="store_true", help="keep each converted GGUF under <output-dir>/gguf")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each converted checkpoint under <output-dir>/ckpt (for eval/cache_split.py, "
                        "rebalance or heal; by default it is deleted once scored)")
    parser.add_argument("--gguf-from", default=None,
                        help="an earlier frontier directory whose kept GGUFs (--keep-gguf) are scored here instead of "
                        "converting again (same calibration, configuration and settings, checked on its rows): the "
                        "same models at another --ctx")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="a finished conversion (or heal) of --model scored as it is, under --cache-types, on the "
                        "kinds of text its calibration left out (repeatable)")
    parser.add_argument("--table-only", action="store_true", help="rebuild frontier.md/.png, measure nothing")
    parser.add_argument("--plot-configs", default="",
                        help="';'-separated configuration names (as in --configs) the plot shows beside the original "
                        "(default: all; the table always has every row)")
    parser.add_argument("--max-cache-bytes", default="216,110",
                        help="comma-separated byte budgets the table recommends a configuration for")
    parser.add_argument("--max-ratio", type=float, default=MAX_RATIO,
                        help="the worst perplexity ratio a recommendation may name (default %(default)s)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        original_types = parse_cache_types(args.original_cache_types, "--original-cache-types")
        converted_types = parse_cache_types(args.cache_types)
        check_mla_types(converted_types)
        for budget in (int(b) for b in args.budgets.split(",")):
            latent = budget - args.rope_dim
            check_mla_sizes(converted_types, latent, args.rope_dim,
                            f"budget {budget} (latent {latent} + rope {args.rope_dim})")
        budgets_asked = [float(b) for b in args.max_cache_bytes.split(",") if b]
    except (UserError, ValueError) as exc:
        raise SystemExit(f"frontier.py: {exc}") from None
    configs = [parse_config(c) for c in args.configs.split(";") if c]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "frontier.jsonl"
    if args.table_only:
        write_tables(out, budgets_asked, _names(args.plot_configs), args.max_ratio)
        return

    from transmla_tool.engines.llamacpp import cache_flags, llama_cpp_version, perplexity, quantize
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    version = llama_cpp_version()  # fails early, with the fix, when `make engines` has not run
    rows = _read(results)
    check_same_engine(rows, results, version)  # before any work; the kernels are checked with each score
    check_same_scoring([{"source_model": DEFAULT_MODEL, **r} for r in rows], results,  # not in a row's key
                       {"ctx": args.ctx, "chunks": args.chunks, "source_model": args.model})
    try:
        model_dir, gguf = model_gguf(args.model)
    except UserError as exc:
        raise SystemExit(f"frontier.py: {exc}") from None
    original_kv_values = kv_values(model_dir, gguf)
    splits = reuse_splits(Path(args.data_dir)) if args.data_dir else domain_splits(out / "data")
    specs = {source: calib_spec(source, splits) for source in args.calib.split(",")}
    given = [checkpoint_point(spec, model_dir, gguf, splits) for spec in args.checkpoint]  # refused before any work
    clash = {base["config"] for base in given} & {name for name, _, _ in configs}
    if clash:
        raise SystemExit(f"--checkpoint {sorted(clash)[0]}: a --configs entry has the same name")
    texts = {d: _text_file(splits[d][1], out / "text" / f"{d}.txt") for d in DOMAINS}
    done = {_key(r) for r in rows}

    def measure(model_file, run_flags, base: dict, types: list[str], analytic, domains=DOMAINS) -> None:
        for entry in types:
            for domain in domains:
                row = {**base, "cache": entry, "domain": domain}
                if _key(row) in done:
                    continue
                ppl = perplexity(model_file, texts[domain], args.ctx, args.chunks,
                                 flags=[*run_flags, *cache_flags(entry)])
                row.update(perplexity=ppl["perplexity"], chunks=ppl["chunks"], ctx=args.ctx, source_model=args.model,
                           bytes=ppl["kv_bytes_per_token_per_layer"], kv_cells=ppl["kv_cells"], kv_layers=ppl["kv_layers"],
                           analytic_bytes=analytic(entry), engine=version, cpu_kernels=ppl["cpu_kernels"],
                           **({"data_dir": args.data_dir} if args.data_dir else {}))
                check_same_engine(rows, results, row["engine"], row["cpu_kernels"])
                _check_bytes(row)
                _append(results, row)
                done.add(_key(row))

    gguf_dir = out / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    original_f32 = gguf_dir / "original-f32.gguf"
    # the original on the kinds of text the asked calibrations are scored on (all four with --all-domains): a 1.5B
    # model under five caches on 2 CPU cores is hours per kind of text
    # --calib's sources where it converts (or nothing else is asked: `--configs ''` scores the original alone)
    calibrations = [*(specs if configs or not given else []), *(base["calib"] for base in given)]
    original_domains = DOMAINS if args.all_domains or args.in_domain else \
        [d for d in DOMAINS if any(d in unseen(s) for s in calibrations)]
    if any(("original", "-", "original", 0, e, d) not in done for e in original_types for d in original_domains):
        if not original_f32.exists():  # the Q4_1 file's values stored as F32: what the conversion reads
            quantize(Path(model_dir) / gguf, original_f32, "F32", allow_requantize=True)
        measure(original_f32, [], {"model": "original", "calib": "-", "config": "original", "budget": 0},
                original_types, lambda e: analytic_bytes(e, kv_values=original_kv_values), original_domains)

    def score_checkpoint(ckpt, name: str, base: dict, domains, reused: dict | None = None) -> None:
        """A checkpoint's rows: exported to <gguf>/NAME-f32.gguf (or a --gguf-from export reused), scored under
        each converted cache type, the GGUF kept (with its run flags) only with --keep-gguf."""
        model_file = gguf_dir / f"{name}-f32.gguf"
        exported = reused or export_gguf(GGUFSettings(checkpoint=str(ckpt), output=str(model_file), outtype="f32",
                                                      tokenizer_gguf=str(Path(model_dir) / gguf), overwrite=True))
        measure(model_file, exported["run_flags"], base, converted_types,
                lambda e, v=base["budget"]: analytic_bytes(e, mla_values=v), domains)
        if not args.keep_gguf:
            model_file.unlink(missing_ok=True)
        elif not reused:  # what llama.cpp must be told at run time, for a later --gguf-from
            model_file.with_name(f"{name}.run-flags.json").write_text(json.dumps(exported["run_flags"]))

    budgets = [int(b) for b in args.budgets.split(",")]
    for source, spec in specs.items():
        for name, preset, overrides in configs:
            method = resolve_method(preset, overrides)
            made = made_with(method, args)
            check_resumable(rows, results, {"model": "converted", "calib": source, "config": name}, made)
            domains = DOMAINS if args.in_domain else unseen(source)
            if not domains:
                raise SystemExit(f"--calib {source} leaves no domain unseen: pass --in-domain to score it anyway")
            todo = [b for b in budgets if any(("converted", source, name, b, e, d) not in done
                                              for e in converted_types for d in domains)]
            if not todo:
                continue
            ckpts = {b - args.rope_dim: out / "ckpt" / f"{source}-{name}-{b}" for b in todo}
            reused = reuse_ggufs(args.gguf_from, source, name, made, ckpts, gguf_dir)
            start = time.time()
            settings = ConvertSettings(
                model=model_dir, gguf_file=gguf, output="", latent_dim=max(ckpts), rope_dim=args.rope_dim,
                calib_data=spec, calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                dtype="float32", device=args.device, overwrite=True, resume=True, target="llamacpp", method=method,
                method_name=preset)
            summaries = {r: {"stages": None} for r in reused}
            # a run killed while scoring left finished checkpoints: scored as they are, not converted again (75 min
            # for Qwen2.5-1.5B on 2 cores)
            summaries.update({r: s for r, p in ckpts.items() if r not in reused
                              and (s := finished_conversion(p, settings, r)) is not None})
            if len(summaries) < len(ckpts):
                summaries.update(convert_many(settings, {r: str(p) for r, p in ckpts.items() if r not in summaries}))
            seconds = round(time.time() - start, 1)
            for latent, ckpt in ckpts.items():
                base = {"model": "converted", "calib": source, "config": name, "preset": preset,
                        "overrides": overrides, "budget": latent + args.rope_dim, "latent_dim": latent,
                        "rope_dim": args.rope_dim, **made, "convert_seconds_all_budgets": seconds,
                        "stages": summaries[latent].get("stages")}
                score_checkpoint(ckpt, ckpt.name, base, domains, reused.get(latent))
                if not args.keep_checkpoints:
                    shutil.rmtree(ckpt, ignore_errors=True)
                gc.collect()
    for base in given:
        check_resumable(rows, results, {k: base[k] for k in ("model", "calib", "config")},
                        {k: base[k] for k in ("method", "calib_samples", "calib_seq_len", "checkpoint")})
        domains = DOMAINS if args.in_domain else unseen(base["calib"])
        if all(_key({**base, "cache": e, "domain": d}) in done for e in converted_types for d in domains):
            continue
        # named as a --configs point's GGUF, which benchmarks.py --frontier-dir finds when kept
        score_checkpoint(base["checkpoint"], f"{base['calib']}-{base['config']}-{base['budget']}", base, domains)
    write_tables(out, budgets_asked, _names(args.plot_configs), args.max_ratio)


def checkpoint_point(spec: str, model_dir: str, gguf: str | None, splits: dict) -> dict:
    """--checkpoint 'NAME=DIR' of a finished conversion or heal of --model -> the fields of its rows: the
    calibration source it was converted on (calibration_source), its budget and how it was made, from its record."""
    try:
        name, ckpt, summary = labelled_checkpoint(spec, "--checkpoint", model_dir, gguf)
    except UserError as exc:
        raise SystemExit(f"frontier.py: {exc}") from None
    made = summary["settings"]
    healing = ckpt / "healing.json"
    return {"model": "converted", "calib": calibration_source(made["calib_data"], splits, f"--checkpoint {name}"),
            "config": name, "preset": made["method_name"], "overrides": [],
            "budget": made["latent_dim"] + made["rope_dim"], "latent_dim": made["latent_dim"],
            "rope_dim": made["rope_dim"], "method": recorded_method(made["method"]),
            "calib_samples": made["calib_samples"], "calib_seq_len": made["calib_seq_len"], "checkpoint": str(ckpt),
            "convert_seconds_all_budgets": summary.get("wall_time_s"), "stages": summary.get("stages"),
            "healed_tokens": json.loads(healing.read_text())["tokens"] if healing.exists() else 0}


def calibration_source(calib_data: str, splits: dict, flag: str) -> str:
    """The calibration source name (a domain, mix or mix-DOMAIN) whose files of this run's splits a conversion's record
    names (the same documents, where the recorded files are still there: provenance.calibrated_on)."""
    for source in [*DOMAINS, "mix", *(f"mix-{d}" for d in DOMAINS)]:
        try:
            if calibrated_on(calib_data, calib_spec(source, splits), flag):
                return source
        except UserError as exc:
            raise SystemExit(f"frontier.py: {exc}") from None
    raise SystemExit(f"{flag} was calibrated on {calib_data}, not on domain splits (DOMAIN-calib.jsonl): frontier.py "
                     "cannot tell which text it never saw; convert it with --calib-data from a --data-dir's splits")


def finished_conversion(ckpt: Path, settings: ConvertSettings, latent: int) -> dict | None:
    """The summary of a finished conversion at `ckpt` made from what `settings` asks at this latent dim, else None:
    every setting that changes the result must be the one recorded (io/resume.py's, as `convert --resume` asks).
    The writer renames a conversion into place only once it is whole, so a directory with its record is finished."""
    record = ckpt / "conversion.json"
    if not record.exists():
        return None
    summary = json.loads(record.read_text())
    made = dict(summary.get("settings", {}))
    made["method"] = recorded_method(made.get("method", {}))
    wanted = result_settings(dataclasses.replace(settings, latent_dim=latent))
    wanted["method"] = settings.method.as_dict()
    return summary if all(made.get(k) == v for k, v in wanted.items()) else None


def reuse_ggufs(earlier: str | None, source: str, name: str, made: dict, ckpts: dict, gguf_dir: Path) -> dict:
    """{latent: export record} of the GGUFs an earlier frontier directory kept for this calibration and configuration,
    linked into this one (their rows must record the same method and calibration: the same models)."""
    if not earlier:
        return {}
    import json

    rows = [r for r in _read(Path(earlier) / "frontier.jsonl") if r["model"] == "converted"
            and (r["calib"], r["config"]) == (source, name)]
    check_resumable(rows, Path(earlier) / "frontier.jsonl", {"calib": source, "config": name}, made)
    found = {}
    for latent, ckpt in ckpts.items():
        kept = Path(earlier) / "gguf" / f"{ckpt.name}-f32.gguf"
        if not kept.exists() or not any(r.get("latent_dim") == latent for r in rows):
            continue
        target = gguf_dir / kept.name
        if not target.exists():
            target.symlink_to(kept.resolve())
        flags = kept.with_name(f"{ckpt.name}.run-flags.json")
        # kept before their run flags were saved: those sources had default rope (SmolLM2, Qwen2.5), which needs none
        found[latent] = {"run_flags": json.loads(flags.read_text()) if flags.exists() else []}
    return found


def unseen(source: str) -> list[str]:
    """The domains a calibration source never saw: the other three for a domain, X for mix-X, none for mix."""
    if source.startswith("mix-"):
        return [source[4:]]
    return [d for d in DOMAINS if d != source and source != "mix"]


def check_same_engine(rows: list[dict], results: Path, engine: str, kernels: str | None = None) -> None:
    """Refuse to add a score from another llama.cpp build, or from the same source built for other CPU kernels, to
    rows that a frontier divides by one another: a quantized cache's perplexity moves between them (SmolLM2, docs,
    iq4_nl: 10.5351 on one machine's native build, 10.5769 on another's). kernels None: the build alone (llama.cpp
    names its kernels only once it has loaded a model), so that a resume on another build stops before any work."""
    for earlier in rows:
        if earlier.get("engine") != engine or (kernels is not None and earlier.get("cpu_kernels") != kernels):
            raise SystemExit(f"{results} holds rows scored by {earlier.get('engine')} on CPU kernels "
                             f"{earlier.get('cpu_kernels', '(not recorded)')}; this is {engine} on "
                             f"{kernels or 'CPU kernels not known yet'}: scores of two builds are not comparable, "
                             "use a new --output-dir")


def _key(row: dict) -> tuple:
    return (row["model"], row["calib"], row["config"], row["budget"], row["cache"], row["domain"])


def _text_file(heldout_jsonl: Path, path: Path) -> Path:
    """The held-out documents as plain text (llama-perplexity reads text and tokenizes it itself)."""
    import json

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = [json.loads(line)["text"] for line in heldout_jsonl.read_text().splitlines() if line.strip()]
        path.write_text("\n\n".join(docs))
    return path


def _check_bytes(row: dict) -> None:
    """llama.cpp prints its cache in MiB with two decimals: the bytes read back must match the type's bytes
    to that precision, or the engine cached something other than we think (and the table would say so)."""
    tolerance = 0.006 * 2**20 / (row["kv_cells"] * row["kv_layers"])  # half a printed unit (0.005 MiB), and a bit
    row["bytes_match_analytic"] = abs(row["bytes"] - row["analytic_bytes"]) <= tolerance


LEAVE_ONE_OUT = "leave-one-out"  # the four mix-D calibrations taken together, each scored on the D it left out


def scored_domains(calib: str) -> list[str]:
    return list(DOMAINS) if calib == LEAVE_ONE_OUT else unseen(calib)


def _calibrated_as(row: dict, calib: str) -> bool:
    if calib == LEAVE_ONE_OUT:
        return row["calib"] == f"mix-{row['domain']}"
    return row["calib"] == calib


def points_for(rows: list[dict], calib: str) -> tuple[list[Point], dict]:
    """Frontier points for one calibration source: ratio = worst over the domains it did not calibrate on.
    calib LEAVE_ONE_OUT: a configuration is a point once it is measured calibrated on each mix-D and scored on that
    D, for all four D; its ratio is the worst of the four (the original's, its worst over the four domains)."""
    reference = {r["domain"]: r["perplexity"] for r in rows if r["model"] == "original" and r["cache"] == "f16"}
    scored = [d for d in scored_domains(calib) if d in reference]
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r["model"] == "converted" and not _calibrated_as(r, calib):
            continue
        groups.setdefault((r["model"], r["config"], r["budget"], r["cache"]), {})[r["domain"]] = r
    points, in_domain = [], {}
    for (model, config, budget, cache), cells in groups.items():
        if any(d not in cells for d in scored):
            continue
        ratios = {d: cells[d]["perplexity"] / reference[d] for d in cells if d in reference}
        worst = max(scored, key=lambda d: ratios[d])
        first = next(iter(cells.values()))
        label = "original" if model == "original" else f"{config} {budget - first['rope_dim']} + {first['rope_dim']}"
        point = Point(label=label, kind=model, cache=cache, bytes=round(first["bytes"], 1), ratio=ratios[worst],
                      worst_domain=worst, latent_dim=first.get("latent_dim"), rope_dim=first.get("rope_dim"),
                      key=(model, first["calib"], config, budget, cache))
        points.append(point)
        seen = [d for d in ratios if d not in scored]
        if seen and model == "converted":
            in_domain[id(point)] = max(ratios[d] for d in seen)
    return points, in_domain


def _calibration_words(calib: str) -> str:
    return "each calibrated on the other three domains" if calib == LEAVE_ONE_OUT else f"calibrated on {calib}"


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(";") if n.strip()]


def write_tables(out: Path, max_bytes: list[float], plot_configs: list[str] | None = None,
                 max_ratio: float = MAX_RATIO) -> None:
    from benchmarks import benchmark_means

    rows = _read(out / "frontier.jsonl")
    if not rows:
        raise SystemExit(f"{out / 'frontier.jsonl'} holds no rows yet")
    reference = next((r["bytes"] for r in rows if r["model"] == "original" and r["cache"] == "f16"), None)
    engine = next((build_label(r["engine"], r.get("cpu_kernels")) for r in rows if "engine" in r), "llama.cpp")
    calibs = list(dict.fromkeys(r["calib"] for r in rows if r["model"] == "converted")) or ["news"]
    if all(f"mix-{d}" in calibs for d in DOMAINS):
        calibs.append(LEAVE_ONE_OUT)
    windows = sorted({(r.get("chunks"), r.get("ctx")) for r in rows}, key=str)
    scored_on = " and ".join(f"{n} windows of {c} tokens" for n, c in windows)
    if len(windows) > 1:
        scored_on += " (**rows scored on different windows: their ratios are not comparable**)"
    title = MODELS[rows[0].get("source_model", DEFAULT_MODEL)].title
    lines = [f"# Quality per KV-cache byte ({title} in {engine})", "",
             f"Perplexity on each domain's held-out text, {scored_on}.", ""]
    mismatched = [r for r in rows if not r.get("bytes_match_analytic", True)]
    if mismatched:
        lines += [f"**{len(mismatched)} rows' allocated bytes differ from their cache type's** (first: "
                  f"{mismatched[0]['config']} {mismatched[0]['cache']}: {mismatched[0]['bytes']:.1f} vs "
                  f"{mismatched[0]['analytic_bytes']:.1f}).", ""]
    means = benchmark_means(out)
    for calib in calibs:
        points, in_domain = points_for(rows, calib)
        if not points:
            continue
        for p in points:  # the benchmark mean of the same model and cache (eval/benchmarks.py), where measured
            p.benchmark = means.get(p.key) if calib != LEAVE_ONE_OUT or p.kind == "original" else None
        scored = ", ".join(scored_domains(calib))
        if calib == LEAVE_ONE_OUT:
            lines += [f"## Calibrated on three kinds of text, scored on the fourth; ratio = worst of {scored}, each "
                      "from the conversion calibrated on the other three (mix-D scored on D)", ""]
        else:
            lines += [f"## Calibrated on {calib}; ratio = worst of {scored} (text the calibration never saw)", ""]
        lines += markdown_table(points, reference)
        if in_domain:
            lines += ["", "In-domain (worst of the calibration's own kinds of text; never the headline): " + ", ".join(
                f"{p.label} {p.cache} {in_domain[id(p)]:.3f}" for p in points if id(p) in in_domain)]
        lines += [""]
        for budget in max_bytes:
            _, advice = recommend(points, budget, max_ratio)
            lines += [f"- at most {budget:g} B/token/layer: {advice}"]
        lines += [""]
        shown = [p for p in points if p.kind == "original" or not plot_configs
                 or p.label.rsplit(" ", 3)[0] in plot_configs]
        subset = " (frontier: points shown)" if len(shown) < len(points) else ""
        plot(shown, reference, out / f"frontier-{calib}.png",
             f"{title} in llama.cpp, {_calibration_words(calib)}: worst of {scored}{subset}")
    lines += commands(rows, out)
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def original_domains_flag(domains: set[str]) -> str:
    """The flag that scores the original, alone, on these kinds of text: the default --calib's unseen ones, all
    four, or the ones --calib mix-D leaves out."""
    if domains == set(unseen("news")):
        return ""
    if domains == set(DOMAINS):
        return " --all-domains"
    return " --calib " + ",".join(f"mix-{d}" for d in DOMAINS if d in domains)


def commands(rows: list[dict], out: Path) -> list[str]:
    """The command that (re)makes each group of rows: a rerun with the same names measures only what is missing."""
    lines = ["## How each row was made", "",
             "Each point is llama-perplexity on a domain's held-out text with the cache flags of its row "
             "(`llama-perplexity -m MODEL.gguf -f text/DOMAIN.txt -c CTX --chunks N -fa on -ctk K -ctv V`), "
             "the converted GGUFs written by `transmla-tool export-gguf --outtype f32`. These commands made the rows:",
             "", "```bash"]
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["calib"], r["config"])
        group = groups.setdefault(key, {"budgets": set(), "caches": set(), "domains": set(), "row": r})
        group["budgets"].add(r["budget"])
        group["caches"].add(r["cache"])
        group["domains"].add(r["domain"])
    for (model, calib, config), group in groups.items():
        r, caches = group["row"], ",".join(sorted(group["caches"]))
        model_flag = f" --model {r['source_model']}" if r.get("source_model", DEFAULT_MODEL) != DEFAULT_MODEL else ""
        data_flag = f" --data-dir {r['data_dir']}" if r.get("data_dir") else ""
        base = (f"python eval/frontier.py --output-dir {out}{model_flag} --chunks {r['chunks']} --ctx {r['ctx']}"
                f"{data_flag}")
        if model == "original":
            where = original_domains_flag(group["domains"])
            lines.append(f"{base}{where} --configs '' --original-cache-types {caches}")
            continue
        if r.get("checkpoint"):
            lines.append(f'{base} --configs \'\' --checkpoint "{config}={r["checkpoint"]}" --cache-types {caches}')
            continue
        sets = remaking_overrides(r["preset"], r.get("overrides") or [], r.get("method"))
        spec = r["preset"] + (":" + ",".join(sets) if sets else "")
        budgets = ",".join(str(b) for b in sorted(group["budgets"]))
        samples = f" --calib-samples {r['calib_samples']}" if r.get("calib_samples") != ConvertSettings.calib_samples else ""
        samples += f" --rope-dim {r['rope_dim']}" if r.get("rope_dim", 64) != 64 else ""
        samples += f" --calib-seq-len {r['calib_seq_len']}" if r.get("calib_seq_len", 512) != 512 else ""
        lines.append(f'{base} --calib {calib}{samples} --budgets {budgets} --configs "{config}={spec}" '
                     f"--cache-types {caches}")
    return [*lines, "```", ""]


if __name__ == "__main__":
    main()
