"""Quality per cache byte: the original under every cache type an engine offers, beside converted checkpoints
under the same types, and the best choice for a byte budget.

A point is one model served with one cache type: its bytes per token per layer (what the engine allocated)
and its perplexity ratio to the original with an f16 cache (the worst over the domains scored, when there
are several). The frontier is the set of points no other point beats on both; `recommend` answers "what
should I run with at most N bytes per token per layer", which is "do not convert, quantize the cache" when
an original point wins.

Cache types are llama.cpp's names (`-ctk/-ctv`); "K/V" (e.g. "q8_0/q4_0") gives the keys and values their
own types. In llama.cpp's deepseek2 path the cache holds one row per token, [latent | rotary key], and the
values are a view of its latent: one type for both, and no V bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..engines.llamacpp import LLAMA_CPP_CACHE_TYPES, split_types
from ..errors import UserError
from ..ops.kv_quant import CACHE_TYPES, bytes_per_token_per_layer, mla_cache_problem

DEFAULT_ORIGINAL_TYPES = "f16,q8_0,q8_0/q5_0,q8_0/q4_0,q5_1,q5_0,q4_1,iq4_nl,q4_0"
DEFAULT_CONVERTED_TYPES = "f16,q8_0,q5_1,q5_0,q4_1,iq4_nl,q4_0"


def parse_cache_types(spec: str, flag: str = "--cache-types") -> list[str]:
    """'f16,q8_0/q4_0' -> ['f16', 'q8_0/q4_0'], each name checked against what llama.cpp accepts."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise UserError(f"{flag} is empty; give cache types such as f16,q8_0,q4_0")
    for entry in entries:
        parts = entry.split("/")
        if len(parts) > 2 or any(p not in LLAMA_CPP_CACHE_TYPES for p in parts):
            raise UserError(f"{flag}: '{entry}' is not a cache type; use one of {', '.join(LLAMA_CPP_CACHE_TYPES)}, "
                            "or K/V such as q8_0/q4_0")
    if len(set(entries)) != len(entries):
        raise UserError(f"{flag} names a cache type twice")
    return entries


def check_mla_types(entries: list[str], flag: str = "--cache-types") -> None:
    mixed = [e for e in entries if split_types(e)[0] != split_types(e)[1]]
    if mixed:
        raise UserError(f"{flag}: '{mixed[0]}' gives keys and values different types, which a converted (MLA) "
                        "model cannot take in llama.cpp (its values are a view of the cached latent); give one type")


def check_mla_sizes(entries: list[str], latent: int, rope: int, what: str, flag: str = "--cache-types") -> None:
    """Refuse, before any work, a cache type llama.cpp would not allocate for a converted model of these sizes
    (`what` names that model for the message)."""
    for entry in entries:
        problem = mla_cache_problem(split_types(entry)[0], latent, rope)
        if problem:
            raise UserError(f"{flag} {entry} for {what}: {problem}; leave the quantized types out for it, or convert "
                            "with sizes that fit")


def reference_cache(types) -> str:
    """The exact cache every cache-type ratio is taken to: llama.cpp's f16, or transformers' dynamic cache."""
    from .quantized_cache import REFERENCE

    return REFERENCE if REFERENCE in types else "f16"


def analytic_bytes(entry: str, *, kv_values: int | None = None, mla_values: int | None = None) -> float:
    """Bytes per token per layer of a cache type: a GQA/MHA model caching `kv_values` keys and as many values,
    or an MLA model in llama.cpp caching one row of `mla_values` (latent + rope, the values a view of it)."""
    k, v = split_types(entry)
    if mla_values is not None:
        return bytes_per_token_per_layer(mla_values, 0, k)
    return bytes_per_token_per_layer(kv_values, kv_values, k, v)


def bits_per_value(entry: str) -> str:
    """Nominal bits per cached value of a llama.cpp type ("-" for transformers' caches: their bytes are measured)."""
    k, v = split_types(entry)
    if k not in CACHE_TYPES or v not in CACHE_TYPES:
        return "-"
    bk, bv = (CACHE_TYPES[t].bytes_per_value * 8 for t in (k, v))
    return f"{bk:g}" if k == v else f"{bk:g}/{bv:g}"


@dataclass
class Point:
    label: str  # "original" or "latent 128 + 64" (+ a configuration name)
    kind: str  # "original" or "converted"
    cache: str  # cache type entry, e.g. "q4_0" or "q8_0/q4_0"
    bytes: float  # per token per layer, as the engine allocated
    ratio: float  # perplexity / the original's with an f16 cache (worst over the domains scored)
    worst_domain: str = ""
    latent_dim: int | None = None
    rope_dim: int | None = None
    command: str = ""  # what made it
    # lm-eval's six 0-shot tasks in the same engine and cache: (mean of their metrics, stderr), when measured
    benchmark: tuple[float, float] | None = None
    key: tuple = ()  # a benchmark script's (model, calib, config, budget, cache) for this point, to join its rows

    def as_dict(self) -> dict:
        return asdict(self)


def pareto(points: list[Point]) -> list[Point]:
    """Points no other point beats on both bytes and ratio, by bytes."""
    ordered = sorted(points, key=lambda p: (p.bytes, p.ratio))
    front, best = [], float("inf")
    for p in ordered:
        if p.ratio < best:
            front.append(p)
            best = p.ratio
    return front


# The worst perplexity ratio (to the original with an f16 cache) a recommendation may name: past it a point is the
# best that fits and still not a model to serve (SmolLM2's 160 + 32 at 8192 tokens: 2.66), and the advice says so.
MAX_RATIO = 1.5


def recommend(points: list[Point], max_bytes: float, max_ratio: float = MAX_RATIO) -> tuple[Point | None, str]:
    """The measured point with the lowest perplexity ratio at <= max_bytes per token per layer, and what to tell the
    user: the advice says it followed perplexity, and what the benchmark mean says where the points have one. A best
    point above max_ratio is not recommended: the advice names it and the fewest bytes that stay within the bound."""
    best, advice = _recommend(points, max_bytes)
    if best is not None and best.ratio > max_ratio:
        within = [p for p in points if p.ratio <= max_ratio]
        fallback = (f"the fewest bytes within it: {describe(min(within, key=lambda p: (p.bytes, p.ratio)))}"
                    if within else "no measured point is within it")
        return None, (f"nothing measured at <= {max_bytes:g} bytes per token per layer is within the quality bound "
                      f"(perplexity ratio <= {max_ratio:g}): the best that fits is {describe(best)}; {fallback}")
    fits = [p for p in points if p.bytes <= max_bytes + 1e-9 and p.benchmark]
    if best is None:
        return best, advice
    note = "chosen by perplexity ratio"
    if fits:
        top = max(fits, key=lambda p: (p.benchmark[0], -p.bytes))
        which = "the same point" if top is best else describe(top)
        note += (f"; by the benchmark mean the best that fits is {which} "
                 f"({top.benchmark[0]:.4f} ± {top.benchmark[1]:.4f})")
    return best, f"{advice} ({note})"


def _recommend(points: list[Point], max_bytes: float) -> tuple[Point | None, str]:
    fits = [p for p in points if p.bytes <= max_bytes + 1e-9]
    if not fits:
        smallest = min(points, key=lambda p: p.bytes)
        return None, (f"nothing measured fits {max_bytes:g} bytes per token per layer; the smallest point is "
                      f"{describe(smallest)}")
    best = min(fits, key=lambda p: (p.ratio, p.bytes))
    if best.kind == "original":
        converted = [p for p in fits if p.kind == "converted"]
        runner = min(converted, key=lambda p: (p.ratio, p.bytes)) if converted else None
        tail = (f"; the best conversion that fits, {describe(runner)}, is worse" if runner else
                "; no measured conversion fits")
        return best, (f"do not convert, quantize the cache: {describe(best)} is the best at <= {max_bytes:g} "
                      f"bytes per token per layer{tail}")
    originals = [p for p in fits if p.kind == "original"]
    rival = (f"; the original's best that fits, {describe(min(originals, key=lambda p: p.ratio))}, is worse"
             if originals else "; no cache type gives the original that few bytes")
    return best, f"convert: {describe(best)} is the best at <= {max_bytes:g} bytes per token per layer{rival}"


def describe(p: Point) -> str:
    return f"{p.label} with a {p.cache} cache ({p.bytes:.0f} B/token/layer, ratio {p.ratio:.3f})"


def markdown_table(points: list[Point], reference_bytes: float, ratio_head: str = "ratio (worst domain)") -> list[str]:
    """Rows by bytes: label, cache, bits per value, bytes, fraction of the f16 original, ratio, on the frontier.
    ratio_head names the ratio: the worst kind of text where several were scored, else what the one text is."""
    front = {id(p) for p in pareto(points)}
    bench = any(p.benchmark for p in points)
    extra = (" benchmark mean |", "---|") if bench else ("", "")
    head = f"| model | cache | bits/value | bytes/token/layer | x smaller | {ratio_head} | frontier |"
    lines = [head + extra[0],
             "|---|---|---|---|---|---|---|" + extra[1]]
    for p in sorted(points, key=lambda p: (-p.bytes, p.ratio)):
        mean = (f" {p.benchmark[0]:.4f} ± {p.benchmark[1]:.4f} |" if p.benchmark else " |") if bench else ""
        lines.append(f"| {p.label} | {p.cache} | {bits_per_value(p.cache)} | {p.bytes:.0f} | "
                     f"{reference_bytes / p.bytes:.2f} | {p.ratio:.3f}{f' ({p.worst_domain})' if p.worst_domain else ''} "
                     f"| {'yes' if id(p) in front else ''} |{mean}")
    return lines


def plot(points: list[Point], reference_bytes: float, path, title: str) -> None:
    """Log bytes vs ratio: one line per model (its cache types), the frontier drawn over them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    labels = list(dict.fromkeys(p.label for p in points))
    for label in labels:
        mine = sorted((p for p in points if p.label == label), key=lambda p: p.bytes)
        style = dict(color="black", marker="s", linewidth=2) if mine[0].kind == "original" else dict(marker="o")
        ax.plot([p.bytes for p in mine], [p.ratio for p in mine], label=label, alpha=0.85, **style)
        for p in mine:
            ax.annotate(p.cache, (p.bytes, p.ratio), fontsize=6, textcoords="offset points", xytext=(2, 3))
    front = pareto(points)
    ax.step([p.bytes for p in front], [p.ratio for p in front], where="post", color="tab:red", linewidth=1,
            linestyle="--", label="frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(f"KV cache bytes per token per layer (f16 original: {reference_bytes:.0f})")
    ax.set_ylabel("perplexity / original with f16 cache")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def point_key(latent: int, rope: int) -> str:
    """How `sweep` names a converted point in sweep.json's cache_types ("LATENT+ROPE"); read back by
    points_from_sweep."""
    return f"{latent}+{rope}"


def points_from_sweep(result: dict) -> list[Point]:
    """Frontier points of a `sweep` result: its cache-type measurements (llama.cpp's, or transformers' caches), or
    (transformers without cache types) each model at a 16-bit cache, bytes = cached values x 2."""
    if "cache_types" in result:
        originals = result["cache_types"]["original"]
        reference = originals[reference_cache(originals)]["perplexity"]
        points = []
        for key, types in result["cache_types"].items():
            latent, rope = (None, None) if key == "original" else map(int, key.split("+"))  # point_key's form
            label = "original" if latent is None else f"latent {latent} + {rope}"
            for entry, m in types.items():
                points.append(Point(label=label, kind="original" if latent is None else "converted", cache=entry,
                                    bytes=round(m["bytes"], 1), ratio=m["perplexity"] / reference, latent_dim=latent,
                                    rope_dim=rope, benchmark=_pair(m.get("benchmark"))))
        return points
    reference = result["original"]["perplexity"]
    points = [Point(label="original", kind="original", cache="16-bit", ratio=1.0,
                    bytes=2.0 * result["original"]["values_per_token_per_layer"],
                    benchmark=_pair(result["original"].get("benchmark")))]
    points += [Point(label=f"latent {p['latent_dim']} + {p['rope_dim']}", kind="converted", cache="16-bit",
                     bytes=2.0 * p["values_per_token_per_layer"], ratio=p["perplexity"] / reference,
                     latent_dim=p["latent_dim"], rope_dim=p["rope_dim"], benchmark=_pair(p.get("benchmark")))
               for p in result["points"]]
    return points


def _pair(value) -> tuple[float, float] | None:
    """A benchmark (mean, stderr) as JSON gave it back (a list), or None."""
    return None if value is None else (float(value[0]), float(value[1]))


def score_in_llamacpp(original: str, gguf_file: str, checkpoints: dict, text_file, ctx: int, chunks: int,
                      original_types: list[str], converted_types: list[str], tmp, tasks=None, known=None,
                      on_scored=None) -> dict:
    """{"original" | str(key): {cache type: {"perplexity", "bytes"[, "benchmark"]}}} measured by llama-perplexity for
    the checkpoints {key: directory}: the original GGUF re-typed to F32 (the values the conversion read), each
    checkpoint exported f32. tasks(model_file, cache, run_flags) -> (mean, stderr), when given, adds each model's
    benchmark mean under each cache type. known: scores of an interrupted run in the same form, taken as they are
    and not measured again (a model all of whose types are known is not even exported); on_scored(key, type,
    measurement) is called after each measurement, so a caller can keep them as they come."""
    from pathlib import Path

    from ..engines.llamacpp import perplexity_per_cache_type, quantize
    from ..gguf_export import GGUFSettings, export_gguf

    tmp = Path(tmp)
    known = known or {}
    scored = {}

    def measure(key: str, entries: list[str], model_file, flags: list) -> None:
        """Scores `key` under each entry not known yet, into scored[key] beside the known ones."""
        done = {entry: known[key][entry] for entry in entries if entry in known.get(key, {})}
        for entry in entries:
            if entry in done:
                continue
            done.update(perplexity_per_cache_type(model_file, text_file, ctx, chunks, [entry], flags))
            if tasks is not None:
                done[entry]["benchmark"] = tasks(model_file, entry, flags)
            if on_scored is not None:
                on_scored(key, entry, done[entry])
        scored[key] = {entry: done[entry] for entry in entries}  # in the order asked

    def unknown(key: str, entries: list[str]) -> bool:
        return any(entry not in known.get(key, {}) for entry in entries)

    types = original_types if "f16" in original_types else ["f16", *original_types]
    source = tmp / "original-f32.gguf"
    if unknown("original", types):
        quantize(Path(original) / gguf_file, source, "F32", allow_requantize=True)
    measure("original", types, source, [])
    source.unlink(missing_ok=True)
    mla_types = list(dict.fromkeys(split_types(t)[0] for t in converted_types))
    for key, path in checkpoints.items():
        model_file, flags = tmp / f"checkpoint-{key}-f32.gguf", []
        if unknown(str(key), mla_types):
            flags = export_gguf(GGUFSettings(checkpoint=str(path), output=str(model_file), outtype="f32",
                                             tokenizer_gguf=str(Path(original) / gguf_file),
                                             overwrite=True))["run_flags"]
        measure(str(key), mla_types, model_file, flags)
        model_file.unlink(missing_ok=True)
    return scored
