"""Failure isolation in the tool rollout: a failed tool call, an engine request that raises, a trajectory over its
wall budget are marked (`RolloutOutput.failed`) while the rest of the rollout runs as if nothing happened; and
`select_rows`, which assembles dynamic sampling's batch from several rollouts."""

import dataclasses
import threading
import time

import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.rollout.agent_loop import PREMONITOR_SLOT_BASE, RolloutConfig, rollout
from arpo_jax.rollout.bisecting_sampler import BisectingSampler
from arpo_jax.rollout.fake_sampler import ScriptedSampler, Segment, by_slot
from arpo_jax.rollout.output import select_rows
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SamplingSettings
from arpo_jax.tools import ExecutorConfig, Tool, ToolExecutor


@pytest.fixture(scope="module")
def tok():
    return testing.make_tiny_tokenizer()


class Python(Tool):
    """`crash` raises (a broken tool, every retry), `sleep <s>` sleeps, anything else is echoed."""

    tag = "python"

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def execute(self, content):
        with self.lock:
            self.calls.append(content)
        if content == "crash":
            raise OSError("sandbox is gone")
        if content.startswith("sleep"):
            time.sleep(float(content.split()[1]))
        return f"ran {content}"


class FailingEngine(Sampler):
    """Wraps an engine; a `generate` call raises when one of its requests matches `bad` (a poisoned request)."""

    def __init__(self, inner, bad):
        self.inner, self.bad, self.raised = inner, bad, 0

    def generate(self, requests, settings):
        if any(self.bad(r) for r in requests):
            self.raised += 1
            raise RuntimeError("engine: request rejected")
        return self.inner.generate(requests, settings)


def call(code):
    return Segment(f"<think> x </think> <python> {code} </python>")


ANSWER = Segment("<answer> 3 </answer>", eos=True)
CFG = RolloutConfig(n=3, initial_rollouts=3, beam_size=1, response_length=200, call_limit=3, isolate_failures=True)


def _run(tok, script, cfg=CFG, *, engine=None, prompts=None):
    sampler = ScriptedSampler(tok, by_slot(script))
    tool = Python()
    executor = ToolExecutor([tool], ExecutorConfig(retry_count=2, max_workers=4))
    try:
        out = rollout(prompts or [tok.encode("the of and to")], engine(sampler) if engine else sampler, executor,
                      tok, cfg, None, 0)
    finally:
        executor.close()
    return out, tool


def _text(out, tok, i):
    return tok.decode(out.responses[i, :out.response_length[i]], skip_special_tokens=False)


def test_a_failed_tool_call_marks_its_trajectory_only(tok):
    script = {0: [call("1+2"), ANSWER], 1: [call("crash"), ANSWER], 2: [ANSWER]}
    out, tool = _run(tok, script)
    assert list(out.failed) == ["", "tool_error", ""]
    assert list(out.finish_reason) == ["eos", "eos", "eos"]  # it saw the error text and went on, as before
    assert "execution failed with message: OSError: sandbox is gone" in _text(out, tok, 1)
    assert tool.calls.count("crash") == 2  # the executor retried it
    ref, _ = _run(tok, script, dataclasses.replace(CFG, isolate_failures=False))
    assert list(ref.failed) == ["", "", ""]  # without isolation nothing is marked ...
    np.testing.assert_array_equal(ref.responses, out.responses)  # ... and the rollout itself is the same


@pytest.mark.parametrize("schedule", ["rounds", "stream"])
def test_an_engine_error_fails_one_request_and_the_rest_runs_unchanged(tok, schedule):
    script = {0: [call("1+2"), ANSWER], 1: [call("4*5"), ANSWER], 2: [call("7"), call("8"), ANSWER]}
    cfg = dataclasses.replace(CFG, schedule=schedule)
    clean, _ = _run(tok, script, cfg)
    # Slot 1's second request (after its tool result) poisons every batch it is in.
    poisoned = lambda r: r.slot_id == 1 and "ran 4*5" in tok.decode(list(r.token_ids))  # noqa: E731
    engines = []
    out, _ = _run(tok, script, cfg, engine=lambda s: engines.append(FailingEngine(s, poisoned)) or engines[-1])
    assert list(out.failed) == ["", "engine_error", ""] and out.finish_reason[1] == "engine_error"
    if schedule == "rounds":
        assert engines[0].raised == 3  # round 1's batch [0, 1, 2], its half [1, 2], then [1] alone
    else:  # the stream: the batch it was in (whatever else was ready with it), its halves, then [1] alone
        assert engines[0].raised >= 2
    for i in (0, 2):  # the others: exactly what they do without the failure
        assert _text(out, tok, i) == _text(clean, tok, i) and out.finish_reason[i] == clean.finish_reason[i]
    assert _text(out, tok, 1) == _text(clean, tok, 1).split("<answer>")[0]  # ends after its tool result
    with pytest.raises(RuntimeError, match="request rejected"):  # without isolation the error propagates
        _run(tok, script, dataclasses.replace(cfg, isolate_failures=False), engine=lambda s: FailingEngine(s, poisoned))


def test_the_bisecting_sampler_fails_only_the_request_that_raises_alone(tok):
    inner = ScriptedSampler(tok, lambda c: Segment(f"<answer> {c.request.slot_id} </answer>", eos=True))
    engine = FailingEngine(inner, lambda r: r.slot_id == 5)
    reqs = [SampleRequest(tok.encode("the of and"), 16, slot_id=i) for i in range(8)]
    out = BisectingSampler(engine).generate(reqs, SamplingSettings())
    assert [r is None for r in out] == [i == 5 for i in range(8)]
    assert engine.raised == 4  # [0..7], then [4..7], [4, 5] and [5]
    assert [[r.slot_id for r in call] for call, _, _ in inner.calls] == [[0, 1, 2, 3], [4], [6, 7]]  # halves batched
    assert [r.text for r in out if r] == [f"<answer> {i} </answer>" for i in range(8) if i != 5]  # in order
    healthy = [r for r in reqs if r.slot_id != 5]
    assert [r.text for r in BisectingSampler(engine).generate(healthy, SamplingSettings())] == [
        r.text for r in inner.generate(healthy, SamplingSettings())]  # no failure: the engine's call as is


@pytest.mark.parametrize("schedule", ["rounds", "stream"])
def test_a_trajectory_over_its_wall_budget_ends_and_is_marked(tok, schedule):
    cfg = dataclasses.replace(CFG, trajectory_timeout_s=0.3, schedule=schedule)
    out, _ = _run(tok, {0: [call("sleep 0.5"), ANSWER], 1: [ANSWER], 2: [call("1"), ANSWER]}, cfg)
    # Slot 0's call took 0.5 s and slot 1 finished at once. Rounds: slot 2 waited for slot 0's call (its round's
    # end), so it is over budget too; the stream: slot 2 went on after its own quick call and finished in time.
    slow = "wall_budget" if schedule == "rounds" else ""
    assert list(out.failed) == ["wall_budget", "", slow]
    assert list(out.finish_reason) == ["wall_budget", "eos", slow or "eos"]
    with pytest.raises(ValueError, match="trajectory_timeout_s needs isolate_failures"):
        dataclasses.replace(cfg, isolate_failures=False)


def test_failed_trajectories_do_not_branch(tok):
    cfg = dataclasses.replace(CFG, n=3, initial_rollouts=1, beam_size=2, branch_probability=1.0, entropy_weight=0.0)
    out, _ = _run(tok, {0: [call("crash"), call("1"), ANSWER]}, cfg)
    # The only root failed in round 0 and never becomes a source: the other two are refills, not its branches.
    assert out.failed[0] == "tool_error" and list(out.parent_id) == [-1, -1, -1]
    assert [n.kind for n in out.trees[0].nodes] == ["root", "refill", "refill"]


def test_premonitor_engine_error_falls_back_to_the_fixed_initial_rollouts(tok):
    cfg = dataclasses.replace(CFG, n=4, initial_rollouts=2, enable_dynamic_rollouts=True, initial_entropy_tokens=8)
    prompts = [tok.encode("the of and to"), tok.encode("search python result")]
    out, _ = _run(tok, {}, cfg, prompts=prompts,
                  engine=lambda s: FailingEngine(s, lambda r: r.slot_id == PREMONITOR_SLOT_BASE + 1))
    assert out.trees[0].h_root is not None and out.trees[1].h_root is None
    assert out.trees[1].initial_rollouts == 2 and len(out.prompt_index) == 8


def test_select_rows_renumbers_prompts_and_keeps_their_trees(tok):
    prompts = [tok.encode("the of and to"), tok.encode("search python result")]
    a, _ = _run(tok, {0: [call("1"), ANSWER]}, prompts=prompts)
    b, _ = _run(tok, {4: [call("2"), ANSWER]}, prompts=prompts[::-1])
    out = select_rows([(a, [3, 4, 5]), (b, [0, 1, 2, 3, 4, 5])])
    assert list(out.prompt_index) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    np.testing.assert_array_equal(out.responses, np.concatenate([a.responses[3:], b.responses]))
    np.testing.assert_array_equal(out.input_ids[:3], a.input_ids[3:])
    assert [t.prompt_index for t in out.trees] == [0, 1, 2]
    assert out.trees[0].nodes == a.trees[1].nodes and out.trees[2].nodes == b.trees[1].nodes
    assert out.metrics["rollout/tool_calls"] == a.metrics["rollout/tool_calls"] + b.metrics["rollout/tool_calls"] == 2
    a.metrics["rollout/test_mean"], b.metrics["rollout/test_mean"] = 1.0, 4.0  # means average, counts add
    assert select_rows([(a, [3]), (b, [0])]).metrics["rollout/test_mean"] == pytest.approx(2.5)


def test_export_folders_of_killed_processes_are_removed(tmp_path):
    """A process killed before VllmSampler.close (the OOM killer, SIGKILL) leaves its weight export in /dev/shm,
    i.e. in RAM; the next sampler's default export folder sweeps those of dead processes and only those."""
    import os
    import subprocess
    import sys

    from arpo_jax.rollout.export_folders import remove_stale_exports

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(child.stdout), os.getppid()
    for pid in (dead, alive, os.getpid()):
        (tmp_path / f"arpo_jax_vllm_{pid}" / "policy").mkdir(parents=True)
        (tmp_path / f"arpo_jax_vllm_{pid}" / "policy" / "model.safetensors").write_bytes(b"x" * 1024)
    (tmp_path / f"arpo_jax_vllm_{dead}.log").write_text("a worker log: a file, kept")
    (tmp_path / "arpo_jax_vllm_cache_0").mkdir()  # not a pid
    assert remove_stale_exports(tmp_path) == [tmp_path / f"arpo_jax_vllm_{dead}"]
    kept = [f"arpo_jax_vllm_{alive}", f"arpo_jax_vllm_{os.getpid()}", f"arpo_jax_vllm_{dead}.log",
            "arpo_jax_vllm_cache_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_an_engine_process_ends_with_the_process_that_started_it():
    """A trainer or eval killed without closing its vLLM engine (SIGKILL here) must not leave the engine running as
    an orphan: the worker script's watcher ends it within about a second, and with it the processes vLLM started
    (on GPUs the engine core runs in a child process, which has no watch of its own): `Worker` starts the worker as
    the leader of its own process group. (Without the watcher the stand-in worker and its child below would sleep
    on for a minute.)"""
    import os
    import subprocess
    import sys

    from arpo_jax.rollout import vllm_worker

    core = "import time; time.sleep(60)"  # vLLM's engine core process, a child of the worker
    worker = (f"import subprocess, sys, time; sys.path.insert(0, {os.path.dirname(vllm_worker.__file__)!r}); "
              f"import vllm_worker as w; c = subprocess.Popen([sys.executable, '-c', {core!r}]); "
              "w.exit_with_parent(0.1); print(c.pid, flush=True); print('ready', flush=True); time.sleep(60)")
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {worker!r}], "
              "process_group=0); print(p.pid, flush=True); time.sleep(60)")  # as Worker starts it
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)

    def alive(pid: int) -> bool:  # a zombie counts as gone (a container's pid 1 may never reap it)
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    try:
        pid, child = int(proc.stdout.readline()), int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "ready" and alive(pid) and alive(child)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while (alive(pid) or alive(child)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the engine process outlived the process that started it"
        assert not alive(child), "the engine's own child process outlived the process that started the engine"
    finally:
        proc.kill()


def test_an_engine_that_reports_each_and_fails_mid_call_reports_every_request_once():
    """`BisectingSampler` over an engine that reports results as they finish (`generate_each`): the requests reported
    before the failure keep those results; the retries report the others, once each, None for the one that raises."""
    from arpo_jax.rollout.sampler import SampleResult, generate_each

    class Streaming(Sampler):
        reports_each = True

        def generate(self, requests, settings, on_result=None):
            out = []
            for i, r in enumerate(requests):
                if r.token_ids[0] == 2:
                    raise RuntimeError("engine: request rejected")
                out.append(SampleResult([r.token_ids[0], len(requests)], "", "length", None, []))
                if on_result is not None:
                    on_result(i, out[-1])
            return out

    reported = []
    requests = [SampleRequest([t], 2) for t in (1, 2, 3)]
    results = generate_each(BisectingSampler(Streaming()), requests, SamplingSettings(), lambda i, r: reported.append(
        (i, None if r is None else r.token_ids)))
    # Request 0 came back from the first call (3 requests), request 2 from a retry of one request.
    assert reported == [(0, [1, 3]), (1, None), (2, [3, 1])]
    assert [None if r is None else r.token_ids for r in results] == [[1, 3], None, [3, 1]]
