"""Command line -> experiment config: ``--config=FILE[:ARG]`` (or ``builtin:NAME``, a file shipped in
``configs/``) and its ``--config.a.b=v`` overrides, through the real ``config_flags`` parser (the same
syntax as every flax example). Errors become one ``ValueError`` naming the argument; ``arpo_jax.assemble.validate``
then checks the values.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from absl import flags
from ml_collections import ConfigDict, config_flags

from arpo_jax.config import experiments

BUILTIN = "builtin:"  # prefix of generated inputs (builtin:tiny model, builtin:toy data / corpus): no file to check


def get(cfg: Any, path: str) -> Any:
    """The value at dotted `path` ("actor.clip_c")."""
    for part in path.split("."):
        cfg = cfg[part]
    return cfg


def has_field(cfg: Any, path: str) -> bool:
    try:
        get(cfg, path)
    except (KeyError, AttributeError, TypeError):
        return False
    return True


def _is_config_arg(arg: str) -> bool:
    """`--config`, `--config=...`, `--config.a.b=...` and `--noconfig.a.b` (absl accepts one or two dashes)."""
    return re.match(r"^--?(config(=|$|\.)|noconfig\.)", arg) is not None


def builtin_configs() -> list[str]:
    """Names accepted as `--config=builtin:NAME`: the experiment files shipped in configs/."""
    return experiments.names()


def config_file(spec: str) -> str:
    """The config file of `spec`: `builtin:NAME[:ARG]` -> the shipped configs/NAME.py[:ARG]; a path as is."""
    if not spec.startswith(BUILTIN):
        return spec
    name, _, arg = spec[len(BUILTIN):].partition(":")
    if name not in builtin_configs():
        raise ValueError(f"--config={spec}: no built-in config {name!r}; allowed: "
                         f"{', '.join(f'builtin:{n}' for n in builtin_configs())}, or a path to a .py file")
    return str(experiments.path(name)) + (f":{arg}" if arg else "")


def _resolve_builtin(config_args: list[str]) -> list[str]:
    """`--config=builtin:NAME` / `--config builtin:NAME` with the shipped file's path."""
    out = list(config_args)
    for i, arg in enumerate(out):
        if re.match(r"^--?config=", arg):
            flag, value = arg.split("=", 1)
            out[i] = f"{flag}={config_file(value)}"
        elif re.match(r"^--?config$", arg) and i + 1 < len(out):
            out[i + 1] = config_file(out[i + 1])
    return out


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the config arguments (with their space-separated values) and the rest.

    `--config path` and `--config.x.y value` take the next token as their value when it does not start with "-";
    a bare `--config.flag` followed by a positional argument must therefore be written `--config.flag=true`.
    """
    config_args, rest = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # absl stops parsing flags here; keep everything after it for the caller
            rest.extend(args[i:])
            break
        if not _is_config_arg(arg):
            rest.append(arg)
        elif "=" in arg or arg.startswith(("-noconfig.", "--noconfig.")) or i + 1 == len(args) \
                or args[i + 1].startswith("-"):
            config_args.append(arg)
        else:
            config_args.extend(args[i:i + 2])
            i += 1
        i += 1
    return _resolve_builtin(config_args), rest


def _parse_with_absl(config_args: list[str]) -> ConfigDict:
    """Runs ml_collections' config_flags on a fresh FlagValues (no global absl state is touched)."""
    fv = flags.FlagValues()
    argv = ["arpo-jax", *config_args]
    # sys_argv: config_flags finds the overrides to define in this list instead of the process's sys.argv.
    config_flags.DEFINE_config_file("config", None, "experiment config file", flag_values=fv, sys_argv=argv)
    fv(argv)
    cfg = fv.config
    if cfg is None:
        raise ValueError(f"no config file given; pass --config=builtin:<name> ({', '.join(builtin_configs())}) "
                         "or --config=path/to/file.py")
    if not isinstance(cfg, ConfigDict):
        cfg.keys()  # config_flags defers a load failure to the first access: this raises it (OSError)
        raise ValueError(f"get_config() returned a {type(cfg).__name__}, not a ConfigDict")
    return cfg


def _unknown_overrides(config_args: list[str]) -> list[str]:
    """Names every `--config.a.b` override whose field does not exist in the loaded config file."""
    files = [a for a in config_args if re.match(r"^--?config(=|$)", a)]
    if not files:
        return []
    path_arg = files[-1].split("=", 1)[1] if "=" in files[-1] else config_args[config_args.index(files[-1]) + 1]
    base = _parse_with_absl([f"--config={path_arg}"])
    problems = []
    for arg in config_args:
        match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
        if match and not has_field(base, match.group(1)):
            problems.append(_unknown_field_message(base, match.group(1)))
    return problems


def _unknown_field_message(cfg: ConfigDict, path: str) -> str:
    """Names the first part of `path` that does not exist and what exists at that level."""
    node = cfg
    for part in path.split("."):
        if not isinstance(node, ConfigDict):
            return f"{path}: unknown config field {part!r} (allowed: none, the parent is a value, not a section)"
        if part not in node:
            return f"{path}: unknown config field {part!r} (allowed: {', '.join(sorted(node.keys()))})"
        node = node[part]
    return f"{path}: unknown config field"


def parse_config_args(argv: Sequence[str]) -> tuple[ConfigDict, list[str]]:
    """Loads `--config=FILE[:arg]` (or `builtin:NAME[:arg]`) with its `--config.a.b=v` overrides; returns
    (config, other args).

    Errors from absl / ml_collections (missing file, unknown field, a value of the wrong type) become a
    ``ValueError`` whose message names the argument.
    """
    config_args, rest = split_config_args(argv)
    if not any(re.match(r"^--?config(=|$)", a) for a in config_args):
        raise ValueError(f"no config file given; pass --config=builtin:<name> ({', '.join(builtin_configs())}) "
                         "or --config=path/to/file.py")
    try:
        cfg = _parse_with_absl(config_args)
    except (AttributeError, KeyError) as e:  # config_flags reports an unknown override as a bare attribute error
        try:
            problems = _unknown_overrides(config_args)
        except Exception:  # the config file itself is broken: report the original error
            problems = []
        raise ValueError("; ".join(problems) or f"config error: {type(e).__name__}: {e}") from None
    except flags.Error as e:
        raise ValueError(f"config argument error: {e}") from None
    except OSError as e:  # config_flags defers a missing file to the first access of the config
        raise ValueError(f"cannot load the config file: {' '.join(str(e).split())}") from None
    except SyntaxError as e:
        raise ValueError(f"the config file has a syntax error: {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # the file's own code (get_config() or a module-level statement) raised
        where = _config_file_arg(config_args)
        raise ValueError(f"the config file {where} failed to load: {type(e).__name__}: {e}") from None
    return cfg, rest


def _config_file_arg(config_args: list[str]) -> str:
    """The `--config=FILE[:ARG]` value (for messages)."""
    for i, a in enumerate(config_args):
        if re.match(r"^--?config$", a) and i + 1 < len(config_args):
            return config_args[i + 1]
        if re.match(r"^--?config=", a):
            return a.split("=", 1)[1]
    return "?"


def load_config(argv: Sequence[str]) -> ConfigDict:
    """Like `parse_config_args`, but every argument must belong to the config; returns the locked ConfigDict."""
    cfg, rest = parse_config_args(argv)
    if rest:
        raise ValueError(f"unrecognised arguments (not --config / --config.*): {' '.join(rest)}")
    return cfg


def apply_overrides(cfg: ConfigDict, overrides: Sequence[str], base: str = "builtin:toy_cpu") -> None:
    """`KEY=VALUE` strings set on an already built config (e.g. the demo's), each parsed and typed exactly as
    `--config.KEY=VALUE` on `base` would be (its parser, its errors); `assemble.validate` checks the values later."""
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"{o!r}: expected KEY=VALUE, e.g. rollout.max_staleness=1")
    parsed = load_config([f"--config={base}", *(f"--config.{o}" for o in overrides)])
    with cfg.unlocked():
        for path in (o.split("=", 1)[0] for o in overrides):
            *parents, leaf = path.split(".")
            get(cfg, ".".join(parents))[leaf] = get(parsed, path)
