"""The toolchain protocol and the request it plans for: the plug-in API's (neuronbuild/plugin_api/toolchain.py),
re-exported here."""

from neuronbuild.plugin_api.toolchain import (  # noqa: F401
    UNSET,
    WARM_UP,
    CompileRequest,
    OptionKey,
    StepDirs,
    Toolchain,
    ToolSettings,
    ignored_options,
    option_warnings,
    toolchain_options,
    warm_up_key,
)
