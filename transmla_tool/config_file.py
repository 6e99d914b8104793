"""`--config recipe.yaml`: a recipe's section for the command, turned into command-line flags."""

from __future__ import annotations

from .errors import UserError


def expand_config(argv: list[str]) -> list[str]:
    """`--config recipe.yaml`: the YAML section named after the command becomes flags placed before
    the command line's own, so flags given explicitly win. Keys are option names (`latent_dim` or
    `latent-dim`); true booleans become bare flags, lists repeat the flag."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise UserError("--config needs a YAML file")
    path, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
    import yaml

    try:
        with open(path) as f:
            recipe = yaml.safe_load(f) or {}
    except OSError as exc:
        raise UserError(f"cannot read --config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"--config {path} is not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from exc
    if not isinstance(recipe, dict):
        raise UserError(f"--config {path} must be a mapping of command names to settings, not a "
                        f"{type(recipe).__name__}")
    command = rest[0] if rest else ""
    section = recipe.get(command)
    if not isinstance(section, dict):
        raise UserError(f"{path} has no '{command}' section")
    flags = []
    for key, value in section.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for item in value:
                flags += [flag, str(item)]
        else:
            flags += [flag, str(value)]
    return [command, *flags, *rest[1:]]
