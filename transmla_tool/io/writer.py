"""Write a checkpoint while its tensors are still being produced, in bounded memory, resumably.

Tensors arrive in groups (the embeddings, one decoder layer, the head); each group is written at
once to its own part file under `parts/` (atomically: temporary name, then rename), so memory holds
one group and a killed run can skip the groups already on disk. `close()` assembles the final shards
from the parts, one shard in memory at a time, following the plan of huggingface_hub's splitter run
on the *planned* (meta) state dict, so files and index are exactly what `save_pretrained` would write.
A part is removed as soon as every shard that reads it is written, so the disk holds about one copy of
the checkpoint during assembly, not two (PEAK_SHARDS of headroom: the shard being written and the parts it
reads that a later shard reads too).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from .staging import ASSEMBLED_MARK

# Memory during assembly is one shard: 2GB keeps an 8B conversion's peak low (save_pretrained's
# 5GB default would dominate it). Pass max_shard_size to change it.
DEFAULT_MAX_SHARD = "2GB"
PARTS = "parts"
PEAK_SHARDS = 2  # disk beyond one copy of the checkpoint while it is assembled, in shards


def check_shard_size(max_shard_size) -> None:
    """A size huggingface_hub's splitter accepts ('2GB', '500MB', bytes), checked before any work."""
    from ..errors import UserError

    try:
        split_torch_state_dict_into_shards({"probe": torch.zeros(1)}, max_shard_size=max_shard_size)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--max-shard-size {max_shard_size!r}: {exc}") from exc


def shard_bytes(max_shard_size) -> int:
    """The largest shard's size in bytes, read as huggingface_hub's splitter reads it (1000-based units)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    return max_shard_size if isinstance(max_shard_size, int) else parse_size_to_int(max_shard_size)


class ShardedWriter:
    def __init__(self, directory: str | Path, planned: dict[str, torch.Tensor], max_shard_size=DEFAULT_MAX_SHARD):
        self.directory = Path(directory)
        self.parts = self.directory / PARTS
        self.parts.mkdir(parents=True, exist_ok=True)
        self.planned = planned
        self.split = split_torch_state_dict_into_shards(planned, max_shard_size=max_shard_size)

    def has_part(self, part: str) -> bool:
        return (self.parts / f"{part}.safetensors").exists()

    def add_part(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one group of tensors (cast to the planned dtype) as part file `part`."""
        out = {}
        for name, tensor in tensors.items():
            if name not in self.planned:
                raise KeyError(f"tensor {name} is not part of the planned checkpoint")
            expected = self.planned[name]
            if tuple(tensor.shape) != tuple(expected.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != planned {tuple(expected.shape)}")
            out[name] = tensor.detach().to(device="cpu", dtype=expected.dtype).contiguous()
        path = self.parts / f"{part}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(out, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)

    def _part_index(self) -> dict[str, Path]:
        where = {}
        for path in sorted(self.parts.glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in where:
                        raise ValueError(f"tensor {name} written twice ({where[name].name}, {path.name})")
                    where[name] = path
        return where

    def close(self) -> list[str]:
        """Assemble the shards (and the index when sharded) and remove the parts. Resumable: each shard is written
        under a temporary name and renamed, and only then are the parts that no unwritten shard reads removed;
        ASSEMBLED_MARK is set once all shards are there. A run killed here writes the shards still missing from
        the parts still there, or finds the mark and only removes what is left of the parts."""
        if not (self.directory / ASSEMBLED_MARK).exists():
            self._assemble()
            (self.directory / ASSEMBLED_MARK).touch()
        shutil.rmtree(self.parts, ignore_errors=True)
        return sorted(self.split.filename_to_tensors)

    def _assemble(self) -> None:
        # a shard under its final name is whole (written under a temporary one, then renamed)
        pending = {f: names for f, names in self.split.filename_to_tensors.items() if not (self.directory / f).exists()}
        where = self._part_index()
        missing = sorted({n for names in pending.values() for n in names} - set(where))
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        for filename, names in list(pending.items()):
            self._write_shard(filename, names, where)
            del pending[filename]
            still_read = {where[n] for rest in pending.values() for n in rest}
            for path in {where[n] for n in names} - still_read:
                path.unlink(missing_ok=True)
        if self.split.is_sharded:
            index = {"metadata": dict(self.split.metadata), "weight_map": dict(self.split.tensor_to_filename)}
            tmp = self.directory / "model.safetensors.index.json.tmp"
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            os.replace(tmp, self.directory / "model.safetensors.index.json")

    def _write_shard(self, filename: str, names: list[str], where: dict[str, Path]) -> None:
        shard = {}
        for path in sorted({where[n] for n in names}):
            with safe_open(path, framework="pt") as f:
                for name in names:
                    if where[name] == path:
                        shard[name] = f.get_tensor(name)
        tmp = self.directory / f"{filename}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.directory / filename)
