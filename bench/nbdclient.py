#!/usr/bin/python3
"""Client workloads driven through libnbd's Python bindings (python3-libnbd).

A real, unmodified NBD client library: the same code path as nbdinfo and
nbdcopy. The Python loop adds about 1 us per request (measured against
qemu-img bench over the Unix socket: 55.7 vs 56.6 us per 4 KiB read), the
same for every front end. Prints one JSON object.

    nbdclient.py qd1 URI COUNT SIZE     QD1 reads, latency per request
    nbdclient.py replay URI SEED        the VM-boot-shaped QD1 replay
    nbdclient.py small-replay URI SEED  the same, dominated by small reads
    nbdclient.py handshakes URI COUNT   connect (TLS), GO, disconnect
    nbdclient.py idle URI COUNT         open COUNT connections, print
                                        "ready", hold until stdin closes
"""

import json
import random
import statistics
import sys
import time

import nbd

EXPORT_SPAN = 1 << 30


def connect(uri):
    h = nbd.NBD()
    # URIs name the certificate directory (tls-certificates=DIR).
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


def qd1(uri, count, size):
    h = connect(uri)
    step = 1 << 20
    latencies = []
    for i in range(count):
        offset = (i * step) % (EXPORT_SPAN - size)
        t = time.perf_counter()
        h.pread(size, offset)
        latencies.append(time.perf_counter() - t)
    h.shutdown()
    latencies.sort()
    return {
        "mean_us": statistics.fmean(latencies) * 1e6,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
    }


def boot_trace(seed, count=2000):
    """Reads shaped like a VM boot: mostly small, partly sequential runs
    (kernel, initrd, libraries), some large; fixed by the seed."""
    rng = random.Random(seed)
    sizes = [4096, 8192, 16384, 32768, 65536, 131072, 262144, 1048576]
    weights = [38, 10, 10, 10, 14, 10, 6, 2]
    offset = 0
    trace = []
    for _ in range(count):
        size = rng.choices(sizes, weights)[0]
        if rng.random() < 0.3 or offset + size > EXPORT_SPAN:
            offset = rng.randrange(0, EXPORT_SPAN - size, 4096)
        trace.append((offset, size))
        offset += size
    return trace


def small_boot_trace(seed, count=3000):
    """A boot as a VM's firmware and kernel read it: 60 % 4 KiB, 25 %
    16-64 KiB, 15 % 128-256 KiB, mostly in sequential runs (a new run
    starts with probability 0.15); fixed by the seed."""
    rng = random.Random(seed)
    offset = 0
    trace = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.60:
            size = 4096
        elif draw < 0.85:
            size = rng.choice([16384, 32768, 65536])
        else:
            size = rng.choice([131072, 262144])
        if rng.random() < 0.15 or offset + size > EXPORT_SPAN:
            offset = rng.randrange(0, EXPORT_SPAN - size, 4096)
        trace.append((offset, size))
        offset += size
    return trace


def replay(uri, seed, shape=boot_trace):
    trace = shape(seed)
    h = connect(uri)
    t = time.perf_counter()
    for offset, size in trace:
        h.pread(size, offset)
    took = time.perf_counter() - t
    h.shutdown()
    return {
        "ms": took * 1e3,
        "requests": len(trace),
        "bytes": sum(size for _, size in trace),
    }


def handshakes(uri, count):
    t = time.perf_counter()
    for _ in range(count):
        h = connect(uri)
        h.shutdown()
        del h  # closes the socket now, not at the next collection
    took = time.perf_counter() - t
    return {"per_s": count / took}


def idle(uri, count):
    handles = [connect(uri) for _ in range(count)]
    print("ready", flush=True)
    sys.stdin.read()
    for h in handles:
        h.shutdown()
    return {"held": len(handles)}


def main():
    kind, uri = sys.argv[1], sys.argv[2]
    if kind == "qd1":
        result = qd1(uri, int(sys.argv[3]), int(sys.argv[4]))
    elif kind == "replay":
        result = replay(uri, int(sys.argv[3]))
    elif kind == "small-replay":
        result = replay(uri, int(sys.argv[3]), small_boot_trace)
    elif kind == "handshakes":
        result = handshakes(uri, int(sys.argv[3]))
    elif kind == "idle":
        result = idle(uri, int(sys.argv[3]))
    else:
        sys.exit(f"nbdclient.py: unknown workload {kind}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
