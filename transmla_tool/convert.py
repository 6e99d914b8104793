"""Orchestration: load -> calibrate -> factorize (-> refine) -> emit -> verify, one layer at a time."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import __version__
from .arch import AttentionGeometry, check_supported
from .arch.families import EMBED, FINAL_NORM, LAYER_PASSTHROUGH, LAYER_PREFIX, LM_HEAD
from .calibrate import SourceLayers, chunks, run_layer_with_attention, run_source_layer
from .data import token_windows
from .engines import servability
from .errors import UserError
from .export import (attention_prefix, deepseek_config, planned_state_dict, residual_scale, scale_residual_writers,
                     stock_attention)
from .io.source import open_source
from .io.staging import RESUMABLE_MARK, check_target, staged_directory, staging_path
from .io.writer import DEFAULT_MAX_SHARD, ShardedWriter, check_shard_size
from .memory import reset_rss_peak, vm_hwm_mb
from .methods import PRESETS, Method
from .model_card import write_model_card
from .ops.decouple import fold_pools, match_pools, plan_rope
from .ops.factorize import factorize
from .ops.linalg import affine_moment
from .ops.mla import mla_attention, pad_latent
from .ops.refine import refine
from .ops.rope import expected_rotation
from .ops.stats import LayerStats, attention_distance_mass

# web text, code and dialogue (streamed from the hub): a calibration mix, since statistics from one
# kind of text transfer badly to others (see the README's cross-domain table)
DEFAULT_CALIB_DATA = ("HuggingFaceFW/fineweb-edu:sample-10BT@train=0.5,"
                      "codeparrot/codeparrot-clean-valid@train=0.25,"
                      "HuggingFaceH4/ultrachat_200k@train_sft=0.25")


class Stages:
    """Wall seconds and peak memory per conversion stage (summed / maxed over layers).

    Peak memory per stage: the kernel's peak RSS (VmHWM), reset at the start of each stage through
    /proc/self/clear_refs (Linux; absent elsewhere), and on a GPU the allocator's peak."""

    def __init__(self, device: torch.device | None = None):
        self.seconds: dict[str, float] = {}
        self.peak_rss_mb: dict[str, float] = {}
        self.peak_gpu_mb: dict[str, float] = {}
        self.overall_rss_mb = 0.0
        self.device = device

    @contextlib.contextmanager
    def __call__(self, name: str):
        cuda = self.device is not None and self.device.type == "cuda"
        self.overall_rss_mb = max(self.overall_rss_mb, vm_hwm_mb() or 0.0)
        reset_rss_peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                gpu = torch.cuda.max_memory_allocated(self.device) / 2**20
                self.peak_gpu_mb[name] = max(self.peak_gpu_mb.get(name, 0.0), gpu)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            rss = vm_hwm_mb()
            if rss is not None:
                self.peak_rss_mb[name] = max(self.peak_rss_mb.get(name, 0.0), rss)
                self.overall_rss_mb = max(self.overall_rss_mb, rss)

    def as_dict(self) -> dict:
        return {name: {"seconds": round(sec, 2), "peak_rss_mb": round(self.peak_rss_mb.get(name, 0.0), 1),
                       **({"peak_gpu_mb": round(self.peak_gpu_mb[name], 1)} if name in self.peak_gpu_mb else {})}
                for name, sec in self.seconds.items()}


DISTANCE_WINDOWS = 8  # windows used for the attention-distance statistics (one at a time)


@dataclass
class ConvertSettings:
    model: str
    output: str
    latent_dim: int
    rope_dim: int = 64
    gguf_file: str | None = None
    revision: str | None = None
    calib_data: str = DEFAULT_CALIB_DATA
    calib_samples: int = 128
    calib_seq_len: int = 512
    text_field: str = "text"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    overwrite: bool = False
    method: Method = field(default_factory=lambda: PRESETS["default"])
    method_name: str = "default"
    ignore_sliding_window: bool = False
    max_shard_size: str = DEFAULT_MAX_SHARD
    batch_size: int = 8
    progress: bool = True
    resume: bool = False  # continue an interrupted conversion from its last finished layer
    # zero-pad the latent to this many channels in the output (exact; for engines whose MLA kernels
    # accept only some sizes, e.g. vLLM's CPU backend: 512 + 64); 0 = no padding
    pad_latent_to: int = 0
    # engine the output must serve in: "vllm" refuses, before converting, what vLLM cannot serve ("llamacpp":
    # what llama.cpp cannot, via export-gguf; both write Llama-3 scaling as DeepSeek YaRN); "auto"
    # prints what each engine will do; "transformers" only needs transformers
    target: str = "auto"
    # attention biases (Qwen2's q/k/v): "keep" (exact in transformers; vLLM drops them silently), "drop"
    # (a bias-free output whose layer-local refinement absorbs them, at a measured cost), "auto": drop for
    # --target vllm, keep otherwise
    biases: str = "auto"
    # False: an engine problem known before converting is printed, not refused (sweep converts every latent
    # dim the way --target would, and marks the sizes the engine refuses in its table)
    refuse_unservable: bool = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} requested but no CUDA device is available; use --device cpu")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise UserError(f"--device must be cpu, cuda, cuda:N or auto, got {name}")
    return torch.device(name)


def resolve_dtype(name: str, src_config) -> torch.dtype:
    if name in ("float16", "fp16", "half"):
        raise UserError(
            "--dtype float16 cannot represent the linearized latent RMSNorm (its tiny activations fall "
            "into fp16's subnormal range); use --dtype bfloat16 or float32"
        )
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if name in table:
        return table[name]
    if name != "auto":
        raise UserError(f"--dtype must be auto, bfloat16 or float32, got {name}")
    src = getattr(src_config, "dtype", None)  # transformers 5 reads an old `torch_dtype` key into `dtype`
    if isinstance(src, str):
        src = getattr(torch, src, None)
    if src == torch.float16:
        return torch.bfloat16  # fp16 cannot hold the linearized norm; bf16 keeps the memory footprint
    return src if src in (torch.bfloat16, torch.float32) else torch.float32


def validate(settings: ConvertSettings, geometry: AttentionGeometry) -> None:
    dr, d = settings.rope_dim, geometry.head_dim
    if dr <= 0 or dr % 2:
        raise UserError(f"--rope-dim {dr} must be a positive even number (RoPE rotates pairs)")
    if dr > d:
        raise UserError(f"--rope-dim {dr} is larger than the source head_dim {d}; use at most {d}")
    if d % dr:
        raise UserError(f"--rope-dim {dr} must divide head_dim {d} (e.g. {d} or {d // 2})")
    if (dr // 2) % settings.method.rope_pool:
        raise UserError(f"rope_pool {settings.method.rope_pool} must divide the {dr // 2} rotary slots")
    max_rank = geometry.max_latent_dim(dr)
    if settings.latent_dim <= 0:
        raise UserError(f"--latent-dim must be positive, got {settings.latent_dim}")
    if settings.latent_dim > max_rank:
        raise UserError(
            f"--latent-dim {settings.latent_dim} exceeds the rank a layer can have "
            f"({max_rank} = min(2*{geometry.num_kv_heads}*{d} - {dr}, hidden {geometry.hidden_size})); "
            f"use at most {max_rank}"
        )
    if settings.calib_samples < 1 or settings.calib_seq_len < 2:
        raise UserError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
    if settings.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if settings.pad_latent_to and settings.pad_latent_to < settings.latent_dim:
        raise UserError(f"--pad-latent-to {settings.pad_latent_to} is smaller than --latent-dim {settings.latent_dim}")
    check_shard_size(settings.max_shard_size)


@dataclass
class _Target:
    """One output being produced: its latent dim, staging dir, writer and (optionally) its own
    converted residual stream."""

    latent_dim: int
    output: str
    config: object
    staging: Path | None = None
    writer: ShardedWriter | None = None
    stream: torch.Tensor | None = None
    reports: list = field(default_factory=list)
    rope_slot_max_log_error: float = 0.0


def convert(settings: ConvertSettings, on_layer=None) -> dict:
    """Convert `settings.model` and write the stock DeepSeek-V3 checkpoint to `settings.output`.

    on_layer(i, mla_weights) is called with each layer's natural-form weights (tests).
    """
    return convert_many(settings, {settings.latent_dim: settings.output}, on_layer=on_layer)[settings.latent_dim]


def convert_many(settings: ConvertSettings, outputs: dict[int, str], on_layer=None) -> dict[int, dict]:
    """Convert once per latent dim in `outputs` ({latent_dim: output dir}) sharing one pass of
    calibration through the source model. Returns the summary of each output."""
    start = time.time()
    torch.manual_seed(settings.seed)
    settings.method.validate()
    for output in outputs.values():
        check_target(output, settings.overwrite or settings.resume and staging_path(output).exists())
    stage = Stages()
    with stage("open source"):
        source = open_source(settings.model, settings.gguf_file, settings.revision)
    geometry = check_supported(source.config, ignore_sliding_window=settings.ignore_sliding_window)
    for latent_dim in outputs:
        validate(replace(settings, latent_dim=latent_dim), geometry)
    device = stage.device = resolve_device(settings.device)
    out_dtype = resolve_dtype(settings.dtype, source.config)
    with stage("calibration text"):
        tokenizer = source.load_tokenizer()
        ids = token_windows(settings.calib_data, tokenizer, settings.calib_seq_len, settings.calib_samples,
                            settings.text_field)
    attention_bias = geometry.q_bias or geometry.k_bias or geometry.v_bias or geometry.o_bias
    drop_biases = attention_bias and _drop_biases(settings)
    warnings = []
    if drop_biases:
        attention_bias = False
        if not settings.method.refine_steps:
            warnings.append(
                f"the source's attention biases are dropped (--target {settings.target}, --biases {settings.biases}) and "
                f"method '{settings.method_name}' has no layer-local refinement to absorb them: the output is the "
                "source without its biases. Use --method default, or --biases keep with --target transformers")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    targets = [
        _Target(latent_dim=r, output=out, config=deepseek_config(
            source.config, geometry, latent_dim=max(r, settings.pad_latent_to), rope_dim=settings.rope_dim,
            q_bias=geometry.q_bias and not drop_biases,
            attention_bias=attention_bias, dtype=out_dtype, yarn_for_scaled_rope=settings.target in ENGINE_TARGETS))
        for r, out in outputs.items()
    ]
    _check_engines(settings, targets)
    resumed = _load_resume(settings, targets, ids)
    summaries = {}
    with contextlib.ExitStack() as stack:
        for t in targets:
            t.staging = stack.enter_context(staged_directory(t.output, settings.overwrite, settings.resume))
            t.writer = ShardedWriter(t.staging, planned_state_dict(t.config, out_dtype), settings.max_shard_size)
        _convert_weights(settings, source, geometry, targets, ids, device, resumed, on_layer, stage)
        generation_config = source.load_generation_config()
        for t in targets:
            t.config.save_pretrained(t.staging)
            tokenizer.save_pretrained(t.staging)
            generation_config.save_pretrained(t.staging)
            summary = {
                "tool": "transmla_tool",
                "version": __version__,
                "source": _source_name(settings),
                "family": geometry.family.name,
                "settings": _settings_dict(replace(settings, latent_dim=t.latent_dim, output=t.output), ids),
                "dtype": str(out_dtype).replace("torch.", ""),
                "cache_values_per_token_per_layer": {
                    "original": geometry.cache_values_per_token_per_layer,
                    "converted": t.config.kv_lora_rank + settings.rope_dim,
                },
                "original_kv_heads": geometry.num_kv_heads,
                "original_head_dim": geometry.head_dim,
                # every output norm uses eps 1e-6; the source's own eps is kept exactly by scaling the residual
                # stream (export.residual_scale)
                "source_rms_norm_eps": geometry.rms_norm_eps,
                "residual_scale": residual_scale(geometry.rms_norm_eps),
                "servable": servability(t.config),
                "warnings": warnings,
                # 0 when every rotary slot turns at its source frequency; > 0 for a scaled rope mapped onto
                # DeepSeek YaRN (--target vllm): the largest |log(frequency ratio)| over the slots
                "rope_slot_max_log_error": round(t.rope_slot_max_log_error, 6),
                "layers": t.reports,
                "wall_time_s": round(time.time() - start, 1),
                # the stages reset the kernel's peak RSS counter: the overall peak is the max over them
                "peak_rss_mb": round(max(stage.overall_rss_mb, peak_rss_mb()), 1),
                "peak_gpu_mb": (round(max(stage.peak_gpu_mb.values(), default=0.0), 1)
                                if device.type == "cuda" else None),
                "stages": stage.as_dict(),
            }
            with open(Path(t.staging) / "conversion.json", "w") as f:
                json.dump(summary, f, indent=2)
            write_model_card(Path(t.staging), summary, t.config)
            summaries[t.latent_dim] = summary
    return summaries


def _settings_dict(settings: ConvertSettings, ids) -> dict:
    out = {k: v for k, v in asdict(settings).items() if k not in ("method", "progress", "overwrite")}
    out["method"] = settings.method.as_dict()
    out["calib_tokens"] = int(ids.numel())
    return out


ENGINE_TARGETS = ("vllm", "sglang", "llamacpp")  # targets that want bias-free output and Llama-3 scaling as YaRN


def _drop_biases(settings: ConvertSettings) -> bool:
    if settings.biases not in ("auto", "keep", "drop"):
        raise UserError(f"--biases must be auto, keep or drop, got {settings.biases}")
    return settings.biases == "drop" or (settings.biases == "auto" and settings.target in ENGINE_TARGETS)


def _check_engines(settings: ConvertSettings, targets) -> None:
    """Say before converting which engines will refuse the output; with --target vllm, refuse it."""
    from .engines import SGLANG_MAX_LATENT, SGLANG_MAX_ROPE, VLLM, check_target

    for t in targets:
        problems = check_target(t.config, settings.target)
        if not problems:
            continue
        if not settings.refuse_unservable:
            if settings.progress:
                print(f"note (--target {settings.target}, latent {t.latent_dim}): {problems[0]}")
            continue
        size = t.config.kv_lora_rank + t.config.qk_rope_head_dim
        if settings.target == "llamacpp":
            raise UserError(f"--target llamacpp: {problems[0]}; pass --biases drop (or --target transformers)")
        if settings.target == "sglang":
            raise UserError(f"--target sglang: {problems[0]}; choose --latent-dim <= {SGLANG_MAX_LATENT} and --rope-dim "
                            f"<= {SGLANG_MAX_ROPE} (multiples of 8), --biases drop, or --target transformers")
        if settings.target == "vllm":
            fix = (f"choose --latent-dim so latent + rope is one of {'/'.join(map(str, VLLM.mla_sizes))}, or "
                   f"--pad-latent-to {min(s for s in VLLM.mla_sizes if s >= size) - settings.rope_dim}"
                   if size not in VLLM.mla_sizes and size <= max(VLLM.mla_sizes) else "")
            raise UserError(f"--target vllm: {problems[0]}" + (f"; {fix}" if fix else "")
                            + "; or pass --target transformers to convert anyway")
        for problem in problems if settings.progress else []:
            print(f"note (vLLM {VLLM.version}, latent {t.config.kv_lora_rank}): {problem}")


RESUME_DIR = "resume"


def _resume_key(settings: ConvertSettings, targets) -> str:
    """What must be equal for a partial conversion to be continued."""
    ignored = ("progress", "overwrite", "resume", "output", "batch_size", "refuse_unservable")
    key = {k: v for k, v in asdict(settings).items() if k not in ignored}
    key["latent_dims"] = [t.latent_dim for t in targets]
    return json.dumps(key, sort_keys=True, default=str)


def _load_resume(settings, targets, ids) -> dict | None:
    """The checkpointed state of an interrupted conversion, or None to start from layer 0. Checked
    before the staging directory is entered, so a refused resume leaves the unfinished work alone."""
    state_file = staging_path(targets[0].output) / RESUME_DIR / "state.json"
    if not settings.resume or not state_file.exists():
        return None
    state = json.loads(state_file.read_text())
    if state["key"] != _resume_key(settings, targets):
        raise UserError(f"the unfinished conversion in {state_file.parent.parent} used other settings; rerun it with "
                        "the same settings, or pass --overwrite instead of --resume to start over")
    if not torch.equal(torch.load(state_file.parent / "ids.pt"), ids):
        raise UserError("the calibration text differs from the unfinished conversion's; use the same "
                        "--calib-data, or --overwrite to start over")
    return state


def _save_resume(settings, targets, ids, hidden, next_layer: int) -> None:
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
    state = {"key": _resume_key(settings, targets), "next_layer": next_layer,
             "reports": {str(t.latent_dim): t.reports for t in targets}}
    tmp = root / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, root / "state.json")
    for t in targets:
        (t.staging / RESUMABLE_MARK).touch()


def _convert_weights(settings, source, geometry, targets, ids, device, resumed=None, on_layer=None,
                     stage: Stages | None = None) -> None:
    stage = stage or Stages()
    method = settings.method
    layers = SourceLayers(source, geometry, device)
    first = 0
    scale = residual_scale(geometry.rms_norm_eps)  # 1 for a source trained with the stock eps (1e-6)
    if resumed is None:
        embed = source.get(EMBED, dtype=None)  # as stored: a 128K-vocabulary fp32 copy would be 2 GB more
        for t in targets:
            t.writer.add_part("embed", {EMBED: embed * scale if scale != 1.0 else embed})
        hidden = embed[ids].float().to(device)  # (N, L, d) fp32: the calibration windows' residual stream
        del embed
        if method.calib_inputs == "converted":
            for t in targets:
                t.stream = hidden.clone()
    else:
        first = resumed["next_layer"]
        root = targets[0].staging / RESUME_DIR
        hidden = torch.load(root / "hidden.pt").to(device)
        for t in targets:
            t.reports = resumed["reports"][str(t.latent_dim)]
            if method.calib_inputs == "converted":
                t.stream = torch.load(root / f"stream-{t.latent_dim}.pt").to(device)
        print(f"resuming {settings.output or 'the conversion'} at layer {first} of {geometry.num_layers}")

    length = ids.shape[1]
    cos, sin = (t[0] for t in layers.position_embeddings(length))  # (L, D)
    target_inv_freq, target_cos, target_sin = _target_rotary(targets[0].config, length, device)
    log_freqs = (target_inv_freq.log(), layers.inv_freq.log())
    if _on_stride(layers.inv_freq, target_inv_freq, geometry.head_dim // settings.rope_dim):
        pools, rope_error = fold_pools(geometry.head_dim, settings.rope_dim, method.rope_pool), 0.0
    else:  # a scaled rope mapped onto YaRN: slots carry the source frequencies nearest to theirs
        pools, rope_error = match_pools(log_freqs[1], log_freqs[0], method.rope_pool)
    for t in targets:
        t.rope_slot_max_log_error = rope_error
    q_lora = targets[0].config.q_lora_rank is not None
    refine_windows = min(method.refine_windows, ids.shape[0])

    bar = tqdm(range(first, geometry.num_layers), desc="converting layers", disable=not settings.progress,
               initial=first, total=geometry.num_layers)
    for i in bar:
        with stage("read layer"):
            layer = layers.layer(i)
            attn = layers.attention_weights(layer)
        shared = None
        for t in targets:
            inputs = t.stream if t.stream is not None else hidden
            if t.stream is None and shared is not None:
                stats, plan, rotation, x_refine, y_refine = shared
            else:
                with stage("statistics"):
                    stats = _layer_stats(layer, attn, inputs, cos, sin, settings.batch_size, method)
                with stage("rope plan"):
                    plan, rotation = _rope_plan(method, attn, stats, geometry, layers.inv_freq, pools, log_freqs)
                x_refine = y_refine = None
                if method.refine_steps:
                    with stage("statistics"):
                        x_refine, y_refine = _refine_data(layer, inputs[:refine_windows], cos, sin,
                                                          settings.batch_size)
                if t.stream is None:
                    shared = (stats, plan, rotation, x_refine, y_refine)
            with stage("factorize"):  # fp64 on the conversion device: a GPU does it in a fraction of the time
                mla, fact = factorize(
                    attn.to(torch.float64, device), stats.x_moment.to(device),
                    _plan_to(plan, device), settings.rope_dim, t.latent_dim,
                    nope_rotation=_rotation_to(rotation, device), latent_weighting=method.latent_weighting,
                    kv_balance=method.kv_balance,
                )
                mla = mla.to(torch.float64, "cpu")
                if not t.config.attention_bias:  # a bias-free output: refinement (if on) absorbs the biases
                    mla = replace(mla, q_bias=None, kv_a_bias=None, o_bias=None)
            report = {"layer": i, "kept_energy": round(fact.kept_energy, 6), "kv_balance": round(fact.kv_balance, 6)}
            if method.refine_steps:
                holdout = max(1, refine_windows // 8) if refine_windows > 1 else 0
                with stage("refine"):
                    mla, ref = refine(mla, x_refine, y_refine, target_cos, target_sin, steps=method.refine_steps,
                                      lr=method.refine_lr, batch=method.refine_batch, queries=method.refine_queries,
                                      holdout=holdout, seed=settings.seed + i, anchor=method.refine_anchor,
                                      noise=method.refine_noise,
                                      teacher=lambda x: _source_attention(layer, x, cos, sin))
                report.update(refine_loss_before=round(ref.loss_before, 6), refine_loss_after=round(ref.loss_after, 6),
                              refine_seconds=round(ref.seconds, 2))
            mla = pad_latent(mla, t.config.kv_lora_rank)
            tensors = stock_attention(mla, layer.input_layernorm.weight.cpu(), q_lora=q_lora,
                                      attention_bias=t.config.attention_bias)
            with stage("verify"), torch.no_grad():
                sample = layer.input_layernorm(inputs[: min(2, inputs.shape[0])])
                report["stock_vs_reference"] = verify_stock_layer(tensors, mla, t.config, i, sample,
                                                                  target_cos, target_sin)
            prefix = attention_prefix(i)
            group = {prefix + name: tensor for name, tensor in tensors.items()}
            for name in LAYER_PASSTHROUGH:
                group[LAYER_PREFIX.format(i=i) + name] = layer.get_parameter(name)
            group = scale_residual_writers(group, scale)
            with stage("write"):
                t.writer.add_part(f"layer-{i:05d}", group)
            del group
            if on_layer is not None:
                on_layer(i, mla)
            if t.stream is not None:
                mla_device = mla.to(torch.float32, device)
                run_layer_with_attention(layer, lambda x, w=mla_device: mla_attention(x, w, target_cos, target_sin),
                                         t.stream, settings.batch_size)
            t.reports.append(report)
            bar.set_postfix(kept=f"{fact.kept_energy:.3f}", **(
                {"refined": f"{report['refine_loss_before']:.3f}->{report['refine_loss_after']:.3f}"}
                if method.refine_steps else {}))
        with stage("source forward"):
            run_source_layer(layer, hidden, (cos[None], sin[None]), settings.batch_size)
        del layer, attn, shared
        with stage("resume checkpoint"):
            _save_resume(settings, targets, ids, hidden, i + 1)

    final_norm = source.get(FINAL_NORM)
    head = source.get(LM_HEAD if source.has(LM_HEAD) else EMBED, dtype=None)  # tied source: untie
    for t in targets:
        t.writer.add_part("final", {FINAL_NORM: final_norm, LM_HEAD: head})
        with stage("assemble shards"):
            t.writer.close()
    shutil.rmtree(targets[0].staging / RESUME_DIR, ignore_errors=True)


def _plan_to(plan, device):
    return type(plan)(a=plan.a.to(device), b=plan.b.to(device))


def _rotation_to(rotation, device):
    return None if rotation is None else tuple(r.to(device) for r in rotation)


def _rope_plan(method, attn, stats, geometry, inv_freq, pools, log_freqs):
    key_moment = affine_moment(attn.k.double().cpu(), _cpu(attn.k_bias), stats.x_moment.cpu())
    candidate_weight = rotation = None
    if method.nope_rotation == "expected" or method.rope_weighting == "score":
        exp_cos, exp_sin = expected_rotation(inv_freq, stats.distance_mass.cpu())  # (H, D/2)
        if method.nope_rotation == "expected":
            rotation = (exp_cos, exp_sin)
        if method.rope_weighting == "score":
            candidate_weight = _score_weight(attn, stats, geometry, 1.0 - exp_cos**2 - exp_sin**2)
    plan = plan_rope(key_moment, pools, geometry.num_kv_heads, geometry.head_dim, candidate_weight, *log_freqs)
    return plan, rotation


@torch.no_grad()
def _refine_data(layer, inputs, cos, sin, batch):
    """Attention inputs and the source attention block's outputs on them, (N, L, d) each."""
    xs, ys = [], []
    for rows in chunks(inputs.shape[0], batch):
        x = layer.input_layernorm(inputs[rows])
        xs.append(x)
        ys.append(_source_attention(layer, x, cos, sin))
    return torch.cat(xs), torch.cat(ys)


def _source_attention(layer, x, cos, sin):
    """The source attention block (causal) on its normalized inputs x (B, L, d)."""
    return layer.self_attn(x, position_embeddings=(cos[None], sin[None]), attention_mask=None)[0]


def _cpu(t):
    return None if t is None else t.double().cpu()


def _layer_stats(layer, attn, inputs, cos, sin, batch, method: Method) -> LayerStats:
    stats = LayerStats.empty(attn.q.shape[1], attn.num_heads, inputs.shape[1], device=inputs.device)
    with torch.no_grad():
        for rows in chunks(inputs.shape[0], batch):
            stats.add(layer.input_layernorm(inputs[rows]))
        # attention maps are L x L per head: a few windows, one at a time, bound their memory
        for rows in chunks(min(DISTANCE_WINDOWS, inputs.shape[0]), 1):
            x = layer.input_layernorm(inputs[rows])
            stats.distance_mass += attention_distance_mass(x, attn, cos, sin).double()
    return stats.finalize(method.moment_shrinkage, method.shrink_target)


def _score_weight(attn, stats, geometry, rotation_spread):
    """(G, D/2): query energy at each frequency, summed over a group's heads, times how much RoPE
    moves scores at that frequency (1 - |E e^{i w delta}|^2)."""
    heads, dim, half = geometry.num_heads, geometry.head_dim, geometry.head_dim // 2
    q_moment = affine_moment(attn.q.double().cpu(), _cpu(attn.q_bias), stats.x_moment.cpu())
    diag = q_moment.diagonal().view(heads, dim)
    energy = diag[:, :half] + diag[:, half:]  # (H, D/2)
    weighted = energy * rotation_spread.clamp_min(0)
    return weighted.view(geometry.num_kv_heads, geometry.group_size, half).sum(1)


def _target_rotary(target_config, length, device):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rotary = DeepseekV3RotaryEmbedding(target_config).to(device)
    positions = torch.arange(length, device=device)[None]
    cos, sin = rotary(torch.zeros(1, device=device), positions)
    return rotary.inv_freq.detach().to("cpu", torch.float64), cos[0], sin[0]


def _on_stride(source_inv_freq, target_inv_freq, stride) -> bool:
    """Does slot j of the target turn exactly at source frequency stride*j?"""
    expected = source_inv_freq[::stride][: target_inv_freq.shape[0]]
    return bool(torch.allclose(expected, target_inv_freq, rtol=1e-5))


def verify_stock_layer(tensors, mla, target_config, layer_idx, x, cos, sin) -> float:
    """Relative difference between transformers' stock DeepSeek-V3 attention loaded with our tensors
    and the reference math of the natural weights, on calibration inputs (fp32)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = copy.deepcopy(target_config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        module = DeepseekV3Attention(config, layer_idx)
    module.load_state_dict({k: v.to(x.device, torch.float32) for k, v in tensors.items()}, assign=True)
    with torch.no_grad():
        stock = module(x, position_embeddings=(cos[None], sin[None]), attention_mask=None)[0]
        reference = mla_attention(x, mla.to(torch.float32, x.device), cos, sin)
    return float((stock - reference).norm() / reference.norm().clamp_min(1e-30))


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _source_name(settings: ConvertSettings) -> str:
    """The source as recorded in conversion.json: a hub id as given, a local path made absolute (so
    export-gguf finds a source GGUF from any working directory)."""
    model = str(Path(settings.model).resolve()) if Path(settings.model).exists() else settings.model
    return f"{model}/{settings.gguf_file}" if settings.gguf_file else model
