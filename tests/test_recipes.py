"""Recipes stay in sync with the command line: every section of every recipe parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from transmla_tool.cli import build_parser, main
from transmla_tool.config_file import expand_config

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_sections_parse(recipe):
    text = recipe.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    sections = yaml.safe_load(text)
    assert set(sections) <= {"convert", "heal", "eval"} and "convert" in sections
    for command in sections:
        args = build_parser().parse_args(expand_config([command, "--config", str(recipe)]))
        assert args.command == command
        for key, value in sections[command].items():
            parsed = getattr(args, key.replace("-", "_"))
            assert str(parsed) == str(value) or parsed == value, (command, key, parsed, value)
        assert f"transmla_tool {command} --config {recipe.relative_to(recipe.parent.parent)}" in header or (
            f"transmla-tool {command} --config {recipe.relative_to(recipe.parent.parent)}" in header)


def test_explicit_flag_beats_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("convert:\n  model: a\n  latent_dim: 64\n  output: o\n")
    args = build_parser().parse_args(expand_config(["convert", "--config", str(recipe), "--latent-dim", "32"]))
    assert args.latent_dim == 32 and args.model == "a"


def test_missing_section(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("heal:\n  model: a\n")
    assert main(["convert", "--config", str(recipe)]) == 2
    assert "has no 'convert' section" in capsys.readouterr().err


def test_accelerate_configs_are_yaml():
    configs = sorted((Path(__file__).parent.parent / "recipes" / "accelerate").glob("*.yaml"))
    assert {c.stem for c in configs} == {"ddp", "fsdp", "deepspeed"}
    for config in configs:
        data = yaml.safe_load(config.read_text())
        assert data["distributed_type"] in ("MULTI_GPU", "FSDP", "DEEPSPEED")


# Each recipe's family as a tiny fixture (what the recipe's header describes).
RECIPE_FAMILY = {
    "llama3.yaml": ("llama", dict(kv_heads=2, rope_scaling=True)),
    "mistral.yaml": ("mistral", dict(kv_heads=2)),
    "qwen2.yaml": ("qwen2", dict(kv_heads=2)),
    "smollm2.yaml": ("llama", dict(kv_heads=2)),
    "qwen3.yaml": ("qwen3", dict(kv_heads=2)),
    "granite.yaml": ("granite", dict(kv_heads=2)),
    "phi3.yaml": ("phi3", dict(kv_heads=4)),
    "gemma.yaml": ("gemma", dict(kv_heads=4)),
}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_converts_its_family_as_its_header_says(recipe, make_model, text_file, tmp_path):
    """The recipe's convert section run on a tiny model of its family: only what ties it to the real model
    and a GPU is replaced (model, output, sizes, calibration, device); its target and biases are its own, and
    the written checkpoint is what the header tells the user (rope written as DeepSeek YaRN for vLLM, biases
    kept for transformers)."""
    import json

    family, kwargs = RECIPE_FAMILY[recipe.name]
    section = yaml.safe_load(recipe.read_text())["convert"]
    header = " ".join(line.lstrip("# ") for line in recipe.read_text().splitlines() if line.startswith("#"))
    src = make_model(family, **kwargs)
    out = tmp_path / "out"
    pad = ["--pad-latent-to", str(320 - 8)] if section.get("target", "vllm") == "vllm" else []
    code = main(["convert", "--config", str(recipe), "--model", str(src), "--output", str(out), "--latent-dim", "16",
                 "--rope-dim", "8", *pad, "--calib-data", str(text_file), "--calib-samples", "4", "--calib-seq-len",
                 "32", "--device", "cpu", "--dtype", "float32", "--set", "refine_steps=5", "--no-progress"])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    if kwargs.get("rope_scaling"):
        written = config["rope_parameters"]["rope_type"]
        claims = {"yarn": "is written as DeepSeek YaRN", "llama3": 'is written as rope_type "llama3"'}
        assert claims[written] in header and all(c not in header for k, c in claims.items() if k != written), header
    if family == "qwen2":
        assert config["attention_bias"] is ("biases are kept exactly" in header), header
    if family == "qwen3":
        summary = json.loads((out / "conversion.json").read_text())
        assert "APPROXIMATE" in header and summary["exact_at_full_rank"] is False
    if family == "gemma":
        assert config["hidden_act"] == "gelu_pytorch_tanh" and "transformers only" in header
