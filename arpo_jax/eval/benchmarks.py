"""The 13 evaluation benchmarks of the reference (spec 13.2): loaders, names, and the evaluation prompt.

Each benchmark is one JSON-lines file, ``<data dir>/<name>/test.jsonl``, whose field names differ from file to
file (``problem`` / ``question`` / ``Question``, ``answer`` as a string, a number or a list of aliases, ``id`` /
``idx`` / ``task_id``). ``BENCHMARKS`` records how to read each one; ``load_benchmark`` turns every row into an
``EvalSample`` with the question, a tuple of reference answers (a sample is correct if it matches any of them)
and the task type that picks the scoring rule (``math``: aime24, aime25, math500, gsm8k; ``qa``: the rest).

A malformed row (bad JSON or UTF-8, not an object, no question, no answer) never stops an evaluation: it is
skipped, logged with its file and line number, and recorded in ``BenchmarkSamples.skipped``.

Prompt (spec B17): the reference evaluates with ``prompt_manager.py``'s system prompt, which differs from the
training data's by the ``\\x08oxed`` byte artifact (spec 2.3), and splices tool results differently. Here the
evaluation prompt is exactly the training one (``arpo_jax.data.prompts``): by default the parquet files' system message
(same bytes, artifact included, identical across math and deep-search data) and the raw question as the user
message, which is how every row of ``train_10k`` / ``valid`` / ``hard_search_1k`` / ``gaia_test`` /
``hle_test`` is stored; for a config trained on the built-in toy tasks, their prompt with a real ``\\boxed``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arpo_jax.data.prompts import REFERENCE_DATA_SYSTEM_PROMPT as TRAINING_SYSTEM_PROMPT
from arpo_jax.data.prompts import chat_messages
from arpo_jax.rewards.qa import as_references

log = logging.getLogger(__name__)

TASKS = ("math", "qa")
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


@dataclasses.dataclass(frozen=True)
class EvalSample:
    """One benchmark question.

    Attributes:
      benchmark: the ``BENCHMARKS`` key it came from.
      id: stable id: the file's own id field when it has one, else ``f"{benchmark}-{line_index}"`` (0-based).
      question: the question text, as the user message.
      answers: reference answers, non-empty stripped strings, deduplicated in order; any one of them is right.
      task: ``"math"`` or ``"qa"``; picks the binary ``correct`` rule in ``scoring.score_output``.
      meta: everything else worth keeping (``language``, level, category, the raw answer when it was rewritten).
    """

    benchmark: str
    id: str
    question: str
    answers: tuple[str, ...]
    task: str
    meta: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """How to read one benchmark file.

    Attributes:
      file: path of the JSON-lines file relative to the data directory.
      task: ``"math"`` or ``"qa"`` (spec 13.2's task of the reference's ``evaluate_passk.sh``).
      question_fields: candidate keys of the question; the first present non-empty string wins.
      answer_fields: candidate keys of the answer (str, number or list of aliases).
      id_fields: candidate keys of the row id; none present -> ``f"{name}-{line_index}"``.
      answer_format: ``"plain"``; ``"gsm8k"`` (keep the number after the last ``####``, thousands commas
        dropped); ``"integer"`` (AIME: ``"025"`` -> ``"25"``, so exact match does not depend on zero padding).
      split_list_strings: a string answer starting with ``[`` is a list of aliases (parsed as a JSON/Python list
        literal, else split on commas as in the reference). Only for files whose answers are natively alias
        lists; elsewhere ``[...]`` is one list-valued answer (HLE: ``[11,19,22,...]``) or an interval (math).
      meta_fields: row keys copied into ``EvalSample.meta`` (lower-cased key names).
    """

    file: str
    task: str
    question_fields: tuple[str, ...] = ("question",)
    answer_fields: tuple[str, ...] = ("answer",)
    id_fields: tuple[str, ...] = ("id",)
    answer_format: str = "plain"
    split_list_strings: bool = False
    meta_fields: tuple[str, ...] = ()


def _qa(name: str, **kw: Any) -> BenchmarkSpec:
    return BenchmarkSpec(file=f"{name}/test.jsonl", task="qa", **kw)


# Order: the math benchmarks, then the knowledge-intensive QA ones, then the deep-search ones (papers' tables).
BENCHMARKS: dict[str, BenchmarkSpec] = {
    "aime24": BenchmarkSpec("aime24/test.jsonl", "math", question_fields=("problem", "question"),
                            answer_format="integer", meta_fields=("url",)),
    "aime25": BenchmarkSpec("aime25/test.jsonl", "math", question_fields=("problem", "question"),
                            answer_format="integer"),
    "math500": BenchmarkSpec("math500/test.jsonl", "math", id_fields=("unique_id", "id"),
                             meta_fields=("level", "subject")),
    "gsm8k": BenchmarkSpec("gsm8k/test.jsonl", "math", id_fields=("idx", "id"), answer_format="gsm8k"),
    "hotpotqa": _qa("hotpotqa", split_list_strings=True),
    "2wiki": _qa("2wiki", split_list_strings=True),
    "musique": _qa("musique", split_list_strings=True),
    "bamboogle": _qa("bamboogle", split_list_strings=True),
    "SimpleQA": _qa("SimpleQA", split_list_strings=True),
    "webwalker": _qa("webwalker"),
    # GAIA's `id` is just the row number; `task_id` is the benchmark's own identifier.
    "gaia": _qa("gaia", question_fields=("Question", "question"), id_fields=("task_id", "id"),
                meta_fields=("Level",)),
    "hle": _qa("hle", meta_fields=("answer_type", "category", "raw_subject")),
    "xbench": _qa("xbench", split_list_strings=True),
}


class BenchmarkSamples(list):
    """``list[EvalSample]`` plus what loading dropped.

    Attributes:
      path: the file read.
      skipped: ``(line_number, reason)`` per malformed row, line numbers 1-based as in an editor.
    """

    def __init__(self, samples: list[EvalSample], *, path: Path, skipped: list[tuple[int, str]]):
        super().__init__(samples)
        self.path, self.skipped = path, list(skipped)


class _BadRow(ValueError):
    """A row that cannot become an EvalSample; the message is the reason recorded in ``skipped``."""


# A benchmark given as a JSON-lines file of its own (`--benchmarks path/to/questions.jsonl`): math questions in the
# MATH500 / train_10k layout. Its name (report key, workdir folder, record `benchmark`) is the file's stem.
FILE_SPEC = BenchmarkSpec(file="", task="math", question_fields=("question", "problem"), id_fields=("id", "idx"))


def is_file_benchmark(name: str) -> bool:
    """Whether ``name`` names a JSON-lines file rather than one of ``BENCHMARKS``."""
    return str(name).endswith(".jsonl")


def benchmark_name(name: str) -> str:
    """The report key of a benchmark argument: a ``BENCHMARKS`` key, or a file benchmark's stem."""
    return Path(name).stem if is_file_benchmark(name) else _canonical(name)


def _canonical(name: str) -> str:
    """The ``BENCHMARKS`` key for ``name`` (case-insensitive); ValueError listing the allowed names."""
    by_lower = {k.lower(): k for k in BENCHMARKS}
    key = by_lower.get(str(name).strip().lower())
    if key is None:
        raise ValueError(f"unknown benchmark {name!r}; allowed: {', '.join(BENCHMARKS)} (or 'all')")
    return key


def parse_benchmarks(arg: str) -> list[str]:
    """Benchmark names from a comma-separated list (``"aime24,gsm8k"``) or ``"all"``, in the order given.

    Names are matched case-insensitively and returned as the ``BENCHMARKS`` keys, duplicates dropped.
    Raises ValueError for an unknown name or an empty list.
    """
    parts = [p.strip() for p in str(arg).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"no benchmark given; allowed: {', '.join(BENCHMARKS)} (or 'all')")
    if any(p.lower() == "all" for p in parts):
        return list(BENCHMARKS)
    names = list(dict.fromkeys(p if is_file_benchmark(p) else _canonical(p) for p in parts))
    stems = [benchmark_name(n) for n in names]
    if len(set(stems)) < len(stems):
        raise ValueError(f"two benchmarks share a name: {', '.join(names)} (a file benchmark is named by its stem)")
    return names


def default_data_dir() -> Path:
    """``$ARPO_EVAL_DATA`` if set, else ``<repo root>/../shared/data/eval`` if it exists.

    Raises:
      FileNotFoundError: neither is available (or ``$ARPO_EVAL_DATA`` names a missing folder).
    """
    env = os.environ.get("ARPO_EVAL_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"ARPO_EVAL_DATA={env!r} is not a directory; pass --data-dir or fix it")
        return path
    path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "eval"
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"no evaluation data directory: {path} does not exist; pass --data-dir or set ARPO_EVAL_DATA to the folder "
        f"holding <benchmark>/test.jsonl"
    )


def _first_field(row: dict, fields: tuple[str, ...]) -> Any:
    """The first of ``fields`` present in ``row`` with a non-empty value, else None."""
    for f in fields:
        value = row.get(f)
        if value is not None and not (isinstance(value, (str, list, tuple)) and len(value) == 0):
            return value
    return None


def _parse_list_literal(text: str) -> list | None:
    """``text`` as a JSON or Python list literal, else None."""
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, list):
            return value
    return None


def normalize_answers(value: Any, *, answer_format: str = "plain", split_list_strings: bool = False
                      ) -> tuple[str, ...]:
    """A raw answer field as a tuple of reference strings.

    Args:
      value: a string, a number, or a (nested) list of them.
      answer_format: see ``BenchmarkSpec.answer_format``.
      split_list_strings: see ``BenchmarkSpec.split_list_strings``.

    Returns:
      Stripped, non-empty, order-preserving deduplicated references (empty tuple if there are none).
    """
    if isinstance(value, dict):
        return ()  # an object is not an answer (as_references would iterate its keys)
    if isinstance(value, str) and split_list_strings and value.strip().startswith("["):
        parsed = _parse_list_literal(value.strip())
        # Not a literal (e.g. `[a, b]` unquoted): the reference's comma split (spec 13.2).
        value = parsed if parsed is not None else as_references(value, split_bracketed=True)
    refs = [r.strip() for r in as_references(value)]
    if answer_format == "gsm8k":
        refs = [r.rsplit("####", 1)[-1].strip().replace(",", "") for r in refs]
    elif answer_format == "integer":
        refs = [str(int(r)) if r.isascii() and r.isdigit() else r for r in refs]
    elif answer_format != "plain":
        raise ValueError(f"unknown answer_format {answer_format!r}")
    return tuple(dict.fromkeys(r for r in refs if r))


def _row_to_sample(name: str, spec: BenchmarkSpec, row: Any, line_index: int) -> EvalSample:
    """One parsed JSON row as an EvalSample; raises _BadRow with the reason."""
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}, expected a JSON object")
    question = _first_field(row, spec.question_fields)
    if not isinstance(question, str) or not question.strip():
        raise _BadRow(f"no question (looked for {', '.join(spec.question_fields)})")
    raw_answer = _first_field(row, spec.answer_fields)
    if raw_answer is None:
        raise _BadRow(f"no answer (looked for {', '.join(spec.answer_fields)})")
    answers = normalize_answers(raw_answer, answer_format=spec.answer_format,
                                split_list_strings=spec.split_list_strings)
    if not answers:
        raise _BadRow(f"empty answer {raw_answer!r:.80}")
    row_id = _first_field(row, spec.id_fields)
    sample_id = str(row_id) if isinstance(row_id, (str, int)) and not isinstance(row_id, bool) else None
    meta = {"language": "zh" if _CJK.search(question) else "en", "line": line_index + 1}
    meta.update({f.lower(): row[f] for f in spec.meta_fields if f in row})
    if not isinstance(raw_answer, list) and answers != (str(raw_answer).strip(),):
        meta["raw_answer"] = raw_answer  # rewritten (gsm8k solution, zero-padded AIME, list string): keep the source
    return EvalSample(benchmark=name, id=sample_id or f"{name}-{line_index}", question=question,
                      answers=answers, task=spec.task, meta=meta)


def load_benchmark(name: str, data_dir: str | os.PathLike | None = None, *, limit: int | None = None,
                   offset: int = 0) -> BenchmarkSamples:
    """Reads one benchmark file into EvalSamples, skipping (and logging) malformed rows.

    Args:
      name: a ``BENCHMARKS`` key (case-insensitive), or the path of a JSON-lines file (``FILE_SPEC``).
      data_dir: folder holding ``<name>/test.jsonl``; default ``default_data_dir()`` (not used for a file).
      limit: keep only ``limit`` samples (the file is not read further).
      offset: leave out the first ``offset`` samples (valid rows) before those: the slice [offset, offset + limit).

    Returns:
      A ``BenchmarkSamples`` (a list of EvalSample, in file order, ids unique) with ``.skipped``.

    Raises:
      ValueError: unknown benchmark name or negative limit.
      FileNotFoundError: the file does not exist.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if is_file_benchmark(name):
        key, spec, path = benchmark_name(name), FILE_SPEC, Path(name)
    else:
        key = _canonical(name)
        spec = BENCHMARKS[key]
        path = Path(data_dir if data_dir is not None else default_data_dir()) / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {key!r}: {path} not found (pass --data-dir or set ARPO_EVAL_DATA)")
    samples: list[EvalSample] = []
    skipped: list[tuple[int, str]] = []
    seen: set[str] = set()
    with open(path, "rb") as f:  # bytes, so one line of bad UTF-8 is one skipped row, not a crashed run
        for line_index, raw in enumerate(f):
            if limit is not None and len(samples) >= offset + limit:
                break
            if not raw.strip():
                continue
            try:
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise _BadRow(f"invalid UTF-8: {e}") from None
                except (ValueError, RecursionError) as e:
                    raise _BadRow(f"invalid JSON: {e}") from None
                sample = _row_to_sample(key, spec, row, line_index)
            except _BadRow as e:
                log.warning("%s line %d: skipped malformed row: %s", path, line_index + 1, e)
                skipped.append((line_index + 1, str(e)))
                continue
            if sample.id in seen:  # a duplicated file id would merge two questions' samples in pass@k
                log.warning("%s line %d: duplicate id %r, using %r", path, line_index + 1, sample.id,
                            f"{key}-{line_index}")
                sample = dataclasses.replace(sample, id=f"{key}-{line_index}")
            seen.add(sample.id)
            samples.append(sample)
    if skipped:
        log.warning("%s: skipped %d malformed row(s), kept %d", path, len(skipped), len(samples))
    return BenchmarkSamples(samples[offset:], path=path, skipped=skipped)


def build_messages(question: str, *, system_prompt: str = TRAINING_SYSTEM_PROMPT,
                   shots: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The chat messages that prompt a model at evaluation time: exactly the training prompt (spec B17).

    The RL parquet files use one system prompt for math and deep-search rows alike, and the bare question as the
    user turn, so there is no per-task variant. `components.system_prompt_for(cfg)` gives the prompt of a config's
    training data (e.g. the built-in toy tasks' real ``\\boxed``); the default is the reference data's bytes.
    ``shots``: (question, response) examples put between the system prompt and the question as earlier user and
    assistant turns (a few-shot prompt: `load_shots`).
    """
    system, user = chat_messages(question, system_prompt)
    turns = [{"role": role, "content": text} for q, r in shots for role, text in (("user", q), ("assistant", r))]
    return [system, *turns, user]


def load_shots(path: str | os.PathLike) -> tuple[tuple[str, str], ...]:
    """Few-shot examples from a JSON file: a list of ``{"question": ..., "response": ...}`` objects."""
    rows = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("question"), str)
                                             and isinstance(r.get("response"), str) for r in rows):
        raise ValueError(f"--few-shot {path}: expected a JSON list of {{\"question\": str, \"response\": str}}")
    return tuple((r["question"], r["response"]) for r in rows)
