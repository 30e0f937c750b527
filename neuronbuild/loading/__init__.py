"""Loading phase: BUILD and .bzl files (Starlark) -> a TargetGraph of typed targets."""
