"""`transmla-tool heal`: a short distillation fine-tune of a converted model, with accelerate.

Runs as is on one CPU or GPU, and unchanged under `accelerate launch` (DDP, FSDP, DeepSpeed; see
recipes/accelerate/). The student is trained in natural form (heal/model.py) and exported as a
stock DeepSeek-V3 checkpoint at the end. Loss: kd_weight * KL(teacher || student) at temperature T
(times T^2) + lm_weight * next-token cross-entropy.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data import token_windows
from ..errors import UserError
from ..io.staging import check_target, staged_directory
from .data import train_batches
from .model import is_attention_param, stock_state_dict, to_natural

STATE_FILE = "trainer_state.json"
SETTINGS_FILE = "settings.json"  # in the checkpoint directory: what a --resume must match
# Settings a resumed run may change: they do not touch the trained weights, the data order or the schedule.
RESUMABLE_CHANGES = ("output", "save_every", "save_total_limit", "eval_data", "eval_every", "eval_windows",
                     "checkpoint_dir", "resume", "overwrite", "progress")


@dataclass
class HealSettings:
    model: str  # a directory written by `transmla-tool convert`
    output: str
    data: str
    teacher: str | None = None  # the source model; None trains on the LM loss alone
    teacher_gguf_file: str | None = None
    text_field: str = "text"
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
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    save_every: int = 0  # steps between resumable checkpoints (0: only at the end)
    save_total_limit: int | None = None  # keep at most this many checkpoints (oldest removed first)
    eval_data: str | None = None
    eval_every: int = 0
    eval_windows: int = 16
    checkpoint_dir: str | None = None  # default: <output>.ckpt
    resume: bool = False
    shuffle_buffer: int = 1024
    seed: int = 0
    overwrite: bool = False
    progress: bool = True

    def validate(self) -> None:
        if self.train not in ("attention", "all"):
            raise UserError(f"--train must be attention or all, got {self.train}")
        if self.teacher is None and self.lm_weight <= 0:
            raise UserError("without --teacher the distillation loss is unavailable: pass --teacher or --lm-weight > 0")
        if self.kd_weight < 0 or self.lm_weight < 0 or self.kd_weight + self.lm_weight <= 0:
            raise UserError("--kd-weight and --lm-weight must be >= 0 and not both 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps must be >= 1, got {self.max_steps} (leave it out to train --max-tokens)")
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if min(self.seq_len, self.batch_size, self.grad_accum) < 1 or self.temperature <= 0:
            raise UserError("--seq-len, --batch-size and --grad-accum must be >= 1, --temperature > 0")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError("--save-total-limit must be >= 1")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise UserError("--mixed-precision must be auto, no, bf16 or fp16")
        if not (Path(self.model) / "config.json").exists():
            raise UserError(f"--model {self.model} is not a directory written by transmla-tool convert")
        check_converted(self.model)


def check_converted(model_dir: str) -> None:
    """Healing trains in natural form, which assumes the latent RMSNorm convert linearized: refuse any other
    DeepSeek-V3 checkpoint (a genuine DeepSeek model would be altered silently)."""
    summary = Path(model_dir) / "conversion.json"
    tool = None
    if summary.exists():
        try:
            tool = json.loads(summary.read_text()).get("tool")
        except (json.JSONDecodeError, AttributeError):
            tool = None
    if tool != "transmla_tool":
        raise UserError(f"--model {model_dir} has no conversion.json written by transmla-tool convert: heal assumes the "
                        "linearized latent norm convert writes and would alter any other DeepSeek-V3 checkpoint")


def fingerprint(settings: HealSettings, num_processes: int) -> dict:
    """What a resumed run must share with the run that wrote the checkpoints: everything that shapes the
    weights, the schedule or the data order (a changed --batch-size would skip the wrong batches)."""
    values = {k: v for k, v in asdict(settings).items() if k not in RESUMABLE_CHANGES}
    values["processes"] = num_processes
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


def _lr_lambda(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def distill_loss(student_logits, teacher_logits, labels, settings: HealSettings):
    """(total, kd, lm) per token; logits (B, L, V), labels (B, L) next-token targets already shifted."""
    vocab = student_logits.shape[-1]
    s = student_logits.float().reshape(-1, vocab)
    kd = lm = torch.zeros((), device=s.device)
    if settings.kd_weight > 0 and teacher_logits is not None:
        t = settings.temperature
        log_p_student = F.log_softmax(s / t, dim=-1)
        log_p_teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / t, dim=-1)
        kd = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean") * t * t
    if settings.lm_weight > 0:
        lm = F.cross_entropy(s, labels.reshape(-1))
    return settings.kd_weight * kd + settings.lm_weight * lm, kd.detach(), lm.detach()


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted((p for p in directory.glob("step-*") if (p / STATE_FILE).exists()),
                   key=lambda p: int(p.name.split("-")[1]))
    return found[-1] if found else None


def heal(settings: HealSettings, on_step=None) -> dict:
    """Train, checkpoint, export. on_step(step, metrics) is called after every optimizer step."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    settings.validate()
    cuda = torch.cuda.is_available()
    precision = settings.mixed_precision if settings.mixed_precision != "auto" else ("bf16" if cuda else "no")
    # cpu=True on machines without CUDA turns torchrun-launched processes into gloo MULTI_CPU workers, so
    # `accelerate launch --multi_gpu --num_processes N` (or the DDP recipe) also works on CPUs.
    accelerator = Accelerator(gradient_accumulation_steps=settings.grad_accum, mixed_precision=precision,
                              cpu=not cuda)
    main = accelerator.is_main_process
    check_target(settings.output, settings.overwrite)
    ckpt_dir = Path(settings.checkpoint_dir or f"{settings.output}.ckpt")
    resume_from = latest_checkpoint(ckpt_dir) if settings.resume and ckpt_dir.exists() else None
    if settings.resume and resume_from is None and main:
        print(f"--resume: no checkpoint in {ckpt_dir}, starting from step 0")
    if ckpt_dir.exists() and not settings.resume and list(ckpt_dir.glob("step-*")):
        if not settings.overwrite:
            raise UserError(f"{ckpt_dir} holds checkpoints of an earlier run; pass --resume or --overwrite")
        if main:
            shutil.rmtree(ckpt_dir)
    accelerator.wait_for_everyone()
    if resume_from is not None:
        check_fingerprint(ckpt_dir, fingerprint(settings, accelerator.num_processes))
    set_seed(settings.seed)
    fresh_ckpt_dir = not ckpt_dir.exists()
    try:
        return _train(settings, accelerator, ckpt_dir, resume_from, precision, on_step)
    except BaseException:
        # a run that failed before its first checkpoint leaves no checkpoint directory behind
        if main and fresh_ckpt_dir and ckpt_dir.exists() and latest_checkpoint(ckpt_dir) is None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        raise


def _train(settings: HealSettings, accelerator, ckpt_dir: Path, resume_from, precision: str, on_step) -> dict:
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..evaluate.run import load_model

    cuda = torch.cuda.is_available()
    main = accelerator.is_main_process

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    output_dtype = checkpoint_dtype(settings.model)  # read before loading: loading in fp32 rewrites config.dtype
    student = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32)
    config = student.config
    if config.model_type != "deepseek_v3":
        raise UserError(f"--model {settings.model} is a {config.model_type} model, not a converted DeepSeek-V3 one")
    to_natural(student)
    for name, param in student.named_parameters():
        param.requires_grad_(settings.train == "all" or is_attention_param(name))
    if settings.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    student.config.use_cache = False
    trainable = [p for p in student.parameters() if p.requires_grad]

    teacher = None
    if settings.teacher and settings.kd_weight > 0:
        teacher_dtype = torch.bfloat16 if cuda else torch.float32
        teacher = load_model(settings.teacher, settings.teacher_gguf_file, teacher_dtype, torch.device("cpu"))
        teacher.requires_grad_(False)
        if teacher.config.vocab_size != config.vocab_size:
            raise UserError("teacher and student vocabularies differ; pass the model the student was converted from")

    per_step = settings.batch_size * settings.seq_len * settings.grad_accum * accelerator.num_processes
    total_steps = settings.max_steps or max(1, settings.max_tokens // per_step)
    warmup = settings.warmup_steps if settings.warmup_steps is not None else min(100, max(1, total_steps // 20))
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total_steps, warmup))
    # The scheduler is not passed through accelerator.prepare: accelerate would step it once per process per
    # optimizer step (it assumes a schedule counted in one process's batches), while total_steps already
    # counts optimizer steps of all processes together. It is stepped once per optimizer step below, and
    # registered so accelerate's own save_state (FSDP, DeepSpeed) still saves it.
    student, optimizer = accelerator.prepare(student, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if teacher is not None:
        if accelerator.distributed_type == DistributedType.FSDP:
            # shard the teacher like the student, but keep it out of the resumable checkpoints
            teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
            accelerator._models.remove(teacher)
        else:
            teacher = teacher.to(accelerator.device)  # frozen: no DDP/DeepSpeed wrapper needed
        teacher.eval()

    state = {"step": 0, "tokens": 0, "batches": 0}
    if resume_from is not None:
        load_checkpoint(accelerator, resume_from, student, optimizer, scheduler)
        state = json.loads((resume_from / STATE_FILE).read_text())
        if main:
            print(f"resumed from {resume_from} (step {state['step']}, {state['tokens']} tokens)")

    batches = train_batches(settings.data, tokenizer, settings.seq_len, settings.batch_size, seed=settings.seed,
                            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
                            shuffle_buffer=settings.shuffle_buffer, text_field=settings.text_field,
                            skip=state["batches"])
    eval_windows = None
    if settings.eval_data:
        eval_windows = token_windows(settings.eval_data, tokenizer, settings.seq_len, settings.eval_windows,
                                     settings.text_field)
    log_path = ckpt_dir / "log.jsonl"
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / SETTINGS_FILE).write_text(json.dumps(fingerprint(settings, accelerator.num_processes), indent=2))
        if eval_windows is not None and state["step"] == 0:
            _log(log_path, {"step": 0, "tokens": 0,
                            "eval_perplexity": evaluate_perplexity(student, eval_windows, accelerator)})
    elif eval_windows is not None and state["step"] == 0:
        evaluate_perplexity(student, eval_windows, accelerator)

    student.train()
    bar = tqdm(total=total_steps, initial=state["step"], desc="healing", disable=not (settings.progress and main),
               unit="step")
    start, start_tokens = time.time(), state["tokens"]
    steady_seconds, steady_tokens, first_step = 0.0, 0, True
    while state["step"] < total_steps:
        step_start = time.perf_counter()
        for _ in range(settings.grad_accum):
            ids = next(batches).to(accelerator.device)
            state["batches"] += 1
            with accelerator.accumulate(student):
                inputs, labels = ids[:, :-1], ids[:, 1:]
                logits = student(inputs).logits
                teacher_logits = None
                if teacher is not None:
                    with torch.no_grad():
                        teacher_logits = teacher(inputs).logits
                loss, kd, lm = distill_loss(logits, teacher_logits, labels, settings)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())  # waits for the step to finish on a GPU
        state["step"] += 1
        state["tokens"] += per_step
        if not first_step:  # the first step of a process pays one-off set-up costs: not steady state
            steady_seconds += time.perf_counter() - step_start
            steady_tokens += per_step
        first_step = False
        metrics = {"step": state["step"], "tokens": state["tokens"], "loss": loss_value, "kd": float(kd),
                   "lm": float(lm), "lr": scheduler.get_last_lr()[0],
                   "tokens_per_s": steady_tokens / steady_seconds if steady_seconds else None}
        bar.update(1)
        if metrics["tokens_per_s"]:
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        if eval_windows is not None and settings.eval_every and (
                state["step"] % settings.eval_every == 0 or state["step"] == total_steps):
            metrics["eval_perplexity"] = evaluate_perplexity(student, eval_windows, accelerator)
            student.train()
        if main:
            _log(log_path, metrics)
        if settings.save_every and state["step"] % settings.save_every == 0 and state["step"] < total_steps:
            save_checkpoint(accelerator, ckpt_dir / f"step-{state['step']}", state, student, optimizer, scheduler,
                            settings.save_total_limit)
        if on_step is not None:
            on_step(state["step"], metrics)
    bar.close()

    accelerator.wait_for_everyone()
    save_checkpoint(accelerator, ckpt_dir / f"step-{state['step']}", state, student, optimizer, scheduler,
                    settings.save_total_limit)  # the natural form, to continue from
    natural = accelerator.get_state_dict(student)
    summary = {"settings": asdict(settings), "steps": state["step"], "tokens": state["tokens"],
               # steady state: optimizer steps only, without this process's first step, evaluation and saving
               "tokens_per_s": steady_tokens / steady_seconds if steady_seconds else None,
               "wall_tokens_per_s": (state["tokens"] - start_tokens) / max(time.time() - start, 1e-9),
               "processes": accelerator.num_processes, "mixed_precision": precision,
               "output_dtype": str(output_dtype).replace("torch.", ""),
               "checkpoint_dir_mb": round(_dir_mb(ckpt_dir), 1) if main else None}
    if main:
        export(natural, config, settings, tokenizer, summary, output_dtype)
    accelerator.wait_for_everyone()
    return summary


@torch.no_grad()
def evaluate_perplexity(model, windows: torch.Tensor, accelerator) -> float:
    """Held-out perplexity, windows split over processes and summed."""
    model.eval()
    nll = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for ids in windows[accelerator.process_index :: accelerator.num_processes]:
        ids = ids[None].to(accelerator.device)
        logits = model(ids).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").double()
        count += ids.shape[1] - 1
    nll, count = accelerator.reduce(nll, "sum"), accelerator.reduce(count, "sum")
    return math.exp(float(nll / count))


LEAN_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")  # every process holds the whole model: save only what trains


def _lean(accelerator) -> bool:
    return accelerator.distributed_type.name in LEAN_TYPES


def save_checkpoint(accelerator, path: Path, state: dict, model, optimizer, scheduler,
                    total_limit: int | None = None) -> None:
    """A resumable checkpoint. Without sharding (one process, DDP) it holds the trainable parameters,
    optimizer and scheduler state and each process's RNG state: the frozen weights are the converted
    checkpoint's and are not copied again. FSDP and DeepSpeed shard parameters and optimizer state:
    there accelerate's own save_state writes each process's shards."""
    import random

    import numpy as np
    from safetensors.torch import save_file

    if not _lean(accelerator):
        accelerator.save_state(str(path))
    else:
        path.mkdir(parents=True, exist_ok=True)
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            trainable = {n: p.detach().cpu().contiguous() for n, p in unwrapped.named_parameters() if p.requires_grad}
            save_file(trainable, str(path / "trainable.safetensors"))
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       path / "optimizer.pt")
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, path / f"rng-{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps(state))  # written last: marks the checkpoint complete
        if total_limit:
            done = sorted((p for p in path.parent.glob("step-*") if (p / STATE_FILE).exists()),
                          key=lambda p: int(p.name.split("-")[1]))
            for old in done[:-total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, path: Path, model, optimizer, scheduler) -> None:
    import random

    import numpy as np
    from safetensors.torch import load_file

    if not (path / "trainable.safetensors").exists():
        accelerator.load_state(str(path))
        return
    unwrapped = accelerator.unwrap_model(model)
    trainable = load_file(path / "trainable.safetensors")
    params = dict(unwrapped.named_parameters())
    with torch.no_grad():
        for name, value in trainable.items():
            params[name].copy_(value)
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng = torch.load(path / f"rng-{accelerator.process_index}.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype a converted checkpoint was written in (its config), fp32 when it says nothing."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""), torch.float32)


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _log(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def export(natural_state: dict, config, settings: HealSettings, tokenizer, summary: dict,
           dtype: torch.dtype = torch.float32) -> None:
    """Write the stock DeepSeek-V3 checkpoint (atomically, like convert)."""
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    from ..model_card import write_model_card

    state = stock_state_dict(natural_state, config)
    config.dtype = dtype
    with torch.device("meta"):
        stock = DeepseekV3ForCausalLM(config)
    stock.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    stock.config.use_cache = True
    with staged_directory(settings.output, settings.overwrite) as staging:
        stock.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            GenerationConfig.from_pretrained(settings.model).save_pretrained(staging)
        except OSError:
            pass
        source_summary = Path(settings.model) / "conversion.json"
        conversion = json.loads(source_summary.read_text()) if source_summary.exists() else None
        (Path(staging) / "healing.json").write_text(json.dumps(summary, indent=2, default=str))
        if conversion is not None:
            (Path(staging) / "conversion.json").write_text(json.dumps(conversion, indent=2))
            section = (f"## Healing\n\nFine-tuned for {summary['steps']} steps ({summary['tokens']} tokens) on "
                       f"`{settings.data}` with {'distillation from `' + settings.teacher + '`' if settings.teacher else 'the LM loss'}"
                       f" (kd_weight {settings.kd_weight}, lm_weight {settings.lm_weight}), training "
                       f"{settings.train} parameters; see healing.json.")
            write_model_card(Path(staging), conversion, stock.config, extra_sections=[section])
