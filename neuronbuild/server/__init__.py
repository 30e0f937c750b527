"""The build server: a per-workspace daemon that keeps warm workers and loaded packages between commands (docs/server.md)."""
