"""Read a source checkpoint one tensor at a time.

A `CheckpointSource` gives the config, the tokenizer location and tensors by their transformers name,
loading each only when asked, so converting a 70B model never holds more than the layer in hand.
Backends: a local directory of safetensors (sharded or not), a hub id (downloaded with
huggingface_hub, then read as a directory) and a GGUF file (dequantized tensor by tensor with the
gguf package and transformers' own GGUF name mapping).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError

# What we need from a hub repository: weights, config, tokenizer and generation config.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


@dataclass
class CheckpointSource:
    """Base class: subclasses implement `_load` and `names`."""

    location: str
    config: object = None
    tokenizer_args: tuple = ()
    tokenizer_kwargs: dict = field(default_factory=dict)

    def names(self) -> set[str]:
        raise NotImplementedError

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


class SafetensorsSource(CheckpointSource):
    """A directory with model.safetensors or model-0000x-of-0000y.safetensors + index."""

    def __init__(self, directory: str | os.PathLike, display: str | None = None):
        from transformers import AutoConfig

        directory = Path(directory)
        super().__init__(location=display or str(directory))
        self.directory = directory
        try:
            self.config = AutoConfig.from_pretrained(directory)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read a config.json in {directory}: {exc}") from exc
        self.tokenizer_args = (str(directory),)
        self._file_of = self._index(directory)

    @staticmethod
    def _index(directory: Path) -> dict[str, str]:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (directory / f).exists()})
            if missing:
                raise UserError(f"{directory} lists shards that are missing: {', '.join(missing[:3])}")
            return dict(weight_map)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise UserError(
                f"no .safetensors weights in {directory}; convert .bin checkpoints with "
                "transformers' save_pretrained(safe_serialization=True) or pass --gguf-file"
            )
        from safetensors import safe_open

        file_of = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    file_of[key] = path.name
        return file_of

    def names(self) -> set[str]:
        return set(self._file_of)

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
        try:
            self.config = AutoConfig.from_pretrained(str(directory), gguf_file=gguf_file)
        except (ValueError, KeyError) as exc:
            raise UserError(f"cannot read the GGUF metadata of {path}: {exc}") from exc
        self.tokenizer_args = (str(directory),)
        self.tokenizer_kwargs = {"gguf_file": gguf_file}
        self._reader = GGUFReader(str(path))
        self._by_hf_name = self._map_names()

    def load_tokenizer(self):
        from ..gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(*self.tokenizer_args, self.tokenizer_kwargs["gguf_file"], reader=self._reader)

    def _map_names(self) -> dict:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        architecture = self._reader.fields["general.architecture"]
        architecture = bytes(architecture.parts[architecture.data[0]]).decode()
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
