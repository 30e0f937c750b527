"""open_cache(): a deployed directory opened for serving, strict (cache-hit-only, checked at open) or lenient.

Never compiles: each graph loads through the runtime loader its toolchain registered for its artifact format
(runtime/loaders.py; cpu graphs through the direct AOTInductor loader). A Neuron graph runs only on a Neuron device
(its NEFF through the Neuron runtime), never silently on the CPU; `emulate="xla-cpu"` runs its exact HLO module on
XLA:CPU instead, for development and CI, counted as `emulated`, never as a hit. Counters follow the Neuron precompile
cache (hit, miss, error, save); save stays 0 here because production never compiles and therefore never saves."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.plugin_api.loader import Host
from neuronbuild.runtime.host import check_graph, current_host, no_loader
from neuronbuild.runtime.inputs import prepare
from neuronbuild.runtime.layout import (
    DRAFT_PREFIX,
    DRAFT_WEIGHTS,
    PROGRAM_CONSTANTS,
    FileRef,
    Graph,
    LayoutError,
    Manifest,
    Release,
    parse_manifest,
    read_manifest,
    read_releases,
)
from neuronbuild.runtime.loaders import load_request, loader_for
from neuronbuild.runtime.router import BucketRouter, NoBucketFits, Route
from neuronbuild.runtime.signing import SIGNATURE as SIGNATURE_FILE
from neuronbuild.runtime.signing import TRUSTED_KEYS_ENV, SignatureError, TrustedKey, load_trusted_keys, verify_manifest
from neuronbuild.runtime.verified import BadWeights, Scratch, load_weights_verified, weights_mismatch

STRICT_ENV = "NEURONBUILD_STRICT"
REQUIRE_ENV = "NEURONBUILD_REQUIRE"
EMULATE_ENV = "NEURONBUILD_EMULATE"
EMULATE_MODES = ("xla-cpu",)
log = logging.getLogger("neuronbuild.runtime")


@dataclass(frozen=True)
class Counters:
    """Graph lookups so far: hit (loaded from the deployed cache), miss (absent or unusable), error (present but
    failed to load), save (compiled and saved: always 0, production never compiles); eager = calls run eagerly;
    emulated = Neuron graphs loaded to run on XLA:CPU (emulate="xla-cpu"): not hits, they did not run on a device."""

    hit: int = 0
    miss: int = 0
    error: int = 0
    save: int = 0
    eager: int = 0
    emulated: int = 0

    def __str__(self) -> str:
        return (f"hit={self.hit} miss={self.miss} error={self.error} save={self.save} eager_calls={self.eager}"
                f" emulated={self.emulated}")


def diff_records(expected: Any, deployed: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Field-by-field differences [(dotted.path, expected, deployed)] between two records."""
    if isinstance(expected, Mapping) and isinstance(deployed, Mapping):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(expected) | set(deployed)):
            path = f"{prefix}.{k}" if prefix else str(k)
            out.extend(diff_records(expected.get(k), deployed.get(k), path))
        return out
    return [] if expected == deployed else [(prefix, expected, deployed)]


def graph_diff(expected: Graph, deployed: Graph) -> list[tuple[str, Any, Any]]:
    """Differences between two graphs' input records; a differing trace is explained by its own record."""
    out = [d for d in diff_records(expected.record, deployed.record) if d[0] != "trace"]
    if expected.record.get("trace") != deployed.record.get("trace"):
        out += [(f"trace.{p}", a, b) for p, a, b in diff_records(expected.trace_record, deployed.trace_record)]
    return out


def _artifact_diff(expected: Graph, deployed: Graph) -> list[tuple[str, str]]:
    """Artifacts and weights whose digest or size differ between the expected and the deployed graph."""
    out = []
    names = sorted(set(expected.artifacts) | set(deployed.artifacts))
    pairs = [(n, expected.artifacts.get(n), deployed.artifacts.get(n)) for n in names]
    pairs.append(("weights", expected.weights, deployed.weights))
    for name, a, b in pairs:
        if (a and (a.sha256, a.size)) != (b and (b.sha256, b.size)):
            out.append((name, f"expected sha256 {a.sha256[:16] if a else None}, deployed "
                              f"{b.sha256[:16] if b else None}"))
        elif a and b and a.blake3 and b.blake3 and a.blake3 != b.blake3:
            out.append((name, f"expected blake3 {a.blake3[:16]}, deployed {b.blake3[:16]}"))
    return out


def _pinned(expected: Graph, deployed: Graph) -> Graph:
    """The deployed graph with the BLAKE3 digests the pin gives (none where it gives none): loading verifies with the
    pinned digest, never with one only the deployed manifest states (see verified.py)."""
    def pin(a: FileRef | None, b: FileRef | None) -> FileRef | None:
        return None if b is None else replace(b, blake3=a.blake3 if a is not None else None)

    arts = {n: pin(expected.artifacts.get(n), r) for n, r in deployed.artifacts.items()}
    return replace(deployed, artifacts={n: r for n, r in arts.items() if r is not None},
                   weights=pin(expected.weights, deployed.weights))


@dataclass(frozen=True)
class Problem:
    """Why a required graph cannot be served from this directory."""

    graph: str
    reason: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.reason}"


class _Slot:
    """One graph of a model: its manifest entry, release directory and (once loaded) callable."""

    def __init__(self, graph: Graph, release: Release | None) -> None:
        self.graph = graph
        self.release = release
        self.fn: Callable[..., Any] | None = None
        self.problem: str | None = None
        self.missed = False  # counted as a miss already


class Model:
    """A compiled model by label: call it with inputs; the router picks the bucket and pads/un-pads."""

    def __init__(self, cache: DeployedCache, label: str, slots: dict[str, _Slot], eager: Callable[..., Any] | None):
        self._cache = cache
        self.label = label
        self._slots = slots
        first = next(iter(slots.values())).graph
        self.families = list(dict.fromkeys(s.graph.graph for s in slots.values()))  # graph families, e.g. context
        self.router = BucketRouter(dict(first.inputs), {n: dict(s.graph.bucket) for n, s in slots.items()})
        self._eager = eager

    def family(self, name: str) -> Model:
        """The graphs of one family (e.g. "token") as a model of their own (one input signature, one router)."""
        slots = {n: s for n, s in self._slots.items() if s.graph.graph == name}
        if not slots:
            raise KeyError(f"{self.label} has no graph family {name!r} (families: {', '.join(self.families)})")
        return Model(self._cache, self.label, slots, self._eager)  # the eager fallback, if any, serves this family

    @property
    def buckets(self) -> dict[str, dict[str, int]]:
        return {n: dict(s.graph.bucket) for n, s in self._slots.items()}

    def graph(self, bucket_name: str) -> Graph:
        return self._slots[bucket_name].graph

    @property
    def inputs(self) -> dict[str, dict[str, Any]]:
        """The declared inputs, in call order: name -> {"dtype", "dims"}."""
        return {n: dict(s) for n, s in self.router.inputs.items()}

    def _prepare(self, args: tuple[Any, ...], named: Mapping[str, Any]) -> list[Any]:
        return prepare(self.router.inputs, args, named, self.label)

    def route(self, *args: Any, **named: Any) -> Route:
        """The bucket a call with these inputs (positional and/or by name) runs on."""
        return self.router.route([tuple(a.shape) for a in self._prepare(args, named)])

    def bucket_fn(self, bucket_name: str) -> Callable[..., Any] | None:
        """The loaded callable of one bucket (exact shapes, no padding), or None when it is a miss."""
        return self._cache._load(self._slots[bucket_name])

    def __call__(self, *args: Any, pad_value: float = 0, split: bool | str = True, **named: Any) -> Any:
        """Run the inputs on the smallest bucket that fits (padded, outputs un-padded). Inputs are given
        positionally (declaration order) and/or by their declared names, as torch tensors or numpy arrays; dtypes
        are checked against the manifest first (lossless integer widening done, anything else an InputError naming
        the input). A call whose `batch` is larger than every bucket's runs as bucket-sized chunks whose outputs
        are concatenated (`split=False` refuses it instead, NoBucketFits; `split="dim"` splits another dim whose
        rows are independent)."""
        if len(self.families) > 1:
            raise TypeError(f"{self.label} has graph families ({', '.join(self.families)}): call one of them, "
                            f"model.family(name)(...), or use causal_lm() for an hf_causal_lm")
        args = tuple(self._prepare(args, named))
        try:
            route = self.router.route([tuple(a.shape) for a in args])
        except NoBucketFits as e:
            dim = "batch" if split is True else split or ""
            chunk = self.router.split_dim([tuple(a.shape) for a in args], dim) if dim else None
            if chunk is not None:  # bucket-sized chunks (the last one padded), outputs concatenated
                chunks = self.router.split(args, chunk, dim)
                parts = [self(*c, pad_value=pad_value, split=False) for c in chunks]
                return self.router.join(parts, self._slots[self.route(*chunks[0]).bucket_name].graph.outputs, dim)
            if self._cache.strict or self._eager is None:
                raise
            return self._cache._eager_call(self.label, f"no bucket fits ({e})", self._eager, args)
        fn = self._cache._load(self._slots[route.bucket_name])
        if fn is None:
            slot = self._slots[route.bucket_name]
            if self._eager is None:
                raise RuntimeError(f"{slot.graph.describe()} is not usable ({slot.problem}) and no eager fallback "
                                   f"was given")
            return self._cache._eager_call(self.label, slot.problem or "miss", self._eager, args)
        out = fn(*self.router.pad(args, route, pad_value))
        graph = self._slots[route.bucket_name].graph
        return self.router.unpad(out, route, graph.outputs, graph.output_tree)


class DeployedCache:
    """A deployed directory opened for serving. Use open_cache()."""

    def __init__(self, root: Path, strict: bool, releases: list[Release], host: Host,
                 eager: Mapping[str, Callable[..., Any]], emulate: str | None = None) -> None:
        self.root = root
        self.strict = strict
        self.emulate = emulate
        self.host = host
        self._releases = releases
        self._eager = dict(eager)
        self._counts = {"hit": 0, "miss": 0, "error": 0, "save": 0, "eager": 0, "emulated": 0}
        self._weights: dict[tuple[Path, str, int, str | None], Any] = {}
        self._models: dict[str, Model] = {}
        self._slots: dict[str, dict[str, _Slot]] = {}
        self._scratch: Scratch | None = None  # while a strict open loads many packages: one reused memory file
        self.load_ms: float = 0.0
        self.num_blocks: Any = None  # the block count the host asks for (runtime/block_layout.py), or None
        self.num_blocks_source = ""

    @property
    def counters(self) -> Counters:
        return Counters(**self._counts)

    def labels(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self._releases:
            for g in r.manifest.graphs:
                seen.setdefault(g.label, None)
        return list(seen)

    def model(self, label: str) -> Model:
        """The deployed model `label`. In strict mode every graph of it must run here: each is loaded now, and a
        graph that cannot run on this host (or is missing, damaged, or fails to load) is a RuntimeError listing them
        all, as `require` at open does, instead of an error at the first call."""
        if label not in self._models:
            slots = self._slots.get(label) or self._select(label, None)[0]
            if not slots:
                if self._eager.get(label) is None or self.strict:
                    raise KeyError(f"{label} is not deployed in {self.root} (deployed: {', '.join(self.labels()) or 'none'})")
                self._counts["miss"] += 1
                log.warning("neuronbuild.runtime: miss: %s is not deployed; running it eagerly", label)
                return _EagerModel(self, label, self._eager[label])  # type: ignore[return-value]
            if self.strict:
                unusable = [f"{s.graph.describe()}: {s.problem}" for s in slots.values() if s.problem is not None]
                if unusable:
                    raise RuntimeError(f"strict mode: {label}: {len(unusable)} graph(s) cannot run here (host: "
                                       f"{self.host.describe()}):\n  " + "\n  ".join(unusable))
                for slot in slots.values():
                    self._load(slot)  # strict: a load failure raises, naming the graph
            self._slots[label] = slots
            self._models[label] = Model(self, label, slots, self._eager.get(label))
        return self._models[label]

    def causal_lm(self, label: str) -> Any:
        """A deployed hf_causal_lm (context + token graphs) ready to `generate` (see runtime/causal_lm.py). In strict
        mode every graph is loaded now."""
        from neuronbuild.runtime.causal_lm import CausalLM

        model = self.model(label)
        if not isinstance(model, Model):
            raise KeyError(f"{label} is not deployed in {self.root}")
        from neuronbuild.runtime.block_layout import check_label

        check_label(label, [s.graph for s in self._slots.get(label, {}).values()], self.num_blocks,
                    self.num_blocks_source)  # (a block count asked for by the host: the compiled one, or refused)
        return CausalLM(model, strict=self.strict)  # strict: model() loaded every graph, or raised

    # -- resolution ------------------------------------------------------------------------------------------------

    def _select(self, label: str, expected: list[Graph] | None) -> tuple[dict[str, _Slot], list[Problem]]:
        """The graphs serving `label`: the expected fingerprints, else the newest release holding the label."""
        problems: list[Problem] = []
        slots: dict[str, _Slot] = {}
        by_fp: dict[tuple[str, str, tuple[str, ...]], tuple[Graph, Release]] = {}  # (by Graph.identity)
        by_key: dict[tuple[str, str], list[Graph]] = {}
        for r in self._releases:
            for g in r.manifest.graphs:
                by_fp.setdefault(g.identity, (g, r))
                by_key.setdefault(g.key, []).append(g)
        pinned = expected is not None
        if expected is None:
            newest = next((r for r in self._releases if label in r.manifest.labels()), None)
            if newest is None:
                return {}, [Problem(label, "not deployed (no release in this directory holds it)")]
            expected = [g for g in newest.manifest.graphs if g.label == label]
        for eg in expected:
            hit = by_fp.get(eg.identity)
            if hit is None:
                near = by_key.get(eg.key)
                if near:
                    diffs = graph_diff(eg, near[0])
                    what = "; ".join(f"{p} differs (expected {a!r}, deployed {b!r})" for p, a, b in diffs[:4])
                    reason = f"missing: a graph with this label and bucket is deployed but was built differently: {what}"
                else:
                    reason = "missing: not deployed"
                slot = _Slot(eg, None)
                slot.problem = reason
                problems.append(Problem(eg.describe(), reason))
            else:
                slot = _Slot(_pinned(eg, hit[0]) if pinned else hit[0], hit[1])
                if pinned:
                    for name, why in _artifact_diff(eg, hit[0]):
                        slot.problem = f"{name} differs from the expected manifest ({why})"
                        problems.append(Problem(eg.describe(), slot.problem))
                for m in check_graph(hit[0], self.host, self.emulate):
                    slot.problem = f"{m.field} differs (built for {m.built}, this host has {m.here})"
                    problems.append(Problem(eg.describe(), slot.problem))
                intact = True
                for ref in [*hit[0].artifacts.values(), *([hit[0].weights] if hit[0].weights else [])]:
                    p = hit[1].dir / ref.path
                    if not p.is_file() or p.stat().st_size != ref.size:
                        intact = False
                        slot.problem = f"artifact {ref.path} is missing or damaged in {hit[1].dir}"
                        problems.append(Problem(eg.describe(), slot.problem))
                if intact and self.strict:  # the weights against the parameters the graph binds (#51), headers only
                    try:
                        mismatch = weights_mismatch(hit[0], hit[1].dir)
                    except BadWeights as e:
                        mismatch = str(e)
                    if mismatch is not None:
                        slot.problem = f"weights do not match the graph: {mismatch}"
                        problems.append(Problem(eg.describe(), slot.problem))
            slots[eg.bucket_name] = slot
        return slots, problems

    # -- loading ---------------------------------------------------------------------------------------------------

    def _weights_for(self, path: Path, ref: FileRef) -> Any:
        key = (path, ref.sha256, ref.size, ref.blake3)  # shared only by graphs that name the same digests
        if key not in self._weights:
            self._weights[key] = load_weights_verified(path, ref)  # every byte checked before use, read once
        return self._weights[key]

    def _weights_ref(self, rdir: Path, g: Graph) -> Callable[[FileRef], Any]:
        """A weights file's tensors for graph `g`: the model's weights (or a rank's shard) and the graph's own tensors
        (program_constants.safetensors, when the graph has one: non-persistent buffers, lifted constants; small), each
        byte checked; a name in both keeps the weights file's value (a tensor-parallel rank's shard holds its own
        values of per-rank buffers)."""
        own = g.artifacts.get(PROGRAM_CONSTANTS)
        draft = g.artifacts.get(DRAFT_WEIGHTS)
        if draft is not None:  # a fused speculation graph: + its draft model's weights under "draft."
            def both(ref: FileRef) -> Any:
                tensors = {DRAFT_PREFIX + k: v for k, v in self._weights_for(rdir / draft.path, draft).items()}
                if own is not None:
                    tensors.update(self._weights_for(rdir / own.path, own))
                return {**tensors, **self._weights_for(rdir / ref.path, ref)}

            return both
        if own is None:
            return lambda ref: self._weights_for(rdir / ref.path, ref)
        return lambda ref: {**self._weights_for(rdir / own.path, own), **self._weights_for(rdir / ref.path, ref)}

    def _load(self, slot: _Slot) -> Callable[..., Any] | None:
        if slot.fn is not None:
            return slot.fn
        if slot.problem is not None or slot.release is None:
            if not slot.missed:
                slot.missed = True
                self._counts["miss"] += 1
                log.warning("neuronbuild.runtime: miss: %s: %s", slot.graph.describe(), slot.problem or "missing")
            return None
        g = slot.graph
        emulated = False
        try:  # through the runtime loader its toolchain registered for the format (runtime/loaders.py)
            loader = loader_for(g.format)
            if loader is None:
                raise RuntimeError(no_loader(g.format))
            loaded = loader.load(load_request(g, slot.release.dir, self.emulate, self._weights_ref(slot.release.dir, g),
                                             self._scratch))
            slot.fn, emulated = loaded.fn, loaded.emulated
        except Exception as e:  # noqa: BLE001 - any load failure is this graph's error
            self._counts["error"] += 1
            slot.problem = f"failed to load: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.error("neuronbuild.runtime: error: %s: %s", g.describe(), slot.problem)
            if self.strict:
                raise RuntimeError(f"strict mode: {g.describe()}: {slot.problem}") from None
            return None
        self._counts["emulated" if emulated else "hit"] += 1
        return slot.fn

    def _eager_call(self, label: str, why: str, fn: Callable[..., Any], args: Sequence[Any],
                    named: Mapping[str, Any] | None = None) -> Any:
        self._counts["eager"] += 1
        if self._counts["eager"] == 1 or self._counts["eager"] % 1000 == 0:
            log.warning("neuronbuild.runtime: %s: running eagerly (%s); %d eager call(s) so far",
                        label, why, self._counts["eager"])
        return fn(*args, **(named or {}))


class _EagerModel:
    """A non-strict stand-in for a model that is not deployed at all: every call runs the eager fallback."""

    def __init__(self, cache: DeployedCache, label: str, fn: Callable[..., Any]) -> None:
        self._cache, self.label, self._fn = cache, label, fn

    def __call__(self, *args: Any, **kw: Any) -> Any:  # no declaration to check against: the eager model checks
        named = {k: v for k, v in kw.items() if k not in ("pad_value", "split")}
        return self._cache._eager_call(self.label, "not deployed", self._fn, args, named)


def _scratch_bytes(g: Graph) -> int:
    loader = loader_for(g.format)
    return loader.scratch_bytes(g) if loader is not None else 0


def _expected(expect: str | Path | Manifest | Mapping[str, Any] | None) -> Manifest | None:
    if expect is None or isinstance(expect, Manifest):
        return expect
    if isinstance(expect, Mapping):
        return parse_manifest(expect, "expect")
    return read_manifest(Path(expect))


def open_cache(root: str | Path, strict: bool | None = None, require: Iterable[str] | None = None,
               expect: str | Path | Manifest | Mapping[str, Any] | None = None,
               eager: Mapping[str, Callable[..., Any]] | None = None, emulate: str | None = None,
               trusted_keys: str | Path | list[TrustedKey] | None = None,
               num_blocks: int | Mapping[str, int] | str | None = None) -> DeployedCache:
    """Open a directory written by `neuronbuild deploy`.

    strict (default: $NEURONBUILD_STRICT): every required graph must be deployed, intact, match `expect` (a bundle
    manifest: exact fingerprints) when given, and suit this host; it is loaded now, else one RuntimeError lists
    every problem, naming the graph and, when a near entry exists, the fields that differ. require (default:
    $NEURONBUILD_REQUIRE, comma-separated, else the labels of `expect`): labels to check and load at open.
    Non-strict: problems are logged, graphs load on first use, and a miss runs `eager[label]` when given.
    emulate (default: $NEURONBUILD_EMULATE): "xla-cpu" runs Neuron graphs' HLO modules on XLA:CPU on any host (needs
    the `neuron` extra), counted as `emulated`; without it a Neuron graph needs a Neuron device.
    trusted_keys (default: $NEURONBUILD_TRUSTED_KEYS, a file of Ed25519 public keys): releases whose manifest is not
    signed by one of them are not served (in strict mode, a required label they hold is an error).
    num_blocks (default: $NEURONBUILD_NUM_BLOCKS): the KV block count this host serves with, N for every
    block-layout model or {label: N} (runtime/block_layout.py): a required model compiled for another count is a
    strict-mode problem naming both counts, and causal_lm(label) refuses it (BlockLayoutMismatch) in either mode.
    Every artifact and weights file is checked against its manifest digest (BLAKE3, else SHA-256) as it is read,
    before it is used."""
    root = Path(root)
    if emulate is None:
        emulate = envvars.current().text(EMULATE_ENV)
    if emulate is not None and emulate not in EMULATE_MODES:
        raise ValueError(f"emulate must be one of {', '.join(EMULATE_MODES)} or None, got {emulate!r}")
    strict = envvars.current().flag(STRICT_ENV) if strict is None else bool(strict)
    want = _expected(expect)
    if require is None:
        env = list(envvars.current().words(REQUIRE_ENV))
        require = env or (want.labels() if want is not None else [])
    required = list(dict.fromkeys(require))
    start = time.perf_counter()
    try:
        releases = read_releases(root)
    except LayoutError as e:
        raise RuntimeError(f"cannot open deployed cache {root}: {e}") from None
    keys_from = trusted_keys if trusted_keys is not None else envvars.current().text(TRUSTED_KEYS_ENV)
    unsigned: dict[str, str] = {}
    if keys_from is not None:
        try:
            keys = keys_from if isinstance(keys_from, list) else load_trusted_keys(keys_from)
        except SignatureError as e:
            raise RuntimeError(f"cannot open deployed cache {root}: {e}") from None
        kept = []
        for r in releases:
            try:
                sig = _read_small(r.dir / SIGNATURE_FILE)
                verify_manifest(r.manifest_bytes, sig, keys, f"release {r.id}")
                kept.append(r)
            except SignatureError as e:
                for lbl in r.manifest.labels():
                    unsigned.setdefault(lbl, str(e))
                log.warning("neuronbuild.runtime: not serving %s: %s", r.dir, e)
        releases = kept
    if not releases and strict and not unsigned:
        raise RuntimeError(f"strict mode: nothing is deployed in {root} (run `neuronbuild deploy BUNDLE --dest {root}`)")
    from neuronbuild.runtime.block_layout import NUM_BLOCKS_ENV, block_count_mismatches, parse_num_blocks

    source = "open_cache(num_blocks=...)" if num_blocks is not None else f"${NUM_BLOCKS_ENV}"
    asked = parse_num_blocks(num_blocks if num_blocks is not None else envvars.current().text(NUM_BLOCKS_ENV), source)
    cache = DeployedCache(root, strict, releases, current_host(), eager or {}, emulate)
    cache.num_blocks, cache.num_blocks_source = asked, source
    problems: list[Problem] = []
    for label in required:
        if label in unsigned and not any(label in r.manifest.labels() for r in releases):
            problems.append(Problem(label, f"refused: {unsigned[label]}"))
            continue
        expected = [g for g in want.graphs if g.label == label] if want is not None else None
        if expected == []:
            problems.append(Problem(label, "required but not in the expected manifest"))
            continue
        slots, found = cache._select(label, expected)
        problems += found
        problems += [Problem(m.graph, f"{m.field} differs (built for {m.built}, this host has {m.here})")
                     for m in block_count_mismatches([s.graph for s in slots.values()], asked, source)]
        if slots:
            cache._slots[label] = slots
    if strict and problems:
        lines = "\n  ".join(str(p) for p in problems)
        raise RuntimeError(f"strict mode: {len(problems)} problem(s) with the deployed graphs in {root} "
                           f"(host: {cache.host.describe()}):\n  {lines}")
    for p in problems:
        log.warning("neuronbuild.runtime: %s", p)
    if strict:
        to_load = [s for label in required for s in cache._slots.get(label, {}).values()]
        cache._scratch = Scratch.create(max((_scratch_bytes(s.graph) for s in to_load if s.problem is None),
                                            default=0))
        try:
            for slot in to_load:
                cache._load(slot)
        finally:
            if cache._scratch is not None:
                cache._scratch.close()
                cache._scratch = None
    cache.load_ms = (time.perf_counter() - start) * 1000
    log.info("neuronbuild.runtime: opened %s (%s%s, %d release(s), %d graph(s) loaded in %.1f ms): %s",
             root, "strict" if strict else "lenient", f", emulate={emulate}" if emulate else "", len(releases),
             cache.counters.hit + cache.counters.emulated, cache.load_ms, cache.counters)
    return cache


def _read_small(path: Path) -> bytes | None:
    """A signature file's bytes (None when absent); bounded so a hostile file cannot exhaust memory."""
    from neuronbuild.runtime.signing import MAX_SIGNATURE_BYTES

    try:
        with open(path, "rb") as f:
            return f.read(MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SignatureError(f"cannot read {path}: {e.strerror or e}") from None
