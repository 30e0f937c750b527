"""Model code is confined: each action runs in a fresh child of a warm worker (one model's monkeypatch never reaches
another's program), may write only its sandbox and temp dirs, and may read only its sandbox and the installation."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild.execution.confine import landlock_abi

# Each model patches a torch class at import time and uses it. In a worker that carried state from one model to the
# next, whichever is traced second would wrap the first's patch (its program would hold both ops).
PATCH = '''import torch

_orig = torch.nn.Linear.forward
torch.nn.Linear.forward = lambda self, x: torch.{op}(_orig(self, x))


def build(config):
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)
'''
OPS = {"relu_m": ("relu", b"maximum"), "sigmoid_m": ("sigmoid", b"exponential")}


def _build_file(models: list[str]) -> str:
    out = 'neuron_buckets(name = "bk", shapes = [{"b": 1}])\nneuron_target(name = "t", platform = "trn2")\n'
    for m in models:
        out += (f'neuron_model(name = "{m}", srcs = ["{m}.py"], entry = "{m}:build", inputs = {{"x": "float32[b, 4]"}})\n'
                f'neuron_compile(name = "{m}_trn2", model = ":{m}", buckets = [":bk"], target = ":t")\n')
    return out


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _program(ws: Path, model: str) -> bytes:
    return (ws / f"neuronbuild-out/pkg/{model}_trn2/b1/model.hlo.pb").read_bytes()


def test_a_models_import_time_monkeypatch_does_not_change_the_next_models_program(tmp_path: Path) -> None:
    files = {f"pkg/{m}.py": PATCH.format(op=op) for m, (op, _hlo) in OPS.items()}
    alone: dict[str, bytes] = {}
    for m, (_op, hlo) in OPS.items():  # each model in a build of its own
        ws = write_ws(tmp_path / f"alone-{m}", {**files, "pkg/BUILD": _build_file([m])})
        proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / f"c-{m}")], ws)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        alone[m] = _program(ws, m)
        assert hlo in alone[m]  # its own patch is in its program: the case is live
        assert not any(other in alone[m] for n, (_o, other) in OPS.items() if n != m)

    both = write_ws(tmp_path / "both", {**files, "pkg/BUILD": _build_file(list(OPS))})
    evf = tmp_path / "events.jsonl"
    # Fresh workers, no zygote: with one, an idle worker may be replaced by a fork that inherits the zygote's warm-up
    # (between two traces), and then the second model would not be traced in the worker that imported the first.
    proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "c-both"),
                    "--build-event-json-file", str(evf)], both, env={"NEURONBUILD_ZYGOTE": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    started = [e for e in _events(evf) if e["event"] == "action_started"]
    # one worker traced both models, one after the other (the Neuron compiles, light steps, ran in the build process)
    assert len({e["pid"] for e in started if e["worker"] != "build"}) == 1
    assert sum(e["description"].startswith("Trace ") for e in started) == 2
    for m in OPS:
        assert _program(both, m) == alone[m], f"{m}'s program changed when built after the other model"


WRITER = '''import os
import torch


def build(config):
    target = config["target"]
    try:
        with open(target, "w") as f:  # into the cache store / the workspace / $HOME
            f.write("poison")
    except PermissionError:
        pass  # swallowing the refusal does not help: the action fails all the same
    return torch.nn.Linear(4, 3)
'''
SHELL_WRITER = '''import subprocess
import torch


def build(config):
    # a subprocess is not Python: only the kernel's rules (Landlock) stop it
    subprocess.run(["sh", "-c", "echo poison > " + config["target"]], check=True)
    return torch.nn.Linear(4, 3)
'''


def _one_model_ws(root: Path, src: str, config: dict[str, str]) -> Path:
    build = (f'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {{"x": "float32[b, 4]"}},\n'
             f'             config = {json.dumps(config)})\n'
             'neuron_buckets(name = "bk", shapes = [{"b": 1}])\n'
             'neuron_target(name = "t", platform = "trn2")\n'
             'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")\n')
    return write_ws(root, {"pkg/BUILD": build, "pkg/m.py": src})


# The model's factory runs in its weights action and in its trace: whichever fails first stops the build.
FAILED_RUNNING_MODEL = r"FAILED:? (Trace //pkg:m \[b=1\]|Weights //pkg:m)[:\s]"


@pytest.mark.parametrize("where", ["cas", "workspace", "home"])
def test_a_model_writing_outside_its_sandbox_fails_and_nothing_is_cached(tmp_path: Path, where: str) -> None:
    cache = tmp_path / "cache"
    (cache / "v1" / "cas" / "ab").mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    target = {"cas": cache / "v1" / "cas" / "ab" / ("ab" + "0" * 62),
              "workspace": tmp_path / "ws" / "pkg" / "BUILD.poison", "home": home / ".bashrc"}[where]
    ws = _one_model_ws(tmp_path / "ws", WRITER, {"target": str(target)})
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], ws, env={"HOME": str(home)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(FAILED_RUNNING_MODEL, proc.stderr), proc.stderr
    assert f"the action wrote '{target}', outside its sandbox and temp dirs" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not target.exists()
    assert not list((cache / "v1" / "ac").rglob("*.json"))  # nothing cached


@pytest.mark.skipif(landlock_abi() < 2, reason="the kernel has no Landlock (ABI >= 2): subprocesses are not confined")
def test_a_subprocess_of_a_model_cannot_write_outside_the_sandbox(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    target = tmp_path / "ws" / "pkg" / "poison.txt"
    ws = _one_model_ws(tmp_path / "ws", SHELL_WRITER, {"target": str(target)})
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(FAILED_RUNNING_MODEL, proc.stderr) and "Traceback" not in proc.stderr, proc.stderr
    assert not target.exists()
    assert not list((cache / "v1" / "ac").rglob("*.json"))


READER = '''import torch


def build(config):
    with open(config["path"]) as f:  # an undeclared file, by absolute path
        n = len(f.read())
    return torch.nn.Linear(4, n)
'''
C_READER = '''import ctypes
import os
import torch


def build(config):
    # C code (as a C extension or a safetensors reader would) opens the file: the audit hook cannot see it
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.open(config["path"].encode(), os.O_RDONLY)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), config["path"])
    os.close(fd)
    return torch.nn.Linear(4, 3)
'''


@pytest.mark.parametrize("how", ["python", "c"])
def test_a_model_reading_an_undeclared_absolute_path_fails_naming_it(tmp_path: Path, how: str) -> None:
    if how == "c" and landlock_abi() < 2:
        pytest.skip("the kernel has no Landlock (ABI >= 2): C-level reads are not confined")
    secret = tmp_path / "elsewhere" / "vocab.txt"
    secret.parent.mkdir()
    secret.write_text("abc")
    cache = tmp_path / "cache"
    ws = _one_model_ws(tmp_path / "ws", READER if how == "python" else C_READER, {"path": str(secret)})
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the action read '{secret}', which is not among its declared inputs" in proc.stderr
    assert "`data`" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((cache / "v1" / "ac").rglob("*.json"))


def test_cache_verify_reports_and_repairs_files_that_do_not_belong(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "v1" / "cas" / "ab").mkdir(parents=True)
    (cache / "v1" / "ac" / "cd").mkdir(parents=True)
    foreign = [cache / "v1" / "cas" / "ab" / "evil.so", cache / "v1" / "cas" / "payload.py",
               cache / "v1" / "cas" / "ab" / ("cd" + "0" * 62), cache / "v1" / "ac" / "cd" / "notes.txt"]
    for f in foreign:
        f.write_text("x")
    proc = run_cli(["cache", "verify", "--cache-dir", str(cache)], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for f in foreign:
        assert f"foreign-file {f.relative_to(cache / 'v1')}" in proc.stdout + proc.stderr
    proc = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], tmp_path)
    assert not any(f.exists() for f in foreign)
    proc = run_cli(["cache", "verify", "--cache-dir", str(cache)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_landlock_probe_matches_the_kernel() -> None:
    """The probe the worker relies on answers as the kernel does (a child that applies it cannot write /tmp)."""
    if landlock_abi() < 2:
        pytest.skip("no Landlock here")
    code = ("import os, sys; from neuronbuild.execution.confine import Policy, apply_landlock;"
            "print(apply_landlock(Policy((), ())));"
            "open('/tmp/nb-landlock-probe', 'w')")
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)  # type: ignore[attr-defined]
    assert proc.stdout.strip() == "None" and "PermissionError" in proc.stderr


def test_etc_rules_leave_out_secrets_and_keep_what_libc_reads(tmp_path: Path) -> None:
    """The kernel rules' /etc: every entry but the secrets (password hashes, sudo rules, host and TLS private keys);
    of ssh/ and ssl/ only the keys are left out (client config and CA certificates stay readable)."""
    from neuronbuild.execution.confine import etc_read

    etc = tmp_path / "etc"
    for d in ("sudoers.d", "ssh", "ssl/certs", "ssl/private", "security"):
        (etc / d).mkdir(parents=True)
    for f in ("passwd", "ld.so.cache", "shadow", "gshadow", "sudoers", "ssh/ssh_config", "ssh/ssh_host_ed25519_key",
              "ssh/ssh_host_ed25519_key.pub", "ssl/openssl.cnf"):
        (etc / f).write_text("x")
    got = {p[len(str(etc)) + 1:] for p in etc_read(str(etc))}
    assert got == {"passwd", "ld.so.cache", "ssh/ssh_config", "ssl/certs", "ssl/openssl.cnf"}


def test_a_confined_process_cannot_open_etc_shadow_through_libc_but_opens_passwd() -> None:
    """What the kernel enforces (not the audit hook): libc's open of /etc/shadow is refused, /etc/passwd is not."""
    if landlock_abi() < 2:
        pytest.skip("no Landlock here")
    if not os.path.exists("/etc/shadow"):
        pytest.skip("no /etc/shadow here")
    code = ("import ctypes, os; from neuronbuild.execution.confine import Policy, apply_landlock;"
            "print(apply_landlock(Policy((), ())));"
            "libc = ctypes.CDLL(None, use_errno=True);"
            "print([libc.open(p, os.O_RDONLY) >= 0 for p in (b'/etc/passwd', b'/etc/shadow')])")
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)  # type: ignore[attr-defined]
    assert proc.stdout.split("\n")[:2] == ["None", "[True, False]"], proc.stdout + proc.stderr
