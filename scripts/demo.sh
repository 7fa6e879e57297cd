#!/usr/bin/env bash
# The gateway in front of a demo qemu-nbd, with freshly generated
# certificates. Prints client commands to try; Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs: the tests' tools wait for scripts/test.sh.
scripts/setup.sh --demo
scripts/build-release.sh >/dev/null

port="${NBDGW_DEMO_PORT:-10809}"
demo="$PWD/demo"
mkdir -p "$demo"
certs="$demo/certs"
[ -f "$certs/server-cert.pem" ] || target/release/nbdgw certs --out "$certs" >/dev/null
if [ ! -f "$demo/disk.qcow2" ]; then
    qemu-img create -q -f qcow2 "$demo/disk.qcow2" 256M
    qemu-io -f qcow2 -c 'write -P 0x42 0 16M' -c 'write -P 0x17 128M 8M' "$demo/disk.qcow2" >/dev/null
fi
rm -f "$demo/nbd.sock"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -f "$demo/nbd.sock"; }
trap cleanup EXIT INT TERM

qemu-nbd -f qcow2 --persistent --shared=64 -A -k "$demo/nbd.sock" "$demo/disk.qcow2" &
pids+=($!)
for _ in $(seq 100); do [ -S "$demo/nbd.sock" ] && break; sleep 0.05; done

target/release/nbdgw \
    --listen "127.0.0.1:$port" \
    --tls-dir "$certs" \
    --upstream "$demo/nbd.sock" &
pids+=($!)
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done

cat <<TXT

nbdgw is listening on 127.0.0.1:$port in front of qemu-nbd on $demo/nbd.sock.
TLS and a client certificate from $certs/ca-cert.pem are required
(--tls-dir $certs: the qemu layout, whose ca-cert.pem is the client CA).
Try, from another terminal (the directory holds client-cert.pem and client-key.pem):

  nbdinfo 'nbds://localhost:$port/?tls-certificates=$certs'
  nbdinfo --map 'nbds://localhost:$port/?tls-certificates=$certs'
  nbdcopy 'nbds://localhost:$port/?tls-certificates=$certs' /tmp/copy.img
  qemu-img info --object tls-creds-x509,id=tls0,dir=$certs,endpoint=client \\
      --image-opts driver=nbd,host=localhost,port=$port,tls-creds=tls0

Ctrl-C stops the gateway and the demo upstream.
TXT
echo "--- first check, nbdinfo through the gateway:"
nbdinfo "nbds://localhost:$port/?tls-certificates=$certs" | head -4
wait
