"""Prints the SIGTERM lead time a SLURM job needs: `python launch/signal_margin.py --config=... [overrides]`.

SLURM sends SIGTERM `--signal=TERM@<s>` seconds before the time limit; arpo-jax then finishes the step it is in,
saves a checkpoint and exits, so the lead must cover one step plus one save. The step comes from the step-time
model (`benchmarks/loop/step_model.py`, co-located synchronous schedule) at the pessimistic efficiencies RESULTS.md
quotes as the likelier ones (training 45% MFU, decode 25% MFU at 30% of the HBM bandwidth: 494 s for the 7B
reasoning config on 8 A100s); the save is the checkpoint (params in `model.param_dtype` plus AdamW's two float32
moments) written by every node at `--write-gbps` GB/s each to the shared file system. Both are estimates: after
the first steps, read the real step time in metrics.jsonl (`time/step`) and a save's from the job's end (the
"stopped by SIGTERM" line's time less the signal's), and resubmit with those.

    sbatch --signal=TERM@$(python launch/signal_margin.py --config=builtin:arpo_qwen25_7b_reasoning \\
        --config.mesh.shape="(2,8,1)" --config.mesh.device=h100-80gb) --nodes=2 launch/slurm_gpu.sbatch ...

The last line of stdout is the lead in seconds; the breakdown goes to stderr. Unknown arguments are ignored, like
mem_fraction.py's, so a launch script can pass its whole argument list.
"""

import importlib.util
import math
import os
import sys
from pathlib import Path

SAFETY = 1.5  # the step and save estimates are unmeasured: half again on top
FIXED_S = 60  # stopping the engines, the step boundary agreement, orbax's commit


def step_model():
    """benchmarks/loop/step_model.py, loaded from this checkout (it is not part of the installed package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "loop" / "step_model.py"
    spec = importlib.util.spec_from_file_location("step_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_model"] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def step_seconds(cfg, devices: int, nodes: int = 1) -> float:
    """The synchronous step with the trainer on `devices` GPUs at the pessimistic efficiencies (module docstring):
    co-located, the engines generate on the same GPUs; with rollout.vllm.placement=split on their own
    `engine_gpus` of each of the `nodes`."""
    from arpo_jax.assemble import placement

    sm = step_model()
    w = sm.workload(cfg, fill=0.5, fill_max=1.0, prompt_fill=0.5)
    ph = sm.phase_seconds(w, cfg.mesh.device, mfu=0.45, decode_mfu=0.25, hbm_eff=0.3, tool_latency=2.0)
    engines = cfg.rollout.vllm.engine_gpus * nodes if placement.is_split(cfg) else devices
    return ph["gen"](engines, cfg.rollout.vllm.gpu_memory_utilization) + ph["tools"] + ph["train"](devices) + \
        ph["sync"]


def save_seconds(params: int, param_dtype: str, nodes: int, write_gbps: float) -> float:
    """A checkpoint of `params` (in `param_dtype`, plus AdamW's two float32 moments) written by `nodes` nodes."""
    per_param = {"float32": 4, "bfloat16": 2, "float16": 2}.get(param_dtype, 4) + 8
    return params * per_param / (nodes * write_gbps * 1e9)


def margin(cfg, write_gbps: float) -> dict:
    from arpo_jax.plan import plan

    shape = tuple(cfg.mesh.shape)
    per_host = plan.host_devices(cfg)  # the trainer's GPUs of a node (less the engines' with split placement)
    devices = math.prod(shape) if -1 not in shape else per_host
    nodes = max(1, devices // per_host)
    params = plan.analyse(cfg, devices=devices)["params"]
    step = step_seconds(cfg, devices, nodes)
    save = save_seconds(params, cfg.model.param_dtype or cfg.model.dtype, nodes, write_gbps)
    return {"step_s": round(step), "save_s": round(save), "nodes": nodes,
            "lead_s": int(math.ceil(SAFETY * (step + save) + FIXED_S))}


if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"  # arithmetic only: keep this process off the GPUs
    from arpo_jax.config import args as config

    gbps = 1.0  # GB/s each node writes to the shared file system: a conservative NFS / Lustre client figure
    args = []
    for a in sys.argv[1:]:
        if a.startswith("--write-gbps="):
            gbps = float(a.split("=", 1)[1])
        else:
            args.append(a)
    cfg, _ = config.parse_config_args(args)
    m = margin(cfg, gbps)
    print(f"signal lead: {SAFETY} x (step ~{m['step_s']} s + save ~{m['save_s']} s on {m['nodes']} node(s) at "
          f"{gbps:g} GB/s each) + {FIXED_S} s = {m['lead_s']} s", file=sys.stderr)
    print(m["lead_s"])
