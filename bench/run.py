#!/usr/bin/env python3
"""Side-by-side throughput and CPU cost of NBD TLS front ends.

One null-co qemu-nbd upstream on a Unix socket (read-zeroes=off, so clients
cannot skip zero data); in front of it, in the same run and interleaved:
nbdgw, qemu-nbd's own TLS, nbdkit's TLS proxy, and the no-TLS references
(qemu-nbd over plain TCP, the Unix socket itself). Clients are unmodified
nbdcopy runs. Prints medians with min-max and ratios to qemu-nbd TLS.

Loopback only. This covers sequential throughput and front-end CPU per GiB;
the other workloads of the performance issue are still to come.
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            sys.exit(f"bench: {what} did not come up")
        time.sleep(0.02)


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Bench:
    def __init__(self, work, size_gib):
        self.work = work
        self.size = size_gib << 30
        self.procs = []
        self.certs = os.path.join(work, "certs")
        self.nbdgw = os.path.join(ROOT, "target", "release", "nbdgw")

    def spawn(self, args, **kw):
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def null_image(self):
        return f"driver=null-co,size={self.size},read-zeroes=off"

    def start(self):
        subprocess.run([self.nbdgw, "certs", "--out", self.certs], check=True,
                       stdout=subprocess.DEVNULL)
        sock = os.path.join(self.work, "up.sock")
        self.spawn(["qemu-nbd", "--persistent", "--shared=64", "--image-opts",
                    self.null_image(), "-k", sock])
        wait_for(lambda: os.path.exists(sock), "upstream qemu-nbd")
        tls_obj = f"tls-creds-x509,id=tls0,dir={self.certs},endpoint=server"
        ports = {name: free_port() for name in ("nbdgw", "qemu-nbd-tls", "nbdkit-proxy", "qemu-nbd-tcp")}
        front = {
            "nbdgw": self.spawn([self.nbdgw, "--listen", f"127.0.0.1:{ports['nbdgw']}",
                                 "--tls-cert", f"{self.certs}/server-cert.pem",
                                 "--tls-key", f"{self.certs}/server-key.pem", "--upstream", sock]),
            "qemu-nbd-tls": self.spawn(["qemu-nbd", "--persistent", "--shared=64", "--image-opts",
                                        self.null_image(), "-b", "127.0.0.1", "-p",
                                        str(ports["qemu-nbd-tls"]), "--object", tls_obj,
                                        "--tls-creds", "tls0"]),
            "nbdkit-proxy": self.spawn(["nbdkit", "--exit-with-parent", "-f", "-i", "127.0.0.1",
                                        "-p", str(ports["nbdkit-proxy"]), "--tls=require",
                                        f"--tls-certificates={self.certs}", "nbd",
                                        f"socket={sock}"]),
            "qemu-nbd-tcp": self.spawn(["qemu-nbd", "--persistent", "--shared=64", "--image-opts",
                                        self.null_image(), "-b", "127.0.0.1", "-p",
                                        str(ports["qemu-nbd-tcp"])]),
        }
        for name, port in ports.items():
            wait_for(lambda port=port: port_open(port), name)
        tls = f"?tls-certificates={self.certs}"
        self.configs = [
            ("nbdgw", f"nbds://localhost:{ports['nbdgw']}/{tls}", front["nbdgw"].pid),
            ("qemu-nbd-tls", f"nbds://localhost:{ports['qemu-nbd-tls']}/{tls}", front["qemu-nbd-tls"].pid),
            ("nbdkit-proxy", f"nbds://localhost:{ports['nbdkit-proxy']}/{tls}", front["nbdkit-proxy"].pid),
            ("qemu-nbd-tcp", f"nbd://localhost:{ports['qemu-nbd-tcp']}/", front["qemu-nbd-tcp"].pid),
            ("unix", f"nbd+unix:///?socket={sock}", None),
        ]

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def run_once(self, workload, uri, pid, connections):
        if workload == "read":
            cmd = ["nbdcopy", f"--connections={connections}", uri, "null:"]
        else:
            cmd = ["nbdcopy", f"--connections={connections}", "--",
                   "[", "nbdkit", "--exit-with-parent", "pattern", f"size={self.size}", "]", uri]
        before = cpu_seconds(pid) if pid else 0.0
        start = time.monotonic()
        subprocess.run(cmd, check=True)
        took = time.monotonic() - start
        cpu = (cpu_seconds(pid) - before) if pid else float("nan")
        gib = self.size / (1 << 30)
        return gib * 1024 / took, cpu / gib


def summary(values):
    return statistics.median(values), min(values), max(values)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--connections", type=int, default=1)
    args = ap.parse_args()
    for tool in ("qemu-nbd", "nbdkit", "nbdcopy"):
        if not shutil.which(tool):
            sys.exit(f"bench: {tool} missing: apt-get install -y qemu-utils nbdkit libnbd-bin")
    subprocess.run(["cargo", "build", "--release", "--locked", "-q"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as work:
        bench = Bench(work, args.size_gib)
        try:
            bench.start()
            results = {}
            for rep in range(args.reps):
                for workload in ("read", "write"):
                    for name, uri, pid in bench.configs:
                        mib_s, cpu = bench.run_once(workload, uri, pid, args.connections)
                        results.setdefault((workload, name), []).append((mib_s, cpu))
        finally:
            bench.stop()
    print(f"# {args.size_gib} GiB per run, {args.reps} runs interleaved, "
          f"{args.connections} connection(s), medians (min-max)")
    print("| workload | front end | MiB/s | vs qemu-nbd-tls | front-end CPU s/GiB | vs qemu-nbd-tls |")
    print("|---|---|---|---|---|---|")
    for workload in ("read", "write"):
        ref_speed = summary([r[0] for r in results[(workload, "qemu-nbd-tls")]])[0]
        ref_cpu = summary([r[1] for r in results[(workload, "qemu-nbd-tls")]])[0]
        for name, _, pid in bench.configs:
            speeds = summary([r[0] for r in results[(workload, name)]])
            cpus = summary([r[1] for r in results[(workload, name)]])
            cpu_cell = f"{cpus[0]:.3f} ({cpus[1]:.3f}-{cpus[2]:.3f})" if pid else "-"
            cpu_ratio = f"{cpus[0] / ref_cpu:.2f}x" if pid else "-"
            print(f"| {workload} | {name} | {speeds[0]:.0f} ({speeds[1]:.0f}-{speeds[2]:.0f}) "
                  f"| {speeds[0] / ref_speed:.2f}x | {cpu_cell} | {cpu_ratio} |")


if __name__ == "__main__":
    main()
