"""The Neuron toolchain's worker steps: lower a trace to model.hlo.pb (once per trace and lowering options, shared by
every Neuron platform), then per platform write the exact neuronx-cc command line and, with a compiler, the NEFF."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronbuild.plugin_api.actions import PROGRAM_CONSTANTS
from neuronbuild.toolchains import neuron_flags
from neuronbuild.toolchains.errors import ToolchainError

HLO_FILE = neuron_flags.HLO_FILE
PARAMS_FILE = "params.json"
FLAGS_FILE = "compile_flags.json"
LOWER_OUTPUTS = (HLO_FILE, PARAMS_FILE, PROGRAM_CONSTANTS)  # from shapes only: no weights file
# What neuronx-cc needs in its environment to compile a module with fp8 parameters (AWS's fp8 tutorials set it;
# toolchains/quantize.py): a function of the module, so of the Compile's inputs, and written to compile_flags.json.
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1"}


def compile_env(params_json: bytes) -> dict[str, str]:
    """The environment variables the module's compile needs: FP8_ENV when one of its parameters is fp8."""
    try:
        params = json.loads(params_json).get("parameters") or []
    except (ValueError, AttributeError) as exc:
        raise ToolchainError(f"the lowering's {PARAMS_FILE} is malformed: {exc}") from None
    return dict(FP8_ENV) if any(str(p.get("dtype", "")).startswith("float8") for p in params) else {}


def run_lower(spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """spec["program"] (in the sandbox) -> out_dir/{model.hlo.pb, params.json, program_constants.safetensors}, from
    shapes only: the program holds no weight values and no weights file is an input (the Compile binds the model's).
    program_constants.safetensors: the program's own tensors (non-persistent buffers, lifted constants), the
    module's parameters that are not weights.

    spec: program, inputs, bucket, options (the lowering options only: auto_cast, auto_cast_type)."""
    from neuronbuild.toolchains.compile import _check_inputs
    from neuronbuild.toolchains.model_import import example_inputs
    from neuronbuild.toolchains.neuron_hlo import lower_program
    from neuronbuild.toolchains.trace import load_program, write_program_constants

    sandbox, out_dir = Path(sandbox), Path(out_dir)
    ep = load_program(sandbox / str(spec["program"]))
    _check_inputs(ep, example_inputs(dict(spec.get("inputs") or {}), dict(spec.get("bucket") or {})))
    tp_info = dict(spec.get("tp") or {})
    tp = int(tp_info.get("degree") or 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_program_constants(ep, out_dir / PROGRAM_CONSTANTS)
    start = time.perf_counter()
    lowered = lower_program(ep, dict(spec.get("options") or {}))
    seconds = time.perf_counter() - start
    state = [p.name for p in lowered.parameters if p.kind != "input"]
    (out_dir / HLO_FILE).write_bytes(lowered.proto)
    (out_dir / PARAMS_FILE).write_bytes(lowered.params_json(tp_info))
    return {"artifact": HLO_FILE, "bytes": len(lowered.proto), "parameters": len(lowered.parameters),
            "weights": len(state), **({"tp_degree": tp} if tp > 1 else {}),
            "ops": sum(n for _op, n in lowered.ops), "auto_cast_ops": lowered.cast_ops, "lower_s": round(seconds, 3)}


def flags_document(platform: str, options: Mapping[str, Any], env_flags: list[str], version: str | None,
                   hlo: bytes, env: Mapping[str, str] | None = None) -> bytes:
    """compile_flags.json: the exact contract argv (run in a dir holding model.hlo.pb), the compiler version, the
    sha256 of the module it compiles (as the Neuron compile cache keys entries by module and flags) and, when the
    module needs any (fp8), the environment variables the compiler runs with."""
    try:
        argv = neuron_flags.neuronx_cc_argv("neuronx-cc", platform, options, env_flags)
    except ValueError as exc:
        raise ToolchainError(str(exc)) from None
    doc = {"platform": platform, "argv": argv, "neuronx_cc_version": version,
           "hlo_sha256": hashlib.sha256(hlo).hexdigest()} | ({"env": dict(env)} if env else {})
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _place(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def run_neuron_compile(spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """Per platform: re-emit the lowering's files (the CAS stores them once), write compile_flags.json and, when
    spec["neuronx_cc"] is set, run neuronx-cc in a scratch dir for model.neff (its output goes to the action log).

    spec: platform, options (effective), env_flags (NEURON_CC_FLAGS, wrapper flags removed), neuronx_cc or None."""
    from neuronbuild.toolchains.neuronx_cc import run_neuronx_cc

    sandbox, out_dir = Path(sandbox), Path(out_dir)
    platform = str(spec["platform"])
    options = dict(spec.get("options") or {})
    env_flags = [str(f) for f in spec.get("env_flags") or ()]
    cc = spec.get("neuronx_cc")
    out_dir.mkdir(parents=True, exist_ok=True)
    # No weights here: they are the module's parameters, bound at load (the weights action's file(s) ship beside
    # these outputs; the runtime's bind checks them against params.json at load).
    for name in LOWER_OUTPUTS:
        if not (sandbox / name).is_file():
            raise ToolchainError(f"the lowering's {name} is missing from the sandbox")
        _place(sandbox / name, out_dir / name)
    version = str(cc["version"]) if cc else None
    env = compile_env((out_dir / PARAMS_FILE).read_bytes())
    (out_dir / FLAGS_FILE).write_bytes(flags_document(platform, options, env_flags, version,
                                                      (out_dir / HLO_FILE).read_bytes(), env))
    meta: dict[str, Any] = {"artifact": HLO_FILE, "flags": FLAGS_FILE}
    if cc:
        meta |= run_neuronx_cc(cc, platform, options, out_dir, sandbox / "neuronx-cc-work", env_flags, env)
    return meta
