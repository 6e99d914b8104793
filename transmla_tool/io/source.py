"""Read a source checkpoint one tensor at a time.

A `CheckpointSource` gives the config, the tokenizer location and tensors by their transformers name,
loading each only when asked, so converting a 70B model never holds more than the layer in hand.
Backends: a local directory of safetensors (sharded or not), a hub id (downloaded with
huggingface_hub, then read as a directory) and a GGUF file (dequantized tensor by tensor with the
gguf package and transformers' own GGUF name mapping).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from .gguf_fields import field_text

# What we need from a hub repository: weights, config, tokenizer and generation config.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
SAMPLE_BYTES = 1 << 20  # read from each end of every weight file for the source's identity


@dataclass
class CheckpointSource:
    """Base class: subclasses implement `_load` and `names`."""

    location: str
    config: object = None
    tokenizer_args: tuple = ()
    tokenizer_kwargs: dict = field(default_factory=dict)

    def names(self) -> set[str]:
        raise NotImplementedError

    def weight_files(self) -> list[Path]:
        """The files the weights are read from."""
        raise NotImplementedError

    def identity(self) -> str:
        """A digest of the weights' content (file names, sizes and the first and last MiB of each): equal for
        the same checkpoint wherever it lies, different for other weights. conversion.json records it so that
        eval and heal can check they were given the model a checkpoint was converted from."""
        digest = hashlib.sha256()
        for path in sorted(self.weight_files(), key=lambda p: p.name):
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}:".encode())
            with open(path, "rb") as f:
                digest.update(f.read(SAMPLE_BYTES))
                if size > SAMPLE_BYTES:
                    f.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                    digest.update(f.read(SAMPLE_BYTES))
        return digest.hexdigest()[:32]

    def fingerprint(self) -> dict:
        """What a resumed conversion must find unchanged: the weights' identity, each file's size and
        modification time, and the config."""
        files = {p.name: {"bytes": p.stat().st_size, "mtime": round(p.stat().st_mtime, 3)}
                 for p in self.weight_files()}
        config = hashlib.sha256(self.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        return {"identity": self.identity(), "files": files, "config": config}

    def has(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor, cast to `dtype` (None: as stored, e.g. to pass a bf16 embedding through without a
        2x larger fp32 copy)."""
        if not self.has(name):
            raise UserError(
                f"tensor '{name}' is missing from {self.location}; the checkpoint is incomplete or not "
                "of the architecture its config claims"
            )
        tensor = self._load(name)
        return tensor if dtype is None else tensor.to(dtype)

    def get_optional(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        return self.get(name, dtype) if self.has(name) else None

    def _load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(*self.tokenizer_args, **self.tokenizer_kwargs)

    def load_generation_config(self):
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(*self.tokenizer_args, **self.tokenizer_kwargs)
        except (OSError, ValueError, TypeError):
            return GenerationConfig.from_model_config(self.config)


# what every family we convert names in config.json; without them transformers would assume its defaults (a 7B
# shape) and the conversion would fail deep inside with a shape error
REQUIRED_CONFIG = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                   "intermediate_size")


def _check_config_file(directory: Path) -> None:
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json; pass a checkpoint directory (config.json and .safetensors), "
                        "a hub id, or a GGUF with --gguf-file")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); restore the checkpoint's config.json") from exc
    if not isinstance(raw, dict):
        raise UserError(f"{path} does not hold a JSON object; restore the checkpoint's config.json")
    nested = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    missing = [key for key in REQUIRED_CONFIG if raw.get(key) is None and nested.get(key) is None]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)} (transformers would assume its defaults); restore the "
                        "checkpoint's config.json")


def safetensors_header(path: Path) -> dict:
    """The tensor table of a safetensors file, checked against the file's size: a truncated or foreign file is a
    one-line error here, not a traceback in the middle of a conversion."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError(f"header length {length} in a file of {size} bytes")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a readable safetensors file ({exc}); download or copy it again") from exc
    if 8 + length + end > size:
        raise UserError(f"{path} is truncated ({size} bytes, its header promises {8 + length + end}); download or "
                        "copy it again")
    return header


class SafetensorsSource(CheckpointSource):
    """A directory with model.safetensors or model-0000x-of-0000y.safetensors + index."""

    def __init__(self, directory: str | os.PathLike, display: str | None = None):
        from transformers import AutoConfig

        directory = Path(directory)
        super().__init__(location=display or str(directory))
        self.directory = directory
        _check_config_file(directory)
        try:
            self.config = AutoConfig.from_pretrained(directory)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"cannot read a config.json in {directory}: {exc}") from exc
        self.tokenizer_args = (str(directory),)
        self._headers: dict[str, dict] = {}
        self._file_of = self._index(directory, self._headers)

    def parameter_count(self) -> int:
        import math

        return sum(math.prod(t["shape"]) for header in self._headers.values() for t in header.values())

    def shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape from its file's header (nothing loaded), or None when it is absent."""
        file = self._file_of.get(name)
        return None if file is None else tuple(self._headers[file][name]["shape"])

    @staticmethod
    def _index(directory: Path, headers: dict) -> dict[str, str]:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc}); download the "
                                "checkpoint again") from exc
            missing = sorted({f for f in weight_map.values() if not (directory / f).exists()})
            if missing:
                raise UserError(f"{directory} lists shards that are missing: {', '.join(missing[:3])}")
            for name in sorted(set(weight_map.values())):
                headers[name] = safetensors_header(directory / name)
            unlisted = sorted(t for t, f in weight_map.items() if t not in headers[f])
            if unlisted:
                raise UserError(f"{index} maps {unlisted[0]} to {weight_map[unlisted[0]]}, which does not hold it; "
                                "download the checkpoint again")
            return dict(weight_map)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise UserError(
                f"no .safetensors weights in {directory}; convert .bin checkpoints with "
                "transformers' save_pretrained(safe_serialization=True) or pass --gguf-file"
            )
        for path in files:
            headers[path.name] = safetensors_header(path)
        return {key: name for name, header in headers.items() for key in header}

    def names(self) -> set[str]:
        return set(self._file_of)

    def weight_files(self) -> list[Path]:
        return [self.directory / name for name in sorted(set(self._file_of.values()))]

    def _load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # Opened per tensor and closed at once: a handle kept open keeps every page it touched mapped,
        # and a whole 70B model's pages would pile up in the process (they count in its RSS).
        with safe_open(self.directory / self._file_of[name], framework="pt") as f:
            return f.get_tensor(name)


class GGUFSource(CheckpointSource):
    """A GGUF file, dequantized one tensor at a time.

    transformers' GGUF loader dequantizes every tensor up front; we reuse its config parsing, its
    GGUF->HF name map and its per-architecture tensor fix-ups (e.g. undoing llama.cpp's q/k row
    permutation) but call them per tensor.
    """

    def __init__(self, directory: str | os.PathLike, gguf_file: str):
        from gguf import GGUFReader
        from transformers import AutoConfig

        path = Path(directory) / gguf_file
        if not path.exists():
            raise UserError(f"GGUF file {path} does not exist; check --model and --gguf-file")
        super().__init__(location=str(path))
        try:  # read first: a truncated or foreign file fails here with numpy's or struct's words, not the loader's
            self._reader = GGUFReader(str(path))
        except Exception as exc:  # every parse failure means the same thing to the user
            raise UserError(f"{path} is not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: "
                            f"{exc}); download or copy it again") from exc
        try:
            self.config = AutoConfig.from_pretrained(str(directory), gguf_file=gguf_file)
        except (ValueError, KeyError) as exc:
            raise UserError(f"cannot read the GGUF metadata of {path}: {exc}") from exc
        self.tokenizer_args = (str(directory),)
        self.tokenizer_kwargs = {"gguf_file": gguf_file}
        self._by_hf_name = self._map_names()

    def load_tokenizer(self):
        from ..gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(*self.tokenizer_args, self.tokenizer_kwargs["gguf_file"], reader=self._reader)

    def _map_names(self) -> dict:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        architecture = field_text(self._reader.fields["general.architecture"])
        processor_cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
        self._processor = processor_cls(config=self.config.to_dict())
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config)
        gguf_to_hf = get_gguf_hf_weights_map(skeleton, self._processor)
        by_hf = {}
        for tensor in self._reader.tensors:
            if tensor.name in gguf_to_hf:
                by_hf[gguf_to_hf[tensor.name]] = tensor
        return by_hf

    def names(self) -> set[str]:
        return set(self._by_hf_name)

    def weight_files(self) -> list[Path]:
        return [Path(self.location)]

    def parameter_count(self) -> int:
        return sum(int(t.n_elements) for t in self._reader.tensors)

    def _load(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        tensor = self._by_hf_name[name]
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = self._processor.process(weights=weights, name=tensor.name).weights
        return torch.from_numpy(np.array(weights, copy=True))


def open_source(model: str, gguf_file: str | None = None, revision: str | None = None) -> CheckpointSource:
    """A local directory, a local GGUF (directory + file name) or a hub id."""
    if gguf_file:
        directory = model if os.path.isdir(model) else _download(model, revision, [gguf_file, "*.json"])
        return GGUFSource(directory, gguf_file)
    if os.path.isdir(model):
        return SafetensorsSource(model)
    if os.path.exists(model):
        raise UserError(f"--model {model} is a file; pass its directory (and --gguf-file for GGUF)")
    return SafetensorsSource(_download(model, revision, HUB_PATTERNS), display=model)


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except HFValidationError as exc:
        raise UserError(f"--model {repo_id} is neither a local directory nor a valid hub id") from exc
    except Exception as exc:  # network, auth, missing repo: all end the same way for the user
        raise UserError(
            f"cannot download {repo_id} from the hub ({type(exc).__name__}: {exc}); "
            "check the id, your network and HF_TOKEN, or pass a local directory"
        ) from exc
