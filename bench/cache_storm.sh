#!/bin/bash
# A small boot storm through the read cache: N concurrent small-read boot
# replays of one seed (identical VMs, bench/nbdclient.py small-replay)
# through nbdgw to qemu-nbd on loopback, uncached, cached without
# read-ahead, and cached with it. Prints the time until the last replay
# finished, nbdgw's and qemu-nbd's CPU seconds, and the cache metrics.
#
#   cargo build --release && N=8 bench/cache_storm.sh
#
# WORK (default a new temporary directory) keeps the 1 GiB image between
# runs; NBDGW names the binary (default target/release/nbdgw).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${NBDGW:-$ROOT/target/release/nbdgw}
W=${WORK:-$(mktemp -d)}
N=${N:-8}
PORT=${PORT:-10900}
cd "$W"
[ -f img ] || head -c 1G /dev/urandom > img
[ -d certs ] || "$BIN" certs --out certs --server-name 127.0.0.1 > /dev/null
cpu() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
run() {
  local label=$1; shift
  rm -f sock
  qemu-nbd -r -f raw --persistent --shared=0 -k "$W/sock" img & local q=$!
  while [ ! -S sock ]; do sleep 0.05; done
  "$BIN" --listen 127.0.0.1:$PORT --tls-dir certs --upstream "$W/sock" \
    --admin-listen 127.0.0.1:$((PORT + 1)) --landlock false "$@" 2> "gw-$label.log" & local g=$!
  sleep 0.5
  local t0 pids=()
  t0=$(date +%s.%N)
  for _ in $(seq "$N"); do
    /usr/bin/python3 "$ROOT/bench/nbdclient.py" small-replay \
      "nbds://127.0.0.1:$PORT/?tls-certificates=$W/certs" 7 > /dev/null & pids+=($!)
  done
  wait "${pids[@]}"
  echo "$label: $N replays, last done after $(echo "$(date +%s.%N) - $t0" | bc) s;" \
    "nbdgw CPU $(cpu $g) s, qemu-nbd CPU $(cpu $q) s"
  curl -s 127.0.0.1:$((PORT + 1))/metrics | grep -E '^nbdgw_cache_(hits|misses|read_ahead)' | sed 's/^/  /'
  kill $g $q; wait $g $q 2> /dev/null || true
}
run uncached
run cached-no-read-ahead --immutable --read-ahead 0
run cached --immutable
