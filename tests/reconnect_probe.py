#!/usr/bin/python3
"""libnbd (python3-libnbd) through `nbdgw client --reconnect`, for
tests/client_reconnect.rs.

reads URI N [GAP]  N reads of 4 KiB at 0, one at a time, GAP seconds
                   apart (default 0): a JSON line each
                   with the errno (0 when it worked) and how long it took;
                   then the connection stays open until stdin ends.
loop URI STOPFILE  QD1 writes and reads of 4-64 KiB at random offsets,
                   every read checked against what was written (and the
                   disk as first read), until STOPFILE exists; then a
                   flush and the whole disk read back and checked. One
                   JSON line: requests, errors (each its errno and text).
"""
import json
import os
import random
import sys
import time

import nbd


def reads(uri, n, gap):
    h = nbd.NBD()
    h.connect_uri(uri)
    for i in range(n):
        if i:
            time.sleep(gap)
        started = time.monotonic()
        try:
            h.pread(4096, 0)
            errno = 0
        except nbd.Error as e:
            errno = e.errno or -1
        print(json.dumps({"errno": errno, "seconds": time.monotonic() - started}),
              flush=True)
    sys.stdin.read()


def loop(uri, stopfile):
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    shadow = bytearray()
    for at in range(0, size, 1 << 20):
        shadow += h.pread(min(1 << 20, size - at), at)
    rng = random.Random(27)
    requests, errors, mismatches = 0, [], 0
    print(json.dumps({"started": True}), flush=True)

    def attempt(what, call):
        """(True, the result), or (False, None) with the error noted."""
        nonlocal requests
        requests += 1
        try:
            return True, call()
        except nbd.Error as e:
            errors.append(f"{what}: {e.errno} {e.string}")
            return False, None

    while not os.path.exists(stopfile):
        length = rng.randrange(4096, 65537, 4096)
        offset = rng.randrange(0, size - length + 1, 4096)
        if rng.random() < 0.5:
            data = rng.randbytes(length)
            if attempt("write", lambda: h.pwrite(data, offset))[0]:
                shadow[offset:offset + length] = data
        else:
            ok, got = attempt("read", lambda: h.pread(length, offset))
            if ok and got != shadow[offset:offset + length]:
                mismatches += 1
    attempt("flush", h.flush)
    whole = bytearray()
    for at in range(0, size, 1 << 20):
        whole += attempt("final read", lambda: h.pread(min(1 << 20, size - at), at))[1] or b""
    print(json.dumps({
        "requests": requests,
        "errors": errors[:20],
        "error_count": len(errors),
        "mismatches": mismatches,
        "final_equal": bytes(whole) == bytes(shadow),
    }), flush=True)
    h.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "reads":
        reads(sys.argv[2], int(sys.argv[3]),
              float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    else:
        loop(sys.argv[2], sys.argv[3])
