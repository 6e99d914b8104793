"""The README.md model card written next to a converted checkpoint."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_model_card(directory: Path, summary: dict, config, extra_sections: list[str] | None = None) -> None:
    settings = summary["settings"]
    cache = summary["cache_values_per_token_per_layer"]
    saved = 1 - cache["converted"] / cache["original"]
    front = {
        "library_name": "transformers",
        "base_model": summary["source"],
        "tags": ["deepseek_v3", "mla", "transmla_tool"],
    }
    kept = [layer["kept_energy"] for layer in summary.get("layers", [])]
    verify = [layer["stock_vs_reference"] for layer in summary.get("layers", [])]
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {Path(summary['source']).name} as multi-head latent attention (DeepSeek-V3 format)",
        "",
        f"Converted from `{summary['source']}` ({summary['family']} family) by transmla_tool "
        f"{summary['version']}. This is a stock `DeepseekV3ForCausalLM` checkpoint: it loads with "
        "`AutoModelForCausalLM.from_pretrained(path)` and no `trust_remote_code`.",
        "",
        *([f"**Approximation:** {summary['approximation']}", ""] if summary.get("approximation") else []),
        *summary.get("family_notes", []),
        *([""] if summary.get("family_notes") else []),
        "## KV cache per token per layer",
        "",
        "| | values | |",
        "|---|---|---|",
        f"| original ({_original_cache(summary, config)}) | {cache['original']} | |",
        f"| converted (latent {config.kv_lora_rank} + rotary key {config.qk_rope_head_dim}) | "
        f"{cache['converted']} | {saved:.0%} saved |",
        "",
        "## Conversion settings",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for key in ("latent_dim", "rope_dim", "calib_data", "calib_samples", "calib_windows", "calib_seq_len",
                "calib_tokens", "seed", "method_name"):
        if key == "calib_windows" and settings.get(key) is None:
            continue  # written by versions before 2026-11-28
        label = {"calib_samples": "calib_samples (asked for)", "calib_windows": "calib_windows (used)"}.get(key, key)
        lines.append(f"| {label} | `{settings.get(key)}` |")
    for key, value in settings["method"].items():
        lines.append(f"| method.{key} | `{value}` |")
    lines += [f"| output dtype | `{summary['dtype']}` |", ""]
    if kept:
        lines += [
            "## Per-layer checks",
            "",
            f"- latent energy kept (weighted): min {min(kept):.4f}, mean {sum(kept) / len(kept):.4f}",
            f"- stock transformers layer vs the tool's reference math: max relative difference {max(verify):.2e}",
            "",
        ]
    serv = summary["servable"]
    lines += ["## Serving", "", "- transformers: " + str(serv.get("transformers", "exact"))]
    for engine in ("vllm", "llama.cpp", "sglang"):
        verdict = serv.get(engine)
        if not isinstance(verdict, dict):
            continue
        state = "serves it as is" if verdict["serves_as_is"] else "**not as is**"
        how = "read from its source, not run" if verdict.get("run") is False else "observed by running it"
        lines.append(f"- {engine} ({verdict['version']}, {how}): {state}")
        lines += [f"  - {problem}" for problem in verdict["problems"]]
    lines += [
        "- The latent RMSNorm (`kv_a_layernorm`) is linearized: its input is scaled so the norm acts as an "
        "exact identity in fp32 and bf16; do not cast this checkpoint to fp16.",
    ]
    scale = summary.get("residual_scale", 1.0)
    if scale != 1.0:
        lines.append(
            f"- Every RMSNorm uses eps 1e-6 (transformers fixes it for the latent norm); the source's blocks used "
            f"{summary['source_rms_norm_eps']:g}, kept exactly by scaling the residual stream by {scale:.6g} "
            "(embeddings, o_proj, down_proj).")
    lines.append("")
    for section in extra_sections or []:
        lines += [section, ""]
    (directory / "README.md").write_text("\n".join(lines))


def _original_cache(summary: dict, config) -> str:
    """What the source cached per layer, e.g. "K and V of 3 heads x 64 (GQA, 9 query heads)"."""
    kv_heads, head_dim = summary.get("original_kv_heads"), summary.get("original_head_dim")
    if kv_heads is None:  # conversion.json written before these were recorded
        return "K and V"
    heads = config.num_attention_heads
    kind = "MHA" if kv_heads == heads else ("MQA" if kv_heads == 1 else "GQA")
    return f"K and V of {kv_heads} heads x {head_dim} ({kind}, {heads} query heads)"
