#!/usr/bin/python3
"""nbdgw's instructions per request, counted by valgrind's callgrind: a
figure that moves far less with the machine's load than the wall-clock
rows of bench/run.py (which spread up to 5x between repetitions here),
but not nothing: work that follows time rather than requests (timers,
the idle timeout's re-arming, the runtime's wake-ups) grows with a run's
wall time, and runs on a loaded machine spread by a few per cent. Hence
one worker thread (`--threads 1`: no second worker waking and parking),
several runs, and their median reported with their range.

A RELEASE nbdgw runs under `valgrind --tool=callgrind` in front of a real
qemu-nbd (a raw image file on a Unix socket); python3-libnbd, the same
library as nbdinfo and nbdcopy, connects over TLS (as users do: the QD1
path) and sends a fixed number of requests one at a time. Each case runs
twice, with N1 and N2 requests; everything both runs share (start-up, the
TLS handshake, the negotiation, the close) cancels out:

    instructions per request = (Ir(N2) - Ir(N1)) / (N2 - N1)

Only nbdgw is under valgrind; the client and qemu-nbd run natively.

Cases: QD1 4 KiB reads and QD1 4 KiB writes on a plain export (each at a
different offset, 1 MiB apart), and 4 KiB reads that hit the read cache
(`--immutable`: the same block, read once to fill it first; the script
checks on /metrics that every one of them was a hit). The image is
written whole with a non-zero pattern first: on a sparse file qemu-nbd
answers a structured read of a hole with a 12-byte OFFSET_HOLE chunk,
not the 4 KiB of data a hit moves, and the write case would turn holes
into data for whichever case runs after it.

Kernel TLS is off (`--ktls off`): with it, encryption leaves user space
and the count would depend on whether the machine has the kernel module.

    bench/callgrind.py [--binary PATH] [--label TEXT] [--n1 N] [--n2 N] [--runs R] [--keep DIR]

--keep DIR keeps each run's callgrind output there (callgrind.CASE.N.RUN),
for `callgrind_annotate` per function: the difference of a function's
cost between the N2 and the N1 file, over N2 - N1, is its share of a
request.

Prints a Markdown table: per case the median of R runs (default 3) and,
under it, each run's figure.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = "/usr/bin/python3"
IMAGE_SIZE = 256 << 20
SIZE = 4096

# The client: one connection, `count` requests of one kind, one at a time.
CLIENT = r"""
import sys, nbd
uri, case, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
import time
for attempt in range(10):
    h = nbd.NBD()
    h.set_uri_allow_local_file(True)
    try:
        h.connect_uri(uri)
        break
    except nbd.Error:
        # nbdgw under valgrind may listen before it is ready to serve.
        if attempt == 9:
            raise
        time.sleep(1)
span = %d - 4096
if case == "hit":
    h.pread(4096, 0)
buf = b"w" * 4096
for i in range(count):
    offset = (i << 20) %% span
    if case == "read":
        h.pread(4096, offset)
    elif case == "write":
        h.pwrite(buf, offset)
    else:
        h.pread(4096, 0)
h.shutdown()
""" % IMAGE_SIZE


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    sys.exit(f"{what} did not come up within {timeout:.0f} s")


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def total_ir(path):
    """The `totals:` (or `summary:`) line of a callgrind output file."""
    with open(path) as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    sys.exit(f"no totals in {path}")


def metric(port, name):
    """A counter's value on nbdgw's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.split(" ")[0] == name:
                return int(float(line.split()[1]))
    return 0


def measure(binary, work, case, count, keep=None):
    """Ir of one nbdgw run serving one client that sends `count` requests;
    its callgrind output moved to `keep` (a path) if given."""
    port, admin = free_port(), free_port()
    out = os.path.join(work, f"callgrind.{case}.{count}")
    extra = ["--immutable"] if case == "hit" else []
    gw = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         binary, "--listen", f"127.0.0.1:{port}", "--tls-dir", os.path.join(work, "certs"),
         "--upstream", os.path.join(work, "up.sock"), "--ktls", "off", "--threads", "1",
         "--admin-listen", f"127.0.0.1:{admin}", "--shutdown-grace", "5", *extra],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: port_open(port), "nbdgw under valgrind")
        uri = f"nbds://127.0.0.1:{port}/?tls-certificates={os.path.join(work, 'certs')}"
        subprocess.run([PYTHON, "-c", CLIENT, uri, case, str(count)], check=True, timeout=1800)
        if case == "hit":
            # The first read filled the block; every one after it must hit.
            hits = metric(admin, "nbdgw_cache_hits_total")
            if hits != count:
                sys.exit(f"hit case: {hits} cache hits of {count} reads")
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=300)
    ir = total_ir(out)
    if keep:
        shutil.move(out, keep)
    else:
        os.unlink(out)
    return ir


def start_upstream(work):
    image = os.path.join(work, "image.raw")
    # Data, not holes, everywhere a case reads (see the docstring).
    with open(image, "wb") as f:
        block = b"\x5a" * (1 << 20)
        for _ in range(IMAGE_SIZE >> 20):
            f.write(block)
    sock = os.path.join(work, "up.sock")
    upstream = subprocess.Popen(
        ["qemu-nbd", "--persistent", "--shared=8", "-f", "raw", "--cache=writeback",
         "-k", sock, image],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(sock), "qemu-nbd")
    return upstream


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "nbdgw"))
    p.add_argument("--label", default=None)
    p.add_argument("--n1", type=int, default=100)
    p.add_argument("--n2", type=int, default=1100)
    p.add_argument("--cases", default="read,write,hit")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keep", default=None, help="keep the callgrind output files in this directory")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="nbdgw-callgrind-")
    upstream = None
    try:
        subprocess.run([args.binary, "certs", "--out", os.path.join(work, "certs"),
                        "--server-name", "127.0.0.1"], check=True, stdout=subprocess.DEVNULL)
        upstream = start_upstream(work)
        label = args.label or args.binary
        cases = args.cases.split(",")
        runs = {case: [] for case in cases}
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)

        def kept(case, count, run):
            return args.keep and os.path.join(args.keep, f"callgrind.{case}.{count}.{run}")

        for run in range(args.runs):
            for case in cases:
                low = measure(args.binary, work, case, args.n1, kept(case, args.n1, run))
                high = measure(args.binary, work, case, args.n2, kept(case, args.n2, run))
                runs[case].append((high - low) / (args.n2 - args.n1))
        names = {"read": "QD1 4 KiB read", "write": "QD1 4 KiB write", "hit": "4 KiB cache hit"}
        print("| binary | " + " | ".join(f"{names[c]} (Ir/request)" for c in cases) + " |")
        print("|---|" + "---:|" * len(cases))
        median = " | ".join(f"{statistics.median(runs[c]):,.0f}" for c in cases)
        print(f"| {label}, median of {args.runs} | {median} |")
        spread = " | ".join(
            f"{min(runs[c]):,.0f}–{max(runs[c]):,.0f} "
            f"({(max(runs[c]) - min(runs[c])) / statistics.median(runs[c]):.1%})"
            for c in cases)
        print(f"| {label}, range | {spread} |")
    finally:
        if upstream:
            upstream.send_signal(signal.SIGTERM)
            upstream.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
