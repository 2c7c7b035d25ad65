"""A small built-in task set (`data.train_files = "builtin:toy"`) for CPU tests and the demo; no downloads.

Three task kinds, each answerable only with the tools the reference policy has:
  * toy_arith:  multiply two 3-4 digit numbers (needs <python>);
  * toy_lookup: a fact about a fictional country or city (needs <search> over `corpus()`);
  * toy_twohop: two lookups plus arithmetic (needs both).

The facts are invented, so a pretrained model cannot know them and the offline BM25 backend
(`arpo_jax.tools.LocalSearchTool(documents=corpus())`) is the only way to find them. Rows follow the reference
parquet schema (spec 2.1) with the reference system prompt, except that `\\boxed` is spelled correctly here
(the reference files store it as `\\x08oxed`, spec 2.3).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import zlib
from collections.abc import Sequence

import numpy as np

from arpo_jax.data.prompts import SYSTEM_PROMPT, chat_messages

DATA_SOURCES = ("toy_arith", "toy_lookup", "toy_twohop")
BUILTIN = "builtin:toy"  # the data.train_files / data.val_files value that selects this task set
NUM_COUNTRIES = 32

# Name parts chosen to sound like places but not be real ones (checked: no combination is a real country/city).
_COUNTRY_HEADS = ("Vel", "Dren", "Korv", "Thal", "Osk", "Mirr", "Zan", "Brel", "Quor", "Fenn", "Ystr", "Galv",
                  "Hesp", "Lunn", "Vorn", "Skarr", "Tezz", "Ulv", "Narr", "Pell")
_COUNTRY_TAILS = ("oria", "mark", "avia", "enland", "ostan", "undia")
_CITY_HEADS = ("Tarn", "Ashk", "Moll", "Kest", "Brin", "Hald", "Quen", "Rov", "Selk", "Wyn", "Dalv", "Corr", "Elmh",
               "Falk", "Gorr", "Istv")
_CITY_TAILS = ("by", "wick", "holm", "ford", "mere", "stead")


@dataclasses.dataclass(frozen=True)
class Country:
    """One fictional country: its capital, founding year and the capital's population."""

    name: str
    capital: str
    founded: int
    population: int


@dataclasses.dataclass(frozen=True)
class Task:
    """A question, its exact answer and the tool calls that solve it ((tool, query, result text) each)."""

    data_source: str
    question: str
    answer: str
    steps: tuple[tuple[str, str, str], ...]


@functools.lru_cache(maxsize=8)
def world(seed: int = 0) -> tuple[Country, ...]:
    """The fictional countries behind `corpus(seed)`; names are unique, so every fact has one right answer."""
    rng = np.random.default_rng([seed, 7])
    countries = [h + t for h in _COUNTRY_HEADS for t in _COUNTRY_TAILS]
    cities = [h + t for h in _CITY_HEADS for t in _CITY_TAILS]
    names = rng.choice(countries, NUM_COUNTRIES, replace=False)
    capitals = rng.choice(cities, NUM_COUNTRIES, replace=False)
    founded = rng.choice(np.arange(1100, 1900), NUM_COUNTRIES, replace=False)  # distinct: no zero-year differences
    population = rng.integers(10_000, 1_000_000, NUM_COUNTRIES)
    return tuple(Country(str(n), str(c), int(f), int(p))
                 for n, c, f, p in zip(names, capitals, founded, population, strict=True))


def _capital_doc(c: Country) -> str:
    return f"The capital of {c.name} is {c.capital}."


def _founded_doc(c: Country) -> str:
    return f"{c.name} was founded in the year {c.founded}."


def _population_doc(c: Country) -> str:
    return f"{c.capital} has a population of {c.population} people."


def corpus(seed: int = 0) -> list[str]:
    """The fictional documents, one fact each (short documents keep BM25 ranking unambiguous)."""
    return [doc(c) for c in world(seed) for doc in (_capital_doc, _founded_doc, _population_doc)]


def _page(doc: str) -> str:
    """A search result as `LocalSearchTool` formats it (the gold document on top)."""
    return f"Page 1: {doc}"


# ----------------------------------------------------------------------------------------------- tasks


def _arith_task(rng: np.random.Generator) -> Task:
    a, b = (int(x) for x in rng.integers(100, 10_000, 2))
    code = f"print({a} * {b})"
    return Task("toy_arith", f"What is {a} * {b}?", str(a * b), (("python", code, str(a * b)),))


def _lookup_task(rng: np.random.Generator, countries: Sequence[Country]) -> Task:
    c = countries[int(rng.integers(len(countries)))]
    kind = int(rng.integers(3))
    if kind == 0:
        q, a, query, doc = f"What is the capital of {c.name}?", c.capital, f"capital of {c.name}", _capital_doc(c)
    elif kind == 1:
        q, a, query, doc = f"In which year was {c.name} founded?", str(c.founded), f"{c.name} founded", _founded_doc(c)
    else:
        q, a, query, doc = (f"What is the population of {c.capital}?", str(c.population), f"population of {c.capital}",
                            _population_doc(c))
    return Task("toy_lookup", q, a, (("search", query, _page(doc)),))


def _twohop_task(rng: np.random.Generator, countries: Sequence[Country]) -> Task:
    if rng.integers(2) == 0:  # capital -> its population -> times k
        c, k = countries[int(rng.integers(len(countries)))], int(rng.integers(2, 10))
        q = f"What is the population of the capital of {c.name} multiplied by {k}?"
        steps = (("search", f"capital of {c.name}", _page(_capital_doc(c))),
                 ("search", f"population of {c.capital}", _page(_population_doc(c))),
                 ("python", f"print({c.population} * {k})", str(c.population * k)))
        return Task("toy_twohop", q, str(c.population * k), steps)
    i, j = (int(x) for x in rng.choice(len(countries), 2, replace=False))
    old, new = sorted((countries[i], countries[j]), key=lambda c: c.founded)
    q = f"How many years after {old.name} was {new.name} founded?"
    steps = (("search", f"{old.name} founded", _page(_founded_doc(old))),
             ("search", f"{new.name} founded", _page(_founded_doc(new))),
             ("python", f"print({new.founded} - {old.founded})", str(new.founded - old.founded)))
    return Task("toy_twohop", q, str(new.founded - old.founded), steps)


def toy_tasks(split: str, n: int, seed: int = 0, *, world_seed: int = 0) -> list[Task]:
    """`n` tasks cycling arith, lookup, twohop; deterministic in (split, seed), different across splits."""
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    countries = world(world_seed)
    makers = (lambda: _arith_task(rng), lambda: _lookup_task(rng, countries), lambda: _twohop_task(rng, countries))
    return [makers[i % 3]() for i in range(n)]


def _row(task: Task, index: int, split: str, system_prompt: str = SYSTEM_PROMPT) -> dict:
    """A row in the reference parquet schema (spec 2.1)."""
    return {
        "data_source": task.data_source,
        "prompt": chat_messages(task.question, system_prompt),
        "ability": "math" if task.data_source == "toy_arith" else "qa",
        "reward_model": {"ground_truth": task.answer, "style": "rule"},
        "extra_info": {"index": index, "question": task.question, "split": split},
    }


def toy_rows(split: str, n: int, seed: int = 0, *, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """`n` rows of `split` in the reference parquet schema; the facts come from `corpus(0)`."""
    return [_row(t, i, split, system_prompt) for i, t in enumerate(toy_tasks(split, n, seed))]


def with_search_results(task: Task, search) -> Task:
    """`task` with each search step's result replaced by what `search.execute(query)` returns, so a response built
    from it shows the contexts the rollout's search tool (e.g. `LocalSearchTool(documents=corpus())`) gives."""
    steps = tuple((tool, q, search.execute(q) if tool == "search" else r) for tool, q, r in task.steps)
    return dataclasses.replace(task, steps=steps)


def solution_text(task: Task) -> str:
    """A correct response in the rollout format: tool results spliced as " <result>\\n...\\n</result>" (spec 3.3)."""
    return _response_text(task.steps, task.answer)


def _response_text(steps: Sequence[tuple[str, str, str]], answer: str) -> str:
    parts = []
    for tool, query, result in steps:
        why = "I need to compute this." if tool == "python" else f"I need to look up {query}."
        parts.append(f"<think> {why} </think> <{tool}> {query} </{tool}> <result>\n{result}\n</result>")
    parts.append(f"<think> The answer is {answer}. </think> <answer> \\boxed{{{answer}}} </answer>")
    return " ".join(parts)


_FACT_VALUE = re.compile(r"is (\w+)\.$|in the year (\d+)\.$|population of (\d+) people\.$")


def _fact_value(page: str) -> str:
    """The value a corpus document states ("The capital of X is Y." -> Y; founded / population -> the number)."""
    match = _FACT_VALUE.search(page.strip())
    if match is None:
        raise ValueError(f"not a toy corpus document: {page!r}")
    return next(g for g in match.groups() if g is not None)


def flawed_text(task: Task) -> str:
    """A well-formed response with one typical agent mistake, every number and name still copied from the question
    or a tool result, so it teaches the same copying skill as `solution_text` but a wrong decision:

      * toy_arith:  the wrong operation (`print(a + b)` for "a * b"), and its result as the answer;
      * toy_lookup: the right search, but the answer read off the *second* result page (needs max_results >= 2);
      * toy_twohop: both searches, then it stops before the Python call and answers with the last value found.

    The demo mixes these with `solution_text` in the cold-start data: where they are the majority, greedy decoding
    makes the mistake on most questions while sampling solves a share of them, which is what RL can fix (the
    deep_research reward scores these 0, a correct tool answer 1). `task.steps` must hold the tools' real results
    (`with_search_results`).
    """
    if task.data_source == "toy_arith":
        a, b = (int(x) for x in re.findall(r"\d+", task.steps[0][1]))
        return _response_text((("python", f"print({a} + {b})", str(a + b)),), str(a + b))
    if task.data_source == "toy_lookup":
        pages = task.steps[0][2].splitlines()
        if len(pages) < 2:
            raise ValueError("flawed_text needs search results with at least two pages (tools.search.max_results)")
        return _response_text(task.steps, _fact_value(pages[1]))
    return _response_text(task.steps[:2], _fact_value(task.steps[1][2].splitlines()[0]))


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Lines for training a small BPE tokenizer: the system prompt, questions, documents and solved responses."""
    tasks = toy_tasks("train", 300, seed) + toy_tasks("val", 60, seed)
    return [SYSTEM_PROMPT, *corpus(0), *(t.question for t in tasks), *(solution_text(t) for t in tasks)]


# ----------------------------------------------------------------------------------------------- files


def _write_if_changed(path: str, rows: list[dict]) -> None:
    """Writes atomically, and only when the content differs, so concurrent hosts and reruns agree."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if os.path.isfile(path) and pq.read_table(path).to_pylist() == rows:
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def write_toy_parquet(directory: str, *, n_train: int = 64, n_val: int = 16, seed: int = 0,
                      system_prompt: str = SYSTEM_PROMPT) -> tuple[str, str]:
    """Writes toy_train.parquet / toy_val.parquet under `directory` (idempotent); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = (os.path.join(directory, "toy_train.parquet"), os.path.join(directory, "toy_val.parquet"))
    for path, split, n in zip(paths, ("train", "val"), (n_train, n_val), strict=True):
        _write_if_changed(path, toy_rows(split, n, seed, system_prompt=system_prompt))
    return paths


def resolve_files(files: str | Sequence[str], directory: str, *, split: str, seed: int = 0) -> list[str]:
    """Replaces "builtin:toy" in `files` with the generated toy parquet of `split` ("train" | "val")."""
    files = [files] if isinstance(files, str) else list(files)
    if BUILTIN not in files:
        return files
    train, val = write_toy_parquet(directory, seed=seed)
    path = {"train": train, "val": val}[split]
    return [path if f == BUILTIN else f for f in files]
