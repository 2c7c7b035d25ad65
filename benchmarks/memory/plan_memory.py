"""Compiled memory of the policy-update step for a published model on a fake-device mesh (see arpo_jax/plan/plan.py).

`arpo-jax plan --config builtin:<experiment>` itemises every program of an experiment config against its device;
this script compiles the update of any published model / mesh / micro-batch shape by hand (`--layers` for a
reduced depth, `--forward` to compile the log-prob forward too):

  python benchmarks/memory/plan_memory.py [--model Qwen2.5-7B-Instruct --mesh 1,8,1 --micro 2 --rows 8 --seq 4096]

Prints a table and a final JSON line; `state_vs_ideal` is (params + optimizer state per device) / (their total /
devices).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _mesh_arg(argv: list[str], default: str = "1,8,1") -> str:
    """--mesh before argparse runs: the fake device count must be set before JAX starts."""
    for i, a in enumerate(argv):
        if a.startswith("--mesh="):
            return a.split("=", 1)[1]
        if a == "--mesh" and i + 1 < len(argv):
            return argv[i + 1]
    return default


_N_DEV = math.prod(int(x) for x in _mesh_arg(sys.argv).split(","))
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_N_DEV}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from arpo_jax import (
    models,  # noqa: E402
    sharding,  # noqa: E402
)
from arpo_jax.models.published import REAL_CONFIGS
from arpo_jax.plan import (
    memory_model,  # noqa: E402
    plan,  # noqa: E402
)
from arpo_jax.update import train_step as ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen2.5-7B-Instruct", choices=sorted(REAL_CONFIGS))
    ap.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor")
    ap.add_argument("--rules", default="fsdp", choices=sorted(sharding.RULES))
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch (whole mesh)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--kl", action="store_true", help="include the KL loss (ref_logp input)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's)")
    ap.add_argument("--attention", default="", help="attention_impl (default: the model's default, blockwise)")
    ap.add_argument("--forward", action="store_true", help="also compile the log-prob forward")
    args = ap.parse_args()
    hf = dict(REAL_CONFIGS[args.model], **({"num_hidden_layers": args.layers} if args.layers else {}))
    cfg = models.config_from_hf(hf, dtype="bfloat16", param_dtype="float32", remat=args.remat,
                                sharding_rules=args.rules, attention_impl=args.attention or None)
    r = {"model": args.model, **plan.plan(cfg, tuple(int(x) for x in args.mesh.split(",")),
                                          ts.UpdateConfig(kl_coef=0.001 if args.kl else 0.0),
                                          micro=args.micro, rows=args.rows, seq=args.seq, forward=args.forward)}
    gib = {k: round(v / memory_model.GB, 3) for k, v in r.items() if k.endswith(("_bytes", "_per_device"))}
    print("\n".join(f"{k:28s} {v:8.2f} GiB" for k, v in gib.items()))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
