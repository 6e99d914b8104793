"""Is this the model it claims to be? Checks that a converted checkpoint was written by this tool, from the
original it is compared with (eval) or distilled from (heal), and that two tokenizers are the same by content.

A comparison of two models that read text differently, or of a checkpoint against a model it was not made from,
prints a plausible report of the wrong thing; these checks refuse it in one line before any work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import UserError

# encoded by both tokenizers: a difference in pre-tokenization or normalization shows here even when the
# vocabularies agree
PROBE_TEXT = ("The quick brown fox, 3.14159 — naïve café; def f(x):\n\treturn x**2  # 你好, мир! <b>ok</b>  "
              "   don't  SHOUT")


def read_record(model_dir: str | Path) -> dict:
    """conversion.json of a directory as written, or {} when it has none that parses as a record."""
    try:
        record = json.loads((Path(model_dir) / "conversion.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def conversion_record(model_dir: str, flag: str) -> dict:
    """conversion.json of a checkpoint this tool wrote (convert, heal or rebalance), or a one-line refusal."""
    path = Path(model_dir)
    if not path.is_dir():
        raise UserError(f"{flag} {model_dir} is not a directory; pass the directory transmla-tool convert wrote")
    record = read_record(path)
    if record.get("tool") != "transmla_tool":
        model_type = _model_type(path)
        what = f"a {model_type} model" if model_type else "not a model directory"
        raise UserError(f"{flag} {model_dir} is {what} without a conversion.json written by transmla-tool; pass a "
                        "directory that transmla-tool convert (or heal) wrote")
    return record


def converted_from(path: str, flag: str, model: str, gguf_file: str | None, source_flag: str = "--model") -> dict:
    """conversion.json of a checkpoint this tool wrote from `model` (convert, heal or rebalance; `source_flag` names
    the option that gave `model`); not such a directory, or converted from other weights: a one-line refusal. A
    record too old to name its source is said on stderr and accepted."""
    record = conversion_record(path, flag)
    warning = check_source(record, model, gguf_file, source_flag, path)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return record


def gguf_converted_from(path: str, flag: str, model: str, gguf_file: str | None) -> None:
    """A GGUF scored as a conversion of `model`: refused when export-gguf recorded other source weights in it; a
    file that records none (another tool's, or exported before the record existed) is said on stderr and taken."""
    from .gguf_export import source_record

    record = source_record(Path(path))
    if not record.get("source_identity"):
        print(f"warning: {flag} {path} does not record the model it was converted from (not written by this "
              f"transmla-tool's export-gguf): cannot check that --model {model} is that model", file=sys.stderr)
        return
    check_source(record, model, gguf_file, "--model", f"{flag} {path}")


def labelled_checkpoint(spec: str, flag: str, model: str, gguf_file: str | None) -> tuple[str, Path, dict]:
    """'LABEL=DIR' naming a checkpoint this tool wrote from `model` -> (label, directory, its conversion.json), or
    a one-line refusal before any work."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise UserError(f"{flag} {spec!r} is not LABEL=DIR (e.g. {flag} \"160+64=runs/ckpt/mix-docs-default-224\")")
    return label, Path(path), converted_from(path, f"{flag} {label}:", model, gguf_file)


def calibrated_on(recorded: str, ours: str, flag: str) -> bool:
    """Whether a conversion's recorded calibration files (`--calib-data`, comma-joined) are `ours` (comma-joined) by
    file name; where they are and the recorded files are still there, they must hold the same documents: a one-line
    refusal otherwise (text that `ours`' run holds out could be text the conversion was calibrated on). Recorded files
    that are gone are said on stderr and taken by name."""
    theirs, mine = (sorted((Path(p) for p in files.split(",") if p), key=lambda p: p.name)
                    for files in (recorded, ours))
    if [p.name for p in theirs] != [p.name for p in mine]:
        return False
    for before, now in zip(theirs, mine):
        if not before.exists():
            print(f"warning: {flag} was calibrated on {before}, which is gone: cannot check that it holds the "
                  f"documents of {now}", file=sys.stderr)
        elif before.resolve() != now.resolve() and before.read_bytes() != now.read_bytes():
            raise UserError(f"{flag} was calibrated on {before}, other documents than this run's {now}: the held-out "
                            f"text could overlap its calibration; use the splits it was calibrated on (those in "
                            f"{before.parent}: eval scripts' --data-dir), or convert again")
    return True


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def check_source(record: dict, model: str, gguf_file: str | None, flag: str, converted: str) -> str | None:
    """Refuse when `model` is not the source `record` (a conversion.json) was converted from. Returns a warning when
    the record is too old to say (it predates source_identity), else None."""
    from .io.source import open_source

    recorded = record.get("source_identity")
    if not recorded:
        return (f"{converted} was converted by an older transmla-tool that did not record its source's identity: "
                f"cannot check that {flag} {model} is the model it was converted from")
    identity = open_source(model, gguf_file).identity()
    if identity != recorded:
        raise UserError(f"{converted} was converted from {record.get('source')}, not from {flag} "
                        f"{model if not gguf_file else f'{model}/{gguf_file}'} (the weights differ); pass the model it "
                        "was converted from")
    return None


def tokenizer_content(tokenizer) -> dict:
    """What decides how a tokenizer reads text: vocabulary, merges, special tokens."""
    merges = []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json.loads(backend.to_str()).get("model", {})
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token")}
    return {"vocab": tokenizer.get_vocab(), "merges": merges, "special": {k: str(v) for k, v in special.items()}}


def compare_tokenizers(a, b, name_a: str, name_b: str) -> None:
    """Refuse, naming the first difference, when two tokenizers would not read text the same way."""
    first, second = tokenizer_content(a), tokenizer_content(b)
    problem = None
    va, vb = first["vocab"], second["vocab"]
    if va != vb:
        if len(va) != len(vb):
            problem = f"vocabularies of {len(va)} and {len(vb)} tokens"
        else:
            moved = sorted(t for t in va if vb.get(t) != va[t])
            example = moved[0] if moved else next(iter(vb.keys() - va.keys()))
            problem = (f"{len(moved) or 'some'} tokens with other ids (e.g. {example!r}: {va.get(example)} vs "
                       f"{vb.get(example)})")
    elif first["merges"] != second["merges"]:
        problem = f"other merges ({len(first['merges'])} vs {len(second['merges'])})"
    elif first["special"] != second["special"]:
        diff = {k: (first["special"][k], second["special"].get(k)) for k in first["special"]
                if first["special"][k] != second["special"].get(k)}
        problem = "other special tokens (" + ", ".join(f"{k} {x!r} vs {y!r}" for k, (x, y) in diff.items()) + ")"
    elif a(PROBE_TEXT, add_special_tokens=False).input_ids != b(PROBE_TEXT, add_special_tokens=False).input_ids:
        problem = "the same vocabulary but other token ids for the same text (pre-tokenizer or normalizer differ)"
    if problem:
        raise UserError(f"the tokenizers of {name_a} and {name_b} differ: {problem}; they must be the same model's "
                        "(pass the model the checkpoint was converted from)")
