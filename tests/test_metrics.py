"""Metrics logging: jsonl content, TensorBoard scalars read back, resume trimming, W&B wiring, redaction, timers."""

import json
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax.experience import step_metrics
from arpo_jax.train import metrics
from tests.tensorboard_events import read_tensorboard_scalars


def test_jsonl_lines_convert_scalars_and_write_null_for_nonfinite(tmp_path):
    with metrics.MetricsLogger(tmp_path, loggers=("jsonl",)) as log:
        log.log(1, {"reward/mean": np.float32(0.5), "n": np.int64(3), "loss": jnp.asarray(2.0), "bad": float("nan"),
                    "inf": np.float64(np.inf), "flag": True})
        log.log(2, {"reward/mean": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]  # strict JSON
    first, second = (json.loads(line) for line in lines)
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert first["reward/mean"] == 0.5 and first["n"] == 3 and first["loss"] == 2.0 and first["flag"] is True
    assert first["bad"] is None and first["inf"] is None
    assert second == {"step": 2, "time": second["time"], "reward/mean": 0.75}


def test_tensorboard_scalars_read_back(tmp_path):
    with metrics.MetricsLogger(tmp_path, loggers=("tensorboard",)) as log:
        for step in range(1, 4):
            log.log(step, {"reward/mean": 0.1 * step, "note": "not a scalar", "vec": np.ones(3)})
    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward/mean"}
    steps, values = zip(*scalars["reward/mean"])
    assert steps == (1, 2, 3)
    np.testing.assert_allclose(values, [0.1, 0.2, 0.3], rtol=1e-6)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with metrics.MetricsLogger(tmp_path, loggers=("jsonl", "tensorboard")) as log:
        for step in range(1, 6):
            log.log(step, {"x": float(step)})
        log.log_jsonl("trajectories", [{"step": s, "text": f"t{s}"} for s in (2, 4, 5)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x":')  # half a line, as a kill mid-write leaves it
    # The run was killed after step 5 and resumes from the checkpoint of step 3: steps 4, 5 are logged again.
    with metrics.MetricsLogger(tmp_path, loggers=("jsonl", "tensorboard"), resume_step=3) as log:
        for step in (4, 5):
            log.log(step, {"x": 10.0 * step})
        log.log_jsonl("trajectories", [{"step": 4, "text": "again"}])
    recs = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert [r["text"] for r in metrics.read_jsonl(tmp_path / "trajectories.jsonl")] == ["t2", "again"]
    assert not list(tmp_path.glob("*.tmp*"))
    tb = read_tensorboard_scalars(tmp_path / "tensorboard")["x"]
    assert tb == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_truncate_jsonl_keeps_records_without_step(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"step": 1}\n{"meta": 1}\n{"step": 9}\n')
    assert metrics.truncate_jsonl(path, 5) == 1
    assert metrics.read_jsonl(path) == [{"step": 1}, {"meta": 1}]
    assert metrics.truncate_jsonl(tmp_path / "missing.jsonl", 5) == 0


def test_read_jsonl_of_a_live_run_leaves_out_the_line_being_written(tmp_path):
    """A watcher (a notebook, the trainer tests' polling) reads metrics.jsonl while the logger appends a line."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "reward/me')  # the second record half written
    assert metrics.read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2}')  # complete, without its newline: kept
    assert metrics.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1\n{"step": 2}\n')  # a damaged line that is not the last: still an error
    with pytest.raises(json.JSONDecodeError):
        metrics.read_jsonl(path)


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match=r"trainer\.loggers.*pip install arpo-jax\[wandb\]"):
        metrics.MetricsLogger(tmp_path / "run", loggers=("wandb",))
    assert not (tmp_path / "run").exists()  # failed before creating anything


def test_wandb_run_id_is_reused_on_resume(tmp_path, monkeypatch):
    calls = []

    class Run:
        def __init__(self, **kw):
            self.kw, self.logged, self.finished = kw, [], False

        def log(self, data, step):
            self.logged.append((step, data))

        def finish(self):
            self.finished = True

    def init(**kw):
        calls.append(Run(**kw))
        return calls[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = {"tools": {"search": {"api_key": "sk-123", "api_key_env": "BRIGHTDATA_API_KEY"}}, "seed": 0}
    with metrics.MetricsLogger(tmp_path, loggers=("wandb",), config=cfg, project="p") as log:
        log.log(1, {"reward/mean": np.float32(0.5), "bad": float("nan"), "s": "text"})
    with metrics.MetricsLogger(tmp_path, loggers=("wandb",), config=cfg, project="p", resume_step=1):
        pass
    first, second = calls
    assert first.kw["project"] == "p" and first.kw["name"] == tmp_path.name and first.kw["resume"] == "allow"
    assert first.kw["dir"] == str(tmp_path) and first.kw["id"] == second.kw["id"]
    assert first.kw["config"]["tools"]["search"] == {"api_key": metrics.REDACTED, "api_key_env": "BRIGHTDATA_API_KEY"}
    step, data = first.logged[0]
    assert step == 1 and data["reward/mean"] == 0.5 and np.isnan(data["bad"]) and "s" not in data
    assert first.finished


def test_write_config_redacts_secrets(tmp_path):
    cfg = {"model": {"tokenizer": "/models/tok", "path": "p"}, "hf_token": "hf_abc", "empty_token": "",
           "actor": {"max_token_len_per_device": 4096}, "search": {"api_key": "k", "api_key_env": "KEY_VAR",
                                                                  "ClientSecret": "s", "password": "pw"},
           "list": [{"access_token": "t", "authToken": "t", "secretKey": "k"}], "path": metrics.Path("/x")}
    with metrics.MetricsLogger(tmp_path, loggers=()) as log:
        log.write_config(cfg)
    out = json.loads((tmp_path / "config.json").read_text())
    red = metrics.REDACTED
    assert out["model"] == {"tokenizer": "/models/tok", "path": "p"}
    assert out["hf_token"] == red and out["empty_token"] == ""
    assert out["actor"]["max_token_len_per_device"] == 4096
    assert out["search"] == {"api_key": red, "api_key_env": "KEY_VAR", "ClientSecret": red, "password": red}
    assert out["list"] == [{"access_token": red, "authToken": red, "secretKey": red}] and out["path"] == "/x"


def test_disabled_logger_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not even imported when disabled
    workdir = tmp_path / "run"
    with metrics.MetricsLogger(workdir, loggers=metrics.LOGGERS, enabled=False, resume_step=0) as log:
        log.log(1, {"x": 1.0})
        log.log_jsonl("trajectories", [{"step": 1}])
        log.write_config({"a": 1})
    assert not workdir.exists()
    assert capsys.readouterr().out == ""


def test_unknown_logger_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.loggers.*'csv'"):
        metrics.MetricsLogger(tmp_path, loggers=("console", "csv"))


def test_console_line_prefers_curated_keys(tmp_path, capsys):
    with metrics.MetricsLogger(tmp_path, loggers=("console",)) as log:
        log.log(7, {"zzz": 1.0, "time/step": 12.345678, "reward/mean": 0.123456, "val/acc": 0.5, "val/f1": 0.25,
                    "bad": float("nan")})
    out = capsys.readouterr().out.strip()
    assert out == "step 7 | reward/mean 0.1235 | val/acc 0.5 | val/f1 0.25 | time/step 12.35"
    assert metrics.console_line(3, {"a": 1, "b": 2.5}) == "step 3 | a 1 | b 2.5"


def test_summarize():
    assert step_metrics.summarize("len", []) == {}
    out = step_metrics.summarize("len", np.array([[1, 2], [3, 6]]))
    assert out == {"len/mean": 3.0, "len/std": pytest.approx(np.std([1, 2, 3, 6])), "len/min": 1.0, "len/max": 6.0}


def test_phase_timer_accumulates_and_resets(monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 5.5, 10.0, 12.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timers = metrics.PhaseTimer()
    with timers("rollout"):
        pass
    with timers("rollout"):
        pass
    with pytest.raises(RuntimeError), timers("update"):
        raise RuntimeError
    assert timers.as_metrics() == {"time/rollout": 1.5, "time/update": 2.0}
    timers.reset()
    assert timers.as_metrics(prefix="t_") == {}


def test_progress_bar_and_noop():
    bar = metrics.progress(3, "steps", enabled=False, initial=1)
    bar.update()
    bar.set_postfix(reward=0.5)
    bar.close()
    assert bar.n == 2
    real = metrics.progress(3, "steps", initial=1)
    real.update(2)
    assert real.n == 3
    real.close()
