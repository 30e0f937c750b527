"""The Neuron lowering: torch.export program -> HloModuleProto (weights as leading parameters, tuple root, byte-stable),
run back on XLA:CPU against eager; casts lower; auto_cast shows in the module; failures name the op and source line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from neuronbuild.runtime.hlo_proto import ProtoError, parse_hlo_module
from neuronbuild.runtime.xla_cpu import XlaCpuError, XlaCpuModule
from neuronbuild.toolchains.neuron_hlo import LoweredModule, LoweringError, lower_program
from neuronbuild.toolchains.trace import relative_stack_traces

MODEL_SRC = textwrap.dedent('''
    import torch

    class Block(torch.nn.Module):
        """Casts (.float(), .to(dtype)), a buffer, a lifted constant, int64 ids, embedding, norm, attention."""

        def __init__(self, vocab=32, hidden=16):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, hidden)
            self.norm = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.out = torch.nn.Linear(hidden, vocab, bias=False)
            self.register_buffer("scale", torch.full((hidden,), 0.5))

        def forward(self, ids, mask):
            h = self.emb(ids).to(torch.float16).float()
            q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
            a = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)
            h = h + a[:, 0] * self.scale + torch.tensor([1.0, 2.0]).sum()
            logits = self.out(h * mask.to(h.dtype)[..., None])
            return logits, logits.argmax(-1)
''')


def _load_model(directory: Path) -> type:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "block_model.py").write_text(MODEL_SRC)
    sys.path.insert(0, str(directory))
    try:
        import importlib

        mod = importlib.import_module("block_model")
        sys.modules.pop("block_model", None)
        return mod.Block  # type: ignore[no-any-return]
    finally:
        sys.path.remove(str(directory))


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (2, 5), generator=g), torch.ones(2, 5, dtype=torch.bool)


def _export(model: torch.nn.Module) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(model.eval(), _args(), strict=False)


def _state(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    return {**dict(ep.state_dict), **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.export.ExportedProgram,
                                                             LoweredModule]:
    torch.manual_seed(0)
    model = _load_model(tmp_path_factory.mktemp("src"))().eval()
    ep = _export(model)
    return model, ep, lower_program(ep)


def test_module_signature_weights_lead_inputs_follow_tuple_root(block) -> None:  # type: ignore[no-untyped-def]
    _model, ep, low = block
    summary = parse_hlo_module(low.proto)
    assert summary.result.dtype == "tuple" and summary.root_opcode == "tuple"
    assert len(summary.result.elements) == 2
    params = json.loads(low.params_json())["parameters"]
    assert [p["index"] for p in params] == list(range(len(summary.parameters)))
    kinds = [p["kind"] for p in params]
    # every parameter, buffer and lifted constant of the program, then the two user inputs, in that order
    state = [s.target for s in ep.graph_signature.input_specs if s.kind.name != "USER_INPUT"]
    assert [p["name"] for p in params] == [*state, "ids", "mask"]
    assert kinds[-2:] == ["input", "input"] and "input" not in kinds[:-2]
    assert {"parameter", "buffer", "constant"} <= set(kinds)
    for p, shape in zip(params, summary.parameters, strict=True):
        assert (p["dtype"], tuple(p["shape"])) == (shape.dtype, shape.dims)
    ids = params[-2]
    assert (ids["source_dtype"], ids["dtype"], ids["shape"]) == ("int64", "int32", [2, 5])
    # the casts (aten._assert_tensor_metadata from .to()/.float()) lowered, no custom calls appeared
    opcodes = dict(summary.opcodes)
    assert "custom-call" not in opcodes and "dot" in opcodes and "convert" in opcodes


def test_weights_never_enter_the_module(block) -> None:  # type: ignore[no-untyped-def]
    model, _ep, low = block
    torch.manual_seed(123)
    other = type(model)().eval()
    assert not torch.equal(other.emb.weight, model.emb.weight)
    assert lower_program(_export(other)).proto == low.proto  # same bytes whatever the weights' values
    opcodes = dict(parse_hlo_module(low.proto).opcodes)
    assert opcodes.get("constant", 0) < 40  # scalars only: a 32x16 embedding would be one constant per weight


def test_runs_on_xla_cpu_and_matches_eager(block) -> None:  # type: ignore[no-untyped-def]
    model, ep, low = block
    run = XlaCpuModule(low.proto, low.params_json()).bind(_state(ep))
    args = _args()
    logits, best = run(*args)
    with torch.no_grad():
        ref_logits, ref_best = model(*args)
    assert logits.dtype == torch.float32 and best.dtype == torch.int64  # int32 in the module, int64 like eager
    assert float((logits - ref_logits).abs().max()) < 1e-5
    assert torch.equal(best, ref_best)
    other_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(9))
    assert float((run(other_ids, args[1])[0] - model(other_ids, args[1])[0]).abs().max()) < 1e-5


def test_auto_cast_shows_in_the_module_and_keeps_bf16_numerics(block) -> None:  # type: ignore[no-untyped-def]
    from jax._src.lib import xla_client as xc

    model, ep, low = block

    def dots(proto: bytes) -> list[str]:
        return [ln for ln in xc.XlaComputation(proto).as_hlo_text().splitlines() if " dot(" in ln]

    assert dots(low.proto) and all("bf16" not in d for d in dots(low.proto))
    cast = lower_program(ep, {"auto_cast": "matmult"})
    assert cast.cast_ops >= 3 and cast.proto != low.proto
    cast_dots = dots(cast.proto)
    assert cast_dots and all(" bf16[" in d for d in cast_dots)  # every dot computes in bf16
    assert json.loads(cast.params_json())["auto_cast"] == "matmult"
    args = _args()
    out = XlaCpuModule(cast.proto, cast.params_json()).bind(_state(ep))(*args)[0]
    with torch.no_grad():
        ref = model(*args)[0]
    err = float((out - ref).abs().max())
    assert 1e-6 < err < 0.05 * float(ref.abs().max())  # bf16 rounding shows, within bf16 tolerance
    fp16 = lower_program(ep, {"auto_cast": "matmult", "auto_cast_type": "fp16"})
    assert all(" f16[" in d for d in dots(fp16.proto))
    with pytest.raises(Exception, match="auto_cast_type"):
        lower_program(ep, {"auto_cast": "matmult", "auto_cast_type": "fp8"})


def test_auto_cast_all_covers_convolutions() -> None:
    from jax._src.lib import xla_client as xc

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    with torch.no_grad():
        ep = torch.export.export(conv, (torch.randn(1, 3, 8, 8),), strict=False)

    def convs(mode: str) -> list[str]:
        text = xc.XlaComputation(lower_program(ep, {"auto_cast": mode}).proto).as_hlo_text()
        return [ln for ln in text.splitlines() if " convolution(" in ln]

    assert convs("matmult") and all("bf16" not in c for c in convs("matmult"))
    assert convs("all") and all(" bf16[" in c for c in convs("all"))


def test_bytes_identical_across_processes_and_workspace_paths(tmp_path: Path, block) -> None:  # type: ignore[no-untyped-def]
    _model, _ep, low = block
    script = textwrap.dedent('''
        import hashlib, sys, torch
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        from block_model import Block
        from neuronbuild.toolchains.neuron_hlo import lower_program
        from neuronbuild.toolchains.trace import relative_stack_traces
        torch.manual_seed(int(sys.argv[2]))
        args = (torch.randint(0, 32, (2, 5)), torch.ones(2, 5, dtype=torch.bool))
        with torch.no_grad():
            ep = torch.export.export(Block().eval(), args, strict=False)
        relative_stack_traces(ep, Path(sys.argv[1]))
        low = lower_program(ep)
        print(hashlib.sha256(low.proto).hexdigest(), hashlib.sha256(low.params_json()).hexdigest())
    ''')
    digests = set()
    for i, where in enumerate((tmp_path / "a", tmp_path / "deeper" / "path" / "b")):
        where.mkdir(parents=True)
        (where / "block_model.py").write_text(MODEL_SRC)
        proc = subprocess.run([sys.executable, "-c", script, str(where), str(i)], capture_output=True, text=True,
                              cwd=where, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        digests.add(proc.stdout.split()[0])
    assert digests == {hashlib.sha256(low.proto).hexdigest()}  # and the same as this process's lowering


def test_lowering_failure_names_the_op_and_the_model_source_line(tmp_path: Path) -> None:
    src = tmp_path / "ws" / "models" / "odd.py"
    src.parent.mkdir(parents=True)
    src.write_text(textwrap.dedent('''
        import torch

        @torch.library.custom_op("nbtest::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)

        class Odd(torch.nn.Module):
            def forward(self, x):
                y = x.float() + 1
                return torch.ops.nbtest.twice(y)
    '''))
    sys.path.insert(0, str(src.parent))
    try:
        from odd import Odd  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(src.parent))
        sys.modules.pop("odd", None)
    ep = torch.export.export(Odd(), (torch.ones(3, dtype=torch.float16),), strict=False)
    relative_stack_traces(ep, tmp_path / "ws")
    with pytest.raises(LoweringError) as info:
        lower_program(ep)
    msg = str(info.value)
    assert "nbtest.twice.default" in msg
    assert "models/odd.py:15 in forward: return torch.ops.nbtest.twice(y)" in msg
    assert "\n" not in msg and str(tmp_path) not in msg


def test_state_updates_are_refused_with_a_clear_message() -> None:
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return x + self.seen

    ep = torch.export.export(Counter(), (torch.ones(2),), strict=False)
    with pytest.raises(LoweringError, match="updates buffer 'seen'.*pass it as an input"):
        lower_program(ep)


def test_xla_cpu_runner_rejects_bad_modules_weights_and_inputs(block, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _model, ep, low = block
    import zipfile

    archive = tmp_path / "program.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("x", "y")
    for bad in (archive.read_bytes(), b"", b"HloModule m\nENTRY e { ROOT p = f32[] parameter(0) }"):
        with pytest.raises(ProtoError):
            parse_hlo_module(bad)
        with pytest.raises(XlaCpuError, match="not an HLO module"):
            XlaCpuModule(bad, low.params_json())
    doc = json.loads(low.params_json())
    doc["parameters"][0]["shape"] = [1]
    with pytest.raises(XlaCpuError, match="params.json says parameter 0"):
        XlaCpuModule(low.proto, json.dumps(doc))
    run = XlaCpuModule(low.proto, low.params_json())
    state = _state(ep)
    with pytest.raises(XlaCpuError, match="bind"):
        run(*_args())
    with pytest.raises(XlaCpuError, match="weights lack 1 tensor"):
        run.bind({k: v for k, v in state.items() if k != "scale"})
    run.bind(state)
    with pytest.raises(XlaCpuError, match=r"input ids must have shape \[2, 5\], got \[2, 6\]"):
        run(torch.zeros(2, 6, dtype=torch.int64), torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(XlaCpuError, match="does not fit the module's int32"):
        run(torch.full((2, 5), 2**40), torch.ones(2, 5, dtype=torch.bool))


def test_float64_is_refused_at_its_source_line() -> None:
    class Wide(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.double() * 2).float()

    ep = torch.export.export(Wide(), (torch.ones(2),), strict=False)
    with pytest.raises(LoweringError, match=r"float64, which Neuron does not support .*test_neuron_hlo.py:\d+ in "
                                            r"forward: return \(x.double\(\) \* 2\).float\(\)"):
        lower_program(ep)


class _ComplexRope(torch.nn.Module):
    """Llama 4's rotary embedding as transformers writes it: torch.polar, a complex scale, view_as_complex, a complex
    multiply through an unsqueezed complex tensor, view_as_real."""

    def __init__(self, heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.heads, self.dim = heads, dim
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * 1.5
        b, s, _ = x.shape
        xq = self.q(x).view(b, s, self.heads, self.dim)
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        rotated = xq_ * freqs_cis[:, :, None, :]
        mixed = rotated + rotated.conj() / (freqs_cis[:, :, None, :] + 2)  # add, conj, divide: more than RoPE uses
        return torch.view_as_real(mixed).flatten(3).type_as(x)


def test_complex_rope_lowers_to_real_pairs_with_no_complex_dtype_and_matches_eager() -> None:
    from jax._src.lib import xla_client as xc

    torch.manual_seed(0)
    model = _ComplexRope().eval()
    args = (torch.randn(2, 5, 16), torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]))
    with torch.no_grad():
        ep = torch.export.export(model, args, strict=False)
        assert any(str(n.target) == "aten.polar.default" for n in ep.graph.nodes)
        low = lower_program(ep)
        text = xc.XlaComputation(low.proto).as_hlo_text()
        assert "c64" not in text and "c128" not in text  # no complex dtype anywhere in the module
        mod = XlaCpuModule(low.proto, low.params_json())
        mod.bind({k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]})
        got = mod(*args)[0]
        want = model(*args)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_an_op_on_complex_tensors_without_a_rewrite_names_the_op_and_line() -> None:
    class Fft(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.view_as_real(torch.fft.fft(x)).sum(-1)

    with torch.no_grad():
        ep = torch.export.export(Fft(), (torch.randn(4, 8),), strict=False)
    with pytest.raises(LoweringError, match=r"on a complex tensor to HLO: Neuron has no complex dtype.*test_neuron_hlo"):
        lower_program(ep)
