"""The evaluation loop (spec 13): the 13 benchmarks through the training agent loop, pass@k, resumable, robust.

``evaluate(cfg, EvalOptions(...))`` is ``arpo-jax eval``. For every benchmark it renders each question with the
training prompt (``benchmarks.build_messages`` through the chat template, as the RL data), runs ``k`` independent
trajectories per question through ``agent_loop.rollout`` with the tools the training config builds
(``components.make_tool_executor``: the same wrappers, call limit and result splicing as training, which is the fix of
spec B17), scores every output with ``scoring.score_output`` and, when a judge is given, asks the LLM judge
(``judge.LLMJudge``). The reports (``report.json``, ``report.md``, ``report.png``) come from ``report.py``, the
engine, tools and prompts (``build_agent``, shared with ``arpo-jax chat``) from ``agent.py``.

Sampling: ``n = initial_rollouts = k`` roots per question, ``beam_size = 1`` and no dynamic rollouts, so no
branching or refill ever happens and the k samples are independent trajectories. Temperature / top-p / top-k are
the config's ``rollout`` values (``--temperature`` overrides the temperature); temperature 0 is greedy (with k > 1
all samples are then the same trajectory). No log-probs are requested (branching never needs an entropy here).

Resume. Questions are processed in fixed chunks of ``batch_size`` by their index in the (limited) benchmark, and the
sampling seed of chunk c of benchmark b is ``sampler.worker_seed(seed, c, 0, "eval/" + b)``: a chunk's outputs
depend on nothing but its questions and that seed (the JAX sampler's cache is reset before each chunk). Each
finished chunk is appended to ``<workdir>/<benchmark>/samples.jsonl`` in one write, flushed and fsync'd. On start,
the file is read back; a chunk counts as done when a valid record of every (question, sample) of it is there (the
question id must also still match the data file); the records of every other chunk (a torn last line, a chunk cut
short by a kill) are dropped by rewriting the file atomically, and those chunks are run again. The reports are
computed from the file alone, so a run killed at any moment and started again with the same arguments ends with
the report of an uninterrupted run (every engine seeds a request by the chunk's seed, its position and its tokens
only: `sampler.request_seed`). ``eval_run.json`` records the settings that determine the
outputs (model, engine, k, batch size, seed, sampling, lengths, tools, judge model); restarting a workdir with
different ones is refused rather than mixing two evaluations in one report. ``--limit`` may change between runs.

Robustness. A prompt longer than ``data.max_prompt_length`` is recorded as failed (its ``error`` says so) and the
rest of its chunk runs; any exception while generating a chunk records all of that chunk's samples as failed
(``correct = False``, the exception in ``error``) and the run goes on. ``sample_timeout``: with the OpenAI engine, the
timeout of each request; with the in-process engines (JAX, vLLM), which generate a whole chunk in lockstep rounds,
the wall-clock budget of a chunk, checked before each generation round (a round in progress, at most
``max_response_length`` tokens, is not interrupted; tool calls have their own ``tools.timeout_s``). A chunk over
its budget is recorded as failed. ``concurrency``: requests in flight for the OpenAI engine (and the judge); tool
workers (``tools.max_workers``) for the in-process engines.

Judge. With ``judge_url``, every generated sample gets ``llm_equal`` and ``judge_source`` and ``correct`` becomes the
judge's verdict (spec 13.2's headline accuracy): ``correct = math_equal or judge``, the reference's
``is_equiv OR reply`` rule. A sample whose ``math_equal`` is already 1 is decided without a request
(``judge_source = "rule"``), as ``LLMJudge`` does for its own exact-match rule; a judge that keeps failing falls back
to the rule (``"fallback"``, ``judge_error`` recorded). Without a judge ``correct`` is scoring.py's rule.

One process: the evaluation runs on the local devices of the process it is started in (no multi-host sharding).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ml_collections import ConfigDict

from arpo_jax.config import redaction
from arpo_jax.eval import report as report_lib
from arpo_jax.eval.agent import Agent, build_agent
from arpo_jax.eval.benchmarks import EvalSample, benchmark_name, load_benchmark, load_shots, parse_benchmarks
from arpo_jax.eval.scoring import aggregate, macro_average, score_output
from arpo_jax.rollout import sampler
from arpo_jax.train import metrics as metrics_lib

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
RUN_FILE = "eval_run.json"
_MAX_ERROR_CHARS = 1000


@dataclasses.dataclass
class EvalOptions:
    """The `arpo-jax eval` arguments besides the config (see ``evaluate`` and the module docstring).

    Attributes:
      model: an HF folder, an orbax checkpoint directory (step folders; the newest is used), ``builtin:tiny``, or
        (engine ``openai``) a label of the served model (the tokenizer is then needed).
      benchmarks: benchmark names (``benchmarks.parse_benchmarks``), or one comma-separated string / "all".
      workdir: where samples.jsonl per benchmark and the reports go; an existing evaluation there is resumed.
      k: samples per question (pass@k).
      limit: only ``limit`` questions of each benchmark (from ``offset`` on).
      offset: leave out each benchmark's first ``offset`` questions (a slice the training never validated on).
      adapter: a PEFT LoRA adapter folder applied to ``model`` (an HF folder or a named model): the JAX engine runs
        the adapters as LoRA layers, vLLM serves the merged weights (written once into the workdir).
      few_shot: a JSON file of (question, response) examples put before each question (``benchmarks.load_shots``).
      engine: ``jax`` | ``vllm`` | ``openai``; None = the config's ``rollout.engine``.
      tokenizer: tokenizer folder (default: the config's ``model.tokenizer``, the model folder, or for a
        checkpoint the ``tokenizer/`` folder `arpo-jax convert hf-to-orbax` stores next to its steps).
      base_url, served_model, api_key_env: the OpenAI-compatible completions server (engine ``openai``).
      judge_url, judge_model, judge_api_key_env: the LLM judge's chat-completions server (optional).
      data_dir: folder of ``<benchmark>/test.jsonl`` (default ``benchmarks.default_data_dir()``).
      batch_size: questions per chunk (a chunk is one rollout call and the unit of resume).
      concurrency: requests in flight (openai engine, judge) / tool workers (in-process engines).
      sample_timeout: seconds; per request (openai) or per chunk (jax, vllm).
      seed: sampling seed; None = the config's ``seed``.
      temperature: overrides ``rollout.temperature``; 0 = greedy.
      progress: show a progress bar over chunks.
    """

    model: str
    benchmarks: Sequence[str] | str
    workdir: str | os.PathLike
    k: int = 1
    limit: int | None = None
    offset: int = 0
    adapter: str | None = None
    few_shot: str | None = None
    engine: str | None = None
    tokenizer: str | None = None
    base_url: str | None = None
    served_model: str | None = None
    api_key_env: str | None = None
    judge_url: str | None = None
    judge_model: str | None = None
    judge_api_key_env: str | None = None
    data_dir: str | os.PathLike | None = None
    batch_size: int = 8
    concurrency: int | None = None
    sample_timeout: float | None = None
    seed: int | None = None
    temperature: float | None = None
    progress: bool = True


# ------------------------------------------------------------------------------------------------------------------
# samples.jsonl: append per chunk, read back the complete chunks
# ------------------------------------------------------------------------------------------------------------------


def chunk_ranges(n_questions: int, batch_size: int) -> list[range]:
    """Question indices of each chunk: [0, B), [B, 2B), ... (the last one may be shorter)."""
    return [range(s, min(s + batch_size, n_questions)) for s in range(0, n_questions, batch_size)]


def read_done_chunks(path: Path, samples: Sequence[EvalSample], k: int, batch_size: int) -> dict[int, list[dict]]:
    """Records of every complete chunk in ``path``, by chunk index; every other line is left out.

    A record belongs to chunk c when its ``chunk``, ``question_index`` and ``sample`` fit c's questions and k, and its
    ``id`` is that question's id. A chunk is complete when each of its (question, sample) pairs has such a record
    (the last record of a pair wins). Unparseable lines (a write torn by a kill) are ignored.
    """
    chunks = chunk_ranges(len(samples), batch_size)
    found: dict[int, dict[tuple[int, int], dict]] = {}
    if path.is_file():
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                    c, q, j = rec["chunk"], rec["question_index"], rec["sample"]
                    ok = (0 <= c < len(chunks) and q in chunks[c] and 0 <= j < k and rec["id"] == samples[q].id)
                except (ValueError, KeyError, TypeError):
                    continue
                if ok:
                    found.setdefault(c, {})[(q, j)] = rec
    done = {}
    for c, recs in found.items():
        keys = [(q, j) for q in chunks[c] for j in range(k)]
        if all(key in recs for key in keys):
            done[c] = [recs[key] for key in keys]
    return done


def _dumps(records: Sequence[dict]) -> str:
    # ASCII escapes: model text may hold lone surrogates, which no UTF-8 file can take.
    return "".join(json.dumps(metrics_lib.to_jsonable(r)) + "\n" for r in records)


def _write_synced(path: Path, text: str, mode: str) -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def compact_samples(path: Path, done: dict[int, list[dict]]) -> None:
    """Rewrites ``path`` with only the complete chunks' records (atomically), unless that changes nothing."""
    if not path.is_file():
        return
    text = _dumps([r for c in sorted(done) for r in done[c]])
    if path.read_text(encoding="utf-8", errors="replace") == text:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    _write_synced(tmp, text, "w")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------------------------
# The evaluation
# ------------------------------------------------------------------------------------------------------------------


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


class _Evaluation:
    """One `evaluate` call's state: the agent, the judge and the per-chunk work."""

    def __init__(self, agent: Agent, opts: EvalOptions, seed: int, judge=None):
        self.agent, self.opts, self.seed, self.judge = agent, opts, seed, judge
        self.max_prompt = agent.cfg.data.max_prompt_length

    def _record(self, sample: EvalSample, q: int, j: int, chunk: int, output: str | None, **extra) -> dict:
        # score_output(None) yields the full key set with zeros without running any check: a failed sample's record
        # (the caller replaces its type error with the failure).
        rec = score_output(output, sample)
        return {"question_index": q, "sample": j, "chunk": chunk, **rec, "output": output or "", **extra}

    def run_chunk(self, name: str, samples: Sequence[EvalSample], chunk: int, indices: range) -> list[dict]:
        """All k records of each question of one chunk; never raises (failures are recorded)."""
        k, t0 = self.opts.k, time.perf_counter()
        seed = sampler.worker_seed(self.seed, chunk, 0, f"eval/{name}")
        prompts, errors = {}, {}
        for q in indices:
            try:
                ids = self.agent.prompt_ids(samples[q].question)
                if len(ids) > self.max_prompt:
                    raise ValueError(f"the prompt has {len(ids)} tokens, more than data.max_prompt_length="
                                     f"{self.max_prompt}")
                prompts[q] = ids
            except Exception as e:  # noqa: BLE001 - one question's failure costs that question only
                errors[q] = _error_text(e)
        outputs: dict[tuple[int, int], tuple[str, dict]] = {}
        if prompts:
            questions = list(prompts)
            try:
                out = self.agent.run(list(prompts.values()), n=k, seed=seed, temperature=self.opts.temperature,
                                     time_budget=self.opts.sample_timeout)
                for row, text in enumerate(self.agent.responses(out)):
                    q, j = questions[int(out.prompt_index[row])], row % k
                    outputs[(q, j)] = (text, {"tool_calls": int(out.tool_calls[row]),
                                              "finish_reason": str(out.finish_reason[row]),
                                              "response_tokens": int(out.response_length[row]),
                                              "truncated": bool(out.truncated[row])})
            except Exception as e:  # noqa: BLE001 - a failing chunk is recorded, the evaluation goes on
                log.warning("%s chunk %d failed: %s", name, chunk, _error_text(e))
                errors |= {q: _error_text(e) for q in prompts}
        records = []
        for q in indices:
            for j in range(k):
                if (q, j) in outputs:
                    text, info = outputs[(q, j)]
                    rec = self._record(samples[q], q, j, chunk, text, **info)
                else:
                    rec = self._record(samples[q], q, j, chunk, None, tool_calls=0, finish_reason="error",
                                       response_tokens=0, truncated=False)
                    rec["error"] = errors.get(q, "no output")
                records.append(rec)
        if self.judge is not None:
            self._judge(records, samples)
        seconds = round(time.perf_counter() - t0, 3)
        return [r | {"seconds": seconds} for r in records]

    def _judge(self, records: list[dict], samples: Sequence[EvalSample]) -> None:
        """Spec 13.2: correct = is_equiv OR the judge's reply; failed samples stay wrong."""
        ask = []
        for r in records:
            r.update(llm_equal=0.0, judge_source=None, judge_error=None)
            if r["finish_reason"] == "error":
                continue
            if r["math_equal"] == 1.0:
                r.update(llm_equal=1.0, judge_source="rule", correct=True)
            else:
                ask.append(r)
        try:
            verdicts = self.judge.judge_many([(samples[r["question_index"]].question,
                                               samples[r["question_index"]].answers, r["prediction"]) for r in ask])
        except Exception as e:  # noqa: BLE001 - the judge never raises on server problems; anything else falls back
            verdicts = [{"correct": False, "source": "fallback", "error": _error_text(e)} for _ in ask]
        for r, v in zip(ask, verdicts):
            r.update(llm_equal=float(bool(v["correct"])), judge_source=v["source"], judge_error=v.get("error"),
                     correct=bool(v["correct"]))


def _run_settings(opts: EvalOptions, agent: Agent, seed: int) -> dict:
    """What determines an evaluation's outputs (a resumed workdir must have been started with the same)."""
    cfg, s = agent.cfg, agent.settings(seed, opts.temperature)
    return {"model": opts.model, "tokenizer": cfg.model.tokenizer, "engine": agent.engine,
            "served_model": opts.served_model if agent.engine == "openai" else None, "k": opts.k,
            "batch_size": opts.batch_size, "seed": seed, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "max_prompt_length": cfg.data.max_prompt_length,
            "max_response_length": cfg.data.max_response_length, "call_limit": cfg.tools.call_limit,
            "python_tool": cfg.tools.python.enabled,
            "search_tool": cfg.tools.search.backend if cfg.tools.search.enabled else None,
            "judge_model": opts.judge_model if opts.judge_url else None,
            # Only when set: a workdir from before these options resumes with the same settings.
            **({"offset": opts.offset} if opts.offset else {}),
            **({"adapter": agent.adapter} if agent.adapter else {}),
            **({"few_shot": _file_digest(opts.few_shot)} if opts.few_shot else {})}


def _file_digest(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _check_run_file(workdir: Path, run: dict) -> None:
    path = workdir / RUN_FILE
    if path.is_file():
        previous = json.loads(path.read_text())
        diff = sorted(k for k in run.keys() | previous.keys() if run.get(k) != previous.get(k))
        if diff:
            raise ValueError(f"{workdir} holds an evaluation with other settings ({', '.join(diff)}: "
                             f"{ {k: previous.get(k) for k in diff} } vs { {k: run.get(k) for k in diff} }); use "
                             "another --workdir or the same arguments")
    else:
        tmp = path.with_name(f"{RUN_FILE}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(run, indent=2) + "\n")
        os.replace(tmp, path)


def _check_options(opts: EvalOptions) -> None:
    problems = [msg for ok, msg in [
        (opts.k >= 1, f"--k must be >= 1, got {opts.k}"),
        (opts.batch_size >= 1, f"--batch-size must be >= 1, got {opts.batch_size}"),
        (opts.limit is None or opts.limit >= 1, f"--limit must be >= 1, got {opts.limit}"),
        (opts.offset >= 0, f"--offset must be >= 0, got {opts.offset}"),
        (opts.temperature is None or opts.temperature >= 0, f"--temperature must be >= 0, got {opts.temperature}"),
        (opts.sample_timeout is None or opts.sample_timeout > 0, "--sample-timeout must be > 0"),
        (not opts.judge_url or bool(opts.judge_model), "--judge-url needs --judge-model"),
    ] if not ok]
    if problems:
        raise ValueError("; ".join(problems))
    if opts.temperature == 0 and opts.k > 1:
        log.warning("--temperature 0 is greedy: the %d samples of a question will be the same trajectory", opts.k)


def _search_only_where_needed(cfg: ConfigDict, data: dict) -> None:
    """Maths benchmarks need no search: with live search configured and its key not set, search is turned off
    for them (a QA benchmark among them keeps the check: `tools.search.api_key_env` must then be set)."""
    s = cfg.tools.search
    if not (s.enabled and s.backend == "brightdata" and not os.environ.get(s.api_key_env or "")):
        return
    if all(sample.task == "math" for samples in data.values() for sample in samples[:1]):
        log.warning("search off: %s needs no search and %s is not set", ", ".join(data), s.api_key_env)
        s.enabled = False


def evaluate(cfg: ConfigDict, opts: EvalOptions) -> dict:
    """`arpo-jax eval`: runs (or resumes) an evaluation and writes report.json / report.md / report.png.

    Args:
      cfg: the experiment config (``load_eval_config``); its model fields are replaced by ``opts.model``.
      opts: see EvalOptions.

    Returns:
      The summary printed as the command's last line: per benchmark pass@1 / pass@k / questions / failed, the macro
      average, chunk counts (total, reused from an earlier run, run now, failed) and the report paths.
    """
    t_start = time.perf_counter()
    _check_options(opts)
    names = parse_benchmarks(opts.benchmarks if isinstance(opts.benchmarks, str) else ",".join(opts.benchmarks))
    # Read before the model is loaded: a bad name, file or slice fails in seconds.
    data = {benchmark_name(name): load_benchmark(name, opts.data_dir, limit=opts.limit, offset=opts.offset)
            for name in names}
    shots = load_shots(opts.few_shot) if opts.few_shot else ()
    _search_only_where_needed(cfg, data)
    workdir = Path(opts.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    agent = build_agent(cfg, opts.model, workdir=workdir, engine=opts.engine, tokenizer=opts.tokenizer,
                        base_url=opts.base_url, served_model=opts.served_model, api_key_env=opts.api_key_env,
                        concurrency=opts.concurrency, sample_timeout=opts.sample_timeout, adapter=opts.adapter,
                        shots=shots, rows=opts.batch_size * opts.k)
    judge = None
    try:
        seed = agent.cfg.seed if opts.seed is None else opts.seed
        run = _run_settings(opts, agent, seed)
        _check_run_file(workdir, run)
        if opts.judge_url:
            from arpo_jax.eval.judge import LLMJudge

            judge = LLMJudge(opts.judge_url, opts.judge_model, api_key_env=opts.judge_api_key_env,
                             timeout_s=opts.sample_timeout or 120.0, max_concurrency=opts.concurrency or 16)
        ev = _Evaluation(agent, opts, seed, judge)
        done, todo = {}, []
        for name, samples in data.items():
            path = workdir / name / SAMPLES_FILE
            path.parent.mkdir(exist_ok=True)
            done[name] = read_done_chunks(path, samples, opts.k, opts.batch_size)
            compact_samples(path, done[name])
            todo += [(name, c, r) for c, r in enumerate(chunk_ranges(len(samples), opts.batch_size))
                     if c not in done[name]]
        reused = sum(len(d) for d in done.values())
        failed_chunks = 0
        bar = metrics_lib.progress(reused + len(todo), "eval", enabled=opts.progress, unit="chunk", initial=reused)
        for name, c, indices in todo:
            bar.set_description(f"eval {name}")
            records = ev.run_chunk(name, data[name], c, indices)
            failed_chunks += all(r["error"] for r in records)
            _write_synced(workdir / name / SAMPLES_FILE, _dumps(records), "a")
            done[name][c] = records
            bar.update(1)
        bar.close()
    finally:
        if judge is not None:
            judge.close()
        agent.close()
    per_bench = {}
    for name, samples in data.items():
        records = [r for c in sorted(done[name]) for r in done[name][c]]
        if not records:
            log.warning("%s: no questions (empty file or every row malformed); left out of the report", name)
            continue
        per_bench[name] = aggregate(records, opts.k) | {"skipped_rows": len(samples.skipped),
                                                       "data_file": str(samples.path)}
    if not per_bench:
        raise ValueError(f"no benchmark had any question: {', '.join(names)}")
    report = {"model": opts.model, "engine": agent.engine, "k": opts.k, "run": run,
              "benchmarks": per_bench, "macro_average": macro_average(per_bench),
              "judge": {"model": opts.judge_model} if opts.judge_url else None,
              "config": redaction.redact(agent.cfg)}
    files = report_lib.write_eval_report(report, workdir)
    return {"k": opts.k, "benchmarks": {n: {key: m[key] for key in ("pass@1", "pass@k", "n_samples", "failed")}
                                        for n, m in per_bench.items()},
            "macro_average": report["macro_average"],
            "chunks": {"total": reused + len(todo), "reused": reused, "run": len(todo), "failed": failed_chunks},
            "wall_s": round(time.perf_counter() - t_start, 1), "workdir": str(workdir), **files}
