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
# The benchmark's own logic (capture analysis); the benchmark itself needs
# root and minutes, so it runs from bench/, not here.
(cd bench && python3 -m py_compile run.py nbdclient.py wire.py && python3 -m unittest -q test_wire)
