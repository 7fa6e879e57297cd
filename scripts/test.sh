#!/usr/bin/env bash
# The full test suite: unit, property and integration tests against a real
# qemu-nbd with qemu-img and libnbd clients.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo test --all-targets --locked "$@"
# Every fuzz target, briefly, from the seed corpus (scripts/fuzz.sh 3600
# for a long run).
scripts/fuzz.sh 30
# A minute of verified I/O from 64 clients under injected faults (needs the
# debug binary cargo test built; bench/soak.py --seconds 14400 for hours).
/usr/bin/python3 bench/soak.py --seconds 60
# The benchmark's own logic (capture analysis); the benchmark itself needs
# root and minutes, so it runs from bench/, not here.
(cd bench && python3 -m py_compile run.py nbdclient.py wire.py soak.py && python3 -m unittest -q test_wire)
