"""The experiment files: configs/ at the top of the repository, one ``get_config()`` each, built on
``config/schema.py`` (every field, its default and meaning). `--config=builtin:NAME` names one of them.

Where they are: a checkout's own configs/ (beside arpo_jax/, with its pyproject.toml), installed or not, so a
checkout run without `pip install` and one imported beside another checkout's install read their own files; else
(a wheel: no configs/ beside the package) the copy installed as `arpo_jax.configs` (pyproject.toml's package-dir),
found without importing it. An experiment built on another loads it with `experiment(NAME)`, by path, as
config_flags loads a `--config` file: nothing is registered in `sys.modules`.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

from arpo_jax.config import schema


@functools.cache
def folder() -> Path:
    """The folder of the experiment files (see the module's docstring)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "configs" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root / "configs"
    spec = importlib.util.find_spec("arpo_jax.configs")
    if spec is None or spec.origin is None:
        raise ImportError("the experiment configs (configs/ at the top of the checkout) are not found: run from a "
                          "whole checkout (configs/ beside arpo_jax/), or install it: pip install -e .")
    return Path(spec.origin).parent


BASE = "base"  # `builtin:base`: the schema itself, every default


def names() -> list[str]:
    """Names accepted as `--config=builtin:NAME`: the experiment files and `base`."""
    return sorted([BASE, *(p.stem for p in folder().glob("*.py") if p.stem != "__init__")])


def path(name: str) -> Path:
    """The file of `builtin:NAME`: configs/NAME.py, or the schema's for `base`."""
    if name not in names():
        raise ValueError(f"no experiment config {name!r} in {folder()}; there are: {', '.join(names())}")
    return Path(schema.__file__) if name == BASE else folder() / f"{name}.py"


@functools.cache
def experiment(name: str) -> ModuleType:
    """The experiment file `name` (configs/NAME.py), loaded by path: its `get_config` and helpers."""
    spec = importlib.util.spec_from_file_location(f"arpo_jax_experiment_{name}", path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
