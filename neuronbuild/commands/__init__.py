"""CLI commands: one module per command, each with register(subparsers) and run(args) -> exit code.

To add a command, add its module name to COMMAND_MODULES. A command run in this process imports every module listed
here (cli.make_parser registers each one's parser); their module level and `register` import nothing heavy, and each
`run` imports what its command needs. A command the build server runs imports none of them in the client."""

COMMAND_MODULES = ("build", "plan", "explain", "query", "upgrade_impact", "deploy", "verify", "validate", "cache", "farm",
                   "clean", "completion", "server", "report", "init", "weights", "help", "audit_keys")
