#!/usr/bin/env bash
# Installs what nbdgw's demo and tests need on a Debian machine:
# qemu-utils (qemu-nbd, qemu-img, qemu-io), libnbd-bin (nbdinfo, nbdcopy),
# python3-libnbd (the soak's clients, for Debian's /usr/bin/python3) and
# iproute2 (ip netns, for the test of a client that powers off), curl (the
# admin endpoints' tests) and systemd (systemd-socket-activate and
# systemd-analyze, for the units' tests).
set -euo pipefail

packages=(qemu-utils libnbd-bin python3-libnbd iproute2 curl systemd)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required" >&2; exit 1; }
# cargo-fuzz, for scripts/fuzz.sh (the fuzzers run on the nightly toolchain).
if ! command -v cargo-fuzz >/dev/null; then
    echo "setup: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked --quiet
fi
# The deployment files' checkers (deploy/test_deploy.py): kubernetes-validate
# (bundled Kubernetes schemas) and checkov, pinned, in a virtualenv kept
# outside the work tree so that fresh clones share it.
deploy_venv="${NBDGW_DEPLOY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/deploy-venv-1}"
if [ ! -x "$deploy_venv/bin/checkov" ] || [ ! -x "$deploy_venv/bin/kubernetes-validate" ]; then
    echo "setup: installing kubernetes-validate and checkov into $deploy_venv" >&2
    python3 -m venv "$deploy_venv"
    "$deploy_venv/bin/pip" install --quiet --disable-pip-version-check \
        kubernetes-validate==1.37.0 checkov==3.3.30 pyyaml
fi
