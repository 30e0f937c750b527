"""CLI commands: one module per command, each with register(subparsers) and run(args) -> exit code.

To add a command, add its module name to COMMAND_MODULES; cli.py imports only the module of the command being run
(parsers are registered from the small, import-free `register` functions)."""

COMMAND_MODULES = ("build", "plan", "explain", "query", "upgrade_impact", "deploy", "verify", "validate", "cache", "farm",
                   "clean", "completion", "server", "report", "init", "weights", "help", "audit_keys")
