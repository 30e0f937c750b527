"""Namespaces per action: a pid namespace with a private /proc, in a private mount namespace (and, for a non-root
user, a user namespace owning both), so an action sees only its own processes and everything it starts dies with it.

How run_isolated (worker.py) uses them. As root (CAP_SYS_ADMIN), the worker itself unshares a pid namespace for its
next child only (`pid_ns_for_children`; threads allowed, the worker stays where it is) and takes it back after the fork
(`own_pid_ns`): its child is straight away pid 1 of the action's namespace. Otherwise (a non-root user needs a user
namespace, which a threaded process may not enter and the worker must not) the worker's child calls `enter` (its next
child is pid 1) and forks it. Either way pid 1, the namespace's init (it runs no model code), makes its own mount
namespace (`enter_mounts`, when `enter` did not), mounts a fresh /proc (`private_proc`) and /dev/shm (`private_shm`),
makes the sandbox's read-only sibling a read-only bind mount (`read_only_bind`) and enters a network namespace of its
own (`private_net`: no interface but a down loopback), then forks the action's process (pid 2). When the action's process ends, the init exits and the kernel kills every process left in the namespace (a
double-forked daemon, one that cleared its parent-death signal or left the session: none escapes).

Only stdlib and ctypes: a kernel or container that refuses namespaces (EPERM, ENOSPC, a seccomp filter) makes each
call return why, and the action runs as before, its log saying so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
# statvfs flags (ST_*) that a read-only remount of a bind mount must keep (a user namespace may not clear flags the
# original mount has: they are locked) -> the mount(2) flag of the same meaning.
_KEEP = {2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 16: 16, 64: 64, 1024: 1024, 2048: 2048, 4096: 1 << 21}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _err(what: str) -> str:
    return f"{what}: {os.strerror(ctypes.get_errno())}"


def write_once(path: str, text: str) -> None:
    """`text` written in one write(2) (a /proc map, a cgroup file: each takes one write whole)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter() -> str | None:
    """unshare(2) this process's next children into a new pid namespace, with a new mount namespace (and a new user
    namespace mapping this uid and gid to themselves, when not root or when root may not do it alone). Call in a
    single-threaded, dumpable process (the maps are written through its own /proc). None when done, else why not."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    tries = [CLONE_NEWPID | CLONE_NEWNS] if uid == 0 else []
    tries.append(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS)
    why = ""
    for flags in tries:
        if libc.unshare(ctypes.c_int(flags)) != 0:
            why = _err("unshare")
            continue
        if flags & CLONE_NEWUSER:
            try:
                write_once("/proc/self/setgroups", "deny")
                write_once("/proc/self/uid_map", f"{uid} {uid} 1\n")
                write_once("/proc/self/gid_map", f"{gid} {gid} 1\n")
            except OSError as e:
                return f"user namespace maps: {e.strerror}"
        return None
    return why or "unshare: not available"


_OWN_PID_NS: list[int] = []  # a descriptor of this process's own pid namespace, opened once (close-on-exec)
_NO_PID_NS: list[str] = []  # why pid_ns_for_children was refused (not tried again in this process)


def pid_ns_for_children() -> str | None:
    """unshare(2) CLONE_NEWPID alone, in the calling thread: its next child is pid 1 of a new pid namespace, while
    this process stays in its own (a threaded process may do it: unlike a user namespace's, its unshare moves no one).
    Needs CAP_SYS_ADMIN (root); call own_pid_ns right after the fork. None when done, else why not (remembered)."""
    if _NO_PID_NS:
        return _NO_PID_NS[0]
    try:
        if not _OWN_PID_NS:
            _OWN_PID_NS.append(os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        _NO_PID_NS.append(f"/proc/self/ns/pid: {e.strerror}")
        return _NO_PID_NS[0]
    if _libc().unshare(ctypes.c_int(CLONE_NEWPID)) != 0:
        _NO_PID_NS.append(_err("unshare"))
        return _NO_PID_NS[0]
    return None


def own_pid_ns() -> str | None:
    """Undo pid_ns_for_children (setns(2) to this process's own pid namespace, which a process may always re-enter):
    its next children are in its own pid namespace again. None when done, else why not."""
    if _libc().setns(_OWN_PID_NS[0], ctypes.c_int(CLONE_NEWPID)) != 0:
        return _err("setns")
    return None


def enter_mounts() -> str | None:
    """unshare(2) a new mount namespace for this (single-threaded) process, the init of a pid namespace made by
    pid_ns_for_children: what private_proc and the others mount is seen in it only. None when done, else why not
    (then nothing may be mounted: it would be the machine's mount table)."""
    if _libc().unshare(ctypes.c_int(CLONE_NEWNS)) != 0:
        return _err("unshare (mount namespace)")
    return None


def private_net() -> str | None:
    """In the pid namespace's init, before it forks the action: a network namespace of its own (a loopback that is
    down, no other interface), so the action reaches no host, port or abstract Unix socket, and its /proc/net shows no
    socket of the machine's (~5 ms per action). None when done, else why not (the machine's network stays)."""
    if _libc().unshare(ctypes.c_int(CLONE_NEWNET)) != 0:
        return _err("unshare (network namespace)")
    return None


def private_proc() -> str | None:
    """In the pid namespace's init: mounts made private (nothing done here reaches the machine's mount table), then a
    fresh /proc showing this namespace's processes only. None when done, else why not (the machine's /proc stays)."""
    libc = _libc()
    if libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) != 0:
        return _err("making mounts private")
    if libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), None) != 0:
        return _err("mounting a private /proc")
    return None


def private_shm(path: str = "/dev/shm") -> str | None:
    """In the init, after private_proc: a fresh tmpfs on `path` (POSIX shared memory, semaphores), seen by this
    namespace only and gone with it: nothing an action leaves there reaches another action or outlives it (the
    machine's /dev/shm is one directory every action could write). None when done or there is none, else why not."""
    if not os.path.isdir(path):
        return None
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
                     b"mode=1777") != 0:
        return _err(f"mounting a private {path}")
    return None


def read_only_bind(path: str) -> str | None:
    """`path` bind-mounted on itself read-only, in this (private) mount namespace: writing, truncating, chmod, chown,
    utime and setxattr of the files under it fail with EROFS for every process of the namespace, whatever their
    rights. None when done, else why not."""
    libc = _libc()
    p = os.fsencode(path)
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"read-only bind mount of {path}: {e.strerror}"
    keep = 0
    for bit, flag in _KEEP.items():
        if st.f_flag & bit:
            keep |= flag
    if libc.mount(p, p, None, ctypes.c_ulong(_MS_BIND | _MS_REC), None) != 0:
        return _err(f"bind mount of {path}")
    if libc.mount(None, p, None, ctypes.c_ulong(_MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep), None) != 0:
        return _err(f"read-only remount of {path}")
    return None


def status_code(status: int) -> int:
    """What the namespace's init exits with for its child's wait status: its exit code, or 128 + the signal that
    killed it (the init, pid 1 of its namespace, cannot re-raise a signal on itself: `reraise` does, outside, or
    the worker decodes it, signal_of)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70


def init_wait(child: int) -> int:
    """The namespace's init: reap every process that ends (orphans are re-parented here) until `child` (the action's
    process) has; returns the code to exit with (status_code). Exiting then kills the rest of the namespace."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 70
        except InterruptedError:
            continue
        if pid == child:
            return status_code(status)


def signal_of(code: int) -> int:
    """The signal an init's exit code (status_code) says the action's process died of (a code above 128 naming a
    signal, but the stop signals), else 0."""
    import signal

    sig = code - 128 if code > 128 else 0
    if sig and sig in {s.value for s in signal.Signals} and sig not in (signal.SIGSTOP, signal.SIGTSTP,
                                                                      signal.SIGTTIN, signal.SIGTTOU):
        return sig
    return 0


def reraise(code: int) -> None:
    """Outside the namespace, end this process as the action's process ended: a code above 128 naming a signal is
    that signal, raised on this process (so the worker's wait status says 'killed by SIGKILL' for the OOM killer);
    else exit with `code`. Never returns."""
    import signal

    sig = signal_of(code)
    if sig:
        for step in (lambda: signal.signal(sig, signal.SIG_DFL),  # (refused for SIGKILL: needed by none)
                     lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig}), lambda: os.kill(os.getpid(), sig)):
            with contextlib.suppress(OSError, ValueError):
                step()
    os._exit(code)
