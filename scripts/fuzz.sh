#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 30) from the seed corpus in
# fuzz/seeds, with cargo-fuzz on the nightly toolchain. A crash fails the
# run and leaves its input in fuzz/artifacts/TARGET/; turn it into a
# regression test. For long runs: scripts/fuzz.sh 3600.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
command -v cargo-fuzz >/dev/null || {
    echo "fuzz: cargo-fuzz missing (scripts/setup.sh installs it)" >&2
    exit 1
}
rustup toolchain list | grep -q '^nightly' || {
    echo "fuzz: the nightly toolchain is required (rustup toolchain install nightly)" >&2
    exit 1
}
cd fuzz
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cargo +nightly fuzz build -s none -O >/dev/null 2>&1 || cargo +nightly fuzz build -s none -O
for target in $(cargo +nightly fuzz list); do
    corpus="$work/$target"
    mkdir -p "$corpus"
    [ -d "seeds/$target" ] && cp seeds/"$target"/* "$corpus"/
    log="$work/$target.log"
    if ! cargo +nightly fuzz run -s none -O "$target" "$corpus" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -40 "$log" >&2
        echo "fuzz: $target FAILED (input saved under fuzz/artifacts/$target/)" >&2
        exit 1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "fuzz: $target ok: $runs runs in ${seconds}s ($speed/s), $cov, corpus $(ls "$corpus" | wc -l) inputs"
done
