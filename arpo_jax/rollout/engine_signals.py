"""The vLLM engine's processes and the signals sent to a whole job (standard library only: the worker script,
vllm_worker.py, imports it from its own folder).

A terminal's Ctrl-C reaches the foreground process group, and SLURM signals every process of the job step
(proctrack/cgroup: a process group of our own does not shield the engine). vLLM 0.32's engine core and its
tensor-parallel workers install handlers that shut the engine down on SIGTERM / SIGINT (vllm/v1/engine/core.py,
v1/executor/multiproc_executor.py), so a rollout in flight would fail. The process that owns the engine decides what
the signal means (the trainer finishes its step, the rollout included, saves, then closes the engine): the worker
blocks both signals before vLLM starts anything, and the mask goes to every process it starts (fork and exec keep
it). Stopping stays with the worker's `close` command, the trainer's SIGKILL of the group (`Worker.wait`,
`exit_with_parent`) and SIGKILL at SLURM's end; vLLM's own shutdown of a separate engine core (a SIGTERM, blocked)
ends in the SIGKILL it sends after its grace period.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def keep_stop_signals_out() -> None:
    """Blocks SIGTERM and SIGINT in this process and so in every process it starts. Call it first, before any thread
    or process is started.

    CPython's multiprocessing starts its resource tracker (a helper process; it ignores both signals itself) with
    them blocked and then UNBLOCKS them in the calling thread (bpo-33613): the first spawned process (vLLM's engine
    core on a GPU) would undo this mask, for itself and for the worker. Started here, first, it is not started
    again."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def exposed_processes(root: int | None = None) -> list[int]:
    """`root` (default this process) and its descendants that neither block nor ignore SIGTERM and SIGINT (Linux
    /proc; [] where it cannot be read): the engine processes a signal to the whole job would stop."""
    todo, exposed = [root or os.getpid()], []
    while todo:
        pid = todo.pop()
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            todo += [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                     for c in (task / "children").read_text().split()]
        except OSError:  # gone meanwhile, or no /proc
            continue
        shielded = int(status["SigBlk"], 16) | int(status["SigIgn"], 16)
        if not all(shielded >> (s - 1) & 1 for s in STOP_SIGNALS):
            exposed.append(pid)
    return exposed
