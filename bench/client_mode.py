#!/usr/bin/python3
"""What `nbdgw client` costs a client host, beside a client that does TLS
itself: the same libnbd client reads the same export through the nbdgw
gateway, once with its own TLS (nbds://, GnuTLS) and once in plaintext
to `nbdgw client` on a Unix socket, which does the TLS. In one run, the
two orders alternating, repeated.

    bench/client_mode.py [--reps 3] [--size-mib 1024] [--qd1 4000]

Rows: sequential read (nbdcopy to null:), MiB/s and client-host CPU per
GiB (nbdcopy's own, plus nbdgw client's where it is used); QD1 4 KiB
reads (bench/nbdclient.py), mean and p99 latency. Prints each run, then
the medians and ratios (client mode / direct) with their range over the
repetitions. Needs the release build (scripts/build-release.sh).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBDGW = os.path.join(ROOT, "target", "release", "nbdgw")
HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_for(path_or_port, what):
    deadline = time.time() + 10
    while time.time() < deadline:
        if isinstance(path_or_port, str) and os.path.exists(path_or_port):
            return
        time.sleep(0.05)
    sys.exit(f"client_mode bench: {what} did not start")


def measure(cmd, client_pid):
    """Runs `cmd`; returns its wall time and the CPU it and client mode used."""
    before_children = children_cpu()
    before_client = cpu_seconds(client_pid) if client_pid else 0.0
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    took = time.perf_counter() - t
    cpu = children_cpu() - before_children
    if client_pid:
        cpu += cpu_seconds(client_pid) - before_client
    return took, cpu, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--qd1", type=int, default=4000)
    args = ap.parse_args()
    if not os.access(NBDGW, os.X_OK):
        sys.exit(f"client_mode bench: build the release binary first (scripts/build-release.sh): {NBDGW}")
    with tempfile.TemporaryDirectory() as work:
        image = os.path.join(work, "disk.img")
        # nbdclient.py's QD1 reads spread over the first GiB.
        size = max(args.size_mib, 1024) << 20
        with open(image, "wb") as f:
            f.truncate(size)
        # Data, not holes, so that every read carries its bytes.
        subprocess.run(["dd", "if=/dev/urandom", f"of={image}", "bs=1M", f"count={size >> 20}",
                        "conv=notrunc", "status=none"], check=True)
        certs = os.path.join(work, "certs")
        subprocess.run([NBDGW, "certs", "--out", certs, "--server-name", "localhost"],
                       check=True, stdout=subprocess.DEVNULL)
        up = os.path.join(work, "up.sock")
        procs = [subprocess.Popen(["qemu-nbd", "-f", "raw", "--persistent", "--shared=0", "-r",
                                   "-k", up, image], stderr=subprocess.DEVNULL)]
        wait_for(up, "qemu-nbd")
        port = 10000 + os.getpid() % 20000
        procs.append(subprocess.Popen([NBDGW, "--listen", f"127.0.0.1:{port}", "--upstream", up,
                                       "--tls-dir", certs, "--landlock", "false"],
                                      stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        local = os.path.join(work, "client.sock")
        client = subprocess.Popen([NBDGW, "client", "--listen", local, "--server", f"localhost:{port}",
                                   "--tls-dir", certs], stderr=subprocess.DEVNULL)
        procs.append(client)
        wait_for(local, "nbdgw client")
        uris = {
            "direct": (f"nbds://localhost:{port}/?tls-certificates={certs}", None),
            "client mode": (f"nbd+unix:///?socket={local}", client.pid),
        }
        results = {name: {"MiB/s": [], "CPU s/GiB": [], "QD1 mean us": [], "QD1 p99 us": []}
                   for name in uris}
        try:
            for rep in range(args.reps):
                order = list(uris) if rep % 2 == 0 else list(reversed(list(uris)))
                for name in order:
                    uri, pid = uris[name]
                    took, cpu, _ = measure(["nbdcopy", "--connections=1", uri, "null:"], pid)
                    gib = size / (1 << 30)
                    results[name]["MiB/s"].append(gib * 1024 / took)
                    results[name]["CPU s/GiB"].append(cpu / gib)
                    _, _, out = measure(["/usr/bin/python3", os.path.join(HERE, "nbdclient.py"), "qd1",
                                         uri, str(args.qd1), "4096"], None)
                    q = json.loads(out)
                    results[name]["QD1 mean us"].append(q["mean_us"])
                    results[name]["QD1 p99 us"].append(q["p99_us"])
                    print(f"rep {rep + 1} {name}: {took:.2f} s, {cpu / gib:.2f} CPU s/GiB, "
                          f"QD1 {q['mean_us']:.0f} us mean, {q['p99_us']:.0f} us p99", flush=True)
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait()
        print("\n| row | direct (libnbd's TLS) | client mode | ratio (range) |")
        print("|---|---|---|---|")
        for row in ["MiB/s", "CPU s/GiB", "QD1 mean us", "QD1 p99 us"]:
            d, c = results["direct"][row], results["client mode"][row]
            ratios = [b / a for a, b in zip(d, c) if a]
            print(f"| {row} | {statistics.median(d):.2f} | {statistics.median(c):.2f} | "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
