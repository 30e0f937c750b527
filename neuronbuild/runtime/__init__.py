"""Runtime helpers that load and run built artifacts (AOTInductor packages)."""
