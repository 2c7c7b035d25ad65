"""Reward functions and their registry.

Every registered reward has the reference signature (spec §7.2)::

    fn(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict

and returns a dict with at least ``"score"`` (float); other keys (``reason``, ``answer``, ``f1_score``) are
for logging. ``score_responses`` applies one to a batch and never lets a single bad row crash the run.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from arpo_jax.rewards import deep_research, math_reward, qa, tool_use
from arpo_jax.rewards.qa import (
    contains_gold,
    exact_match,
    extract_answer_tag,
    extract_boxed,
    normalize_answer,
    token_f1,
)


class RewardFn(Protocol):
    """``fn(data_source, response, ground_truth, extra_info=None) -> {"score": float, ...}``."""

    def __call__(self, data_source: str, response: str, ground_truth: Any, extra_info: dict | None = None) -> dict: ...


def _deep_research(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Registry adapter for :func:`deep_research.compute_score` (the ARPO/AEPO training reward)."""
    return deep_research.compute_score(response, ground_truth, extra_info)


def _math(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Registry adapter for :func:`math_reward.compute_score`."""
    return math_reward.compute_score(response, ground_truth)


def _math_tool(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Registry adapter for :func:`tool_use.math_tool_score` (the math reward + a bonus for a Python call that ran)."""
    return tool_use.math_tool_score(response, ground_truth)


def _qa_em(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Registry adapter for :func:`qa.qa_em`."""
    return qa.qa_em(response, ground_truth)


def _qa_f1(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Registry adapter for :func:`qa.qa_f1`."""
    return qa.qa_f1(response, ground_truth)


REWARDS: dict[str, RewardFn] = {
    "deep_research": _deep_research,
    "math": _math,
    "math_tool": _math_tool,
    "qa_em": _qa_em,
    "qa_f1": _qa_f1,
}

# "auto" dispatch: first matching data_source prefix wins (case-sensitive; both spellings listed where the
# public sets use them). DR_* comes first: every reference parquet is DR_* even for maths questions.
AUTO_DISPATCH: tuple[tuple[str, str], ...] = (
    ("DR_", "deep_research"),
    ("openai/gsm8k", "math"),
    ("gsm8k", "math"),
    ("lighteval/MATH", "math"),
    ("MATH", "math"),
    ("math", "math"),
    ("aime", "math"),
    ("AIME", "math"),
    ("nq", "qa_f1"),
    ("triviaqa", "qa_f1"),
    ("hotpotqa", "qa_f1"),
    ("2wiki", "qa_f1"),
    ("musique", "qa_f1"),
    ("bamboogle", "qa_f1"),
)
AUTO_DEFAULT = "deep_research"


def reward_name_for(data_source: str) -> str:
    """The registry name "auto" uses for ``data_source`` (prefix table, default deep_research)."""
    for prefix, name in AUTO_DISPATCH:
        if data_source.startswith(prefix):
            return name
    return AUTO_DEFAULT


def _auto(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
    """Dispatches on ``data_source`` through :data:`AUTO_DISPATCH`."""
    return REWARDS[reward_name_for(data_source)](data_source, response, ground_truth, extra_info)


def _as_score_dict(value: Any, where: str) -> dict:
    """Normalises a custom reward's return value (float or dict with "score") to a dict."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"custom reward {where} returned a dict without a 'score' key: {sorted(value)}")
        return {**value, "score": float(value["score"])}
    return {"score": float(value)}


def load_custom_reward(path: str, name: str = "compute_score") -> RewardFn:
    """Loads ``name`` from the Python file ``path`` (the reference's ``custom_reward_function``).

    The function must take ``(data_source, solution_str, ground_truth, extra_info=None)`` and return a float
    or a dict with a "score" key; the returned wrapper always yields a dict.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ImportError: the file raised while being imported.
      AttributeError: the file has no callable ``name``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward file not found: {path!r} (config field reward.custom_path)")
    spec = importlib.util.spec_from_file_location(f"arpo_custom_reward_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import custom reward file {path!r} (config field reward.custom_path)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ImportError(
            f"custom reward file {path!r} failed to import ({type(e).__name__}: {e}); "
            f"check config field reward.custom_path"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(
            f"custom reward file {path!r} has no function {name!r} "
            f"(config fields reward.custom_path / reward.custom_name)"
        )
    where = f"{os.path.basename(path)}:{name}"

    def custom(data_source: str, response: str, ground_truth, extra_info: dict | None = None) -> dict:
        return _as_score_dict(fn(data_source, response, ground_truth, extra_info), where)

    return custom


def get_reward_fn(
    name: str = "deep_research", *, custom_path: str = "", custom_name: str = "compute_score"
) -> RewardFn:
    """Selects a reward: ``custom_path`` (if set) wins for every sample, as in the reference (spec §7.1).

    Args:
      name: a key of :data:`REWARDS` or "auto" (dispatch on ``data_source``).
      custom_path: Python file holding a reference-signature reward function.
      custom_name: function name inside ``custom_path``.

    Raises:
      ValueError: unknown ``name`` (the message lists the allowed names).
    """
    if custom_path:
        return load_custom_reward(custom_path, custom_name)
    if name == "auto":
        return _auto
    if name not in REWARDS:
        allowed = ", ".join(sorted([*REWARDS, "auto"]))
        raise ValueError(f"unknown reward name {name!r} (config field reward.name); allowed: {allowed}")
    return REWARDS[name]


def _safe_score(fn: Callable, data_source: str, response: str, ground_truth, extra_info: dict | None) -> dict:
    """One reward call that never raises: errors and non-finite scores become score 0 with ``error=True``."""
    try:
        out = _as_score_dict(fn(data_source, response, ground_truth, extra_info), getattr(fn, "__name__", "fn"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a malformed row must not crash training (BaseException: library timeouts)
        return {"score": 0.0, "reason": f"reward_error: {type(e).__name__}: {e}", "error": True}
    if not math.isfinite(out["score"]):
        return {**out, "score": 0.0, "reason": f"reward_error: non-finite score {out['score']}", "error": True}
    return out


def score_responses(
    fn: RewardFn,
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
) -> list[dict]:
    """Scores a batch with ``fn``; one dict per response, each with a float "score".

    Raises:
      ValueError: the input sequences have different lengths (a caller bug, not a bad row).
    """
    n = len(responses)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            f"length mismatch: data_sources={len(data_sources)}, responses={n}, "
            f"ground_truths={len(ground_truths)}, extra_infos={len(extra_infos)}"
        )
    return [_safe_score(fn, *args) for args in zip(data_sources, responses, ground_truths, extra_infos)]


__all__ = [
    "AUTO_DISPATCH",
    "REWARDS",
    "RewardFn",
    "contains_gold",
    "exact_match",
    "extract_answer_tag",
    "extract_boxed",
    "get_reward_fn",
    "load_custom_reward",
    "normalize_answer",
    "reward_name_for",
    "score_responses",
    "token_f1",
]
