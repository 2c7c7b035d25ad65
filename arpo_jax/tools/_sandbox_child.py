"""The sandbox side of the Python tool. Runs in the configured interpreter, never in the trainer.

This file is passed verbatim to ``python -I -c`` so it must use the standard library only and run on any Python
>= 3.9 (the configured interpreter may be a different environment without arpo_jax installed).

Two modes (``sys.argv[1]``):
  once    read one JSON request from stdin, run it, exit (cold start, one interpreter per call).
  zygote  preload modules, then serve requests from a unix socket: one fork per call, so every call starts
          from the same pristine, warm interpreter image and nothing leaks from one call to the next.

Per call a *monitor* process (the forked zygote, or the ``once`` process itself) enters new namespaces, forks the
*user* process, enforces the wall-clock timeout, and reports the pid and the final wait status as JSON lines
on a status socket. The user process sets limits, drops privileges and ``exec``s the code.
"""

import ctypes
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 1 << 18
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG = 38, 1
_LIBC = []


def _libc():
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _check(ret):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(req):
    """Unshares net/pid/mount namespaces in the (single-threaded) monitor. Returns the list that took effect.

    As root no user namespace is needed; otherwise a user namespace (identity-mapped, so files keep their owner)
    grants the right to create the others. Where the kernel refuses, fall back to fewer namespaces.
    """
    want = []
    if req["isolate_network"]:
        want.append("net")
    if req["isolate_processes"]:
        want.append("pid")
    attempts = [want, ["pid"] if "pid" in want else [], ["net"] if "net" in want else []]
    uid, gid = os.getuid(), os.getgid()
    for names in attempts:
        if not names:
            continue
        flags = (CLONE_NEWNET if "net" in names else 0) | (CLONE_NEWPID | CLONE_NEWNS if "pid" in names else 0)
        if uid != 0:
            flags |= CLONE_NEWUSER
        try:
            _check(_libc().unshare(flags))
        except OSError:
            continue
        if uid != 0:
            _write_file("/proc/self/setgroups", "deny")
            _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
            _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
            names = names + ["user"]
        return names
    return []


def _mount_private_proc():
    # A fresh /proc shows only this pid namespace: the code cannot read other processes' environ or cmdline.
    libc = _libc()
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None))


def _blocking_ancestor(path):
    """The first ancestor directory of ``path`` that other users may not traverse, and its child on the way."""
    parts = os.path.realpath(path).split(os.sep)[1:]
    for i in range(1, len(parts)):
        ancestor = os.sep + os.path.join(*parts[:i])
        try:
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return ancestor, parts[i]
        except OSError:
            return None
    return None


def _expose_interpreter(paths):
    """Makes the interpreter readable to the private uid when it lives under e.g. /root (mode 0700).

    In our private mount namespace a tmpfs hides the blocking directory (so its other files stay private) and
    only the children the interpreter needs are bind-mounted back in.
    """
    wanted = {}
    for path in paths:
        found = _blocking_ancestor(path) if path else None
        if found:
            wanted.setdefault(found[0], set()).add(found[1])
    libc = _libc()
    for ancestor, children in wanted.items():
        fds = {c: os.open(os.path.join(ancestor, c), os.O_PATH) for c in children}
        _check(libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m"))
        for child, fd in fds.items():
            target = os.path.join(ancestor, child)
            os.mkdir(target)
            _check(libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None))
            os.close(fd)


def _drop_capabilities():
    # In a user namespace the process holds every capability *inside* it; clear them before running code.
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc().capset(header, data))


def _set_limits(limits):
    for name, value in limits.items():
        if value is None:
            continue
        res = getattr(resource, name)
        soft, hard = resource.getrlimit(res)
        # CPU: the soft limit sends SIGXCPU, the hard limit (one second later) SIGKILL.
        new_hard = value + 1 if name == "RLIMIT_CPU" else value
        if hard != resource.RLIM_INFINITY:
            new_hard = min(new_hard, hard)
        resource.setrlimit(res, (min(value, new_hard), new_hard))


def _reseed_rngs():
    # A forked child inherits the zygote's RNG state; reseed so two calls never draw the same numbers.
    for name in ("numpy.random",):
        mod = sys.modules.get(name)
        if mod is not None:
            try:
                mod.seed()
            except Exception:
                pass


def _setup_user_process(req, out_fd, err_fd, namespaces):
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    if "pid" in namespaces:
        try:
            _mount_private_proc()
        except OSError:
            pass  # the pid namespace still reaps everything; /proc just keeps showing the host's processes
        if req.get("uid") is not None:
            _expose_interpreter([sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
                                + sys.path)
    os.closerange(3, 65536)  # the zygote's control socket, the status socket, everything else
    os.chdir(req["cwd"])
    _set_limits(req["limits"])
    _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    if req.get("uid") is not None:
        os.setgroups([])
        os.setgid(req["gid"])
        os.setuid(req["uid"])  # from root to a non-zero uid: the kernel clears all capabilities
    elif "user" in namespaces:
        _drop_capabilities()
    os.environ.clear()
    os.environ.update(req["env"])
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _reseed_rngs()
    sys.argv = ["-c"]
    sys.path.insert(0, "")  # as for `python -c`: modules written to the working directory are importable


def _run_user_code(code):
    """Executes like `python -c code`: same filename, same traceback shape, same exit codes."""
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # hide this runner's frame
        if isinstance(e, SyntaxError) and tb is None:
            traceback.print_exception(type(e), e, None, limit=0)
        else:
            traceback.print_exception(type(e), e, tb)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = status or 120
    return status


def user_process(req, out_fd, err_fd, namespaces):
    try:
        _setup_user_process(req, out_fd, err_fd, namespaces)
    except BaseException:
        os.write(2, ("sandbox setup failed: " + traceback.format_exc()).encode())
        os._exit(125)
    os._exit(_run_user_code(req["code"]) & 0xFF)


def _sweep_uid(uid):
    # Everything still running as this call's private uid is a leftover (e.g. a daemonised child): kill it all.
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # as a plain uid, -1 means "every process I may signal", i.e. that uid
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _send(sock, obj):
    try:
        sock.sendall((json.dumps(obj) + "\n").encode())
    except OSError:
        pass


def monitor(req, out_fd, err_fd, status_fd):
    """Runs one call: namespaces, fork, timeout, cleanup, status report. Never returns."""
    status_sock = socket.socket(fileno=status_fd)
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        namespaces = enter_namespaces(req)
        pid = os.fork()
        if pid == 0:
            user_process(req, out_fd, err_fd, namespaces)
        os.close(out_fd)
        os.close(err_fd)
        _send(status_sock, {"pid": pid, "namespaces": namespaces})
        status, reason = _wait(pid, status_sock, time.monotonic() + req["timeout_s"], "pid" in namespaces)
        if "pid" not in namespaces:  # (with one, the kernel killed every descendant when pid 1 exited)
            try:
                os.killpg(pid, signal.SIGKILL)  # grandchildren left in its process group
            except OSError:
                pass
            if req.get("uid") is not None:
                _sweep_uid(req["uid"])  # daemonised grandchildren that left the process group
        _send(status_sock, {"status": status, "reason": reason})
    except BaseException:
        _send(status_sock, {"error": traceback.format_exc()})
        code = 1
    os._exit(code)


def _pidfd(pid):
    try:
        return os.pidfd_open(pid)  # readable once the process exits (Linux >= 5.3, Python >= 3.9)
    except (AttributeError, OSError):
        return None  # fall back to polling


def _kill_tree(pid, pid_namespace):
    # Killing pid 1 of a pid namespace kills every process in it; otherwise kill the process group too.
    kills = [os.kill] if pid_namespace else [os.kill, os.killpg]
    for kill in kills:
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _wait(pid, status_sock, deadline, pid_namespace):
    """Waits for the user process; kills it on timeout or when the caller asks (b"K") or goes away (EOF)."""
    pidfd = _pidfd(pid)
    reason = None
    while reason is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        fds = [status_sock] + ([pidfd] if pidfd is not None else [])
        ready, _, _ = select.select(fds, [], [], remaining if pidfd is not None else min(remaining, 0.02))
        if status_sock in ready:
            reason = "killed" if status_sock.recv(16) else "caller_gone"
    _kill_tree(pid, pid_namespace)
    _, status = os.waitpid(pid, 0)
    return status, reason


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def zygote(ctrl_fd, preload):
    ctrl = socket.socket(fileno=ctrl_fd)
    for name in filter(None, preload.split(",")):
        try:
            __import__(name)
        except Exception:
            pass  # a missing optional module only costs the user code its import time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    ctrl.sendall(b"R")
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(ctrl, 4, 3)
            if not header:
                break
            (size,) = struct.unpack("!I", header + _recv_exact(ctrl, 4 - len(header)))
            req = json.loads(_recv_exact(ctrl, size))
        except (EOFError, OSError):
            break
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            monitor(req, *fds)
        for fd in fds:
            os.close(fd)
    os._exit(0)


def main():
    if sys.argv[1] == "zygote":
        zygote(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
    else:
        req = json.loads(sys.stdin.read())
        monitor(req, *req["fds"])


if __name__ == "__main__":
    main()
