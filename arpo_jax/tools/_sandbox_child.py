"""The sandbox side of the Python tool. Runs in the configured interpreter, never in the trainer.

This file is passed verbatim to ``python -I -c`` so it must use the standard library only and run on any Python
>= 3.9 (the configured interpreter may be a different environment without arpo_jax installed).

Two modes (``sys.argv[1]``):
  once    read one JSON request from stdin, serve it, exit (cold start, one interpreter per sandbox).
  zygote  preload modules, then serve requests from a unix socket: one fork per sandbox, so every sandbox starts
          from the same pristine, warm interpreter image and nothing leaks from one call to the next.

Per sandbox a *monitor* process (the forked zygote, or the ``once`` process itself) enters new namespaces, forks
the *user* process, enforces the wall-clock timeout, and reports the pids and the final wait status as JSON lines
on a status socket. The user process builds the call's filesystem view (a fresh root: read-only system and
interpreter directories, a private size-capped tmpfs for /tmp, /var/tmp and /dev/shm, nothing else), sets
limits, drops privileges, installs the seccomp filter compiled by the trainer, then says ``R`` on its code socket
and waits for its one program (so that all of this can happen before the call: ``sandbox_pool.py``). The caller
sends ``G`` to the monitor (the timeout starts) and ``C<program>`` + EOF on the code socket; the user process
answers ``A``, closes the socket and runs the program. EOF without a program (a ready sandbox discarded) exits.
"""

import ctypes
import io
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

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x1000, 0x2000, 0x4000, 1 << 18
# Flags a bind mount keeps when remounted read-only (the kernel refuses to clear the ones it locked).
MS_KEEP = 8 | 1024 | 2048 | 4096  # NOEXEC, NOATIME, NODIRATIME, RELATIME (same values as os.ST_*)
PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 1, 22, 2
PR_SET_CHILD_SUBREAPER = 36
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # merged-usr: symlinks
DEVICES = ("null", "zero", "full", "random", "urandom")
VIEW_ROOT = "/tmp"  # where the new root is assembled; any directory works, the mount is private to the call
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
    """Unshares net/pid/mount/IPC namespaces in the (single-threaded) monitor. Returns the list that took effect.

    The IPC namespace dies with the call, and with it any System V shared memory, semaphores or message queues
    (which otherwise outlive their creator) and POSIX message queues the code created.

    As root no user namespace is needed; otherwise a user namespace (identity-mapped, so files keep their owner)
    grants the right to create the others. Where the kernel refuses, fall back to fewer namespaces (the trainer's
    start-up probe reports what is missing).
    """
    want = [name for name, on in (("net", req["isolate_network"]), ("pid", req["isolate_processes"]),
                                  ("mnt", req["isolate_processes"]), ("ipc", req["isolate_processes"])) if on]
    attempts = [want, [n for n in want if n != "net"], ["net"] if "net" in want else []]
    uid, gid = os.getuid(), os.getgid()
    bits = {"net": CLONE_NEWNET, "pid": CLONE_NEWPID, "mnt": CLONE_NEWNS, "ipc": CLONE_NEWIPC}
    for names in attempts:
        if not names:
            continue
        flags = sum(bits[n] for n in names) | (CLONE_NEWUSER if uid != 0 else 0)
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


def _mount(source, target, fstype, flags, data=None):
    enc = lambda v: v.encode() if isinstance(v, str) else v  # noqa: E731
    try:
        _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))
    except OSError as e:
        raise OSError(e.errno, f"mount {fstype or source} on {target}: {e.strerror}") from None


def _under(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _bind_read_only(fd, target):
    # A bind mount takes the source's flags; remounting adds read-only (keeping the flags the kernel locked).
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    keep = os.statvfs(target).f_flag & MS_KEEP
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def exposed_paths(req):
    """What the code may read: system directories, the interpreter's prefixes and import path, ``expose``.

    An import-path entry inside a hidden path (e.g. an old-style editable install of the project) is left out
    unless it belongs to an interpreter prefix (a virtualenv inside the project tree is the interpreter).
    """
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)]
    hidden = req["hide"]
    candidates = [p for p in SYSTEM_DIRS if not os.path.islink(p)] + list(req["expose"])
    for path in prefixes:
        candidates += [os.path.abspath(path), os.path.realpath(path)]
    for path in sys.path:
        if not path:
            continue
        for p in {os.path.abspath(path), os.path.realpath(path)}:
            if not any(_under(p, h) or _under(h, p) for h in hidden) or any(_under(p, q) for q in prefixes):
                candidates.append(p)
    found = []
    for p in sorted(set(candidates), key=len):  # parents first: a path inside an exposed one adds nothing
        if os.path.exists(p) and p != "/" and not any(_under(p, q) for q in found):
            found.append(p)
    return found


def build_view(req, namespaces):
    """Makes a fresh tmpfs holding only what the code needs this call's root (``MS_MOVE`` onto / + ``chroot``).

    Read-only: SYSTEM_DIRS, the interpreter and ``expose``. Hidden paths under them are covered. Writable: one
    private tmpfs of ``tmp_size_mb`` behind /tmp, /var/tmp and /dev/shm, which goes away with the call.
    Devices: null, zero, full, random, urandom. /proc: a fresh one for the call's pid namespace (required).

    The old root stays mounted *underneath* the new one (no unmount: each costs an RCU grace period, ~2 ms), out
    of reach: no path leads there, the code holds no descriptor into it, and ``chroot`` is denied by seccomp
    (and needs CAP_SYS_CHROOT, which the code lacks).
    """
    if "mnt" not in namespaces or "pid" not in namespaces:  # the host's /proc/<pid>/root would lead out
        raise OSError("no mount or pid namespace: the kernel refused it, so the filesystem view cannot be built")
    expose = _exposed_paths_cached(req)
    # Opened before anything is mounted over VIEW_ROOT, which could shadow an interpreter living below it.
    fds = {p: (os.open(p, os.O_PATH), os.path.isdir(p)) for p in expose}
    dev_fds = {d: os.open("/dev/" + d, os.O_PATH) for d in DEVICES}
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # The private tmpfs first (one superblock, so its size cap bounds /tmp + /var/tmp + /dev/shm together; tmpfs
    # pages are RAM), then the new root inside it as a separate small tmpfs: the stage is left behind in the old
    # root when the new root moves onto /.
    stage, root = VIEW_ROOT, VIEW_ROOT + "/root"
    size = req["tmp_size_mb"]
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={size}m,nr_inodes={max(1024, 256 * size)}")
    for sub in ("tmp", "var_tmp", "shm", "root"):
        os.mkdir(f"{stage}/{sub}")
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    for p in SYSTEM_DIRS:
        if os.path.islink(p):
            os.symlink(os.readlink(p), root + p)
    for d in ("/dev", "/var", "/var/tmp", "/tmp", "/proc"):
        os.mkdir(root + d)
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    os.mkdir(root + "/dev/shm")
    for d, fd in dev_fds.items():
        os.close(os.open(f"{root}/dev/{d}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(f"/proc/self/fd/{fd}", f"{root}/dev/{d}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for sub, target in (("tmp", "/tmp"), ("var_tmp", "/var/tmp"), ("shm", "/dev/shm")):
        os.chmod(f"{stage}/{sub}", 0o1777)
        _mount(f"{stage}/{sub}", root + target, None, MS_BIND)
    _mount(None, root + "/dev", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.mkdir(root + req["cwd"], 0o700)  # the working directory, on the private tmpfs
    if req.get("uid") is not None:
        os.chown(root + req["cwd"], req["uid"], req["gid"])
    # After the private /tmp, so that an interpreter living under /tmp stays visible.
    for p, (fd, is_dir) in fds.items():
        target = root + p
        if is_dir:
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _bind_read_only(fd, target)
        os.close(fd)
    for h in req["hide"]:  # hidden paths that an exposed directory contains
        target = root + h
        if any(_under(h, p) and h != p for p in expose) and os.path.lexists(target):
            if os.path.isdir(target):
                _mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0")
            else:
                _mount(f"/proc/self/fd/{dev_fds['null']}", target, None, MS_BIND)
    for fd in dev_fds.values():
        os.close(fd)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _mount(".", "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


_EXPOSED = {}


def _exposed_paths_cached(req):
    # The zygote's import path does not change between calls: compute it once per (expose, hide).
    key = (tuple(req["expose"]), tuple(req["hide"]))
    if key not in _EXPOSED:
        _EXPOSED[key] = exposed_paths(req)
    return _EXPOSED[key]


def install_seccomp(bpf):
    """Installs the trainer-compiled filter (``struct sock_filter[]`` bytes); needs PR_SET_NO_NEW_PRIVS."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    try:
        _check(_libc().prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                             ctypes.c_ulong(0), ctypes.c_ulong(0)))
    except OSError as e:
        raise OSError(e.errno, f"installing the seccomp filter: {e.strerror}") from None


def _unbuffered_stdio():
    # Like `python -u` (the zygote's -I ignores PYTHONUNBUFFERED): output printed before a kill is not lost.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)


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


def _setup_user_process(req, out_fd, err_fd, code_fd, namespaces):
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    if req["isolate_filesystem"]:
        build_view(req, namespaces)  # failing is fatal for the call: never run with less than was asked for
    elif "pid" in namespaces:
        try:
            _mount_private_proc()
        except OSError:
            pass  # the pid namespace still reaps everything; /proc just keeps showing the host's processes
        if req.get("uid") is not None:
            _expose_interpreter([sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
                                + sys.path)
    os.dup2(code_fd, 3)  # the code socket, closed before the program runs
    os.closerange(4, 65536)  # the zygote's control socket, the status socket, everything else
    os.chdir(req["cwd"])
    _set_limits(req["limits"])
    _check(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    if req.get("uid") is not None:
        os.setgroups([])
        os.setgid(req["gid"])
        os.setuid(req["uid"])  # from root to a non-zero uid: the kernel clears all capabilities
    elif "user" in namespaces:
        _drop_capabilities()
    if req.get("seccomp_bpf"):
        install_seccomp(bytes.fromhex(req["seccomp_bpf"]))
    os.environ.clear()
    os.environ.update(req["env"])
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _reseed_rngs()
    _unbuffered_stdio()
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


def _receive_program(fd):
    """Says ready, reads the one program (``C`` + UTF-8 up to EOF), acknowledges it; None if discarded unused."""
    sock = socket.socket(fileno=fd)
    sock.sendall(b"R")
    chunks = []
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    data = b"".join(chunks)
    if not data.startswith(b"C"):
        return None
    sock.sendall(b"A")
    sock.close()  # the program never holds a descriptor back to the trainer
    return data[1:].decode("utf-8", "surrogatepass")


def user_process(req, out_fd, err_fd, code_fd, namespaces):
    try:
        _setup_user_process(req, out_fd, err_fd, code_fd, namespaces)
    except BaseException:
        os.write(2, ("sandbox setup failed: " + traceback.format_exc()).encode())
        os._exit(125)
    try:
        code = _receive_program(3)
    except OSError:
        code = None  # the caller went away
    if code is None:
        os._exit(0)
    os._exit(_run_user_code(code) & 0xFF)


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


def monitor(req, out_fd, err_fd, status_fd, code_fd):
    """Runs one sandbox: namespaces, fork, wait for the go, timeout, cleanup, status report. Never returns."""
    status_sock = socket.socket(fileno=status_fd)
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        namespaces = enter_namespaces(req)
        pid = os.fork()
        if pid == 0:
            user_process(req, out_fd, err_fd, code_fd, namespaces)
        for fd in (out_fd, err_fd, code_fd):
            os.close(fd)
        _send(status_sock, {"pid": pid, "monitor": os.getpid(), "namespaces": namespaces})
        status, reason = _wait(pid, status_sock, req["timeout_s"], "pid" in namespaces)
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


def _wait(pid, status_sock, timeout_s, pid_namespace):
    """Waits for the user process; kills it on timeout or when the caller asks (b"K") or goes away (EOF).

    The timeout starts at the caller's b"G" (the program is on its way): a ready sandbox may wait for a call long.
    """
    pidfd = _pidfd(pid)
    reason, deadline = None, None
    while reason is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, None
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            reason = "timeout"
            break
        fds = [status_sock] + ([pidfd] if pidfd is not None else [])
        poll = 0.02 if remaining is None else min(remaining, 0.02)
        ready, _, _ = select.select(fds, [], [], remaining if pidfd is not None else poll)
        if status_sock in ready:
            data = status_sock.recv(16)
            if deadline is None and data.startswith(b"G"):
                deadline, data = time.monotonic() + timeout_s, data[1:]
                if not data:
                    continue
            reason = "killed" if data else "caller_gone"
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
    # A user process whose monitor died (killed while its sandbox waited in the pool) is adopted here and reaped
    # the same way, not left a zombie of the container's init.
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    ctrl.sendall(b"R")
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(ctrl, 4, 4)
            if not header:
                break
            (size,) = struct.unpack("!I", header + _recv_exact(ctrl, 4 - len(header)))
            req = json.loads(_recv_exact(ctrl, size))
        except (EOFError, OSError):
            break
        if req["isolate_filesystem"]:
            try:
                _exposed_paths_cached(req)  # once, here: every later fork inherits the result
            except OSError:
                pass  # the call itself will report it
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
