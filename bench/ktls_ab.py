#!/usr/bin/python3
"""Kernel TLS against rustls, side by side: nbdcopy reads and writes through
one nbdgw with --ktls auto and one with --ktls off, alternating, and each
gateway's CPU time per GiB (user and system: with kernel TLS the crypto
runs in nbdgw's syscalls, so it is counted).

Needs a kernel with the `tls` ULP. This machine's lacks it, so run it in
the VM scripts/ktls-vm.sh boots (qemu TCG: absolute figures there are the
emulator's, only the ratio between the two columns means anything):

    printf 'ip link set lo up\\npython3 %s/bench/ktls_ab.py\\n' "$PWD" > /tmp/ab.sh
    scripts/ktls-vm.sh --run /tmp/ab.sh
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBDGW = os.path.join(ROOT, "target", "release", "nbdgw")
MODES = ("auto", "off")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    size = args.size_mib << 20
    work = tempfile.mkdtemp(prefix="nbdgw-ktls-ab-")
    certs, sock = os.path.join(work, "certs"), os.path.join(work, "up.sock")
    subprocess.run([NBDGW, "certs", "--out", certs, "--server-name", "localhost"],
                   check=True, stdout=subprocess.DEVNULL)
    procs = [subprocess.Popen(["qemu-nbd", "--persistent", "--shared=10", "--image-opts",
                               f"driver=null-co,size={size},read-zeroes=off", "-k", sock])]
    time.sleep(1)
    gateways = {}
    for offset, mode in enumerate(MODES):
        port = 20800 + offset
        log = open(os.path.join(work, f"{mode}.log"), "w")
        gateways[mode] = (subprocess.Popen(
            [NBDGW, "--listen", f"127.0.0.1:{port}", "--tls-dir", certs, "--upstream", sock,
             "--ktls", mode], stderr=log), port)
        procs.append(gateways[mode][0])
    time.sleep(1)
    results = {}
    try:
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                proc, port = gateways[mode]
                uri = f"nbds://localhost:{port}/?tls-certificates={certs}"
                for work_name, cmd in (
                        ("read", ["nbdcopy", "--connections=1", uri, "null:"]),
                        ("write", ["nbdcopy", "--connections=1", "--", "[", "nbdkit",
                                   "--exit-with-parent", "pattern", f"size={size}", "]", uri])):
                    cpu0, t0 = cpu_seconds(proc.pid), time.time()
                    subprocess.run(cmd, check=True)
                    cpu1, t1 = cpu_seconds(proc.pid), time.time()
                    results.setdefault((work_name, mode), []).append(
                        ((cpu1 - cpu0) * (1 << 30) / size, size / (1 << 20) / (t1 - t0)))
    finally:
        for p in procs:
            p.terminate()
    for (work_name, mode), runs in sorted(results.items()):
        cpu = [r[0] for r in runs]
        rate = [r[1] for r in runs]
        print(f"{work_name:5} --ktls {mode:4}: CPU s/GiB {statistics.median(cpu):.2f} "
              f"({min(cpu):.2f}-{max(cpu):.2f}); MiB/s {statistics.median(rate):.0f} "
              f"({min(rate):.0f}-{max(rate):.0f})")
    handed = open(os.path.join(work, "auto.log")).read().count("handed to the kernel")
    print(f"{handed} sessions handed to the kernel under --ktls auto")


if __name__ == "__main__":
    main()
