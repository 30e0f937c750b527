"""What a rule kind is: its attribute schema plus its analysis (the plug-in API's `RuleKind`, re-exported here)."""

from neuronbuild.plugin_api.rules import RuleKind as RuleKind
