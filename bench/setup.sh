#!/usr/bin/env bash
# Everything bench/run.py needs on a fresh Debian machine, from Debian's
# packages: the peers (qemu-nbd, nbdkit), the clients (nbdcopy, libnbd's
# Python bindings, qemu-img bench, fio's nbd engine), packet capture,
# iperf3, the namespace tools, perf (bench/timeline.py) and valgrind
# (bench/callgrind.py).
# Needs root, as bench/run.py does (apt-get, network namespaces, tshark).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "bench/setup.sh: run as root (sudo bench/setup.sh): it installs packages" >&2
    exit 1
fi
scripts/setup.sh
need=()
for pair in qemu-nbd:qemu-utils nbdkit:nbdkit nbdcopy:libnbd-bin tshark:tshark \
            iperf3:iperf3 openssl:openssl ethtool:ethtool ip:iproute2 taskset:util-linux \
            fio:fio curl:curl perf:linux-perf valgrind:valgrind; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
/usr/bin/python3 -c 'import nbd' 2>/dev/null || need+=(python3-libnbd)
if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}"
fi
