"""The JAX engine inside the agent loop: generated tokens/s, tool time and compiles per step (issue 54).

`benchmarks/engine/rollout.py` measures the engine alone on one batch; this runs it the way training does: `--steps`
ARPO rollouts (`agent_loop.rollout`) of `--prompts` toy questions x `--n` trajectories (`--initial` roots, beam 2)
with the real tools (Python sandbox, local search over the toy corpus), temperature 1, the demo's system prompt and
budgets (`--prompt-len` 160 + `--response` 256 tokens). So that an untrained instruct model calls tools, each prompt
ends with the start of a Python call (`--prefix`). Per step: wall time, the engine's share (`generate`), the
tools' wait, generated tokens, tool calls, branches, and the programs compiled (traced or served by the persistent
compilation cache: `arpo_jax.compile_log` where it exists, else the same `jax.monitoring` events counted here).

  python benchmarks/loop/rollout_loop.py [--model smollm2-135m-instruct] [--steps 4] [--prompts 4 --n 8]
                                   [--algo arpo|grpo] [--schedule stream|rounds]

`--algo grpo`: n independent trajectories a prompt (no branching), the same budget. Per step also the engine's
sequential decode steps (`rollout/decode_steps`) and the longest chain of them a trajectory needed
(`rollout/critical_path_steps`).

Prints a table, then a final JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402


def _own_tokens(out):
    """Per trajectory, the mask of the model tokens it sampled itself (past the state it branched from)."""
    for i, branch_point in enumerate(_branch_points(out)):
        mask = out.loss_mask[i].copy()
        mask[:branch_point] = 0
        yield mask


def _branch_points(out):
    points = {node.slot_id: node.branch_point for tree in out.trees for node in tree.nodes}
    return [points[int(s)] for s in out.slot_id]


def _compiles():
    """() -> compiles so far: `compile_log` (this tree) or the same events counted here (an older tree)."""
    try:
        from arpo_jax import compile_log

        compile_log.install()
        return lambda: compile_log.total(compile_log.counts())
    except ImportError:
        from jax import monitoring

        seen = [0]

        def listener(event, duration, **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                seen[0] += 1

        monitoring.register_event_duration_secs_listener(listener)
        return lambda: seen[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--initial", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--decode-chunk", type=int, default=16)
    ap.add_argument("--slots", type=int, default=0, help="engine rows (0: prompts x n)")
    ap.add_argument("--decode-rows", default="auto", help="rollout.jax.decode_rows: auto | all | quarters")
    ap.add_argument("--prefix", default="<think> I need to compute this. </think> <python> print(")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--algo", default="arpo", choices=("arpo", "grpo"))
    ap.add_argument("--schedule", default="stream", choices=("stream", "rounds"))
    args = ap.parse_args()
    compiled = _compiles()

    from transformers import AutoTokenizer

    import arpo_jax
    from arpo_jax.assemble import components
    from arpo_jax.config import args as config_args
    from arpo_jax.data import prompts, toy
    from arpo_jax.rollout.agent_loop import RolloutConfig, rollout
    from arpo_jax.rollout.jax_sampler import JaxSampler
    from arpo_jax.rollout.sampler import SamplingSettings
    from arpo_jax.weights import named_models

    folder = named_models.model_folder(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tasks = toy.toy_tasks("train", args.steps * args.prompts, seed=0)
    texts = [
        tok.apply_chat_template(
            prompts.chat_messages(t.question, prompts.DEMO_SYSTEM_PROMPT), add_generation_prompt=True, tokenize=False
        )
        + args.prefix
        for t in tasks
    ]
    prompt_ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    max_len = args.prompt_len + args.response
    params = inspect.signature(JaxSampler).parameters
    extra = {"slots": args.slots or args.prompts * args.n} if "slots" in params else {}
    if "decode_rows" in params:
        extra["decode_rows"] = args.decode_rows
    engine = JaxSampler(
        arpo_jax.from_pretrained(folder, dtype=args.dtype),
        tok,
        max_len=max_len,
        decode_chunk=args.decode_chunk,
        **extra,
    )
    sampler = engine
    executor = components.make_tool_executor(config_args.load_config(["--config=builtin:toy_cpu"]))
    grpo = args.algo == "grpo"
    rcfg = RolloutConfig(
        n=args.n,
        initial_rollouts=args.n if grpo else args.initial,
        beam_size=1 if grpo else 2,
        schedule=args.schedule,
        branch_probability=0.5,
        entropy_weight=0.2,
        response_length=args.response,
        prompt_length=args.prompt_len,
        call_limit=3,
    )
    steps = []
    try:
        for step in range(args.steps):
            batch = prompt_ids[step * args.prompts : (step + 1) * args.prompts]
            before = compiled()
            t0, c0 = time.perf_counter(), time.process_time()
            sampler.reset_cache()
            out = rollout(batch, sampler, executor, tok, rcfg, SamplingSettings(temperature=1.0, seed=step), rng=step)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = out.metrics
            # The tokens the engine sampled: the output's own (a branch's inherited ones counted once) and the
            # discarded ones of what started early and was cancelled.
            own = sum(int(t.sum()) for t in _own_tokens(out))
            tokens = own + int(m.get("rollout/speculative_tokens_discarded", 0))
            gen = m["time/rollout_generate_s"]
            steps.append(
                {
                    "step": step,
                    "wall_s": round(wall, 2),
                    "cpu_s": round(cpu, 2),
                    "generate_s": round(gen, 2),
                    "tools_wait_s": round(m["time/rollout_tools_s"], 2),
                    "tokens": tokens,
                    "tokens_per_generate_s": round(tokens / gen, 1),
                    "tokens_per_wall_s": round(tokens / wall, 1),
                    "tool_calls": int(m["rollout/tool_calls"]),
                    "branches": int(m["rollout/branches"]),
                    "rounds": int(m["rollout/rounds"]),
                    "decode_steps": int(m.get("rollout/decode_steps", 0)),
                    "critical_path_steps": int(m.get("rollout/critical_path_steps", 0)),
                    "decode_calls": int(m.get("rollout/decode_calls", 0)),
                    "computed_row_steps": int(m.get("rollout/computed_row_steps", 0)),
                    "speculative_tokens_discarded": int(m.get("rollout/speculative_tokens_discarded", 0)),
                    "compiles": compiled() - before,
                }
            )
            print(json.dumps(steps[-1]), flush=True)
    finally:
        executor.close()
    warm = steps[1:] or steps
    summary = {
        "benchmark": "rollout_loop",
        "model": args.model,
        "algo": args.algo,
        "schedule": args.schedule,
        "dtype": args.dtype,
        "cpus": os.cpu_count(),
        "platform": platform.processor() or platform.machine(),
        "load_avg": round(os.getloadavg()[0], 1),
        "prompts": args.prompts,
        "n": args.n,
        "response": args.response,
        "engine_rows": extra.get("slots"),
        "steps": steps,
        "warm_tokens_per_generate_s": round(
            float(np.sum([s["tokens"] for s in warm]) / np.sum([s["generate_s"] for s in warm])), 1
        ),
        "warm_compiles": int(np.sum([s["compiles"] for s in warm])),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
