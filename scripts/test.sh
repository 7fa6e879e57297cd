#!/usr/bin/env bash
# The full test suite: unit, property and integration tests against a real
# qemu-nbd with qemu-img and libnbd clients.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo test --all-targets --locked "$@"
