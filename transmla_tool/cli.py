"""Command line: parse arguments, call one function per command. Errors a user can fix print one line
and exit with status 2."""

from __future__ import annotations

import errno
import sys

from .cli_args import build_parser
from .errors import UserError


def cmd_convert(args) -> int:
    from .convert import ConvertSettings, convert
    from .methods import resolve_method

    settings = ConvertSettings(
        model=args.model, gguf_file=args.gguf_file, revision=args.revision, output=args.output,
        latent_dim=args.latent_dim, rope_dim=args.rope_dim, calib_data=args.calib_data,
        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, text_field=args.text_field,
        dtype=args.dtype, device=args.device, seed=args.seed, overwrite=args.overwrite,
        method=resolve_method(args.method, args.overrides), method_name=args.method,
        ignore_sliding_window=args.ignore_sliding_window, max_shard_size=args.max_shard_size,
        batch_size=args.batch_size, progress=not args.no_progress, resume=args.resume,
        pad_latent_to=args.pad_latent_to, target=args.target, biases=args.biases,
    )
    summary = convert(settings)
    cache = summary["cache_values_per_token_per_layer"]
    print(f"wrote {args.output}: cache {cache['original']} -> {cache['converted']} values per token per layer, "
          f"{summary['wall_time_s']} s, peak RSS {summary['peak_rss_mb']} MB")
    from .memory import stage_line

    print("time per stage: " + stage_line(summary["stages"]))
    for note in summary["servable"]["notes"]:
        print(f"note: {note}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from exc
    if not values:
        raise UserError(f"{flag} is empty")
    return values


def cmd_eval(args) -> int:
    from .evaluate.run import EvalSettings, run_eval

    settings = EvalSettings(
        original=args.original, gguf_file=args.gguf_file, converted=args.converted, output_dir=args.output_dir,
        data=args.data, seq_len=args.seq_len, max_tokens=args.max_tokens, skip_windows=args.skip_windows,
        batch_size=args.eval_batch_size, contexts=_int_list(args.contexts, "--contexts"),
        new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens, attention=args.attention, engine=args.engine,
        gguf_type=args.gguf_type, prefill_chunk=args.prefill_chunk,
        cache_types=[t for t in args.cache_types.split(",") if t.strip()],
        tasks=[t for t in args.tasks.split(",") if t], limit=args.limit, num_fewshot=args.num_fewshot,
        include_path=args.include_path, task_data_source=args.task_data, dtype=args.dtype, device=args.device, seed=args.seed,
        overwrite=args.overwrite,
    )
    report = run_eval(settings)
    from .evaluate.report import markdown

    print(markdown(report))
    print(f"report written to {args.output_dir}/report.json, report.md and plots")
    return 0


def cmd_sweep(args) -> int:
    from .sweep import SweepSettings, run_sweep

    settings = SweepSettings(
        model=args.model, gguf_file=args.gguf_file, revision=args.revision,
        latent_dims=_int_list(args.latent_dims, "--latent-dims"), output_dir=args.output_dir,
        overwrite=args.overwrite, keep_checkpoints=args.keep_checkpoints,
        rope_dims=tuple(_int_list(str(args.rope_dim), "--rope-dim")),
        data=args.data, calib_data=args.calib_data, calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len, text_field=args.text_field, method=args.method,
        overrides=args.overrides, seq_len=args.seq_len, max_tokens=args.max_tokens,
        eval_batch_size=args.eval_batch_size, batch_size=args.batch_size, dtype=args.dtype, device=args.device,
        seed=args.seed, ignore_sliding_window=args.ignore_sliding_window, progress=not args.no_progress,
        target=args.target, biases=args.biases, engine=args.engine, cache_types=args.cache_types,
        max_cache_bytes=args.max_cache_bytes, **({} if args.max_ratio is None else {"max_ratio": args.max_ratio}),
        tasks=[t for t in args.tasks.split(",") if t], limit=args.limit,
        task_data_source=args.task_data,
    )
    result = run_sweep(settings)
    from .sweep import markdown

    print(markdown(result))
    return 0


def cmd_heal(args) -> int:
    from .heal.train import HealSettings, heal

    summary = heal(HealSettings(
        model=args.model, output=args.output, data=args.data, teacher=args.teacher,
        teacher_gguf_file=args.teacher_gguf_file, text_field=args.text_field, repeat_share=args.repeat_share,
        max_tokens=args.max_tokens,
        max_steps=args.max_steps, seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum,
        lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, kd_weight=args.kd_weight,
        lm_weight=args.lm_weight, temperature=args.temperature, train=args.train, cache_type=args.cache_type,
        gradient_checkpointing=args.gradient_checkpointing, loss_chunk=args.loss_chunk,
        mixed_precision=args.mixed_precision,
        save_every=args.save_every, save_total_limit=args.save_total_limit, eval_data=args.eval_data, eval_every=args.eval_every,
        eval_windows=args.eval_windows, eval_seq_len=args.eval_seq_len, checkpoint_dir=args.checkpoint_dir,
        resume=args.resume, seed=args.seed,
        overwrite=args.overwrite, progress=not args.no_progress,
    ))
    print(heal_line(summary, args.output))
    return 0


def heal_line(summary: dict, output: str) -> str:
    """heal's last line: tokens, speed (steady state only where there was one: a process's first step is set-up),
    peak memory of loading, of the training steps and of the held-out evaluations between them."""
    steady = summary["tokens_per_s"]
    speed = (f"{steady:.0f} tokens/s steady state (wall {summary['wall_tokens_per_s']:.0f})" if steady
             else f"{summary['wall_tokens_per_s']:.0f} tokens/s wall (no steady state: one step in this process)")
    peaks = [(summary.get(key), stage) for key, stage in (("setup_peak_rss_mb", "loading"),
                                                           ("train_peak_rss_mb", "training"),
                                                           ("eval_peak_rss_mb", "held-out evaluation"))]
    peaks = [f"{mb:.0f} MB {stage}" for mb, stage in peaks if mb is not None]
    memory = f", peak RSS {' / '.join(peaks)}" if peaks else ""
    if summary.get("train_peak_gpu_mb") is not None:
        memory += f", peak GPU {summary['train_peak_gpu_mb']:.0f} MB training"
    return (f"healed {summary['steps']} steps, {summary['tokens']} tokens, {speed}{memory} -> {output} "
            f"({summary['output_dtype']})")


def cmd_demo(args) -> int:
    from .demo import DemoSettings, run_demo

    run_demo(DemoSettings(
        output_dir=args.output_dir, latent_dim=args.latent_dim, rope_dim=args.rope_dim,
        calib_samples=args.calib_samples, method=args.method,
        overrides=DemoSettings.overrides if args.overrides is None else args.overrides, max_tokens=args.max_tokens, contexts=_int_list(args.contexts, "--contexts"), device=args.device,
        progress=not args.no_progress,
    ))
    return 0


def cmd_export_gguf(args) -> int:
    from .gguf_export import GGUFSettings, export_gguf

    result = export_gguf(GGUFSettings(
        checkpoint=args.checkpoint, output=args.output, outtype=args.outtype, tokenizer_gguf=args.tokenizer_gguf,
        tokenizer_pre=args.tokenizer_pre, overwrite=args.overwrite,
    ))
    print(f"wrote {result['output']} ({result['tensors']} tensors, {result['bytes'] / 2**20:.0f} MiB, "
          f"{result['outtype']}; tokenizer from {result['tokenizer']})")
    print(f"to quantize for llama.cpp / ollama keep the latent projection precise:\n  {result['quantize']}")
    if result["run_flags"]:
        print("llama.cpp ignores this GGUF's YaRN ramp keys for deepseek2; run it with:\n  "
              + " ".join(result["run_flags"]))
    return 0


def cmd_rebalance(args) -> int:
    from .rebalance import RebalanceSettings, rebalance

    record = rebalance(RebalanceSettings(
        model=args.checkpoint, output=args.output, balance=args.balance, calib_data=args.calib_data,
        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, text_field=args.text_field,
        batch_size=args.batch_size, device=args.device, overwrite=args.overwrite,
    ))
    spread = [(layer["pair_energy_spread_before"], layer["pair_energy_spread_after"]) for layer in record["layers"]]
    print(f"wrote {args.output}: rotary key carries energy^-{record['power']} of its unbalanced pairs (scaled by "
          f"energy^-{record['applied_power']:.3g}; {record['calib_tokens']} "
          f"calibration tokens); largest pair-energy spread {max(s[0] for s in spread):.1f}x -> "
          f"{max(s[1] for s in spread):.1f}x")
    return 0


COMMANDS = {"convert": cmd_convert, "eval": cmd_eval, "sweep": cmd_sweep, "heal": cmd_heal, "demo": cmd_demo,
            "export-gguf": cmd_export_gguf, "rebalance": cmd_rebalance}


def main(argv: list[str] | None = None) -> int:
    from .config_file import expand_config

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv)
    except UserError as exc:
        print(f"transmla-tool: error: {exc}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(argv)
        _check_finite(args)
    except UserError as exc:
        print(f"transmla-tool: error: {exc}", file=sys.stderr)
        return 2
    from .io.staging import kept_message

    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"transmla-tool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = kept_message()
        print(f"transmla-tool {args.command}: interrupted; " + (kept or "no output was left behind"), file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in USER_ERRNOS:
            raise
        kept = kept_message()
        print(f"transmla-tool {args.command}: error: {exc.strerror}: {exc.filename or ''} ({USER_ERRNOS[exc.errno]})"
              + (f"; {kept}" if kept else "; no output was left behind"), file=sys.stderr)
        return 2


# errors of the machine, not of the tool: a full disk, no permission, a read-only file system
USER_ERRNOS = {errno.ENOSPC: "free space and rerun", errno.EDQUOT: "free space and rerun",
               errno.EACCES: "choose a path you can write", errno.EROFS: "choose a writable path"}


def _check_finite(args) -> None:
    """No NaN or infinity in a numeric flag (argparse's float() accepts 'nan')."""
    import math

    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


if __name__ == "__main__":
    raise SystemExit(main())
