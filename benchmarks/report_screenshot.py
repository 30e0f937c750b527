"""Makes docs/report.png: the invocation page of the example workspace after a bucket edit, as headless Chromium shows it.

    python benchmarks/report_screenshot.py [--out docs/report.png]

Copies examples/ to a temporary directory, builds //models:llama_trn2 there (traces and HLO lowerings: no neuronx-cc,
no AOTInductor compile; ~1 minute), changes the context length of :serve (32 -> 48) and builds again, so the page has
executed and cached cells, a timeline and a compare view; then `neuronbuild report` and Chromium's own --screenshot
(Debian's /usr/bin/chromium). Everything (cache, output base, browser profile) lives in the temporary directory."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def nb(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "neuronbuild", "--batch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"neuronbuild {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "report.png"))
    ap.add_argument("--width", type=int, default=1300)
    ap.add_argument("--height", type=int, default=1900)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nb-report-shot-") as tmp:
        t = Path(tmp)
        ws = t / "examples"
        shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__", "hf"))
        env = {**os.environ, "NEURONX_CC": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(t / "output-root")}
        build = ["build", "//models:llama_trn2", "--jobs", "2", "--cache-dir", str(t / "cache")]
        print(nb(build, ws, env).strip().splitlines()[0])
        build_file = ws / "models" / "BUILD"
        text = build_file.read_text()
        assert "context_lengths = [32]" in text
        build_file.write_text(text.replace("context_lengths = [32]", "context_lengths = [48]"))
        print(nb(build, ws, env).strip())
        page = nb(["report"], ws, env).strip()
        print(page)
        out = Path(args.out).resolve()
        subprocess.run(["/usr/bin/chromium", *CHROMIUM_ARGS, f"--user-data-dir={t / 'profile'}",
                        f"--window-size={args.width},{args.height}", f"--screenshot={out}", page],
                       check=True, capture_output=True, timeout=120)
        print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
