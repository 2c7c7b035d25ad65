"""Evaluation reports (``report.json``, ``report.md``, ``report.png``) and ``arpo-jax compare`` across runs.

``write_eval_report`` writes an evaluation's figures (``runner.evaluate`` builds them) as JSON, as a Markdown table
(benchmark, questions, pass@1, pass@k, em, f1, tool calls, failed outputs) and as a bar chart of pass@1 / pass@k per
benchmark. ``compare`` puts several runs side by side, like the reference's compare_models script: each run is a
training workdir (``metrics.jsonl``), an evaluation workdir (``report.json``), or both; it writes ``compare.md``
(evaluation scores per benchmark, final training metrics, and each evaluation paired with the first one question
by question: `paired`) and ``compare.png`` (reward and validation accuracy against the step, pass@1 per benchmark).

Charts need matplotlib (Agg backend, no display); where it is not installed the PNG is skipped with a warning and
the JSON / Markdown outputs are still written.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

from arpo_jax.train import metrics as metrics_lib

log = logging.getLogger(__name__)

REPORT_JSON, REPORT_MD, REPORT_PNG = "report.json", "report.md", "report.png"
COMPARE_MD, COMPARE_PNG = "compare.md", "compare.png"
METRICS_FILE = "metrics.jsonl"
# Final training metrics shown by `compare` (trainer.py's names), and the curves drawn.
TRAIN_KEYS = ("reward/mean", "val/accuracy", "tools/calls_per_trajectory/mean")
CURVE_KEYS = ("reward/mean", "val/accuracy")
MISSING = "–"


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal (``0.4567`` -> ``45.7``); MISSING for None."""
    return MISSING if x is None else f"{100 * x:.1f}"


def num(x: float | None, digits: int = 3) -> str:
    return MISSING if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG chart (pip install matplotlib)")
        return None
    return plt


# ------------------------------------------------------------------------------------------------------------------
# One evaluation
# ------------------------------------------------------------------------------------------------------------------


def markdown_report(report: dict) -> str:
    """The Markdown summary of one evaluation (percentages; tool calls per output; failed = outputs with an error)."""
    k = report["k"]
    passes = ["pass@1", "pass@k"] if k > 1 else ["pass@1"]  # with k = 1 the two are one number: one column

    def row(*cells) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    macro = report["macro_average"]
    lines = [f"# Evaluation of `{report['model']}`", "",
             f"Engine `{report['engine']}`, k = {k}, "
             f"judge: {report['judge']['model'] if report.get('judge') else 'none (rule-based correctness)'}.", "",
             row("benchmark", "questions", *(f"{p.replace('@k', f'@{k}')} (%)" for p in passes), "± s.e. (pass@1)",
                 "em (%)", "f1 (%)", "tool calls", "Python calls ran (%)", "response tokens", "failed"),
             "|---|" + "---:|" * (len(passes) + 8)]
    lines += [row(name, m["n_samples"], *(pct(m[p]) for p in passes), pct(m.get("pass@1_stderr")), pct(m["em"]),
                  pct(m["f1"]), f"{m['tool_calls']:.2f}", pct(m.get("python_ran_share")),
                  f"{m.get('response_tokens', 0):.0f}", m["failed"]) for name, m in report["benchmarks"].items()]
    lines.append(row("**macro average**", f"{macro['n_benchmarks']} benchmarks", *(pct(macro[p]) for p in passes),
                     "", "", "", "", "", "", ""))
    return "\n".join(lines) + "\n"


def plot_eval(report: dict, path: Path) -> bool:
    """Bar chart of pass@1 and pass@k per benchmark (and the macro average); False when it cannot be drawn."""
    plt = _pyplot()
    if plt is None:
        return False
    names = [*report["benchmarks"], "macro avg"]
    rows = [*report["benchmarks"].values(), report["macro_average"]]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(names) + 1.5), 3.6))
    width = 0.4
    xs = range(len(names))
    for offset, key, label in ((-width / 2, "pass@1", "pass@1"), (width / 2, "pass@k", f"pass@{report['k']}")):
        ax.bar([x + offset for x in xs], [100 * m[key] for m in rows], width, label=label)
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.set_title(f"{Path(str(report['model'])).name} ({report['engine']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_eval_report(report: dict, workdir: str | os.PathLike) -> dict:
    """Writes report.json, report.md and (with matplotlib) report.png into ``workdir``; returns their paths."""
    workdir = Path(workdir)
    _write_atomic(workdir / REPORT_JSON, json.dumps(metrics_lib.to_jsonable(report), indent=2) + "\n")
    _write_atomic(workdir / REPORT_MD, markdown_report(report))
    png = workdir / REPORT_PNG
    drawn = plot_eval(report, png)
    return {"report_json": str(workdir / REPORT_JSON), "report_md": str(workdir / REPORT_MD),
            "report_png": str(png) if drawn else None}


# ------------------------------------------------------------------------------------------------------------------
# compare
# ------------------------------------------------------------------------------------------------------------------


def _read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl records, skipping unreadable lines (a run killed mid-write)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
    return records


def load_run(path: str | os.PathLike) -> dict:
    """One run's comparable data: ``{"path", "eval" (report.json or None), "curves", "final"}``.

    ``curves[key]`` is ``[(step, value), ...]`` for the CURVE_KEYS; ``final`` holds the last value of each TRAIN_KEY
    and ``steps`` (the last logged step). Raises FileNotFoundError when the folder has neither file.
    """
    run = Path(path)
    report = run / REPORT_JSON
    metrics = run / METRICS_FILE
    if not report.is_file() and not metrics.is_file():
        raise FileNotFoundError(f"{run}: neither {REPORT_JSON} (an evaluation) nor {METRICS_FILE} (a training run)")
    out = {"path": str(run), "eval": json.loads(report.read_text()) if report.is_file() else None, "curves": {},
           "final": {}}
    if metrics.is_file():
        records = _read_metrics(metrics)
        for key in CURVE_KEYS:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                out["curves"][key] = points
        for key in TRAIN_KEYS:
            values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
            out["final"][key] = values[-1] if values else None
        out["final"]["steps"] = max((r["step"] for r in records), default=None)
    return out


def sign_test(gained: int, lost: int) -> float:
    """Two-sided exact sign test over the questions whose result changed (McNemar's exact test when each question
    has one sample): the chance of a split at least this uneven were the two models equally good on them."""
    n = gained + lost
    tail = sum(math.comb(n, i) for i in range(min(gained, lost) + 1)) / 2**n
    return min(1.0, 2 * tail)


def question_scores(samples: Path) -> dict[str, float]:
    """Each question's share of correct samples in an evaluation's ``<benchmark>/samples.jsonl``, by question id
    (unparseable lines skipped; the last record of a (question, sample) wins, as the runner reads them)."""
    last: dict[tuple, bool] = {}
    with open(samples, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
                last[(str(rec["id"]), rec["sample"])] = bool(rec["correct"])
            except (ValueError, KeyError, TypeError):
                continue
    per_question: dict[str, list[bool]] = {}
    for (qid, _), correct in last.items():
        per_question.setdefault(qid, []).append(correct)
    return {qid: sum(v) / len(v) for qid, v in per_question.items()}


def paired(base: str | os.PathLike, other: str | os.PathLike, benchmark: str) -> dict | None:
    """`other`'s evaluation of `benchmark` against `base`'s on the questions both answered: ``{"questions",
    "gained", "lost", "p"}`` (a question gained: more of its samples right in `other`; `p`: `sign_test`), or None
    when either has no samples of it. Two pass@1s a standard error apart may still differ significantly when the
    same questions are asked: this is the test that uses that."""
    files = [Path(run) / benchmark / "samples.jsonl" for run in (base, other)]
    if not all(f.is_file() for f in files):
        return None
    a, b = (question_scores(f) for f in files)
    common = a.keys() & b.keys()
    if not common:
        return None
    gained = sum(b[q] > a[q] for q in common)
    lost = sum(b[q] < a[q] for q in common)
    return {"questions": len(common), "gained": gained, "lost": lost, "p": sign_test(gained, lost)}


def _paired_with_first(runs: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """{run: {benchmark: `paired` with the first evaluation}} for every later evaluation."""
    evals = [(n, r) for n, r in runs.items() if r["eval"]]
    if len(evals) < 2:
        return {}
    (_, first), out = evals[0], {}
    for name, r in evals[1:]:
        pairs = {b: paired(first["path"], r["path"], b) for b in r["eval"]["benchmarks"]}
        out[name] = {b: v for b, v in pairs.items() if v}
    return out


def _names(paths: Sequence[str]) -> list[str]:
    """Short, unique labels: the folder names (with the parent's when two folders share a name)."""
    names = [Path(p).resolve().name for p in paths]
    if len(set(names)) < len(names):
        names = ["/".join(Path(p).resolve().parts[-2:]) for p in paths]
    if len(set(names)) < len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    return names


def markdown_compare(runs: dict[str, dict], pairs: dict[str, dict[str, dict]]) -> str:
    """compare.md: the runs, evaluation scores per benchmark (pass@1 / pass@k, %), `pairs` (`_paired_with_first`),
    final training metrics."""
    names = list(runs)
    head = "| {} | " + " | ".join(names) + " |"
    rule = "|---|" + "---:|" * len(names)
    lines = ["# Comparison", ""] + [f"* **{n}**: `{r['path']}`" for n, r in runs.items()]
    evals = {n: r["eval"] for n, r in runs.items() if r["eval"]}
    if evals:
        benches = list(dict.fromkeys(b for e in evals.values() for b in e["benchmarks"]))
        ks = sorted({e["k"] for e in evals.values()})
        lines += ["", f"## Evaluation: pass@1 / pass@k (%), k = {', '.join(map(str, ks))}", "",
                  head.format("benchmark"), rule]
        for b in [*benches, None]:
            cells = []
            for n in names:
                e = evals.get(n)
                m = (e["benchmarks"].get(b) if b else e["macro_average"]) if e else None
                cells.append(f"{pct(m['pass@1'])} / {pct(m['pass@k'])}" if m else MISSING)
            lines.append(f"| {b or '**macro average**'} | " + " | ".join(cells) + " |")
    if any(pairs.values()):
        first = next(n for n, r in runs.items() if r["eval"])
        lines += ["", f"## Paired with {first}, question by question: gained / lost, exact sign test p", "",
                  "| run | benchmark | questions | gained | lost | p |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {b} | {v['questions']} | {v['gained']} | {v['lost']} | {v['p']:.3g} |"
                  for n, by_bench in pairs.items() for b, v in by_bench.items()]
    trained = {n: r["final"] for n, r in runs.items() if r["final"]}
    if trained:
        lines += ["", "## Training: final values", "", head.format("metric"), rule]
        for key in ("steps", *TRAIN_KEYS):
            cells = [num(trained[n].get(key), 4) if n in trained else MISSING for n in names]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_compare(runs: dict[str, dict], path: Path) -> bool:
    """compare.png: reward/mean and val/accuracy vs step per run, and pass@1 per benchmark per run."""
    panels = [key for key in CURVE_KEYS if any(key in r["curves"] for r in runs.values())]
    evals = {n: r["eval"] for n, r in runs.items() if r["eval"]}
    n_panels = len(panels) + bool(evals)
    plt = _pyplot() if n_panels else None
    if plt is None:
        return False
    fig, axes = plt.subplots(1, n_panels, figsize=(4.8 * n_panels, 3.6), squeeze=False)
    for ax, key in zip(axes[0], panels):
        for name, r in runs.items():
            if key in r["curves"]:
                steps, values = zip(*r["curves"][key])
                ax.plot(steps, values, marker="o", markersize=3, label=name)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.legend(fontsize="small")
    if evals:
        ax = axes[0][-1]
        benches = list(dict.fromkeys(b for e in evals.values() for b in e["benchmarks"]))
        width = 0.8 / len(evals)
        for i, (name, e) in enumerate(evals.items()):
            xs = [x + (i - (len(evals) - 1) / 2) * width for x in range(len(benches))]
            ax.bar(xs, [100 * e["benchmarks"][b]["pass@1"] if b in e["benchmarks"] else 0 for b in benches], width,
                   label=name)
        ax.set_xticks(list(range(len(benches))), benches, rotation=30, ha="right")
        ax.set_ylim(0, 100)
        ax.set_title("pass@1 (%)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def compare(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict:
    """`arpo-jax compare`: writes ``out/compare.md`` and ``out/compare.png``; returns the JSON summary.

    Args:
      run_dirs: training and/or evaluation workdirs.
      out: output folder (created).

    Returns:
      ``{"runs": {name: {"path", "eval": {benchmark: {pass@1, pass@k}} | None, "macro_average",
      "paired_with_first": {benchmark: `paired`} | None, "training"}},
      "compare_md", "compare_png"}``.
    """
    if not run_dirs:
        raise ValueError("compare needs at least one run directory")
    paths = [str(p) for p in run_dirs]
    runs = dict(zip(_names(paths), (load_run(p) for p in paths)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pairs = _paired_with_first(runs)  # read once: each evaluation's samples, for the Markdown and the JSON
    _write_atomic(out / COMPARE_MD, markdown_compare(runs, pairs))
    drawn = plot_compare(runs, out / COMPARE_PNG)
    summary = {}
    for name, r in runs.items():
        e = r["eval"]
        summary[name] = {"path": r["path"],
                         "eval": {b: {"pass@1": m["pass@1"], "pass@k": m["pass@k"]}
                                  for b, m in e["benchmarks"].items()} if e else None,
                         "macro_average": e["macro_average"] if e else None,
                         "paired_with_first": pairs.get(name),
                         "training": r["final"] or None}
    return {"runs": summary, "compare_md": str(out / COMPARE_MD), "compare_png": str(out / COMPARE_PNG) if drawn
            else None}
