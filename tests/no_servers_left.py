"""After the server tests: fails (exit 1) when a build server they started under DIR is still running."""

import json
import os
import pathlib
import sys

alive = []
for info in pathlib.Path(sys.argv[1]).rglob("server.json"):
    pid = json.loads(info.read_text())["pid"]
    try:
        os.kill(pid, 0)
        alive.append(f"{pid} ({info})")
    except ProcessLookupError:
        pass
if alive:
    sys.exit("build servers outlived the tests: " + ", ".join(alive))
