"""`heal`'s settings, their checks, and the fingerprint a resumed run must match."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from ..ops.kv_quant import BLOCK, SIMULATED_CACHE_TYPES, mla_cache_problem
from ..provenance import read_record

SETTINGS_FILE = "settings.json"  # in the checkpoint directory: what a --resume must match
# Settings a resumed run may change: they do not touch the trained weights, the data order or the schedule.
RESUMABLE_CHANGES = ("output", "save_every", "save_total_limit", "eval_data", "eval_every", "eval_windows",
                     "checkpoint_dir", "resume", "overwrite", "progress", "loss_chunk")


@dataclass
class HealSettings:
    model: str  # a directory written by `transmla-tool convert`
    output: str
    data: str
    teacher: str | None = None  # the source model; None trains on the LM loss alone
    teacher_gguf_file: str | None = None
    text_field: str = "text"
    # share of the training windows rebuilt as their first half twice (data.with_repeats): distillation on text whose
    # second half the teacher copies from the first, for the copying a low-rank cache loses (docs/benchmarks.md)
    repeat_share: float = 0.0
    max_tokens: int = 2_000_000
    max_steps: int | None = None
    seq_len: int = 512
    batch_size: int = 4  # per process
    grad_accum: int = 1
    lr: float = 3e-5
    warmup_steps: int | None = None  # default: 5% of the steps, at most 100
    weight_decay: float = 0.0
    kd_weight: float = 1.0
    lm_weight: float = 0.0
    temperature: float = 1.0
    train: str = "attention"  # "attention" or "all"
    # Quantization-aware healing: train through this llama.cpp cache type's quantizer (ops/kv_quant.py), for a
    # model that will be served over that cache (None: an exact cache)
    cache_type: str | None = None
    gradient_checkpointing: bool = False
    # logits of at most this many positions at once in the loss (0: whole windows); at 8192 tokens a window's
    # logits are 1.6 GB per model for SmolLM2's vocabulary (heal/loss.py)
    loss_chunk: int = 1024
    mixed_precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    save_every: int = 0  # steps between resumable checkpoints (0: only at the end)
    save_total_limit: int | None = None  # keep at most this many checkpoints (oldest removed first)
    eval_data: str | None = None
    eval_every: int = 0
    eval_windows: int = 16
    # length of the held-out windows (None: seq_len): train on short windows and score at the serving length
    eval_seq_len: int | None = None
    checkpoint_dir: str | None = None  # default: <output>.ckpt
    resume: bool = False
    shuffle_buffer: int = 1024
    seed: int = 0
    overwrite: bool = False
    progress: bool = True

    def validate(self) -> None:
        if self.train not in ("attention", "all"):
            raise UserError(f"--train must be attention or all, got {self.train}")
        check_cache_type(self.cache_type)
        if self.teacher is None and self.lm_weight <= 0:
            raise UserError("without --teacher the distillation loss is unavailable: pass --teacher or --lm-weight > 0")
        if self.kd_weight < 0 or self.lm_weight < 0 or self.kd_weight + self.lm_weight <= 0:
            raise UserError("--kd-weight and --lm-weight must be >= 0 and not both 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps must be >= 1, got {self.max_steps} (leave it out to train --max-tokens)")
        check_repeat_share(self.repeat_share)
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if min(self.seq_len, self.batch_size, self.grad_accum) < 1 or self.temperature <= 0:
            raise UserError("--seq-len, --batch-size and --grad-accum must be >= 1, --temperature > 0")
        if self.eval_seq_len is not None and self.eval_seq_len < 1:
            raise UserError(f"--eval-seq-len must be >= 1 (leave it out to score at --seq-len), got {self.eval_seq_len}")
        if self.loss_chunk < 0:
            raise UserError(f"--loss-chunk must be >= 0 (0: whole windows), got {self.loss_chunk}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError("--save-total-limit must be >= 1")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise UserError("--mixed-precision must be auto, no, bf16 or fp16")
        if not (Path(self.model) / "config.json").exists():
            raise UserError(f"--model {self.model} is not a directory written by transmla-tool convert")
        check_converted(self.model)


def check_repeat_share(share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise UserError(f"--repeat-share must be between 0 and 1, got {share}")


def check_cache_type(name: str | None) -> None:
    if name is not None and name not in SIMULATED_CACHE_TYPES:
        raise UserError(f"--cache-type {name}: healing can train through {', '.join(SIMULATED_CACHE_TYPES)} (the cache "
                        "types reproduced in torch); leave it out for an exact cache")


def check_cache_row(name: str | None, latent: int, rope: int) -> None:
    """A block-quantized cache stores each token's row [latent | rotary key] in blocks of 32 values and llama.cpp reads
    the values from the latent alone: refuse to train for a cache the engine would not allocate."""
    problem = None if name is None else mla_cache_problem(name, latent, rope)
    if problem:
        raise UserError(f"--cache-type {name}: {problem}; convert with a latent and a rotary key that are multiples "
                        f"of {BLOCK}, or heal for an f16 cache")


def check_converted(model_dir: str) -> None:
    """Healing trains in natural form, which assumes the latent RMSNorm convert linearized: refuse any other
    DeepSeek-V3 checkpoint (a genuine DeepSeek model would be altered silently)."""
    if read_record(model_dir).get("tool") != "transmla_tool":
        raise UserError(f"--model {model_dir} has no conversion.json written by transmla-tool convert: heal assumes the "
                        "linearized latent norm convert writes and would alter any other DeepSeek-V3 checkpoint")


def fingerprint(settings: HealSettings, num_processes: int) -> dict:
    """What a resumed run must share with the run that wrote the checkpoints: everything that shapes the
    weights, the schedule or the data order (a changed --batch-size would skip the wrong batches)."""
    values = {k: v for k, v in asdict(settings).items() if k not in RESUMABLE_CHANGES}
    values["processes"] = num_processes
    if not values["repeat_share"]:  # recorded only when used, so checkpoints from before it existed still resume
        del values["repeat_share"]
    return values


def check_fingerprint(ckpt_dir: Path, expected: dict) -> None:
    saved = json.loads((ckpt_dir / SETTINGS_FILE).read_text()) if (ckpt_dir / SETTINGS_FILE).exists() else None
    if saved is None:
        raise UserError(f"{ckpt_dir} records no settings (written by an older transmla-tool?); --resume cannot check "
                        "it continues the same run: pass --overwrite to start over")
    changed = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
    if changed:
        detail = ", ".join(f"{k} {saved.get(k)!r} -> {expected.get(k)!r}" for k in changed)
        raise UserError(f"--resume: the checkpoints in {ckpt_dir} were made with other settings ({detail}); rerun with "
                        "the same settings, or pass --overwrite to start over")
