"""On-disk state of an interrupted conversion (`convert --resume`).

After each finished layer the staging directory holds, under resume/: the calibration ids, the source's
residual stream (and each target's own stream when the method calibrates on converted inputs), and a
state file naming the next layer and the settings it must be continued with. The state file is written
last, so a kill at any moment leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from ..errors import UserError
from .staging import RESUMABLE_MARK, staging_path

if TYPE_CHECKING:
    from ..convert import ConvertSettings

RESUME_DIR = "resume"


# the settings that do not change what a conversion makes; every other one does (--batch-size too: it changes the
# rounding of the statistics), and one added later counts until it is listed here
NOT_THE_RESULT = ("progress", "overwrite", "resume", "output", "refuse_unservable")


def result_settings(settings: ConvertSettings) -> dict:
    """The settings that change what a conversion makes, as JSON reads them back."""
    return json.loads(json.dumps({k: v for k, v in asdict(settings).items() if k not in NOT_THE_RESULT},
                                 sort_keys=True, default=str))


def resume_key(settings: ConvertSettings, targets, source_fingerprint: dict) -> dict:
    """What must be equal for a partial conversion to be continued: every setting that changes the result and the
    source's weights and config."""
    key = result_settings(settings)
    key["latent_dims"] = [t.latent_dim for t in targets]
    key["source"] = source_fingerprint
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def _differences(saved: dict, current: dict) -> list[str]:
    """The fields that differ, named the way a user sets them."""
    out = []
    for name in sorted(set(saved) | set(current)):
        before, after = saved.get(name), current.get(name)
        if before == after:
            continue
        if name == "source" and isinstance(before, dict) and isinstance(after, dict):
            changed = [f for f in sorted(set(before.get("files", {})) | set(after.get("files", {})))
                       if before.get("files", {}).get(f) != after.get("files", {}).get(f)]
            what = f"weight files changed: {', '.join(changed[:3])}" if changed else (
                "config changed" if before.get("config") != after.get("config") else "weights changed")
            out.append(f"the source model ({what})")
        elif name == "method" and isinstance(before, dict) and isinstance(after, dict):
            out += [f"--set {k}: {before.get(k)!r} -> {after.get(k)!r}" for k in sorted(set(before) | set(after))
                    if before.get(k) != after.get(k)]
        else:
            out.append(f"--{name.replace('_', '-')}: {before!r} -> {after!r}")
    return out


def load_resume(settings, targets, ids, source_fingerprint: dict) -> dict | None:
    """The checkpointed state of an interrupted conversion, or None to start from layer 0. Checked
    before the staging directory is entered, so a refused resume leaves the unfinished work alone."""
    state_file = staging_path(targets[0].output) / RESUME_DIR / "state.json"
    if not settings.resume or not state_file.exists():
        return None
    state = json.loads(state_file.read_text())
    saved = state["key"] if isinstance(state["key"], dict) else json.loads(state["key"])
    changed = _differences(saved, resume_key(settings, targets, source_fingerprint))
    if changed:
        raise UserError(f"the unfinished conversion in {state_file.parent.parent} was made with other settings "
                        f"({'; '.join(changed)}); rerun it with the same ones, or pass --overwrite instead of "
                        "--resume to start over")
    if not torch.equal(torch.load(state_file.parent / "ids.pt"), ids):
        raise UserError("the calibration text differs from the unfinished conversion's; use the same "
                        "--calib-data, or --overwrite to start over")
    return state


def save_resume(settings, targets, ids, hidden, next_layer: int, source_fingerprint: dict) -> None:
    """Checkpoint after a finished layer: the calibration stream(s), then the state file (the commit point)."""
    root = targets[0].staging / RESUME_DIR
    root.mkdir(exist_ok=True)

    def save(obj, name):
        tmp = root / f"{name}.tmp"
        torch.save(obj, tmp)
        os.replace(tmp, root / name)

    if next_layer == 1:
        save(ids, "ids.pt")
    save(hidden.cpu(), "hidden.pt")
    for t in targets:
        if t.stream is not None:
            save(t.stream.cpu(), f"stream-{t.latent_dim}.pt")
    state = {"key": resume_key(settings, targets, source_fingerprint), "next_layer": next_layer,
             "reports": {str(t.latent_dim): t.reports for t in targets},
             "constant_channel": targets[0].constant_channel}
    tmp = root / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, root / "state.json")
    for t in targets:
        (t.staging / RESUMABLE_MARK).touch()
