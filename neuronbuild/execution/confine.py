"""What an action's process may read and write: the sandbox, its temp dirs and the installed toolchain, nothing else.

Applied in the per-action child a worker forks (worker.py), never in the worker itself, since neither mechanism can be
undone in a process:
- Landlock (Linux >= 5.13, unprivileged, via ctypes): the kernel refuses every other open for reading or writing,
  every create/remove/rename elsewhere, for the action's process and every process it starts (g++, neuronx-cc),
  whatever the language. Where the kernel lacks it (or a seccomp filter hides it) the audit hook alone applies.
- a `sys.addaudithook` hook: the same rules for Python-level opens (`open`, `os.open`, pathlib, `io`) and file-system
  calls (`os.rename/replace/remove/rmdir/mkdir/symlink/link/truncate/chmod/utime`, `shutil`), raising a
  PermissionError whose message names the path and says how to declare it. It also records the first violation, so
  an action whose code caught the exception still fails. Alone, it does not see C extensions or subprocesses.

Sockets and signals: Landlock's TCP rules (ABI >= 4) refuse TCP bind/connect, its scoping (ABI >= 6) refuses
signals to processes outside the action's domain and abstract Unix sockets made outside it, and a seccomp filter
refuses new sockets of every family but netlink (Unix, IP, vsock, ...) and io_uring (so no connect() to the build server's socket, a path).

Other processes' /proc files (environ, maps, mem, fd): Landlock's ptrace scoping refuses them for a non-root action;
a root action first drops every capability (drop_capabilities), without which Landlock did not refuse them.

Reads are allowed under the sandbox (which holds the action's own TMPDIR and HOME), the Python installation (prefixes, sys.path,
site-packages), neuronbuild itself, plug-in paths, PATH dirs and what the step's toolchain declares (step_dirs: e.g. a
configured neuronx-cc's install, inductor's precompiled headers), /usr, /lib*, /dev,
/proc and /sys (and, for the kernel rules only, /bin and /etc but its secrets (ETC_SECRETS: shadow, sudoers, host and
TLS keys, ...), which libc and compilers read); writes only under the
sandbox (with its TMPDIR and HOME), the toolchain's declared scratch dirs, the action's log and /dev. The workers'
shared TMPDIR and HOME are neither. Its pid and mount namespaces: confine_ns.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronbuild import envvars

# Of /dev, the nodes actions use (libc, Python, compilers, multiprocessing's semaphores in /dev/shm), read and written
# by rules of their own: never all of /dev, where an action running as root (it owns the nodes, so no capability is
# needed) would read and write the machine's block devices (every file on its disks, past every rule), open /dev/kvm
# or a console's screen (/dev/vcs), and create or remove entries of the machine's /dev (its /dev/null).
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/shm")
# Links in /dev to the process's own descriptors (/proc/self/fd): Python code may name them (the kernel rules apply
# to what they resolve to).
DEV_LINKS = ("/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr")
# Directories every process may read (interpreter, compilers, libc): the kernel rules' read set beyond the policy's.
# /etc is added entry by entry (etc_read()): all but the secrets.
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", *DEV_NODES, "/proc", "/sys")
# Entries of /etc that hold secrets (password hashes, sudo rules, host keys, TLS private keys, keytabs, VPN and Wi-Fi
# credentials): the kernel rules leave them out; everything else in /etc stays readable (libc, compilers, locales).
ETC_SECRETS = frozenset({
    "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "security", "krb5.keytab", "credstore",
    "credstore.encrypted", "wireguard", "NetworkManager", "ppp", "openvpn", "ipsec.secrets", "ipsec.d", "docker",
    "libvirt", "polkit-1", "audit", "ssh", "ssl", "pki"})
# Of those, directories whose other entries stay readable (client config, CA certificates): without these entries.
ETC_PARTLY = {"ssh": lambda n: "key" not in n, "ssl": lambda n: n != "private", "pki": lambda n: "private" not in n}
# What Python code may read beyond the policy (the audit hook): no /etc, /bin, /sbin: model code has no business there.
PY_SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", *DEV_NODES, *DEV_LINKS, "/proc", "/sys")
SYSTEM_WRITE = tuple(d for d in DEV_NODES if d not in ("/dev/random", "/dev/urandom"))

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True)
class Policy:
    """Absolute, symlink-resolved directory roots an action may read and write (writes imply reads)."""

    read: tuple[str, ...]
    write: tuple[str, ...]

    def may_read(self, path: str) -> bool:
        return _under(path, self.read) or _under(path, self.write)

    def may_write(self, path: str) -> bool:
        return _under(path, self.write)


class Violation(PermissionError):
    """An action's code touched a path its confinement does not allow."""


def _under(path: str, roots: Iterable[str]) -> bool:
    for r in roots:
        if path == r or path.startswith(r if r.endswith("/") else r + "/"):
            return True
    return False


def _real(p: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(p))


def _dedup(paths: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for p in paths:
        if p and p not in out:
            out.append(p)
    return tuple(out)


def installation_roots() -> tuple[str, ...]:
    """The Python installation a worker runs (prefixes, sys.path dirs, site-packages) and neuronbuild itself; computed
    in the worker before any action, so nothing an action adds to sys.path is in it."""
    import site

    import neuronbuild

    roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    pkg_parent = str(Path(neuronbuild.__file__).resolve().parent.parent)
    roots.append(str(Path(neuronbuild.__file__).resolve().parent))
    for p in sys.path:
        # '' is the cwd; the package parent is the checkout neuronbuild runs from (it may hold workspaces): only
        # the package dir itself above.
        if p and os.path.isabs(p) and os.path.isdir(p) and _real(p) != pkg_parent:
            roots.append(p)
    with contextlib.suppress(Exception):
        roots += site.getsitepackages()
    for d in envvars.current().words("NEURONBUILD_PLUGIN_PATH"):
        if d and os.path.isabs(d):
            roots.append(d)
    return _dedup(_real(r) for r in roots if os.path.exists(r))


def toolchain_roots(env: Mapping[str, str], spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Tools an action may run: PATH dirs (and their installations). What else a toolchain's step reads (e.g. a
    configured compiler's installation) comes from its `step_dirs`."""
    roots = [d for d in env.get("PATH", "").split(os.pathsep) if d and os.path.isabs(d) and os.path.isdir(d)]
    # A tool in <prefix>/bin (or a pyenv shim) reads its installation: the prefix, unless that is / or a home dir.
    homes = {"/", _real(os.path.expanduser("~"))}
    with contextlib.suppress(Exception):
        import pwd

        homes.add(_real(pwd.getpwuid(os.getuid()).pw_dir))
    for d in list(roots):
        parent = os.path.dirname(_real(d))
        if os.path.basename(_real(d)) in ("bin", "sbin", "shims") and parent not in homes:
            roots.append(parent)
    return _dedup(_real(r) for r in roots)


def policy_for(inputs: str, outputs: str, env: Mapping[str, str], spec: Mapping[str, Any],
               installation: tuple[str, ...], extra_write: Iterable[str] = (), extra_read: Iterable[str] = ()) -> Policy:
    """The policy of one action: its sandbox (the inputs' and outputs' common parent, which holds the action's own
    $HOME and $TMPDIR: execution/sandbox.private_dirs) and `extra_write` writable; the installation, toolchain and
    `extra_read` (precompiled headers) readable. The machine's shared TMPDIR and HOME of `env` (the workers') are
    neither: nothing one action writes there could be read by another."""
    ins, outs = Path(_real(inputs)), Path(_real(outputs))
    sandbox = [str(ins.parent)] if ins.parent == outs.parent else [str(ins), str(outs)]
    writable = sandbox + [_real(p) for p in extra_write]
    readable = [*installation, *toolchain_roots(env, spec), *(_real(p) for p in extra_read)]
    return Policy(read=_dedup(readable), write=_dedup(writable))


def readable_by_actions(path: str | os.PathLike[str], env: Mapping[str, str], extra: Iterable[str] = ()) -> str | None:
    """The root under which an action could read `path` (the installation, PATH tools, system dirs, /etc but its
    secrets, the action environment's TMPDIR and HOME, `extra`), or None: for files actions must never read (a key
    records or releases are signed with), checked in the build process before any action runs."""
    p = _real(path)
    cwd = _real(os.getcwd())  # (on this process's sys.path under `python -m`; workers start with -P: not theirs)
    roots = [*(r for r in installation_roots() if r != cwd), *toolchain_roots(env, {}), *SYSTEM_READ,
             *(_real(env[k]) for k in ("TMPDIR", "HOME") if env.get(k)), *(_real(x) for x in extra)]
    for r in roots:
        if _under(p, (r,)):
            return r
    return "/etc" if _under(p, etc_read()) else None


# ----------------------------------------------------------------------------------------------------- audit hook
_violations: list[str] = []


def first_violation() -> str | None:
    return _violations[0] if _violations else None


def _message(op: str, path: str, write: bool) -> str:
    if write:
        return (f"the action {op} {path!r}, outside its sandbox and temp dirs: actions may write only their "
                "outputs, the sandbox and $TMPDIR (model code is confined; nothing was cached)")
    return (f"the action read {path!r}, which is not among its declared inputs (the sandbox holds only those): "
            "declare it in the neuron_model's `data` (non-Python files) or `srcs`/`deps` (Python)")


def _is_write_open(mode: Any, flags: Any) -> bool:
    if isinstance(flags, int) and flags & _WRITE_FLAGS:
        return True
    return isinstance(mode, str) and any(c in mode for c in "wax+")


# event -> (indices of path arguments, what it does: "write" or "read")
_PATH_EVENTS: dict[str, tuple[tuple[int, ...], str]] = {
    "os.rename": ((0, 1), "renamed"), "os.remove": ((0,), "removed"), "os.rmdir": ((0,), "removed"),
    "os.mkdir": ((0,), "created"), "os.symlink": ((1,), "created"), "os.link": ((1,), "created"),
    "os.truncate": ((0,), "truncated"), "os.chmod": ((0,), "changed"), "os.chown": ((0,), "changed"),
    "os.utime": ((0,), "changed"), "shutil.rmtree": ((0,), "removed"), "shutil.copyfile": ((1,), "wrote"),
    "shutil.move": ((1,), "moved into"),
}
_READ_OPS: set[str] = set()  # listing a directory is not checked (names only; the import system lists sys.path)


def install_audit_hook(policy: Policy) -> None:
    """Check every Python-level open and file-system call of this process against `policy` (irreversible)."""
    py_read = _dedup([*policy.read, *PY_SYSTEM_READ])

    def allowed(path: str, write: bool) -> bool:
        if write:
            return policy.may_write(path) or _under(path, (*SYSTEM_WRITE, *DEV_LINKS))
        return _under(path, py_read) or policy.may_write(path)

    def check(op: str, raw: Any, write: bool) -> None:
        if isinstance(raw, int) or raw is None:
            return  # a file descriptor: opened (and checked) before
        try:
            p = os.fsdecode(raw)
        except (TypeError, ValueError):
            return
        absolute = os.path.abspath(p)
        if allowed(absolute, write) and allowed(_real(absolute), write):
            return
        msg = _message(op, absolute, write)
        if not _violations:
            _violations.append(msg)
        raise Violation(errno.EACCES, msg, absolute)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            write = _is_write_open(mode, flags)
            check("wrote" if write else "read", path, write)
            return
        spec = _PATH_EVENTS.get(event)
        if spec is None:
            return
        idx, op = spec
        for i in idx:
            if i < len(args):
                check(op, args[i], op not in _READ_OPS)

    sys.addaudithook(hook)


# ------------------------------------------------------------------------------------------------------- Landlock
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR, _MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
_MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM, _REFER, _TRUNCATE = 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE  # the only rights a rule on a non-directory may hold


# ABI 4: TCP bind and connect (handled with no rule allowing any port: refused); ABI 6: scoping, so the action cannot
# signal a process outside its Landlock domain (its worker, the build, the server, any process of the user) nor
# connect to an abstract Unix socket created outside it.
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when unavailable (old kernel, disabled, or filtered)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, int(v))


def etc_read(etc: str = "/etc") -> tuple[str, ...]:
    """The paths in /etc the kernel rules let actions read: every entry but ETC_SECRETS (and, of ETC_PARTLY, every
    entry but the keys). Entries made in /etc later are not readable by actions."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(etc))
    except OSError:
        return ()
    for name in names:
        if name not in ETC_SECRETS:
            out.append(f"{etc}/{name}")
        elif name in ETC_PARTLY:
            with contextlib.suppress(OSError):
                keep = ETC_PARTLY[name]
                out.extend(f"{etc}/{name}/{n}" for n in sorted(os.listdir(f"{etc}/{name}")) if keep(n))
    return tuple(out)


def apply_landlock(policy: Policy) -> str | None:
    """Restrict this process and its future children to `policy` for good. None when applied, else why not."""
    abi = landlock_abi()
    if abi < 2:  # ABI 1 cannot allow renames across directories (REFER), which compilers' temp files need
        return "Landlock is not available in this kernel (ABI >= 2 needed)"
    write = (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG | _MAKE_SOCK | _MAKE_FIFO
             | _MAKE_BLOCK | _MAKE_SYM | _REFER | (_TRUNCATE if abi >= 3 else 0))
    handled = _READ | write
    libc = ctypes.CDLL(None, use_errno=True)
    attr = _RulesetAttr(handled, _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                        _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct as this ABI knows it
    fd = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return f"Landlock ruleset: {os.strerror(ctypes.get_errno())}"
    try:
        rules = [(r, _READ) for r in (*policy.read, *SYSTEM_READ, *etc_read())]
        rules += [(w, _READ | write) for w in (*policy.write, *SYSTEM_WRITE)]
        for root, access in rules:
            try:
                pfd = os.open(root, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent on this machine
            try:
                if not os.path.isdir(root):
                    access &= _FILE_RIGHTS
                rule = _PathBeneathAttr(access & handled, pfd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    return f"Landlock rule for {root}: {os.strerror(ctypes.get_errno())}"
            finally:
                os.close(pfd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"no_new_privs: {os.strerror(ctypes.get_errno())}"
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            return f"Landlock restrict: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    return None


# ------------------------------------------------------------------------------------------------------- seccomp
# A filter refusing (EACCES) new sockets of every family but netlink (Unix, IPv4, IPv6, vsock to a VM's host, packet,
# ...) and io_uring (whose operations would bypass the filter): an action cannot connect to the build server's socket
# (a path Landlock's file rules do not cover for connect()), another Unix socket of the user, or any network. socketpair() stays allowed (an anonymous pair, between the
# action's own processes).
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
# audit arch -> (socket, io_uring_setup) syscall numbers
_ARCHES = {0xC000003E: (41, 425), 0xC00000B7: (198, 425)}  # x86_64, aarch64
_X32_BIT = 0x40000000
_AF_NETLINK = 16  # the only family socket() may create: glibc asks the kernel's routing netlink (getaddrinfo)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program(arch: int) -> list[tuple[int, int, int, int]]:
    sock_nr, uring_nr = _ARCHES[arch]
    deny = _RET_ERRNO | errno.EACCES
    prog = [
        (_LD_W_ABS, 0, 0, 4),  # arch
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, deny),  # another ABI (32-bit calls on a 64-bit kernel): nothing is allowed through it
        (_LD_W_ABS, 0, 0, 0),  # syscall number
        (_JGE_K, 0, 1, _X32_BIT),
        (_RET_K, 0, 0, deny),  # x32 calls
        (_JEQ_K, 0, 1, uring_nr),
        (_RET_K, 0, 0, deny),
        (_JEQ_K, 1, 0, sock_nr),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_LD_W_ABS, 0, 0, 16),  # socket(domain, ...): the low 32 bits of the first argument
        (_JEQ_K, 0, 1, _AF_NETLINK),
        (_RET_K, 0, 0, _RET_ALLOW),
        (_RET_K, 0, 0, deny),  # Unix, IPv4, IPv6, vsock (the VM's host), packet, Bluetooth, ...: every other family
    ]
    return prog


def apply_seccomp() -> str | None:
    """Refuse new sockets of every family but netlink (and io_uring) to this process and its children for good; None
    when applied, else why not. Needs no_new_privs (set by apply_landlock; set here too when Landlock was not applied)."""
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(os.uname().machine)
    if arch is None:
        return "no seccomp filter for this architecture"
    prog = _seccomp_program(arch)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), arr)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"no_new_privs: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return f"seccomp: {os.strerror(ctypes.get_errno())}"
    return None


# ------------------------------------------------------------------------------------------- other processes
# What stops an action from reading /proc/<pid>/environ, maps, mem, fd/* of another process (the build process, its
# parent, sibling actions, their workers, the user's shell): the kernel's ptrace-read check, which procfs applies to
# those files. It passes for a reader with the target's uid and at least its capabilities, unless the target is
# non-dumpable (then CAP_SYS_PTRACE is needed) or the reader is Landlock-confined and the target is outside its
# domain. Measured on Linux 6.18 (tests/test_security_escape.py): a non-root action is refused by Landlock alone;
# a root action keeping its capabilities is not (Landlock then refuses only `mem`), so an action drops every
# capability (drop_capabilities) before Landlock applies. Workers and the zygote are non-dumpable too
# (set_dumpable(False)): the fallback where Landlock is missing, for a non-root user.
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 4, 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def set_dumpable(on: bool) -> None:
    """PR_SET_DUMPABLE: off, this process's /proc files (environ, maps, mem, fd) are root's and the ptrace-read check
    needs CAP_SYS_PTRACE, so no other process of the user (an action included) reads them; a fork inherits it, an
    exec resets it. The action's child turns it back on (non-root, its own /proc/self/fd would be unreadable)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)


def capabilities() -> int:
    """The capabilities this process holds (effective | permitted | inheritable, as one mask); 0 for a non-root user."""
    libc = ctypes.CDLL(None, use_errno=True)
    head, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(head), data) != 0:
        return 0
    return sum((d.effective | d.permitted | d.inheritable) << (32 * i) for i, d in enumerate(data))


def drop_capabilities() -> str | None:
    """Drop every capability of this process and everything it starts, for good: the bounding and ambient sets, then
    effective, permitted and inheritable. A process running as root keeps only its uid: it cannot read the /proc files
    of a process holding capabilities it lacks (the build, its parent, the shell, pid 1) nor of a non-dumpable one
    (dropping them makes this one non-dumpable too), cannot write files it does not own, and an exec'd binary
    regains nothing (the bounding set is empty; no_new_privs). Nothing to do without capabilities (a non-root user).
    None when done, else why not."""
    if capabilities() == 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            last = int(f.read().strip())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # needs CAP_SETPCAP, dropped from the effective set only below
    head, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(head), data) != 0:
        return f"dropping capabilities: {os.strerror(ctypes.get_errno())}"
    return None


def confine(policy: Policy) -> str | None:
    """No capabilities, Landlock, seccomp and the audit hook, for this process for good; returns why Landlock was not
    applied (None when it was)."""
    sys.dont_write_bytecode = True  # imports must not try to write .pyc files into the installation
    # sys.path entries outside the policy (the checkout neuronbuild was started from) would only be scanned and
    # refused (importlib.metadata, the import system): neuronbuild itself is already imported.
    sys.path[:] = [p for p in sys.path if not os.path.isabs(p) or policy.may_read(_real(p))]
    caps = drop_capabilities()  # before Landlock: a root action keeping them would read other processes' /proc
    why = apply_landlock(policy)
    no_sockets = apply_seccomp()
    install_audit_hook(policy)
    if no_sockets is not None:  # (stderr is the action's log)
        print(f"neuronbuild: {no_sockets}; this action may open Unix and network sockets", file=sys.stderr)
    if caps is not None:
        print(f"neuronbuild: {caps}; this action may read other processes' /proc files", file=sys.stderr)
    return why


def explain_denied(e: BaseException, policy: Policy) -> str | None:
    """A clear message for a PermissionError the rules caused (the kernel's for a C extension or a subprocess, or
    the audit hook's), else None."""
    if isinstance(e, Violation):
        return str(e.strerror)
    if not isinstance(e, OSError) or e.errno not in (errno.EACCES, errno.EPERM) or not e.filename:
        return None
    path = os.path.abspath(os.fsdecode(e.filename))
    if policy.may_write(path):
        return None
    if policy.may_read(path) or _under(path, SYSTEM_READ) or _under(path, etc_read()):
        return _message("wrote", path, write=True)
    return _message("read", path, write=False)
