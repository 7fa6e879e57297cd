"""A herd of libnbd clients from one address, for tests/crowds.rs: N
processes each make a handle, wait at one barrier, then connect at the
same instant, read one 4 KiB block and compare it with the image. One
attempt each: a client that fails is reported, never retried.

    herd.py PORT CERT_DIR IMAGE N

Prints JSON: {"ok": count, "errors": [...], "connect_secs": [sorted]}.
Processes, not threads: each client's GnuTLS work and connect run apart
from the others', as on separate VMs, whatever the bindings do with the
GIL.
"""

import json
import multiprocessing
import sys
import time

import nbd

BLOCK = 4096


def main():
    port, cert_dir, image, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(image, "rb") as f:
        data = f.read()
    blocks = len(data) // BLOCK
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(n)
    queue = ctx.Queue()

    def client(i):
        h = nbd.NBD()
        h.set_tls(nbd.TLS_REQUIRE)
        h.set_tls_certificates(cert_dir)
        barrier.wait()
        started = time.monotonic()
        try:
            h.connect_tcp("localhost", port)
            took = time.monotonic() - started
            offset = (i % blocks) * BLOCK
            got = h.pread(BLOCK, offset)
            if got != data[offset : offset + BLOCK]:
                queue.put(("error", f"client {i}: the block at {offset} differs"))
            else:
                queue.put(("ok", took))
            h.shutdown()
        except nbd.Error as e:
            queue.put(("error", f"client {i}: {e.string}"))

    procs = [ctx.Process(target=client, args=(i,)) for i in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    ok = sorted(r[1] for r in results if r and r[0] == "ok")
    errors = [r[1] for r in results if not r or r[0] != "ok"]
    print(json.dumps({"ok": len(ok), "errors": errors, "connect_secs": ok}))


if __name__ == "__main__":
    main()
