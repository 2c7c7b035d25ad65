"""Step-time model of one RL step on a node: synchronous vs one step off-policy, co-located vs split placement.

No accelerator has been lent to this project yet, so a node's phase times are modelled here, not measured. The
model takes a shipped config's real sizes (batch, n, P, R, model shape, mesh device, KL, remat, tree training) and
the device's published peak numbers, and applies stated efficiencies:

  update       (6 N + 2 N with model.remat=full) FLOPs per trained token x ppo_epochs, plus attention (12 L A ctx
               per token forward + backward); trained tokens = the batch's tokens / the tree saving (tree training:
               at least the shared prompt, `plan.tree_saving`); at `--mfu` of the training devices' peak.
  log-probs    2 N + 4 L A ctx FLOPs per token, once for the old policy and once more for the reference (KL on).
  generation   per engine (`rollout.vllm.tensor_parallel_size` devices) and decode step: max(the bf16 weights + the
               live sequences' KV cache read at `--hbm-eff` of the bandwidth, 2 N FLOPs per live sequence at
               `--decode-mfu`), over the R `--fill-max` steps the slowest trajectory takes (sequences leave as they
               finish: the KV read uses the mean response); at most the sequences whose KV cache fits the engine's
               memory (co-located: `rollout.vllm.gpu_memory_utilization` of each device, split: 0.9, less the
               weights) decode together, the rest wait; prompts prefilled once per group (prefix caching).
  tools        `tools.call_limit` rounds x `--tool-latency` s during which the engine waits for the slowest call.
  weight sync  the bf16 weights exported and reloaded at the bandwidths measured on CPU for SmolLM2
               (RESULTS.md "LoRA vs full fine-tuning": 2.0 GB/s export to /dev/shm, 1.1 GB/s reload).

Placements and schedules (8 devices unless --devices):
  co-located   engines and trainer share every device. Synchronous: generate, tools, train, sync. One step off:
               the device still does one thing at a time, so the overlap can only fill the tool waits with the
               update: generate + max(tools, train) + sync.
  split k      k devices generate, the rest train. Synchronous: gen(k) + tools + train(8 - k) + sync; one step off:
               max(gen(k) + tools, train(8 - k)) + sync. The table shows the k with the shortest off-policy step.
Idle fractions: trainer = 1 - its busy time / step, engine = 1 - its generating time / step (tool waits idle),
device = 1 - the devices' busy time / (devices x step) (co-located: a device busy generating is not idle).

How it was checked: the same formulas on the toy run's measured phases (`benchmarks/loop/offpolicy.py`, JSON given with
--toy) predict the one-step-off step the CPU measured; the co-located rule (a shared device gains only its idle
waits) is the one the CPU showed (its update-bound run did not gain). The GPU figures themselves are unchecked
until a GPU is lent: read them as where the time goes and which placement wins, not as seconds to expect.

  python benchmarks/loop/step_model.py [--config builtin:arpo_qwen25_7b_reasoning] [--fill 0.5] [--mfu 0.35]
      [--toy offpolicy_output.log ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

# Dense bf16 peak FLOP/s and HBM bytes/s per device (vendor datasheets; H100/H200 SXM).
PEAK = {"a100-40gb": (312e12, 1.56e12), "a100-80gb": (312e12, 2.04e12), "h100-80gb": (989e12, 3.35e12),
        "h200": (989e12, 4.8e12), "tpu-v4": (275e12, 1.2e12), "tpu-v5e": (197e12, 0.82e12),
        "tpu-v5p": (459e12, 2.76e12)}
EXPORT_BPS, RELOAD_BPS = 2.0e9, 1.1e9  # measured on CPU (module docstring)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One step's sizes, from a config."""

    matmul_params: float  # N: parameters that multiply per token (layers + LM head; not the embedding lookup)
    layers: int
    attn_width: int  # A = heads x head_dim
    kv_bytes_per_token: float  # bf16 K and V of every layer
    prompts: int
    n: int
    prompt: float  # mean prompt tokens
    response: float  # mean response tokens
    response_max: float  # the slowest trajectory's tokens
    tree_saving: float
    epochs: int
    remat_full: bool
    ref_forward: bool
    tool_rounds: int
    tp: int


def workload(cfg, fill: float, fill_max: float, prompt_fill: float) -> Workload:
    from arpo_jax.plan import plan

    m, _ = plan._model_config(cfg)
    a, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = m.hidden_size * (2 * a + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    p, r = cfg.data.max_prompt_length * prompt_fill, cfg.data.max_response_length * fill
    tree = plan.tree_saving(p, r, cfg.rollout.n) if cfg.actor.tree_training else 1.0
    return Workload(m.num_layers * per_layer + m.vocab_size * m.hidden_size, m.num_layers, a, 2 * m.num_layers * kv * 2,
                    cfg.data.train_batch_size, cfg.rollout.n, p, r, cfg.data.max_response_length * fill_max, tree,
                    cfg.actor.ppo_epochs, cfg.model.remat == "full", bool(cfg.actor.kl_coef), cfg.tools.call_limit,
                    max(1, cfg.rollout.vllm.tensor_parallel_size))


def phase_seconds(w: Workload, device: str, *, mfu: float, decode_mfu: float, hbm_eff: float,
                  tool_latency: float) -> dict:
    """Each phase's time on d devices (train, logprob, gen: functions of d) and the fixed ones (tools, sync)."""
    from arpo_jax.plan.memory_model import GB
    from arpo_jax.sharding import DEVICES

    peak, hbm = PEAK[device]
    hbm_bytes = DEVICES[device].hbm_gib * GB
    seqs = w.prompts * w.n
    ctx = w.prompt + w.response / 2  # mean context a token attends to
    tokens = seqs * (w.prompt + w.response)
    trained = tokens / w.tree_saving
    fwd_flops = 2 * w.matmul_params + 4 * w.layers * w.attn_width * ctx
    update_flops = w.epochs * trained * fwd_flops * (4 if w.remat_full else 3)
    logprob_flops = trained * fwd_flops * (2 if w.ref_forward else 1)
    weights = 2 * w.matmul_params

    def gen(d: int, memory_fraction: float) -> float:
        """Generation on d devices whose engines may use `memory_fraction` of each device."""
        engines = max(1, d // w.tp)
        live = seqs / engines  # sequences per engine; they leave as they finish
        ctx_tokens = w.prompt + w.response  # a sequence's KV cache when it ends
        kv_room = memory_fraction * hbm_bytes * w.tp - weights  # vLLM's KV cache per engine
        if kv_room <= 0:
            return float("inf")
        # Sequences decoding together: on average live x R_mean / R_max (they finish at different lengths), at
        # most what the KV cache holds; with fewer, the rest wait (continuous batching: more decode steps).
        together = min(live * w.response / w.response_max, kv_room / (w.kv_bytes_per_token * ctx_tokens))
        steps = max(w.response_max, live * w.response / together)
        kv_read = together * w.kv_bytes_per_token * (w.prompt + w.response / 2)
        step_mem = (weights + kv_read) / w.tp / (hbm * hbm_eff)
        step_flops = together * 2 * w.matmul_params / w.tp / (peak * decode_mfu)
        prefill = 2 * w.matmul_params * w.prompts * w.prompt / (d * peak * mfu)
        return steps * max(step_mem, step_flops) + prefill

    return {"train": lambda d: (update_flops + logprob_flops) / (d * peak * mfu), "gen": gen,
            "tools": w.tool_rounds * tool_latency, "sync": weights / EXPORT_BPS + weights / RELOAD_BPS,
            "tokens": tokens, "trained_tokens": trained}


def schedules(ph: dict, devices: int, tp: int, gpu_memory_utilization: float) -> dict:
    """Step time and idle fractions per placement and schedule. Co-located engines get `gpu_memory_utilization` of
    each device (the config's); split ones 0.9 of theirs."""
    def row(gen, train, step, k):
        """k: devices that generate (k == devices: co-located, every device does both)."""
        busy = (gen + train) if k == devices else (k * gen + (devices - k) * train) / devices
        return {"step_s": round(step, 1), "gen_s": round(gen, 1), "train_s": round(train, 1),
                "trainer_idle": round(1 - train / step, 3), "engine_idle": round(1 - gen / step, 3),
                "device_idle": round(1 - busy / step, 3)}

    gen, train, tools, sync = ph["gen"](devices, gpu_memory_utilization), ph["train"](devices), ph["tools"], ph["sync"]
    out = {"colocated_sync": row(gen, train, gen + tools + train + sync, devices),
           "colocated_off_policy": row(gen, train, gen + max(tools, train) + sync, devices)}
    best = min(range(tp, devices, tp), key=lambda k: max(ph["gen"](k, 0.9) + tools, ph["train"](devices - k)))
    g, t = ph["gen"](best, 0.9), ph["train"](devices - best)
    out[f"split_{best}_gen_sync"] = row(g, t, g + tools + t + sync, best)
    out[f"split_{best}_gen_off_policy"] = row(g, t, max(g + tools, t) + sync, best)
    return out


def check_toy(toy: dict) -> dict:
    """The formulas on the CPU toy run's measured phases (offpolicy.py JSON): predicted vs measured off-policy step."""
    runs = {r["max_staleness"]: r for r in toy["runs"]}
    s0 = runs[0]
    rollout = s0["rollout"] + s0["reward"]
    train = sum(s0[p] for p in ("advantages", "pack", "old_logprob", "update", "metrics"))
    out = {"sync_measured_s": s0["step_s"], "split_off_policy_predicted_s": round(max(rollout, train) +
                                                                                 s0["weight_sync"], 2),
           "colocated_off_policy_predicted_s": round(rollout + train + s0["weight_sync"], 2)}
    if 1 in runs:
        out["off_policy_measured_s"] = runs[1]["step_s"]
    return out


def main() -> None:
    from arpo_jax.config import args as args_lib

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="builtin:arpo_qwen25_7b_reasoning")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--fill", type=float, default=0.5, help="mean response length / max_response_length")
    ap.add_argument("--fill-max", type=float, default=1.0, help="the slowest trajectory's length / max_response_length")
    ap.add_argument("--prompt-fill", type=float, default=0.5, help="mean prompt length / max_prompt_length")
    ap.add_argument("--mfu", type=float, default=0.35, help="training and prefill FLOP efficiency")
    ap.add_argument("--decode-mfu", type=float, default=0.5, help="decode FLOP efficiency at large batch")
    ap.add_argument("--hbm-eff", type=float, default=0.6, help="decode's share of the HBM bandwidth")
    ap.add_argument("--tool-latency", type=float, default=2.0, help="s per tool round (the slowest call)")
    ap.add_argument("--toy", nargs="*", default=[], help="files holding benchmarks/loop/offpolicy.py's output "
                    "(its last line, the JSON) to check the formulas on")
    args = ap.parse_args()
    cfg = args_lib.load_config([f"--config={args.config}"])
    w = workload(cfg, args.fill, args.fill_max, args.prompt_fill)
    ph = phase_seconds(w, cfg.mesh.device, mfu=args.mfu, decode_mfu=args.decode_mfu, hbm_eff=args.hbm_eff,
                       tool_latency=args.tool_latency)
    util = cfg.rollout.vllm.gpu_memory_utilization
    result = {"config": args.config, "device": cfg.mesh.device, "devices": args.devices,
              "assumptions": {k: getattr(args, k) for k in ("fill", "fill_max", "prompt_fill", "mfu", "decode_mfu",
                                                            "hbm_eff", "tool_latency")},
              "tokens_per_step": round(ph["tokens"]), "trained_tokens": round(ph["trained_tokens"]),
              "phases_s_on_all_devices": {"gen": round(ph["gen"](args.devices, util), 1),
                                          "train": round(ph["train"](args.devices), 1),
                                          "tools": ph["tools"], "sync": round(ph["sync"], 1)},
              "schedules": schedules(ph, args.devices, w.tp, util)}
    result["toy_checks"] = [check_toy(json.loads(open(f).read().strip().splitlines()[-1])) for f in args.toy]
    for name, r in result["schedules"].items():
        print(f"{name:28s} step {r['step_s']:7.1f} s   trainer idle {r['trainer_idle']:.0%}   "
              f"engine idle {r['engine_idle']:.0%}   devices idle {r['device_idle']:.0%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
