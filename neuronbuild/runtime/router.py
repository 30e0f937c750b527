"""The bucket router: picks the smallest compiled bucket that fits an input's shape, pads inputs and un-pads outputs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class NoBucketFits(ValueError):
    """No compiled bucket is large enough for the inputs (or the inputs do not match the model's input spec)."""


@dataclass(frozen=True)
class Route:
    """The chosen bucket for one call: its name, sizes, and the actual sizes of the named dims."""

    bucket_name: str
    bucket: Mapping[str, int] = field(hash=False)
    actual: Mapping[str, int] = field(hash=False)

    @property
    def padded(self) -> bool:
        return any(self.actual[d] != self.bucket[d] for d in self.actual)


@dataclass(frozen=True)
class BucketRouter:
    """Routes positional inputs (declared as name -> {"dtype", "dims"}) to one of `buckets` (name -> sizes)."""

    inputs: Mapping[str, Mapping[str, Any]] = field(hash=False)
    buckets: Mapping[str, Mapping[str, int]] = field(hash=False)

    def actual_sizes(self, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
        specs = list(self.inputs.items())
        if len(shapes) != len(specs):
            raise NoBucketFits(f"expected {len(specs)} input(s) ({', '.join(self.inputs)}), got {len(shapes)}")
        actual: dict[str, int] = {}
        for (name, spec), shape in zip(specs, shapes, strict=True):
            dims = list(spec.get("dims", ()))
            if len(shape) != len(dims):
                raise NoBucketFits(f"input {name!r} has {len(shape)} dims, the model declares {len(dims)} ({dims})")
            for d, size in zip(dims, shape, strict=True):
                if isinstance(d, int):
                    if size != d:
                        raise NoBucketFits(f"input {name!r}: fixed dim of size {d} got {size}")
                elif actual.setdefault(d, int(size)) != int(size):
                    raise NoBucketFits(f"dim {d!r} is {actual[d]} in one input and {size} in {name!r}")
        return actual

    def route(self, shapes: Sequence[Sequence[int]]) -> Route:
        """The smallest bucket (fewest padded elements, then declaration order) whose every dim is >= the input's."""
        actual = self.actual_sizes(shapes)
        best: tuple[int, str] | None = None
        for name, sizes in self.buckets.items():
            if all(sizes.get(d, -1) >= v for d, v in actual.items()):
                cost = math.prod(sizes[d] for d in actual)
                if best is None or cost < best[0]:
                    best = (cost, name)
        if best is None:
            have = "; ".join(f"{n} ({', '.join(f'{k}={v}' for k, v in b.items())})" for n, b in self.buckets.items())
            want = ", ".join(f"{k}={v}" for k, v in actual.items())
            raise NoBucketFits(f"no bucket fits {want}; compiled buckets: {have}")
        return Route(best[1], dict(self.buckets[best[1]]), actual)

    def split_dim(self, shapes: Sequence[Sequence[int]], dim: str = "batch") -> int | None:
        """When no bucket fits only because `dim` is larger than every bucket's: the chunk size to run the call in
        (the largest size of `dim` among the buckets that fit the other dims), else None. Only valid for a dim whose
        rows are independent (a batch): that is why the dim is named, never guessed."""
        actual = self.actual_sizes(shapes)
        if dim not in actual:
            return None
        fit = [b[dim] for b in self.buckets.values()
               if dim in b and all(b.get(d, -1) >= v for d, v in actual.items() if d != dim)]
        if not fit or max(fit) >= actual[dim]:
            return None
        return max(fit)

    def split(self, args: Sequence[Any], chunk: int, dim: str = "batch") -> list[list[Any]]:
        """The inputs cut into consecutive chunks of `chunk` along `dim` (the last one may be smaller)."""
        positions = [spec.get("dims", ()).index(dim) if dim in spec.get("dims", ()) else None
                     for spec in self.inputs.values()]
        n = next(int(a.shape[p]) for a, p in zip(args, positions, strict=True) if p is not None)
        return [[a if p is None else a.narrow(p, start, min(chunk, n - start))
                 for a, p in zip(args, positions, strict=True)] for start in range(0, n, chunk)]

    @staticmethod
    def join(parts: Sequence[Any], outputs: Sequence[Mapping[str, Any]], dim: str = "batch") -> Any:
        """The outputs of the chunks of a split call (each a {name: tensor} dict, or one tensor), concatenated
        along the dim each output is recorded to follow `dim` at; one that follows no such dim: NoBucketFits."""
        import torch

        follows = {str(o["name"]): list(o.get("follows") or ()) for o in outputs}

        def axis(name: str) -> int:
            f = follows.get(name, [])
            if dim not in f:
                raise NoBucketFits(f"output {name!r} does not follow {dim!r}: the chunks of a split call cannot be "
                                   f"joined (pass exact sizes, at most the largest bucket's)")
            return f.index(dim)

        if isinstance(parts[0], torch.Tensor):
            return torch.cat(list(parts), dim=axis(next(iter(follows), "output")))
        return {name: torch.cat([p[name] for p in parts], dim=axis(name)) for name in parts[0]}

    def pad(self, args: Sequence[Any], route: Route, pad_value: float = 0) -> list[Any]:
        """Inputs padded at the end of each named dim up to the bucket's size."""
        import torch.nn.functional as F

        out = []
        for (_name, spec), t in zip(self.inputs.items(), args, strict=True):
            pads: list[int] = []
            for d, size in reversed(list(zip(spec.get("dims", ()), t.shape, strict=True))):
                pads += [0, (route.bucket[d] - int(size)) if isinstance(d, str) else 0]
            out.append(F.pad(t, pads, value=pad_value) if any(pads) else t)
        return out

    def unpad(self, result: Any, route: Route, outputs: Sequence[Mapping[str, Any]] = (),
              tree: str = "tuple") -> Any:
        """The compiled graph's flat outputs by name, in order, with padded positions sliced off exactly the dims
        recorded (declared or inferred at trace time) to follow a padded bucket dim.

        `outputs` are the manifest's output records ({"name", "follows": [bucket dim or None per dim]}); a model
        whose output was one tensor (`tree == "tensor"`) gets that tensor back, any other a {name: tensor} dict.
        Without output records (bundles built before they existed) a padded call is refused: nothing says which
        dims to cut, and guessing from sizes gives wrong shapes."""
        import torch

        tensors = [result] if isinstance(result, torch.Tensor) else list(result)
        if not outputs:
            if route.padded:
                raise NoBucketFits(f"the inputs need padding to bucket {route.bucket_name}, but this bundle records "
                                   f"no output dims to un-pad; rebuild it with this neuronbuild or pass exact sizes")
            return result
        if len(tensors) != len(outputs):
            raise NoBucketFits(f"the graph returned {len(tensors)} output(s), its manifest names {len(outputs)}")
        named: dict[str, Any] = {}
        for spec, t in zip(outputs, tensors, strict=True):
            for j, d in enumerate(spec.get("follows") or ()):
                if isinstance(d, str) and d in route.actual and route.actual[d] != route.bucket.get(d) \
                        and j < t.dim():
                    t = t.narrow(j, 0, route.actual[d])
            named[str(spec["name"])] = t
        if tree == "tensor" and len(named) == 1:
            return next(iter(named.values()))
        return named
