#!/usr/bin/env bash
# The test suite of `make test` (the batch suite on two xdist workers, then the build server's tests) run twice on this
# checkout, one after the other: first with #53's dispatch switched off (NEURONBUILD_PREPARED_ACTIONS=0: every action's
# namespace init and process forked at dispatch; NEURONBUILD_LIGHT_STEPS=0: light steps in workers like every other
# action), then on. Group commits, unsynced claims and sized copy buffers stay on in both, so the difference is a lower
# bound of what #53 saves a suite of many small actions. No -x: with the switches off, the tests that assert prepared
# processes and light steps fail (5 expected); their time counts like any other. Each side starts without a pytest
# cache, so both hand test files out in the same order. Quiet machine only (2 x ~35 min): prints each side's seconds.
# Usage: benchmarks/suite_ab.sh [OUTDIR]   (run from anywhere; uses this checkout's .venv and `make test-deps`)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/suite_ab}; mkdir -p "$out"; : > "$out/times"
make -s test-deps > "$out/deps.log" 2>&1
for side in off on; do
  if [ "$side" = off ]; then sw=(NEURONBUILD_PREPARED_ACTIONS=0 NEURONBUILD_LIGHT_STEPS=0); else sw=(); fi
  rm -rf .pytest_cache
  echo "$side batch start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/times"
  s=$(date +%s)
  env "${sw[@]}" NEURONBUILD_NO_SERVER=1 .venv/bin/pytest -q -n 2 --dist loadfile --durations=30 tests \
    --ignore=tests/test_server.py > "$out/$side.batch.log" 2>&1
  echo "$side batch $(( $(date +%s) - s )) s: $(tail -1 "$out/$side.batch.log")" | tee -a "$out/times"
  tmp=$(mktemp -d); s=$(date +%s)
  env "${sw[@]}" .venv/bin/pytest -q tests/test_server.py --basetemp "$tmp/server-tests" > "$out/$side.server.log" 2>&1
  echo "$side server $(( $(date +%s) - s )) s: $(tail -1 "$out/$side.server.log")" | tee -a "$out/times"
  .venv/bin/python tests/no_servers_left.py "$tmp" | tee -a "$out/times"; rm -rf "$tmp"
done
rm -rf .pytest_cache
