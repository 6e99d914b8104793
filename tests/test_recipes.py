"""Recipes stay in sync with the command line: every section of every recipe parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from transmla_tool.cli import build_parser, expand_config, main

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
