"""Action values, defined in the plug-in API (neuronbuild/plugin_api/actions.py) and re-exported here."""

from neuronbuild.plugin_api.actions import *  # noqa: F403
