"""The plug-in API, at the base layer: what rule kinds (rules.py), toolchains and their settings (toolchain.py, flag.py)
and runtime loaders (loader.py) implement, the plain data they mention (actions.py, ...), and the registry they are
registered in (registry.py). It imports nothing above the base at run time (tests/test_layering.py)."""
