"""`transmla-tool heal`: a short distillation fine-tune of a converted model, with accelerate.

Runs as is on one CPU or GPU, and unchanged under `accelerate launch` (DDP, FSDP, DeepSpeed; see
recipes/accelerate/). The student is trained in natural form (heal/model.py) and exported as a
stock DeepSeek-V3 checkpoint at the end. Loss: kd_weight * KL(teacher || student) at temperature T
(times T^2) + lm_weight * next-token cross-entropy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data import token_windows
from ..errors import UserError
from ..io.staging import (
    KEPT,
    LOCK_FILE,
    MARKER,
    check_not_input,
    check_target,
    check_writable,
    local_paths,
    marker_of,
    write_marker,
)
from ..memory import Stages, vm_hwm_mb
from .checkpoint import STATE_FILE, latest_checkpoint, load_checkpoint, save_checkpoint
from .data import train_batches
from .export import checkpoint_dtype, export
from .loss import FinalHidden, chunked_distill_loss, distill_loss, window_nll
from .model import is_attention_param, to_natural
from .settings import SETTINGS_FILE, HealSettings, check_cache_row, check_fingerprint, fingerprint


def _lr_lambda(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


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
    ckpt_dir = Path(settings.checkpoint_dir or f"{settings.output}.ckpt")
    inputs = local_paths(settings.model, settings.teacher, settings.data, settings.eval_data)
    check_target(settings.output, settings.overwrite, [*inputs, ckpt_dir.resolve()])
    check_checkpoint_dir(ckpt_dir, inputs)
    check_teacher(settings)
    resume_from = latest_checkpoint(ckpt_dir) if settings.resume and ckpt_dir.exists() else None
    if settings.resume and resume_from is None and main:
        print(f"--resume: no checkpoint in {ckpt_dir}, starting from step 0")
    if ckpt_dir.exists() and not settings.resume and list(ckpt_dir.glob("step-*")):
        if not settings.overwrite:
            raise UserError(f"{ckpt_dir} holds checkpoints of an earlier run; pass --resume to continue it or "
                            "--overwrite to discard them")
        if main:
            shutil.rmtree(ckpt_dir)
    accelerator.wait_for_everyone()
    if resume_from is not None:
        check_fingerprint(ckpt_dir, fingerprint(settings, accelerator.num_processes))
    set_seed(settings.seed)
    fresh_ckpt_dir = not ckpt_dir.exists()
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_marker(ckpt_dir, CHECKPOINTS_KIND)
        (ckpt_dir / LOCK_FILE).write_text(str(os.getpid()))
    try:
        return _train(settings, accelerator, ckpt_dir, resume_from, precision, on_step)
    except BaseException:
        # a run that failed before its first checkpoint leaves no checkpoint directory behind
        if main and fresh_ckpt_dir and ckpt_dir.exists() and latest_checkpoint(ckpt_dir) is None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        elif main and latest_checkpoint(ckpt_dir) is not None:
            KEPT.append((ckpt_dir, "rerun the same command with --resume"))
        raise
    finally:
        if main and ckpt_dir.exists():
            (ckpt_dir / LOCK_FILE).unlink(missing_ok=True)


CHECKPOINTS_KIND = "heal-checkpoints"


def check_checkpoint_dir(ckpt_dir: Path, inputs: list[Path]) -> None:
    """The checkpoint directory is heal's own (or new), not an input, and no other live heal is writing it."""
    check_not_input(ckpt_dir, inputs, "--checkpoint-dir")
    if not ckpt_dir.exists():
        check_writable(ckpt_dir)
        return
    if not ckpt_dir.is_dir():
        raise UserError(f"--checkpoint-dir {ckpt_dir} is a file; give a directory path")
    record = marker_of(ckpt_dir)
    strangers = [p.name for p in ckpt_dir.iterdir() if not _heal_writes(p.name)]
    if (record or {}).get("kind") not in (None, CHECKPOINTS_KIND) or strangers:
        found = ", ".join(strangers[:3]) or MARKER
        raise UserError(f"--checkpoint-dir {ckpt_dir} holds files heal did not write ({found}); choose another "
                        "directory")
    lock = ckpt_dir / LOCK_FILE
    if lock.exists():
        try:
            pid = int(lock.read_text().strip())
            os.kill(pid, 0)
        except (ValueError, OSError):
            return  # a dead run's lock
        if pid != os.getpid():
            raise UserError(f"another heal (pid {pid}) is writing {ckpt_dir}; wait for it or stop it")


def _heal_writes(name: str) -> bool:
    """Is `name` something heal writes into its checkpoint directory?"""
    return name in (MARKER, LOCK_FILE, SETTINGS_FILE, "log.jsonl") or (
        name.startswith("step-") and name[5:].isdigit())


def check_teacher(settings: HealSettings) -> None:
    """The teacher is the model the student was converted from, and both read text the same way."""
    from transformers import AutoTokenizer

    from ..evaluate.models import load_tokenizer
    from ..provenance import compare_tokenizers, converted_from

    if not settings.teacher:
        return
    converted_from(settings.model, "--model", settings.teacher, settings.teacher_gguf_file, "--teacher")
    compare_tokenizers(load_tokenizer(settings.teacher, settings.teacher_gguf_file),
                       AutoTokenizer.from_pretrained(settings.model), f"--teacher {settings.teacher}",
                       f"--model {settings.model}")


def _models(settings: HealSettings, accelerator):
    """The student in natural form with its trainable parameters marked, the teacher (or None), and what the
    export needs: (tokenizer, student, trainable, teacher, config, output dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..evaluate.models import load_model

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    output_dtype = checkpoint_dtype(settings.model)  # read before loading: loading in fp32 rewrites config.dtype
    student = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32)
    config = student.config
    if config.model_type != "deepseek_v3":
        raise UserError(f"--model {settings.model} is a {config.model_type} model, not a converted DeepSeek-V3 one")
    check_cache_row(settings.cache_type, config.kv_lora_rank, config.qk_rope_head_dim)
    to_natural(student, settings.cache_type)
    for name, param in student.named_parameters():
        param.requires_grad_(settings.train == "all" or is_attention_param(name))
    if settings.gradient_checkpointing:
        checkpoint_activations(student)
    student.config.use_cache = False
    trainable = [p for p in student.parameters() if p.requires_grad]

    teacher = None
    if settings.teacher and settings.kd_weight > 0:
        teacher_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        teacher = load_model(settings.teacher, settings.teacher_gguf_file, teacher_dtype, torch.device("cpu"))
        teacher.requires_grad_(False)
        if teacher.config.vocab_size != config.vocab_size:
            raise UserError("teacher and student vocabularies differ; pass the model the student was converted from")
    return tokenizer, student, trainable, teacher, config, output_dtype


def checkpoint_activations(model) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them. transformers 5.25 calls
    it activation_checkpointing_enable and deprecates gradient_checkpointing_enable (a FutureWarning; gone in v6); 5.15,
    the oldest allowed, has only the old name."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    if not checkpointed_layers(model):
        raise UserError(f"{type(model).__name__} did not turn activation checkpointing on; heal without "
                        "--gradient-checkpointing")


def checkpointed_layers(model) -> int:
    """How many of the model's layers recompute their activations in the backward pass."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())


def _train(settings: HealSettings, accelerator, ckpt_dir: Path, resume_from, precision: str, on_step) -> dict:
    from accelerate.utils import DistributedType

    main = accelerator.is_main_process
    tokenizer, student, trainable, teacher, config, output_dtype = _models(settings, accelerator)

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

    chunk = _loss_chunk(settings, accelerator, settings.seq_len)
    # held-out windows longer than the training ones (--eval-seq-len) read their logits a chunk at a time too: an
    # 8192-token window's are 1.6 GB for SmolLM2 before the softmax, even when training reads 512 whole
    eval_len = settings.eval_seq_len or settings.seq_len
    eval_chunk = chunk if eval_len == settings.seq_len else _loss_chunk(settings, accelerator, eval_len)
    student_hidden = FinalHidden(student) if chunk else None
    teacher_hidden = FinalHidden(teacher) if chunk and teacher is not None else None

    state = {"step": 0, "tokens": 0, "batches": 0}
    if resume_from is not None:
        load_checkpoint(accelerator, resume_from, student, optimizer, scheduler)
        state = json.loads((resume_from / STATE_FILE).read_text())
        if main:
            print(f"resumed from {resume_from} (step {state['step']}, {state['tokens']} tokens)")

    batches = train_batches(settings.data, tokenizer, settings.seq_len, settings.batch_size, seed=settings.seed,
                            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
                            shuffle_buffer=settings.shuffle_buffer, text_field=settings.text_field,
                            skip=state["batches"], repeat_share=settings.repeat_share)
    eval_windows = None
    if settings.eval_data:
        eval_windows = token_windows(settings.eval_data, tokenizer, eval_len, settings.eval_windows,
                                     settings.text_field)
    log_path = ckpt_dir / "log.jsonl"
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / SETTINGS_FILE).write_text(json.dumps(fingerprint(settings, accelerator.num_processes), indent=2))
        _restart_log(log_path, state["step"] if resume_from is not None else None)
        if eval_windows is not None and state["step"] == 0:
            _log(log_path, {"step": 0, "tokens": 0,
                            "eval_perplexity": evaluate_perplexity(student, eval_windows, accelerator, eval_chunk)})
    elif eval_windows is not None and state["step"] == 0:
        evaluate_perplexity(student, eval_windows, accelerator, eval_chunk)

    student.train()
    # the training steps' own peak, apart from the held-out evaluations between them (their windows can be longer:
    # --eval-seq-len) and from loading and the export, none of which --seq-len changes. Each stage resets what the
    # kernel reports for the whole process (VmHWM, and getrusage/wait4's ru_maxrss), so the peak of loading is read
    # first and kept beside them
    setup_peak_rss = vm_hwm_mb()
    stages = Stages(accelerator.device)

    def one_step() -> tuple[float, float, float]:
        """One optimizer step over --grad-accum micro-batches: its (total, kd, lm) loss."""
        losses = torch.zeros(3, device=accelerator.device)  # (total, kd, lm) summed over the step's micro-batches
        for _ in range(settings.grad_accum):
            ids = next(batches).to(accelerator.device)
            state["batches"] += 1
            with accelerator.accumulate(student):
                inputs, labels = ids[:, :-1], ids[:, 1:]
                if chunk:  # at length: the last hidden states, and the logits a chunk at a time
                    hidden = student_hidden(inputs)
                    target = None
                    if teacher_hidden is not None:
                        with torch.no_grad():
                            target = teacher_hidden(inputs)
                    with accelerator.autocast():
                        loss, kd, lm = chunked_distill_loss(
                            hidden, student_hidden.head, target, None if teacher_hidden is None else teacher_hidden.head,
                            labels, settings, chunk)
                else:
                    logits = student(inputs).logits
                    teacher_logits = None
                    if teacher is not None:
                        with torch.no_grad():
                            teacher_logits = teacher(inputs).logits
                    loss, kd, lm = distill_loss(logits, teacher_logits, labels, settings)
                losses += torch.stack([loss.detach(), kd, lm])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        # the step's loss: the mean over its micro-batches and processes (waits for the step to finish on a GPU)
        return tuple(float(v) for v in accelerator.reduce(losses, "mean") / settings.grad_accum)

    bar = tqdm(total=total_steps, initial=state["step"], desc="healing", disable=not (settings.progress and main),
               unit="step")
    start, start_tokens = time.time(), state["tokens"]
    steady_seconds, steady_tokens, first_step = 0.0, 0, True
    while state["step"] < total_steps:
        step_start = time.perf_counter()
        with stages("train"):
            loss_value, kd, lm = one_step()
        state["step"] += 1
        state["tokens"] += per_step
        if not first_step:  # the first step of a process pays one-off set-up costs: not steady state
            steady_seconds += time.perf_counter() - step_start
            steady_tokens += per_step
        first_step = False
        metrics = {"step": state["step"], "tokens": state["tokens"], "loss": loss_value, "kd": kd, "lm": lm,
                   "lr": scheduler.get_last_lr()[0],
                   "tokens_per_s": steady_tokens / steady_seconds if steady_seconds else None}
        bar.update(1)
        if metrics["tokens_per_s"]:
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        if eval_windows is not None and settings.eval_every and (
                state["step"] % settings.eval_every == 0 or state["step"] == total_steps):
            with stages("evaluate"):
                metrics["eval_perplexity"] = evaluate_perplexity(student, eval_windows, accelerator, eval_chunk)
            student.train()
        if main:
            _log(log_path, metrics)
        if settings.save_every and state["step"] % settings.save_every == 0 and state["step"] < total_steps:
            save_checkpoint(accelerator, ckpt_dir / f"step-{state['step']}", state, student, optimizer, scheduler,
                            settings.save_total_limit)
        if on_step is not None:
            on_step(state["step"], metrics)
    bar.close()
    train_peak_rss = stages.peak_rss_mb.get("train") if setup_peak_rss is not None else None
    eval_peak_rss = stages.peak_rss_mb.get("evaluate") if setup_peak_rss is not None else None
    train_peak_gpu = stages.peak_gpu_mb.get("train")

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
               "checkpoint_dir_mb": round(_dir_mb(ckpt_dir), 1) if main else None,
               # positions whose logits were alive at once (None: whole windows), and the steps that checked it
               "loss_chunk": chunk or None, "loss_chunk_checks": student_hidden.checks if chunk else 0,
               # decoder layers recomputed in the backward pass (--gradient-checkpointing; 0: none)
               "checkpointed_layers": checkpointed_layers(accelerator.unwrap_model(student)),
               # this process's peak memory (MiB; RSS from the kernel, GPU from torch): loading the models and the
               # text, the training steps alone, the held-out evaluations between them (None: none ran in this
               # process), and the process's peak up to the export (the saving of checkpoints included)
               "setup_peak_rss_mb": _mb(setup_peak_rss), "train_peak_rss_mb": _mb(train_peak_rss),
               "eval_peak_rss_mb": _mb(eval_peak_rss),
               "peak_rss_mb": None if setup_peak_rss is None else _mb(max(setup_peak_rss, stages.overall_rss_mb,
                                                                          vm_hwm_mb() or 0.0)),
               "train_peak_gpu_mb": _mb(train_peak_gpu)}
    if main:
        export(natural, config, settings, tokenizer, summary, output_dtype)
    accelerator.wait_for_everyone()
    return summary


def _loss_chunk(settings: HealSettings, accelerator, length: int) -> int:
    """Positions whose logits the loss holds at once for windows of `length`: --loss-chunk when the windows are
    longer, else 0 (whole windows, as the model's forward gives them). FSDP shards the output layer outside the
    forward: whole windows."""
    from accelerate.utils import DistributedType

    if not settings.loss_chunk or length <= settings.loss_chunk:
        return 0
    if accelerator.distributed_type == DistributedType.FSDP:
        if accelerator.is_main_process:
            print(f"heal: --loss-chunk {settings.loss_chunk} is not applied under FSDP (the output layer is sharded "
                  f"outside the forward); {length}-token windows' logits are read whole")
        return 0
    return settings.loss_chunk


@torch.no_grad()
def evaluate_perplexity(model, windows: torch.Tensor, accelerator, chunk: int = 0) -> float:
    """Held-out perplexity, windows split over processes and summed (logits `chunk` positions at a time)."""
    model.eval()
    nll = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    count = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    for ids in windows[accelerator.process_index :: accelerator.num_processes]:
        ids = ids[None].to(accelerator.device)
        nll += window_nll(model, ids, chunk)
        count += ids.shape[1] - 1
    nll, count = accelerator.reduce(nll, "sum"), accelerator.reduce(count, "sum")
    return math.exp(float(nll / count))


def _mb(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def _restart_log(path: Path, step: int | None) -> None:
    """The log as of the checkpoint the run starts from (None: a fresh run, an empty log). Rows a killed process
    wrote after its last checkpoint, or a run killed before its first one, would otherwise stay in the log beside
    the rows the run writes again, and the reports drawn from it would show both."""
    if step is None or not path.exists():
        path.unlink(missing_ok=True)
        return
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line the kill cut short
            continue
        if row["step"] <= step:
            rows[row["step"]] = row  # the last one written for a step
    path.write_text("".join(json.dumps(rows[k]) + "\n" for k in sorted(rows)))


def _log(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


