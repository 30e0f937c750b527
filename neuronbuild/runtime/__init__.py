"""Production runtime: open a deployed cache, route inputs to buckets, run built artifacts; never compiles.

Importing this package needs neither torch nor the build-side dependencies (starlark, networkx, blake3); torch is
imported when the first graph loads."""

from neuronbuild.runtime.deployed import Counters, DeployedCache, Model, open_cache
from neuronbuild.runtime.inputs import InputError
from neuronbuild.runtime.router import BucketRouter, NoBucketFits

__all__ = ["BucketRouter", "Counters", "DeployedCache", "InputError", "Model", "NoBucketFits", "open_cache"]
