# Sourced by scripts/container-test.sh: builds the two images from
# deploy/container/ unchanged, runs nbdgw's with real clients, and runs the
# Kubernetes pod with `podman kube play`.

nbdgw_image=localhost/nbdgw-test/nbdgw:test
tools_image=localhost/nbdgw-test/nbd-tools:test
backup_uri=spiffe://cluster.local/ns/disks/sa/disk-backup

# --build-context swaps each FROM for the local base (podman >= 4.3), so the
# Containerfiles stay as an operator with a registry would use them. The
# release build inside is niced: CI shares its cores.
build_images() {
    local minbase=$1 runtime=$2 builder=$3 t0=$SECONDS old registry mounts=()
    # The previous run's images, dropped once replaced (not left dangling).
    old=$(podman image inspect --format '{{.Id}}' "$nbdgw_image" "$tools_image" 2>/dev/null || true)
    log "building $nbdgw_image (cargo build --release inside $builder)"
    # The host's crates, overlaid (the build's downloads stay in the
    # build): the build still compiles everything inside the builder, it
    # only does not fetch again what cargo already has here.
    registry="${CARGO_HOME:-$HOME/.cargo}/registry"
    [ -d "$registry" ] && mounts=(-v "$registry:/usr/local/cargo/registry:O")
    nice -n 10 timeout 1800 podman build --pull=never --layers=false "${mounts[@]}" \
        --build-context "docker.io/library/rust:$wanted-bookworm=container-image://$builder" \
        --build-context "gcr.io/distroless/cc-debian12:nonroot=container-image://$runtime" \
        -f deploy/container/Containerfile -t "$nbdgw_image" . >"$work/build-nbdgw.log" 2>&1 &
    build_pid=$!
    wait "$build_pid" ||
        { tail -30 "$work/build-nbdgw.log" >&2; fail "the nbdgw image did not build"; }
    build_pid=""
    log "nbdgw image built in $((SECONDS - t0)) s; size $(image_size "$nbdgw_image")"
    t0=$SECONDS
    nice -n 10 timeout 900 podman build --pull=never \
        --build-context "docker.io/library/debian:bookworm-slim=container-image://$minbase" \
        -f deploy/container/nbd-tools.Containerfile -t "$tools_image" deploy/container >"$work/build-tools.log" 2>&1 &
    build_pid=$!
    wait "$build_pid" ||
        { tail -30 "$work/build-tools.log" >&2; fail "the nbd-tools image did not build"; }
    build_pid=""
    log "nbd-tools image built in $((SECONDS - t0)) s; size $(image_size "$tools_image")"
    for id in $old; do
        if podman image inspect --format '{{.RepoTags}}' "$id" 2>/dev/null | grep -qx '\[\]'; then
            podman rmi "$id" >/dev/null 2>&1 || true
        fi
    done
}

image_size() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.1f MB", $1 / 1e6}'; }

# The hardening a cluster's restricted profile asks for, on every container.
hardened=(--read-only --user 65532:65532 --cap-drop ALL --security-opt no-new-privileges --label "nbdgw-test=$run_id")

# Until $url answers 200, while container $2 runs: a container that died
# fails at once with its log, and one that never answers within 180 s
# (a loaded machine) with its log too. Logs are printed here, before the
# cleanup removes the containers.
wait_ready() {
    local url=$1 container=$2 deadline=$((SECONDS + 180))
    while [ "$SECONDS" -lt "$deadline" ]; do
        [ "$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "$url")" = 200 ] && return 0
        if [ "$(podman inspect --format '{{.State.Running}}' "$container" 2>/dev/null)" != true ]; then
            podman logs "$container" 2>&1 | tail -30 >&2
            fail "$container stopped before $url answered 200"
        fi
        sleep 0.2
    done
    podman logs "$container" 2>&1 | tail -30 >&2
    fail "$container never answered 200 at $url in 180 s"
}

# What --read-only, --user, --cap-drop ALL and no-new-privileges (or the
# pod's securityContext) really gave the container's process: every uid
# 65532, no effective capability, NoNewPrivs, and / mounted read-only.
check_hardened() {
    local container=$1 pid status
    pid=$(podman inspect --format '{{.State.Pid}}' "$container")
    [ "${pid:-0}" -gt 0 ] || fail "$container has no process"
    status=$(cat "/proc/$pid/status")
    grep -Eq '^Uid:\s+65532\s+65532\s+65532\s+65532$' <<<"$status" || fail "$container runs as $(grep ^Uid: <<<"$status")"
    grep -Eq '^CapEff:\s+0+$' <<<"$status" || fail "$container has capabilities: $(grep ^CapEff: <<<"$status")"
    grep -Eq '^NoNewPrivs:\s+1$' <<<"$status" || fail "$container lacks no-new-privileges"
    awk '$2 == "/" {ro = ($4 ~ /(^|,)ro(,|$)/)} END {exit !ro}' "/proc/$pid/mounts" ||
        fail "$container's / is not read-only: $(awk '$2 == "/"' "/proc/$pid/mounts")"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

sha() { sha256sum "$1" | cut -d' ' -f1; }

# Mutual TLS material from the image itself (`nbdgw certs`), written as
# 65532 into a directory that user owns.
make_pki() {
    install -d -o 65532 -g 65532 "$work/pki"
    podman run --rm "${hardened[@]}" -v "$work/pki:/pki" "$nbdgw_image" certs --out /pki \
        --server-name localhost --server-name 127.0.0.1 \
        --client-name disk-backup --client-uri "$backup_uri" --client-name intruder >/dev/null
    [ -s "$work/pki/client-intruder-key.pem" ] || fail "nbdgw certs made no intruder certificate"
    # Only the server's files in the gateway's --tls-dir (qemu's layout).
    install -d -o 65532 -g 65532 -m 0700 "$work/tls"
    cp -p "$work/pki"/{ca-cert,server-cert,server-key}.pem "$work/tls/"
}

run_image() {
    local port admin disk uri
    make_pki
    install -d -o 65532 -g 65532 "$work/data" "$work/run"
    disk="$work/data/disk.img"
    head -c 16M /dev/urandom >"$disk"
    chown 65532:65532 "$disk"
    podman run --rm --entrypoint /bin/sh "$nbdgw_image" -c true >/dev/null 2>&1 &&
        fail "the nbdgw image has a shell"
    podman run -d --name "$run_id-qemu-nbd" "${hardened[@]}" -v "$work/data:/data" -v "$work/run:/run/nbd" \
        "$tools_image" qemu-nbd --persistent --shared=8 --format=raw --export-name=disk \
        --socket=/run/nbd/disk.sock /data/disk.img >/dev/null
    port=$(free_port) admin=$(free_port)
    podman run -d --name "$run_id-nbdgw" "${hardened[@]}" -p "127.0.0.1:$port:10809" -p "127.0.0.1:$admin:9090" \
        -v "$work/run:/run/nbd" -v "$work/tls:/etc/nbdgw/tls:ro" -e RUST_LOG=info "$nbdgw_image" \
        --listen '[::]:10809' --admin-listen '0.0.0.0:9090' --tls-dir /etc/nbdgw/tls \
        --upstream /run/nbd/disk.sock >/dev/null
    wait_ready "http://127.0.0.1:$admin/readyz" "$run_id-nbdgw"
    check_hardened "$run_id-nbdgw"
    log "nbdgw container ready: read-only /, uid 65532, CapEff 0, NoNewPrivs 1 (read in /proc)"
    uri="nbds://localhost:$port/disk?tls-certificates=$work/pki"
    image_clients "$uri" "$port" "$disk"
    # A clean stop: SIGTERM, the drain, exit status 0.
    podman stop -t 60 "$run_id-nbdgw" >/dev/null
    [ "$(podman inspect --format '{{.State.ExitCode}}' "$run_id-nbdgw")" = 0 ] ||
        { podman logs "$run_id-nbdgw" | tail -20 >&2; fail "nbdgw did not exit 0 on SIGTERM"; }
    log "podman stop: nbdgw drained and exited 0"
    podman rm -f "$run_id-nbdgw" "$run_id-qemu-nbd" >/dev/null
}

image_clients() {
    local uri=$1 port=$2 disk=$3 tls creds
    timeout 60 nbdinfo "$uri" >"$work/nbdinfo.out" || { podman logs "$run_id-nbdgw" | tail >&2; fail "nbdinfo through the container"; }
    grep -q 'export-size: 16777216' "$work/nbdinfo.out" || fail "nbdinfo saw $(cat "$work/nbdinfo.out")"
    timeout 120 nbdcopy "$uri" "$work/copy.img"
    [ "$(sha "$work/copy.img")" = "$(sha "$disk")" ] || fail "nbdcopy's copy differs from the disk"
    log "nbdinfo and nbdcopy (16 MiB, sha256 equal) through the container"
    tls="tls-creds-x509,id=tls0,dir=$work/pki,endpoint=client"
    creds="driver=nbd,host=localhost,port=$port,export=disk,tls-creds=tls0"
    timeout 60 qemu-io --object "$tls" --image-opts "$creds" -c 'write -P 0x5a 1M 64k' >/dev/null
    timeout 120 qemu-img convert --object "$tls" --image-opts "$creds" -O raw "$work/qemu-copy.img"
    [ "$(sha "$work/qemu-copy.img")" = "$(sha "$disk")" ] || fail "qemu-img's copy differs from the disk"
    cmp -s <(head -c $((1024 * 1024 + 65536)) "$disk" | tail -c 65536) <(head -c 65536 /dev/zero | tr '\0' 'Z') ||
        fail "qemu-io's write did not reach the disk"
    log "qemu-io wrote 64 KiB that reached the disk; qemu-img convert read it all back equal"
}

# The ports deploy/kubernetes-test-podman publishes on the host's loopback.
pod_nbd_port=31809
pod_admin_port=31909
# podman 4.3 names a Deployment's pod NAME-pod-0, its containers
# NAME-pod-0-CONTAINER (seen here).
pod_name=disk-export-pod-0

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A claim as podman's named volume (labelled for the cleanup), filled by
# copying files into it.
filled_volume() {
    local name=$1 mount
    shift
    podman volume create --label "nbdgw-test=$run_id" "$name" >/dev/null
    mount=$(podman volume mount "$name")
    # Never into an empty path: "$mount/" would be the host's /.
    [ -n "$mount" ] && [ -d "$mount" ] && [ "$mount" != / ] || fail "podman volume mount $name gave '$mount'"
    cp "$@" "$mount/"
    chown -R 65532:65532 "$mount"
    podman volume unmount "$name" >/dev/null
    echo "$mount"
}

# The volumes the overlay names: the disk, and the TLS files cert-manager's
# Secret would hold (tls.crt, tls.key, ca.crt), from the test's PKI.
pod_volumes() {
    local tls="$work/pod-tls"
    mkdir -p "$tls"
    cp "$work/pki/server-cert.pem" "$tls/tls.crt"
    cp "$work/pki/server-key.pem" "$tls/tls.key"
    cp "$work/pki/ca-cert.pem" "$tls/ca.crt"
    filled_volume nbdgw-test-tls "$tls"/* >/dev/null
    mkdir -p "$work/pod-data"
    head -c 16M /dev/urandom >"$work/pod-data/disk.img"
    echo "$(filled_volume nbdgw-test-disk "$work/pod-data/disk.img")/disk.img"
}

run_pod() {
    local disk uri admin="http://127.0.0.1:$pod_admin_port" intruder
    for port in $pod_nbd_port $pod_admin_port; do port_free "$port" || fail "port $port (the test overlay's hostPort) is in use"; done
    podman pod exists "$pod_name" && fail "a pod $pod_name exists already (not a killed run's: it lacks the label nbdgw-test=overlay)"
    podman volume exists nbdgw-policy && fail "a volume nbdgw-policy exists already"
    podman_objects >"$work/before-play"
    disk=$(pod_volumes)
    "$kubectl" kustomize deploy/kubernetes-test-podman >"$work/pod.yaml"
    pod_yaml="$work/pod.yaml"
    timeout 180 podman kube play "$pod_yaml" >"$work/play.log" 2>&1 || { cat "$work/play.log" >&2; fail "podman kube play"; }
    podman container exists "$pod_name-nbdgw" ||
        fail "kube play made no container $pod_name-nbdgw: $(podman ps -a --format '{{.Names}}' | tr '\n' ' ')"
    wait_ready "$admin/readyz" "$pod_name-nbdgw"
    check_hardened "$pod_name-nbdgw"
    log "pod up (podman kube play of deploy/kubernetes-test-podman); /readyz 200; its nbdgw read-only /, uid 65532, CapEff 0, NoNewPrivs 1"
    uri="nbds://localhost:$pod_nbd_port/disk?tls-certificates=$work/pki"
    timeout 120 nbdcopy "$uri" "$work/pod-copy.img" || { pod_logs; fail "the backup identity's nbdcopy through the pod"; }
    [ "$(sha "$work/pod-copy.img")" = "$(sha "$disk")" ] || fail "the pod's copy differs from the disk"
    pod_write_refused "$uri"
    [ "$(sha "$work/pod-data/disk.img")" = "$(sha "$disk")" ] || fail "the refused write changed the disk"
    log "through the pod: the backup identity's nbdcopy (16 MiB, sha256 equal); its write, put on the wire, refused by nbdgw (EPERM), and its session audited read-only by policy:1"
    intruder="$work/intruder"
    install -d -m 0700 "$intruder"
    cp "$work/pki/ca-cert.pem" "$intruder/"
    cp "$work/pki/client-intruder-cert.pem" "$intruder/client-cert.pem"
    cp "$work/pki/client-intruder-key.pem" "$intruder/client-key.pem"
    timeout 60 nbdinfo "nbds://localhost:$pod_nbd_port/disk?tls-certificates=$intruder" >/dev/null 2>&1 &&
        fail "an unknown identity opened the export"
    curl -sf --max-time 10 "$admin/metrics" >"$work/metrics"
    grep -qx 'nbdgw_identities_refused_total 1' "$work/metrics" || fail "/metrics did not count the unknown identity"
    log "an unknown identity refused (nbdgw_identities_refused_total 1 in /metrics)"
    pod_down
}

# The backup identity's write, refused by nbdgw itself. nbdcopy would not
# do: libnbd refuses to write to a read-only export before anything is
# sent. So libnbd's strict check is switched off and a real NBD_CMD_WRITE
# goes out; nbdgw's own error text (libnbd's debug "structured error server
# message") tells its refusal from qemu-nbd's. The answer alone cannot show
# the policy (nbdgw refuses any write to an export qemu-nbd serves
# --read-only), so the session's audit line must say access "read-only"
# under policy:1 for that identity.
pod_write_refused() {
    local uri=$1
    timeout 60 /usr/bin/python3 - "$uri" >"$work/write.out" 2>&1 <<'EOF' || { cat "$work/write.out" >&2; pod_logs; fail "the backup identity's write was not refused by nbdgw"; }
import errno, sys
import nbd
h = nbd.NBD()
said = []
h.set_debug_callback(lambda context, message: said.append(message))
h.set_debug(True)
h.set_strict_mode(h.get_strict_mode() & ~nbd.STRICT_COMMANDS)
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
assert h.is_read_only(), "the export is not advertised read-only"
try:
    h.pwrite(b"\x5a" * 65536, 0)
except nbd.Error as e:
    assert e.errnum == errno.EPERM, f"the write failed otherwise: {e}"
else:
    sys.exit("the write was acknowledged")
servers = [m for m in said if "server message" in m]
assert any("nbdgw: the export is read-only" in m for m in servers), f"not nbdgw's refusal: {servers}"
h.shutdown()
EOF
    podman logs "$pod_name-nbdgw" >"$work/pod-nbdgw.log" 2>&1
    audited_read_only "$work/pod-nbdgw.log" "$backup_uri" || fail "the backup identity's session was not audited read-only by policy:1"
}

# A `negotiated` audit line (JSON) for the identity $2 in log $1 that says
# access "read-only" under policy:1.
audited_read_only() {
    /usr/bin/python3 - "$1" "$2" <<'EOF'
import json, sys
path, uri = sys.argv[1:]
for line in open(path):
    try:
        entry = json.loads(line)
    except ValueError:
        continue
    fields = entry.get("fields", {})
    if (entry.get("target") == "nbdgw::audit" and fields.get("message") == "negotiated"
            and f'URI ["{uri}"]' in fields.get("client", "")):
        wanted = ("read-only", "policy:1", True)
        sys.exit(0 if (fields.get("access"), fields.get("rule"), fields.get("read_only")) == wanted else f"audited as {fields}")
sys.exit(f"no negotiated line for {uri}")
EOF
}

pod_logs() { podman pod logs "$pod_name" 2>&1 | tail -30 >&2; }

# Every pod, container, volume and secret podman has, one a line.
podman_objects() {
    podman pod ls --format 'pod {{.Name}}'
    podman ps -a --format 'container {{.Names}}'
    podman volume ls --format 'volume {{.Name}}'
    podman secret ls --format 'secret {{.Name}}'
}

# kube down, then nothing the play made may be left: podman holds what it
# held before the play.
pod_down() {
    local left
    timeout 120 podman kube down "$pod_yaml" >/dev/null
    pod_yaml=""
    podman volume rm nbdgw-test-disk nbdgw-test-tls >/dev/null
    # podman 4.3's kube down leaves the volume kube play made of the
    # ConfigMap (seen here); it is removed by name, and counted below if not.
    podman volume rm nbdgw-policy >/dev/null
    left=$(diff <(sort "$work/before-play") <(podman_objects | sort) || true)
    [ -z "$left" ] || fail "left behind after podman kube down: $left"
    log "podman kube down left no pod, container, volume or secret"
}
