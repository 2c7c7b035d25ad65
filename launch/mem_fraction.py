"""Prints the XLA_PYTHON_CLIENT_MEM_FRACTION a config needs: `python launch/mem_fraction.py --config=... [overrides]`.

With the co-located vLLM engine each GPU is shared three ways: JAX gets its planned peak plus 10% headroom
(`arpo-jax plan`'s itemised model, no compile, on the device `mesh.device` names), vLLM takes
`rollout.vllm.gpu_memory_utilization`, and the rest must hold what neither counts: JAX's and the engine's CUDA
contexts and NCCL's buffers and the engine's weight reload (`memory_model.gpu_reserve_gib`, per GPU type; NVLS's too
when NCCL_NVLS_ENABLE=1), and 2% of the GPU stays out of all (`memory_model.MARGIN`). The split goes to stderr, with
a warning when they do not fit the GPU (`arpo-jax plan` says what to change), or when there is no plan (no model
config yet: a fixed share, `plan.fallback_fraction`).
With `rollout.vllm.placement=split` the engines have GPUs of their own and JAX its planned peak plus 10% of each of
the others (the rest: its CUDA context and NCCL's buffers). The JAX engine gets JAX's usual 0.9. Unknown arguments
(--workdir, ...) are ignored, so a launch script can pass its whole argument list. The last line of stdout is the
fraction.
"""

import os
import sys

if __name__ == "__main__":
    # The plan is arithmetic: keep this short-lived process off the GPUs (JAX would preallocate them).
    os.environ["JAX_PLATFORMS"] = "cpu"
    from arpo_jax.assemble import placement
    from arpo_jax.config import args
    from arpo_jax.plan import plan
    from arpo_jax.plan.memory_model import MARGIN, nvls_on
    from arpo_jax.sharding import DEVICES

    cfg, _ = args.parse_config_args(sys.argv[1:])
    fraction = plan.jax_mem_fraction(cfg)
    try:
        r = plan.memory_split(cfg) if DEVICES[cfg.mesh.device].kind == "gpu" else None
    except FileNotFoundError as e:  # no config.json for model.path yet: jax_mem_fraction used the fixed split
        r = None
        if cfg.rollout.engine == "vllm":
            print(f"mem_fraction.py: warning: no plan ({e}); JAX gets the fixed {fraction} of each GPU "
                  f"({'split placement: the whole GPU' if placement.is_split(cfg) else 'what vLLM leaves'} less "
                  "reserves), unchecked against the run's peak: put the model's config.json there (or name a "
                  "published model) and run `arpo-jax plan` with the same arguments", file=sys.stderr)
    if r is not None and (r.get("engines") or {}).get("placement") == "split":
        e, k = r["engines"], cfg.rollout.vllm.engine_gpus
        total = fraction + r["reserve_gib"]["total"] / r["hbm_gib"]
        print(f"{cfg.mesh.device} ({r['hbm_gib']} GiB), split: JAX {fraction} + {r['reserve_gib']['total']} GiB "
              f"outside it (CUDA context, NCCL{', NVLS' if nvls_on() else ''}) = {total:.2f} of each of its "
              f"{r['host_devices']} GPUs; vLLM {cfg.rollout.vllm.gpu_memory_utilization} + "
              f"{e['reserve_gib']['total']} GiB of each of the engines' {k}", file=sys.stderr)
        if total > 1.0 - MARGIN + 1e-9 or not e["fits"] or not r["fits"]:
            print("mem_fraction.py: warning: these do not fit; run `arpo-jax plan` with the same arguments",
                  file=sys.stderr)
    elif cfg.rollout.engine == "vllm" and r is not None:
        reserve = r["reserve_gib"]["total"]
        total = fraction + cfg.rollout.vllm.gpu_memory_utilization + reserve / r["hbm_gib"]
        print(f"{cfg.mesh.device} ({r['hbm_gib']} GiB): JAX {fraction} + vLLM "
              f"{cfg.rollout.vllm.gpu_memory_utilization} + {reserve} GiB outside both (CUDA contexts, NCCL"
              f"{', NVLS' if nvls_on() else ''}) = "
              f"{total:.2f} of each GPU", file=sys.stderr)
        if total > 1.0 - MARGIN + 1e-9 or not r["fits"]:  # the margin: what the reserve does not itemise
            print("mem_fraction.py: warning: these do not fit one GPU; run `arpo-jax plan` with the same arguments",
                  file=sys.stderr)
    print(fraction)
