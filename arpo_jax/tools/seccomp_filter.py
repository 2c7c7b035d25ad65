"""The Python sandbox's seccomp filter, compiled to classic BPF with the system's libseccomp (via ctypes).

Why libseccomp through ctypes: it is the only option that works for *any* sandbox interpreter. The filter is
compiled here, in the trainer, and the BPF program travels to the sandbox in the call's request, where
``_sandbox_child.py`` (standard library only, possibly another Python environment) installs it with one
``prctl``. Debian's ``python3-seccomp`` binds only the system Python; ``pyseccomp`` (PyPI, last release 2021) is a
ctypes wrapper over the same ``libseccomp.so.2`` and would add a dependency without adding anything.
``libseccomp.so.2`` ships with every Debian/Ubuntu system (``apt`` depends on it; package ``libseccomp2``) and
with the other major distributions (``libseccomp``). libseccomp knows each architecture's syscall numbers and
makes the filter kill a process that switches ABI (i386 ``int 0x80``, x32), which a hand-written filter would
have to get right itself.

Denied (``EPERM``): new namespaces (``unshare``, ``setns``, ``clone`` with a namespace flag; ``clone3`` gets
``ENOSYS`` so that libc falls back to ``clone``, whose flags a filter can read), every mount call, ``chroot``,
``ptrace`` and cross-process memory access, ``bpf``, ``perf_event_open``, the kernel keyring, ``userfaultfd``,
``io_uring``, ``open_by_handle_at`` and kernel-module / kexec / reboot calls. Everything else is allowed.
"""

import ctypes
import errno
import functools
import os

# Bits of clone()'s first argument that create namespaces (x86_64 and aarch64 pass the flags first).
CLONE_NAMESPACE_FLAGS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x2000000,
                         "CLONE_NEWUTS": 0x4000000, "CLONE_NEWIPC": 0x8000000, "CLONE_NEWUSER": 0x10000000,
                         "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev",
          "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "lookup_dcookie", "open_by_handle_at")
LIBSECCOMP = "libseccomp.so.2"
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7


def _act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused to build the filter (the message says what to install)."""


def _load_libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(LIBSECCOMP, use_errno=True)
    except OSError as e:
        raise SeccompUnavailable(
            f"the seccomp filter needs the system library libseccomp.so.2 ({e}); install it (Debian/Ubuntu: "
            "apt-get install libseccomp2; Fedora/RHEL: dnf install libseccomp)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def sandbox_filter_bpf() -> bytes:
    """The filter as ``struct sock_filter[]`` bytes for ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``.

    Raises ``SeccompUnavailable`` with a clear message when libseccomp is missing or fails.
    """
    lib = _load_libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def add(name: str, action: int, *cmps: _ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # a syscall this architecture does not have (e.g. an old one on aarch64)
                return
            arr = (_ArgCmp * max(len(cmps), 1))(*cmps)
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")

        for name in DENIED:
            add(name, _act_errno(errno.EPERM))
        add("clone3", _act_errno(errno.ENOSYS))  # its flags sit in memory a filter cannot read
        for flag in CLONE_NAMESPACE_FLAGS.values():
            add("clone", _act_errno(errno.EPERM), _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        fd = os.memfd_create("arpo_seccomp")  # a file, so a large program cannot block a pipe
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            bpf = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    if not bpf or len(bpf) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed filter ({len(bpf)} bytes)")
    return bpf
