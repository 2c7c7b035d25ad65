"""Started sandboxes of the Python tool, and the pool of ready ones (``PythonSandboxConfig.ready_sandboxes``).

A sandbox is started *before* its program is known: the monitor enters the namespaces and forks the user
process, which builds the filesystem view, sets the limits, drops privileges, installs the seccomp filter, says
``R`` on its code socket and waits (``_sandbox_child.py``). A call then hands it the program: ``G`` to the
monitor (the timeout starts), the program on the code socket, and the user process acknowledges with ``A``
before it runs it. Measured on 2 cores, start-up is ~11 of a call's ~14 ms (benchmarks/tools/sandbox_load.py): a pool
that keeps sandboxes ready takes it off the call's latency.

Isolation is the same as for a sandbox started on demand: every sandbox runs exactly one program and is then
discarded, and a ready one is a pristine fork that has run nothing, so no call sees anything of another (files,
environment, memory, module state). A ready sandbox that died (killed, OOM) is found when it is taken; one that
does not take its program (stopped, hung) is found by the missing acknowledgement. Both are killed and replaced.
"""

import collections
import json
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time

log = logging.getLogger(__name__)


class StartedSandbox:
    """One started sandbox, used for one program: the caller's ends of its pipes and sockets, and its pids."""

    def __init__(self, out_r: int, err_r: int, status: socket.socket, code: socket.socket,
                 bootstrap: subprocess.Popen | None, cleanup):
        self.out_r, self.err_r, self.status, self.code = out_r, err_r, status, code
        self.bootstrap = bootstrap  # the cold ``once`` process (it is the monitor); None when the zygote forked it
        self._cleanup = cleanup  # releases the uid slot and the host working directory
        self.status_buf, self.msgs = b"", []
        self._pidfds: dict[str, int] = {}  # "pid" (user process), "monitor": to kill it whatever state it is in
        self._closed = False

    def _read_status(self) -> bool:
        """Reads what the monitor sent (pids, a final status); False at EOF."""
        try:
            chunk = self.status.recv(65536)
        except OSError:  # ECONNRESET: the monitor died
            return False
        if not chunk:
            return False
        self.status_buf += chunk
        *lines, self.status_buf = self.status_buf.split(b"\n")
        for msg in (json.loads(line) for line in lines if line):
            self.msgs.append(msg)
            for key in ("pid", "monitor"):
                if key in msg:
                    try:  # a pidfd, not the pid: a pid reused by another process is never signalled
                        self._pidfds[key] = os.pidfd_open(msg[key])
                    except OSError:
                        pass  # already gone
        return True

    def final(self) -> bool:
        """The monitor reported the end (the user process exited, or the monitor failed)."""
        return any("status" in m or "error" in m for m in self.msgs)

    def wait_ready(self, timeout_s: float) -> str:
        """``ready``, ``dead`` (its status, if any, says why) or ``hung`` (not ready within ``timeout_s``).

        Ready: the user process said so and the monitor sent the pids (so that ``close`` can always kill it)."""
        deadline, said_ready = time.monotonic() + timeout_s, False
        while (remaining := deadline - time.monotonic()) > 0:
            watch = [self.status] + ([] if said_ready else [self.code])
            ready, _, _ = select.select(watch, [], [], remaining)
            if self.status in ready and (not self._read_status() or self.final()):
                return "dead"
            if self.code in ready:
                if self.code.recv(1) != b"R":
                    return "dead"
                said_ready = True
            if said_ready and any("pid" in m for m in self.msgs):
                return "ready"
        return "hung"

    def alive(self) -> bool:
        """Still waiting for its program (checked without blocking when a ready one is taken)."""
        ready, _, _ = select.select([self.code, self.status], [], [], 0)
        if self.code in ready:  # EOF: the user process is gone
            return False
        return not (self.status in ready and (not self._read_status() or self.final()))

    def go(self, code: str, timeout_s: float) -> bool:
        """Hands over the program; False when the sandbox did not acknowledge it within ``timeout_s``."""
        try:
            self.status.sendall(b"G")
            self.code.settimeout(timeout_s)  # a stopped user process must not block the caller on a full buffer
            self.code.sendall(b"C" + code.encode("utf-8", "surrogatepass"))
            self.code.shutdown(socket.SHUT_WR)
            return self.code.recv(1) == b"A"
        except OSError:  # gone (EPIPE, reset) or silent (timeout)
            return False

    def close(self, wait_s: float = 0.0) -> None:
        """Kills what is left of it (nothing after a finished call), closes the caller's ends, releases its slot.

        ``wait_s``: wait (bounded) until the killed processes have exited, e.g. before the zygote that reaps them
        exits (its orphans would be left zombies of the container's init)."""
        if self._closed:
            return
        self._closed = True
        # The user process (pid 1 of its namespace: everything in it dies too); its monitor then reaps it and exits.
        # A zygote's monitor is killed as well (it may be the part that hangs): the zygote is a subreaper and reaps
        # both. A cold monitor is not: its user process would be left a zombie of init; reap() ends it instead.
        kill = [] if self.final() else ["pid"] + (["monitor"] if self.bootstrap is None else [])
        for key in kill:
            if key in self._pidfds:
                try:
                    signal.pidfd_send_signal(self._pidfds[key], signal.SIGKILL)
                except OSError:
                    pass  # already exited
        pending, deadline = [self._pidfds[k] for k in kill if k in self._pidfds], time.monotonic() + wait_s
        while pending and (remaining := deadline - time.monotonic()) > 0:  # a pidfd is readable once it exited
            done, _, _ = select.select(pending, [], [], remaining)
            pending = [fd for fd in pending if fd not in done]
        for pidfd in self._pidfds.values():
            os.close(pidfd)
        for fd in (self.out_r, self.err_r):
            os.close(fd)
        self.status.close()  # a monitor still waiting sees EOF and kills its user process
        self.code.close()
        if self.bootstrap is not None:
            reap(self.bootstrap)
        self._cleanup()


def reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class ReadyPool:
    """Keeps ``size`` started sandboxes waiting for a program; a background thread refills it.

    ``start_one()`` (PythonSandbox._start) starts one. An empty pool makes the caller start one itself (``take`` gives
    None): the pool only ever moves start-up earlier, it never makes a call wait for the refill. A taken sandbox is
    replaced once its call is over (``done``), not when it is taken: started at once, the replacement would take
    CPU from that very call (on 2 busy cores it cost the call most of what the pool saved).
    """

    def __init__(self, size: int, start_one, start_timeout_s: float):
        self.size, self._start, self._timeout = size, start_one, start_timeout_s
        self._ready: collections.deque[StartedSandbox] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._generation = 0  # bumped by close(): a refill thread of an older generation stops
        self._out = 0  # taken sandboxes whose calls are still running

    def start(self) -> None:
        """Starts the refill thread (done by the first ``take``, and again by the first one after ``close``)."""
        with self._cond:
            if self._thread is None and self.size:
                self._thread = threading.Thread(target=self._refill, args=(self._generation,), daemon=True,
                                                name="python-sandbox-pool")
                self._thread.start()

    def take(self) -> StartedSandbox | None:
        """A ready sandbox that is still alive, or None (the pool is empty or has size 0)."""
        if self.size == 0:
            return None
        self.start()
        dead = []
        with self._cond:
            found = None
            while self._ready and found is None:
                sb = self._ready.popleft()
                if sb.alive():
                    found = sb
                    self._out += 1
                else:
                    dead.append(sb)
            if dead:
                self._cond.notify_all()
        for sb in dead:
            log.warning("python sandbox: a ready sandbox died while waiting; replaced")
            sb.close()
        return found

    def done(self) -> None:
        """The call of a taken sandbox is over: its replacement may start."""
        with self._cond:
            self._out -= 1
            self._cond.notify_all()

    def idle(self) -> int:
        with self._cond:
            return len(self._ready)

    def _refill(self, generation: int) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                until = time.monotonic() + backoff  # the last start failed (e.g. a broken interpreter): do not spin
                while generation == self._generation and (len(self._ready) + self._out >= self.size
                                                          or time.monotonic() < until):
                    self._cond.wait(max(0.0, until - time.monotonic()) or None)
                if generation != self._generation:
                    return
            try:
                sb = self._start()
            except Exception as e:  # the call that finds the pool empty reports it to the model
                backoff = min(30.0, max(0.1, 2 * backoff))
                log.warning("python sandbox pool: could not start a sandbox (%r); again in %.1f s", e, backoff)
                continue
            state = sb.wait_ready(self._timeout)
            with self._cond:
                if state == "ready" and generation == self._generation:
                    self._ready.append(sb)
                    backoff, sb = 0.0, None
            if sb is not None:
                if state != "ready":
                    backoff = min(30.0, max(0.1, 2 * backoff))
                    log.warning("python sandbox pool: a sandbox was %s before it was ready; again in %.1f s", state,
                                backoff)
                sb.close(wait_s=2.0)  # close() may be about to stop the zygote, which reaps it

    def close(self) -> None:
        """Kills the ready sandboxes and stops the refill (a later ``take`` starts it again)."""
        with self._cond:
            self._generation += 1
            ready, self._ready = list(self._ready), collections.deque()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        for sb in ready:
            sb.close(wait_s=2.0)  # gone before the zygote, which reaps them, is closed
        if thread is not None:
            thread.join(self._timeout + 5)  # it closes the sandbox it may be starting
