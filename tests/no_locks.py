"""Runs a Python command on a "file system without locks": Lustre mounted without `flock` or NFS without lockd
answer every lock request with an error, and so does the kernel here, for this process and its children, through a
seccomp filter that returns ENOLCK for the lock requests of fcntl (F_SETLK, F_SETLKW and their OFD forms) and for
flock(2). Nothing else changes: the files are still created, read and written.

Usage: python tests/no_locks.py -m MODULE [ARGS...] | -c CODE [ARGS...]   (as `python -m` / `python -c`)
"""

import ctypes
import errno
import runpy
import sys

from arpo_jax.tools.seccomp_filter import _SCMP_ACT_ALLOW, _act_errno, _ArgCmp, _load_libseccomp

_SCMP_CMP_EQ = 4
_LOCK_COMMANDS = (6, 7, 37, 38)  # F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW (asm-generic/fcntl.h)


def refuse_locks() -> None:
    lib = _load_libseccomp()
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    try:
        for cmd in _LOCK_COMMANDS:
            rule = (_ArgCmp * 1)(_ArgCmp(1, _SCMP_CMP_EQ, cmd, 0))
            assert lib.seccomp_rule_add_array(ctx, _act_errno(errno.ENOLCK),
                                              lib.seccomp_syscall_resolve_name(b"fcntl"), 1, rule) == 0
        assert lib.seccomp_rule_add_array(ctx, _act_errno(errno.ENOLCK), lib.seccomp_syscall_resolve_name(b"flock"),
                                          0, (_ArgCmp * 1)()) == 0
        assert lib.seccomp_load(ctx) == 0  # sets no_new_privs first (libseccomp's default)
    finally:
        lib.seccomp_release(ctx)


if __name__ == "__main__":
    assert sys.argv[1] in ("-m", "-c"), __doc__
    refuse_locks()
    mode, target, sys.argv = sys.argv[1], sys.argv[2], [sys.argv[2], *sys.argv[3:]]
    if mode == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv[0] = "-c"
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
