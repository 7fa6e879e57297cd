#!/usr/bin/env bash
# The release binary, target/release/nbdgw: the one build command the demo
# and the container image share. --strip leaves out debug information
# (10.5 MB without it, measured 2026-12-03 in the image that
# scripts/container-test.sh builds), as an image should.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--strip" ]; then
    export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
fi
cargo build --release --locked --quiet --bin nbdgw
echo target/release/nbdgw
