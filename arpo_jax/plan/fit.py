"""The verdict of `arpo-jax plan` (plan.py): what one device gives JAX, whether the largest program fits it, and
what the vLLM engines' share of their GPUs holds.

JAX's budget per device (`budget_gib`): the whole HBM on TPU; on a GPU beside a co-located vLLM engine (which takes
`rollout.vllm.gpu_memory_utilization` of each GPU) the rest less what the GPU holds outside both budgets
(`memory_model.gpu_reserve_gib`: JAX's and the engine's CUDA contexts, NCCL's buffers, the engine's weight reload's
transient); on a GPU of its own (`rollout.vllm.placement=split`: the engines run on other GPUs) the whole HBM less
JAX's CUDA context and NCCL buffers; 0.9 of the HBM with the JAX engine. A program fits when its peak leaves at least
`HEADROOM` of the budget free; `jax_fraction` (the XLA_PYTHON_CLIENT_MEM_FRACTION a launch sets) is the largest
peak / (1 - HEADROOM) as a share of the HBM, on a GPU at most the budget less `memory_model.MARGIN` (2% of the GPU
for what the reserve does not itemise), and a program fits only if that pool holds its peak.

The engines' share (`engine_memory`): vLLM takes `gpu_memory_utilization` of each of its GPUs (co-located: the
trainer's; split: its own) and loads the whole model there first, over `tensor_parallel_size` GPUs in the engine's
dtype; its KV cache gets at most the rest (vLLM's activations and CUDA graphs come out of it too, so the token count
is an upper bound). The engines fit when that holds one full-length trajectory (data.max_prompt_length +
data.max_response_length tokens); how many it holds at once bounds the batch an engine decodes together.
"""

from __future__ import annotations

import math

from arpo_jax import models
from arpo_jax.plan.memory_model import (
    CUDA_RESERVE,
    GB,
    HEADROOM,
    MARGIN,
    Shapes,
    device_hbm_gib,
    engine_reload_gib,
    engine_reserve_gib,
    gpu_reserve_gib,
)
from arpo_jax.sharding import DEVICES


def budget_gib(device: str, engine: str, gpu_memory_utilization: float, engine_tp: int = 1,
               placement: str = "colocated", reload_gib: float = 0.0) -> float:
    """What one device gives JAX (module docstring); `reload_gib`: a co-located engine's reload transient."""
    hbm = device_hbm_gib(device)
    if DEVICES[device].kind != "gpu":
        return hbm
    if engine == "vllm" and placement == "split":  # no engine on JAX's GPUs
        return hbm - gpu_reserve_gib(device, "jax").get("total", CUDA_RESERVE * hbm)
    if engine == "vllm":
        reserve = gpu_reserve_gib(device, engine, engine_tp, reload_gib=reload_gib).get("total", CUDA_RESERVE * hbm)
        return (1.0 - gpu_memory_utilization) * hbm - reserve
    return 0.9 * hbm


def evaluate(programs: dict[str, dict[str, float]], device: str, engine: str, gpu_memory_utilization: float,
             engine_tp: int = 1, placement: str = "colocated", reload_gib: float = 0.0) -> dict:
    """Fit of the largest program against the device's budget for JAX (`reload_gib`: `engine_reload_gib`)."""
    peaks = {name: sum(items.values()) / GB for name, items in programs.items()}
    worst = max(peaks, key=peaks.get)
    budget = budget_gib(device, engine, gpu_memory_utilization, engine_tp, placement, reload_gib)
    hbm = device_hbm_gib(device)
    headroom = 1.0 - peaks[worst] / budget if budget > 0 else -1.0
    jax_fraction = math.ceil(peaks[worst] / (1.0 - HEADROOM) / hbm * 100) / 100 if hbm else 0.0
    if DEVICES[device].kind == "gpu" and budget > 0:  # the pool leaves the margin (rounded up, it could take it)
        jax_fraction = min(jax_fraction, math.floor((budget / hbm - MARGIN) * 100) / 100)
    items = {k: round(v / GB, 3) for k, v in sorted(programs[worst].items(), key=lambda kv: -kv[1])}
    fits = headroom >= HEADROOM and peaks[worst] <= jax_fraction * hbm
    out = {"fits": fits, "device": device, "hbm_gib": round(hbm, 2), "budget_gib": round(budget, 2),
           "peak_gib": round(peaks[worst], 2), "peak_program": worst, "headroom": round(headroom, 3),
           "items_gib": items, "program_peaks_gib": {k: round(v, 2) for k, v in peaks.items()},
           "jax_fraction": jax_fraction}
    if engine == "vllm" and DEVICES[device].kind == "gpu" and placement == "split":
        out["reserve_gib"] = gpu_reserve_gib(device, "jax") or {"total": round(CUDA_RESERVE * hbm, 3)}
    elif engine == "vllm" and DEVICES[device].kind == "gpu":
        out["items_gib"]["vllm_engine_gpu0"] = round(gpu_memory_utilization * hbm, 2)
        out["reserve_gib"] = gpu_reserve_gib(device, engine, engine_tp, reload_gib=reload_gib) or {
            "total": round(CUDA_RESERVE * hbm, 3)}
        out["engine_fraction_max"] = math.floor((1.0 - out["reserve_gib"]["total"] / hbm - jax_fraction - MARGIN)
                                                * 100) / 100
    return out


def fallback_fraction(device: str, gpu_memory_utilization: float, split: bool) -> float:
    """JAX's share of a GPU beside vLLM where nothing can be planned (no model config, `mesh.device=cpu`): co-located
    `1 - gpu_memory_utilization - 0.05`; with `rollout.vllm.placement=split` (`split`: no engine on JAX's GPUs) the
    whole GPU less JAX's reserve (itemised where `device` is a known GPU, else 0.05) and 0.05 more. Unchecked against
    any peak: `launch/mem_fraction.py` warns."""
    if not split:
        return round(1.0 - gpu_memory_utilization - CUDA_RESERVE, 2)
    reserve = gpu_reserve_gib(device, "jax").get("total", 0.0) / device_hbm_gib(device)
    return round(1.0 - (reserve or CUDA_RESERVE) - CUDA_RESERVE, 2)


def engine_memory(c: models.Config, total_params: int, sh: Shapes, device: str) -> dict:
    """What one GPU of a vLLM engine holds (module docstring): its share, the weights, the KV cache left (GiB and
    tokens), the full-length trajectories that fit it at once, and whether the engine fits. With split placement
    also what its GPU holds outside the share (`memory_model.engine_reserve_gib`) and the largest share it allows."""
    hbm = device_hbm_gib(device)
    tp = sh.engine_tp
    share = sh.gpu_memory_utilization * hbm
    weights = total_params * sh.engine_bytes / tp / GB
    # K and V of every layer; vLLM splits the KV heads over the engine's GPUs (each keeps one when there are fewer).
    per_token = 2 * c.num_layers * max(1, c.num_kv_heads // tp) * c.head_dim * sh.engine_bytes
    tokens = max(0, int((share - weights) * GB // per_token))
    out = {"placement": sh.placement, "tensor_parallel_size": tp, "share_gib": round(share, 2),
           "weights_gib": round(weights, 2), "kv_cache_gib": round(max(0.0, share - weights), 2),
           "kv_tokens": tokens, "trajectories": tokens // sh.min_seq}
    out["fits"] = out["trajectories"] >= 1
    if sh.placement == "split":
        reserve = engine_reserve_gib(device, tp, reload_gib=engine_reload_gib(c, sh.engine_bytes, tp)) or {
            "total": round(CUDA_RESERVE * hbm, 3)}
        out |= {"reserve_gib": reserve, "fraction_max": math.floor((1.0 - reserve["total"] / hbm - MARGIN) * 100) / 100}
        out["fits"] = out["fits"] and sh.gpu_memory_utilization <= out["fraction_max"]
    return out


def engines_fit(c: models.Config, total_params: int, sh: Shapes, device: str) -> bool:
    """`engine_memory`'s verdict; True where no vLLM engine runs on a GPU."""
    return sh.engine != "vllm" or DEVICES[device].kind != "gpu" or engine_memory(c, total_params, sh, device)["fits"]


def gib_items(items: dict) -> str:
    return ", ".join(f"{k} {v:g} GiB" for k, v in items.items())


def engine_words(e: dict, host_devices: int) -> str:
    """The vLLM engines' line of the plan (`fit.engine_memory`)."""
    where = (f"on GPUs of their own (placement=split; the trainer's mesh has {host_devices} GPUs a host)"
             if e["placement"] == "split" else "beside JAX on every GPU")
    out = (f"vLLM engines {where}: {'fit' if e['fits'] else 'DO NOT FIT'}: {e['share_gib']} GiB a GPU = weights "
           f"{e['weights_gib']} GiB (tensor_parallel_size {e['tensor_parallel_size']}) + KV cache <= "
           f"{e['kv_cache_gib']} GiB = {e['kv_tokens']} tokens, {e['trajectories']} full-length trajectories at once")
    if e["placement"] == "split":
        out += f"; outside vLLM's share, per engine GPU: {gib_items(e['reserve_gib'])} (share <= {e['fraction_max']})"
    return out
