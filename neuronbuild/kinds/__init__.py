"""The built-in rule kinds, one module each (schema + analysis), registered with neuronbuild.plugins on import."""

from neuronbuild.kinds import buckets, bundle, compile, model, options, py_library, target, weights
from neuronbuild.plugin_api import registry as plugins

for _kind in (model.KIND, py_library.KIND, buckets.KIND, target.KIND, options.KIND, compile.KIND, weights.KIND,
              bundle.KIND):
    plugins.register_rule(_kind)
