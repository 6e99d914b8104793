"""Orchestration: load -> calibrate -> factorize (-> refine) -> emit -> verify, one layer at a time."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .arch import AttentionGeometry, check_shapes, check_supported, llama_view
from .arch.families import EMBED, FINAL_NORM, LAYER_PASSTHROUGH, LAYER_PREFIX, LM_HEAD
from .calibrate import SourceLayers, run_layer_with_attention, run_source_layer
from .data import token_windows, with_repeats
from .devices import resolve_device, resolve_dtype
from .engines import ENGINE_TARGETS, check_engines, drops_biases
from .errors import UserError
from .export import attention_prefix, deepseek_config, planned_state_dict, residual_scale, scale_residual_writers
from .io.resume import RESUME_DIR, load_resume, save_resume
from .io.source import open_source
from .io.staging import (
    COMPLETE_MARK,
    check_target,
    check_writable,
    local_paths,
    resumable,
    staged_directory,
    staging_path,
)
from .io.writer import DEFAULT_MAX_SHARD, PARTS, PEAK_SHARDS, ShardedWriter, check_shard_size, shard_bytes
from .layer import LayerContext, calibrate_layer, convert_layer, folds_biases
from .memory import Stages
from .methods import PRESETS, Method
from .model_card import write_model_card
from .ops.bias_fold import SPREAD_WARNING, with_constant_channel
from .ops.kv_quant import BLOCK, mla_cache_problem
from .ops.mla import mla_attention
from .summary import conversion_summary

# web text, code and dialogue (streamed from the hub): a calibration mix, since statistics from one
# kind of text transfer badly to others (see the README's cross-domain table)
DEFAULT_CALIB_DATA = ("HuggingFaceFW/fineweb-edu:sample-10BT@train=0.5,"
                      "codeparrot/codeparrot-clean-valid@train=0.25,"
                      "HuggingFaceH4/ultrachat_200k@train_sft=0.25")


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
    fit_cache = settings.method.refine_cache
    problem = None if fit_cache == "none" else mla_cache_problem(
        fit_cache, max(settings.pad_latent_to, settings.latent_dim), dr)  # the latent as stored
    if problem:
        raise UserError(f"refine_cache={fit_cache}: {problem}; choose a --latent-dim (or --pad-latent-to) and a "
                        f"--rope-dim that are multiples of {BLOCK}")
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
    constant_channel: dict | None = None  # the embedding channel the first layer's biases fold through, if any


def convert(settings: ConvertSettings, on_layer=None) -> dict:
    """Convert `settings.model` and write the stock DeepSeek-V3 checkpoint to `settings.output`.

    on_layer(i, mla_weights) is called with each layer's natural-form weights (tests).
    """
    return convert_many(settings, {settings.latent_dim: settings.output}, on_layer=on_layer)[settings.latent_dim]


def check_outputs(settings: ConvertSettings, latent_dims, rope_dims) -> None:
    """What convert_many refuses before any work, checked without converting, for every latent dim at every rope
    dim (one source open): for a caller that converts several times (sweep at several rope dims) and must not fail
    on a later one after finishing the first."""
    settings.method.validate()
    _open_checked(settings, latent_dims, Stages(), rope_dims)


def _open_checked(settings: ConvertSettings, latent_dims, stage: Stages, rope_dims=None):
    """The source and its attention geometry, every output's settings (at each of `rope_dims`, default the
    settings' own) validated against it."""
    with stage("open source"):
        source = open_source(settings.model, settings.gguf_file, settings.revision)
    geometry = check_supported(source.config, ignore_sliding_window=settings.ignore_sliding_window)
    check_shapes(source, geometry)
    for rope_dim in rope_dims or [settings.rope_dim]:
        for latent_dim in latent_dims:
            validate(replace(settings, latent_dim=latent_dim, rope_dim=rope_dim), geometry)
    check_biases(settings, geometry)
    return source, geometry


def check_biases(settings: ConvertSettings, geometry: AttentionGeometry) -> None:
    """A bias-free output of a source with attention biases needs the refinement: no stock engine path holds the
    biases, and without them the closed form alone destroys a real model (Qwen2.5-Coder-1.5B: held-out perplexity
    5.5 -> 1.4e6 with its q/k/v biases dropped; the value bias alone 8e5). Refused rather than written."""
    if geometry.biased and drops_biases(settings.target, settings.biases) and not settings.method.refines:
        named = next((name for name, preset in PRESETS.items() if preset == settings.method), "given")
        raise UserError(
            f"the source has attention biases, which --target {settings.target} (--biases {settings.biases}) drops, "
            f"and the {named} method has no refinement (refine_steps 0) to make up for them: the output would not be "
            "this model. Use --method default, or --biases keep --target transformers for an exact checkpoint")


def convert_many(settings: ConvertSettings, outputs: dict[int, str], on_layer=None) -> dict[int, dict]:
    """Convert once per latent dim in `outputs` ({latent_dim: output dir}) sharing one pass of
    calibration through the source model. Returns the summary of each output."""
    start = time.time()
    torch.manual_seed(settings.seed)
    settings.method.validate()
    inputs = local_paths(settings.model, settings.calib_data)
    if len(set(outputs.values())) != len(outputs):
        raise UserError("two latent dims would be written to the same output directory")
    for output in outputs.values():
        # a resumed run that was asked to --overwrite may find the old output still there
        check_target(output, settings.overwrite or settings.resume and resumable(staging_path(output)), inputs)
    stage = Stages()
    source, geometry = _open_checked(settings, outputs, stage)
    source_fingerprint = source.fingerprint()
    source = llama_view(source, geometry)  # Granite, Phi-3, Gemma: an exact Llama view (arch/rewrite.py)
    device = stage.device = resolve_device(settings.device)
    out_dtype = resolve_dtype(settings.dtype, source.config)
    check_room(settings, source, geometry, outputs, out_dtype)
    with stage("calibration text"):
        tokenizer = source.load_tokenizer()
        ids = calibration_windows(settings, tokenizer)
    attention_bias = geometry.biased
    drop_biases = attention_bias and drops_biases(settings.target, settings.biases)
    warnings = []
    if drop_biases:
        attention_bias = False
    targets = [
        _Target(latent_dim=r, output=out, config=deepseek_config(
            source.config, geometry, latent_dim=max(r, settings.pad_latent_to), rope_dim=settings.rope_dim,
            q_bias=geometry.q_bias and not drop_biases,
            attention_bias=attention_bias, dtype=out_dtype, yarn_for_scaled_rope=settings.target in ENGINE_TARGETS,
            query_norm=geometry.family.qk_norm and settings.method.query_norm == "keep"))
        for r, out in outputs.items()
    ]
    check_engines({t.latent_dim: t.config for t in targets}, settings.target, settings.rope_dim,
                  refuse=settings.refuse_unservable, progress=settings.progress)
    resumed = load_resume(settings, targets, ids, source_fingerprint)
    summaries = {}
    with contextlib.ExitStack() as stack:
        for t in targets:
            t.staging = stack.enter_context(staged_directory(
                t.output, settings.overwrite, settings.resume, kind="convert", inputs=inputs,
                transient=(RESUME_DIR, PARTS)))
        if all((t.staging / COMPLETE_MARK).exists() for t in targets):  # killed after the last file: just rename
            return {t.latent_dim: json.loads((t.staging / "conversion.json").read_text()) for t in targets}
        for t in targets:
            t.writer = ShardedWriter(t.staging, planned_state_dict(t.config, out_dtype), settings.max_shard_size)
        _convert_weights(settings, source, geometry, targets, ids, device, resumed, on_layer, stage,
                         source_fingerprint)
        warnings += fold_warnings(targets[0].reports, ids.shape[0])
        generation_config = source.load_generation_config()
        for t in targets:
            t.config.save_pretrained(t.staging)
            tokenizer.save_pretrained(t.staging)
            generation_config.save_pretrained(t.staging)
            summary = conversion_summary(settings, geometry, t, ids, out_dtype, warnings, stage, device, start,
                                         source_identity=source_fingerprint["identity"])
            with open(Path(t.staging) / "conversion.json", "w") as f:
                json.dump(summary, f, indent=2)
            write_model_card(Path(t.staging), summary, t.config)
            summaries[t.latent_dim] = summary
        for t in targets:
            (t.staging / COMPLETE_MARK).touch()
    return summaries


def fold_warnings(reports: list[dict], windows: int) -> list[str]:
    """Warnings (printed and kept in conversion.json) where the direction a layer's biases are folded through reads
    1 only loosely on calibration windows it was not fitted on (ops/bias_fold.heldout_spread)."""
    spreads = {r["layer"]: r["bias_fold"]["heldout_spread"] ** 0.5 for r in reports
               if "heldout_spread" in r.get("bias_fold", {})}
    loose = {i: s for i, s in spreads.items() if s > SPREAD_WARNING}
    if not loose:
        return []
    worst = max(loose, key=loose.get)
    text = (f"attention biases folded through a direction that reads 1 only to +-{loose[worst]:.2f} (root mean square) "
            f"on calibration windows it was not fitted on, at layer {worst} ({len(loose)} layers above "
            f"{SPREAD_WARNING}): the bias-free output loses part of what the biases carry. Calibrate on more text "
            f"(--calib-samples, {windows} windows now) or keep the biases (--biases keep --target transformers)")
    print(f"warning: {text}", file=sys.stderr)
    return [text]


def calibration_windows(settings: ConvertSettings, tokenizer) -> torch.Tensor:
    """The calibration windows; fewer than asked for is said, and conversion.json records what was used."""
    ids = token_windows(settings.calib_data, tokenizer, settings.calib_seq_len, settings.calib_samples,
                        settings.text_field)
    if len(ids) < settings.calib_samples:
        print(f"warning: --calib-data yields {len(ids)} windows of {settings.calib_seq_len} tokens, fewer than the "
              f"{settings.calib_samples} asked for (--calib-samples); calibrating on {len(ids)} (conversion.json and "
              "the model card record it). Give more text for the statistics asked for.", file=sys.stderr)
    return with_repeats(ids, settings.method.calib_repeat) if settings.method.calib_repeat else ids


def check_room(settings: ConvertSettings, source, geometry, outputs, out_dtype) -> None:
    """Refuse before any work when the output's disk cannot hold it: every output's parts until the end, and while
    one is assembled the shard being written beside the parts it reads (io/writer.py: about PEAK_SHARDS shards),
    plus the resume checkpoint's residual stream."""
    parameters = source.parameter_count() if hasattr(source, "parameter_count") else None
    if not parameters:
        return
    if not source.has(LM_HEAD):
        parameters += source.config.vocab_size * geometry.hidden_size  # the output unties a tied head
    element = torch.tensor([], dtype=out_dtype).element_size()
    stream = settings.calib_samples * settings.calib_seq_len * geometry.hidden_size * 4 * 2
    size = parameters * element
    assembly = min(size, PEAK_SHARDS * shard_bytes(settings.max_shard_size))
    for output in outputs.values():
        check_writable(Path(output), needed_bytes=size * len(outputs) + assembly + stream)


def _convert_weights(settings, source, geometry, targets, ids, device, resumed=None, on_layer=None,
                     stage: Stages | None = None, source_fingerprint: dict | None = None) -> None:
    stage = stage or Stages()
    method = settings.method
    layers = SourceLayers(source, geometry, device)
    first = 0
    scale = residual_scale(geometry.rms_norm_eps)  # 1 for a source trained with the stock eps (1e-6)
    # a bias-free output of a biased source: the first layer reads a constant embedding channel (ops/bias_fold.py)
    channel = folds_biases(geometry, targets[0].config, method) and method.constant_channel == "embedding"
    if resumed is None:
        embed = source.get(EMBED, dtype=None)  # as stored: a 128K-vocabulary fp32 copy would be 2 GB more
        if channel:
            embed, chosen = with_constant_channel(embed, geometry.rms_norm_eps)
            for t in targets:
                t.constant_channel = asdict(chosen)
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
            t.constant_channel = resumed.get("constant_channel")
            if method.calib_inputs == "converted":
                t.stream = torch.load(root / f"stream-{t.latent_dim}.pt").to(device)
        print(f"resuming {settings.output or 'the conversion'} at layer {first} of {geometry.num_layers}")

    ctx = LayerContext.build(method, geometry, layers, targets[0].config, length=ids.shape[1],
                             rope_dim=settings.rope_dim, seed=settings.seed, batch_size=settings.batch_size,
                             windows=ids.shape[0], device=device)
    for t in targets:
        t.rope_slot_max_log_error = ctx.rope_slot_max_log_error

    bar = tqdm(range(first, geometry.num_layers), desc="converting layers", disable=not settings.progress,
               initial=first, total=geometry.num_layers)
    for i in bar:
        with stage("read layer"):
            layer = layers.layer(i)
            attn = layers.attention_weights(layer, hidden, method.query_norm)
        shared = None  # the calibration of the source's own stream, shared by every target that reads it
        for t in targets:
            inputs = t.stream if t.stream is not None else hidden
            calib = shared if t.stream is None and shared is not None else calibrate_layer(layer, attn, inputs, ctx,
                                                                                          stage)
            if t.stream is None:
                shared = calib
            tensors, mla, report = convert_layer(layer, attn, inputs, calib, ctx, i, t.latent_dim, t.config, stage)
            with stage("write"):
                t.writer.add_part(f"layer-{i:05d}", layer_tensors(i, tensors, layer, scale))
            if on_layer is not None:
                on_layer(i, mla)
            if t.stream is not None:
                mla_device = mla.to(torch.float32, device)
                run_layer_with_attention(layer, lambda x, w=mla_device: mla_attention(x, w, ctx.target_cos,
                                                                                      ctx.target_sin),
                                         t.stream, settings.batch_size)
            if layers.qk_norm_errors:
                report["qk_norm_fold"] = dict(layers.qk_norm_errors)
            t.reports.append(report)
            bar.set_postfix(kept=f"{report['kept_energy']:.3f}", **(
                {"refined": f"{report['refine_loss_before']:.3f}->{report['refine_loss_after']:.3f}"}
                if method.refines else {}))
        with stage("source forward"):
            run_source_layer(layer, hidden, (ctx.cos[None], ctx.sin[None]), settings.batch_size)
        del layer, attn, shared
        with stage("resume checkpoint"):
            save_resume(settings, targets, ids, hidden, i + 1, source_fingerprint or {})

    final_norm = source.get(FINAL_NORM)
    head = source.get(LM_HEAD if source.has(LM_HEAD) else EMBED, dtype=None)  # tied source: untie
    for t in targets:
        t.writer.add_part("final", {FINAL_NORM: final_norm, LM_HEAD: head})
        with stage("assemble shards"):
            t.writer.close()


def layer_tensors(i: int, attention: dict, layer, scale: float) -> dict:
    """Layer i of the output by full name: the stock attention tensors, the source's norms and MLP as they are,
    and what writes into the residual stream scaled by `scale` (export.residual_scale)."""
    prefix = attention_prefix(i)
    group = {prefix + name: tensor for name, tensor in attention.items()}
    for name in LAYER_PASSTHROUGH:
        group[LAYER_PREFIX.format(i=i) + name] = layer.get_parameter(name)
    return scale_residual_writers(group, scale)
