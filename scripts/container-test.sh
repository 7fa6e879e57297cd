#!/usr/bin/env bash
# The image and the pod, for real, with Debian's podman (needs root, and
# podman, buildah, runc and debootstrap: scripts/setup.sh installs them):
#
# 1. The bases the Containerfiles name are made locally
#    (scripts/container-bases.sh), then deploy/container/Containerfile is
#    built unchanged, both stages: `cargo build --release --locked` runs
#    inside the builder. So is nbd-tools.Containerfile.
# 2. The image runs read-only, as 65532, with every capability dropped and
#    no-new-privileges, in front of qemu-nbd in the nbd-tools image, with
#    mutual TLS; nbdinfo, nbdcopy (checksum), qemu-img and qemu-io on this
#    host are its clients.
# 3. The node gateway's hand-over (deploy/kubernetes/node-gateway): two
#    containers of the image in their own pid namespaces on the host's
#    network take over one from the other under a python3-libnbd client
#    writing and reading on one TLS session (scripts/container-handover.sh).
# 4. `podman kube play` runs the kustomize base through the test overlay
#    deploy/kubernetes-test-podman/ (what podman 4.3 lacks, patched there);
#    the backup identity copies the disk (checksum) and is refused a write,
#    an unknown identity is refused, /readyz and /metrics answer; then
#    `podman kube down`, and nothing may be left.
#
# Everything it starts is removed at the end, failure or not. The bases are
# cached under ~/.cache/nbdgw/container (keyed by their inputs).
#
#   scripts/container-test.sh            # all of it
#   scripts/container-test.sh --no-pod   # the image only
#   NBDGW_CONTAINER_REUSE=1 scripts/container-test.sh   # no build if built
set -euo pipefail
# Without it bash switches -e off inside $(...), where the bases are made:
# a failed step would cache a broken base (the review's experiment: a
# 10 KB runtime tarball, status 0, reused by every later run).
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
repo=$PWD
started=$SECONDS
log() { echo "container-test: [$((SECONDS - started))s] $*" >&2; }
fail() { echo "container-test: FAILED: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || fail "needs root (debootstrap, and podman's rootful storage)"
# kubectl from the deploy virtualenv scripts/setup.sh makes (as test.sh).
deploy_venv="${NBDGW_DEPLOY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/deploy-venv-2}"
kubectl="$deploy_venv/bin/kubectl"
[ -x "$kubectl" ] || fail "$kubectl is missing: run scripts/setup.sh"
for tool in rustc cargo python3 podman buildah runc debootstrap qemu-nbd nbdinfo nbdcopy qemu-img qemu-io curl; do
    command -v "$tool" >/dev/null || fail "$tool is missing: run scripts/setup.sh"
done
cache="${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/container"
mkdir -p "$cache"
# One run at a time: two would share the :test tags, the hostPorts and the
# pod's names. The script runs again under flock; -o keeps the lock in
# flock's own process, so that no container's conmon inherits it and holds
# it past the run.
if [ "${NBDGW_CONTAINER_LOCKED:-}" != "$cache/lock" ]; then
    NBDGW_CONTAINER_LOCKED="$cache/lock" exec flock -o -w 3600 "$cache/lock" "$repo/scripts/container-test.sh" "$@"
fi
work=$(mktemp -d /tmp/nbdgw-container.XXXXXX)
chmod 0755 "$work"
# scripts/containers.conf with the containers' ulimits at most this
# machine's hard limits: a fixed figure above them fails every container
# ("error setting rlimit type 7"). Not the hard limit itself: nproc at
# the hard limit (96362 here) failed too ("error setting rlimit type 6",
# seen), so at most 16384 open files and 4096 processes, as before.
at_most() { local n; n=$(ulimit "-H$1"); [ "$n" != unlimited ] && [ "$n" -lt "$2" ] && echo "$n" || echo "$2"; }
sed -e "s/@NOFILE@/$(at_most n 16384)/g" -e "s/@NPROC@/$(at_most u 4096)/g" scripts/containers.conf >"$work/containers.conf"
export CONTAINERS_CONF="$work/containers.conf"
run_id="nbdgw-test-$$"
pod_yaml=""
build_pid=""

cleanup() {
    local status=$?
    set +e
    # A build still running (the run was interrupted): timeout passes the
    # TERM on to podman build.
    [ -z "$build_pid" ] || { kill "$build_pid"; wait "$build_pid"; } 2>/dev/null
    if [ -n "$pod_yaml" ]; then
        timeout 120 podman kube down "$pod_yaml" >/dev/null 2>&1
        podman volume rm nbdgw-policy >/dev/null 2>&1  # what kube down leaves
    fi
    podman ps -a --filter "label=nbdgw-test=$run_id" -q | xargs -r podman rm -f -t 5 >/dev/null 2>&1
    podman pod ls --filter "label=nbdgw-test=$run_id" -q | xargs -r podman pod rm -f >/dev/null 2>&1
    podman volume ls --filter "label=nbdgw-test=$run_id" -q | xargs -r podman volume rm -f >/dev/null 2>&1
    # An interrupted build's working containers (buildah's, GBs), which
    # podman ps shows only with --external: those on this script's bases.
    podman ps -a --external --format '{{.ID}} {{.Image}}' | awk '$2 ~ /^localhost\/nbdgw-test\// {print $1}' |
        xargs -r podman rm -f >/dev/null 2>&1
    rm -rf "$work"
    [ "$status" -eq 0 ] || echo "container-test: FAILED (exit $status) after $((SECONDS - started)) s" >&2
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# What a killed run left (holding the lock, no other run is going):
# containers and volumes labelled nbdgw-test, the overlay's pod, and the
# ConfigMap's volume only if that pod was there (kube down leaves it).
remove_stale() {
    local pods
    pods=$(podman pod ls -q --filter label=nbdgw-test=overlay)
    [ -z "$pods" ] || { log "removing a killed run's pod"; podman pod rm -f $pods >/dev/null; }
    podman ps -a -q --filter label=nbdgw-test | xargs -r podman rm -f >/dev/null
    podman volume ls -q --filter label=nbdgw-test | xargs -r podman volume rm -f >/dev/null
    [ -z "$pods" ] || ! podman volume exists nbdgw-policy || podman volume rm -f nbdgw-policy >/dev/null
}

# shellcheck source=scripts/container-bases.sh
source scripts/container-bases.sh
# shellcheck source=scripts/container-run.sh
source scripts/container-run.sh
# shellcheck source=scripts/container-handover.sh
source scripts/container-handover.sh

# The rest in one function, which bash reads whole before running it: an
# edit of this file during a run cannot derail the run.
main() {
remove_stale
# The toolchain copied into the builder must be the one the Containerfile
# names, or the stand-in would build with another compiler.
wanted=$(sed -n 's|^FROM docker.io/library/rust:\([0-9.]*\)-bookworm AS build$|\1|p' deploy/container/Containerfile)
[ -n "$wanted" ] || fail "the Containerfile's build stage is not rust:X.Y-bookworm any more"
# That version installed beside another default is used as it is.
if [[ "$(rustc -V)" != "rustc $wanted."* ]] && command -v rustup >/dev/null &&
    rustup toolchain list | grep -q "^$wanted"; then
    RUSTUP_TOOLCHAIN=$(rustup toolchain list | grep -m1 "^$wanted" | cut -d' ' -f1)
    export RUSTUP_TOOLCHAIN
fi
[[ "$(rustc -V)" == "rustc $wanted."* ]] || fail "the Containerfile wants rust $wanted, this machine has $(rustc -V)"

# NBDGW_CONTAINER_REUSE=1 keeps images an earlier run built, to work on the
# steps after the build; CI never sets it.
if [ "${NBDGW_CONTAINER_REUSE:-}" = 1 ] && podman image exists "$nbdgw_image" && podman image exists "$tools_image"; then
    log "reusing $nbdgw_image and $tools_image (NBDGW_CONTAINER_REUSE=1): nothing built"
else
    minbase=$(minbase_image)
    runtime=$(runtime_image)
    builder_image "$minbase"
    log "bases: $minbase $runtime $builder"
    prune_bases "$minbase" "$runtime" "$builder"
    build_images "$minbase" "$runtime" "$builder"
fi
run_image
run_node_handover
[ "${1:-}" = "--no-pod" ] || run_pod
log "passed in $((SECONDS - started)) s"
}
main "$@"
