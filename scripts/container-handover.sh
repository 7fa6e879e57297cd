# Sourced by scripts/container-test.sh: the node gateway's hand-over
# (deploy/kubernetes/node-gateway, docs/guides/restarts.md "Kubernetes")
# with the image the test built, as a DaemonSet's rollout runs it: two
# containers from the same image with the same flags, each in its own pid
# namespace (podman's default), both on the host's network, sharing a
# directory for the hand-over socket and qemu-nbd's (a hostPath in the
# manifest); read-only, uid 65532, no capability. A python3-libnbd client
# writes and reads back, verified, on one TLS session while the second
# container takes over from the first.

# The node gateway's command line, as daemonset.yaml has it (the ports
# aside): container $1 on ports $2 (NBD) and $3 (admin).
node_gateway() {
    local name=$1 port=$2 admin=$3 node=$work/node
    podman run -d --name "$name" "${hardened[@]}" --network host \
        -v "$node/handover:/run/nbdgw" -v "$node/nbd:/run/nbd:ro" -v "$work/tls:/etc/nbdgw/tls:ro" \
        -e RUST_LOG=info "$nbdgw_image" \
        --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --tls-dir /etc/nbdgw/tls \
        --upstream /run/nbd/disk.sock --shutdown-grace 20 \
        --handover-socket /run/nbdgw/handover.sock --take-over /run/nbdgw/handover.sock \
        --take-over-missing start --after-handover wait >/dev/null
}

# Until container $1's log has $2, within 120 s; its log and a failure if
# not, or if it stopped.
wait_log() {
    local name=$1 text=$2 deadline=$((SECONDS + 120))
    # grep without -q reads all: with pipefail, a grep that stops early
    # fails the pipeline on podman's SIGPIPE.
    until podman logs "$name" 2>&1 | grep -F -- "$text" >/dev/null; do
        if [ "$SECONDS" -ge "$deadline" ] || [ "$(podman inspect --format '{{.State.Running}}' "$name")" != true ]; then
            podman logs "$name" 2>&1 | tail -30 >&2
            fail "$name: no \"$text\" in its log"
        fi
        sleep 0.2
    done
}

# Until file $1 has a line "ops N" with N >= $2, within 120 s, while the
# client (pid $3) runs.
wait_ops() {
    local file=$1 wanted=$2 pid=$3 deadline=$((SECONDS + 120))
    until [ "$(awk '$1 == "ops" {n = $2} END {print n + 0}' "$file")" -ge "$wanted" ]; do
        kill -0 "$pid" 2>/dev/null || { cat "$file" >&2; fail "the libnbd client stopped"; }
        [ "$SECONDS" -lt "$deadline" ] || { cat "$file" >&2; fail "the libnbd client did not reach $wanted operations"; }
        sleep 0.2
    done
}

# TLS sessions established, summed over the groups, at admin port $1.
tls_sessions() {
    curl -sf --max-time 10 "http://127.0.0.1:$1/metrics" |
        awk '/^nbdgw_tls_sessions_total[{ ]/ {n += $NF} END {print n + 0}'
}

# One connection, until a file appears: 64 KiB written at a random place
# and read back, and another place read, each checked against a copy of
# the disk kept here; then the whole disk read back and checked, and that
# copy saved (argv: URI, the disk's file, where to save, the stop file).
# A file, not a pipe's end: the containers started meanwhile would
# inherit the pipe and hold it open.
node_client_py='
import os, random, sys
import nbd
uri, disk, saved, stop = sys.argv[1:]
model = bytearray(open(disk, "rb").read())
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(uri)
block, rng, ops = 65536, random.Random(29), 0
blocks = h.get_size() // block
assert blocks * block == len(model)
while not os.path.exists(stop):
    at = rng.randrange(blocks) * block
    data = os.urandom(block)
    h.pwrite(data, at)
    model[at:at + block] = data
    if h.pread(block, at) != data:
        sys.exit(f"mismatch after the write at {at}")
    other = rng.randrange(blocks) * block
    if h.pread(block, other) != model[other:other + block]:
        sys.exit(f"mismatch at {other}")
    ops += 1
    if ops % 10 == 0:
        print("ops", ops, flush=True)
h.flush()
for at in range(0, len(model), 1 << 20):
    if h.pread(1 << 20, at) != model[at:at + (1 << 20)]:
        sys.exit(f"mismatch in the final read at {at}")
h.shutdown()
open(saved, "wb").write(model)
print("done", ops, flush=True)
'

run_node_handover() {
    local t0=$SECONDS node=$work/node a=$run_id-node-a b=$run_id-node-b q=$run_id-node-qemu
    local port admin client ops status deadline ns_a ns_b
    install -d -o 65532 -g 65532 -m 0700 "$node/handover"
    install -d -o 65532 -g 65532 "$node/nbd" "$node/data"
    head -c 16M /dev/urandom >"$node/data/disk.img"
    chown 65532:65532 "$node/data/disk.img"
    podman run -d --name "$q" "${hardened[@]}" -v "$node/data:/data" -v "$node/nbd:/run/nbd" \
        "$tools_image" qemu-nbd --persistent --shared=8 --format=raw --export-name=disk \
        --socket=/run/nbd/disk.sock /data/disk.img >/dev/null
    port=$(free_port) admin=$(free_port)
    node_gateway "$a" "$port" "$admin"
    wait_ready "http://127.0.0.1:$admin/readyz" "$a"
    podman logs "$a" 2>&1 | grep -F "starting fresh (--take-over-missing start)" >/dev/null ||
        fail "the first node gateway did not start fresh with no predecessor"
    /usr/bin/python3 -c "$node_client_py" "nbds://localhost:$port/disk?tls-certificates=$work/pki" \
        "$node/data/disk.img" "$work/node-model.img" "$work/node-client.stop" </dev/null >"$work/node-client.out" 2>&1 &
    client=$!
    wait_ops "$work/node-client.out" 20 "$client"
    [ "$(tls_sessions "$admin")" = 1 ] || fail "the first node gateway counts $(tls_sessions "$admin") TLS sessions, not 1"
    node_gateway "$b" "$port" "$admin"
    wait_log "$b" "hand-over: serving a session handed over"
    wait_log "$a" "idle, listening on nothing"
    ops=$(awk '$1 == "ops" {n = $2} END {print n + 0}' "$work/node-client.out")
    wait_ops "$work/node-client.out" $((ops + 20)) "$client"
    touch "$work/node-client.stop"
    status=0
    timeout 120 tail --pid="$client" -f /dev/null || fail "the libnbd client did not stop"
    wait "$client" || status=$?
    [ "$status" = 0 ] && grep -q '^done ' "$work/node-client.out" ||
        { cat "$work/node-client.out" >&2; podman logs "$b" 2>&1 | tail -20 >&2; fail "the libnbd client failed across the hand-over (exit $status)"; }
    cmp -s "$work/node-model.img" "$node/data/disk.img" || fail "the disk differs from what the client wrote"
    # The session went on in the new gateway without a handshake: the
    # admin port is the new gateway's now.
    [ "$(tls_sessions "$admin")" = 0 ] || fail "the new node gateway counts $(tls_sessions "$admin") TLS sessions, not 0"
    curl -sf --max-time 10 "http://127.0.0.1:$admin/metrics" >"$work/node-metrics"
    grep -qx 'nbdgw_session_handovers_total{outcome="resumed"} 1' "$work/node-metrics" ||
        fail "the new node gateway did not count the session resumed"
    # Two pid namespaces, each peer watched by a pidfd all the same.
    ns_a=$(readlink "/proc/$(podman inspect --format '{{.State.Pid}}' "$a")/ns/pid")
    ns_b=$(readlink "/proc/$(podman inspect --format '{{.State.Pid}}' "$b")/ns/pid")
    [ -n "$ns_a" ] && [ "$ns_a" != "$ns_b" ] || fail "the node gateways share a pid namespace ($ns_a)"
    podman logs "$a" >"$work/node-a.log" 2>&1
    podman logs "$b" >"$work/node-b.log" 2>&1
    grep -q 'a successor connected.*pid=1\b' "$work/node-a.log" || fail "the old gateway did not see a successor that is pid 1 in its namespace"
    if grep -qF "cannot be watched" "$work/node-a.log"; then fail "the old gateway could not watch the new one"; fi
    grep -qF "watched=true" "$work/node-b.log" || fail "the new gateway could not watch the old one"
    check_hardened "$b"
    # The old one stays, idle (a kubelet would restart it had it exited),
    # until SIGTERM, which it answers at once with 0.
    [ "$(podman inspect --format '{{.State.Running}}' "$a")" = true ] || fail "the old node gateway did not stay"
    podman stop -t 30 "$a" >/dev/null
    [ "$(podman inspect --format '{{.State.ExitCode}}' "$a")" = 0 ] || fail "the old node gateway did not exit 0 on SIGTERM"
    podman logs "$a" 2>&1 | grep -F "SIGTERM received after the hand-over" >/dev/null || fail "the old node gateway's SIGTERM not logged"
    podman stop -t 30 "$b" >/dev/null
    [ "$(podman inspect --format '{{.State.ExitCode}}' "$b")" = 0 ] || fail "the new node gateway did not exit 0 on SIGTERM"
    podman rm -f "$a" "$b" "$q" >/dev/null
    log "node gateway (two containers, two pid namespaces, host network): $(awk '$1 == "done" {print $2}' "$work/node-client.out") verified write+read rounds on one TLS session through the hand-over, 1 handshake, the disk equal, the old one idle until SIGTERM, exit 0; $((SECONDS - t0)) s"
}
