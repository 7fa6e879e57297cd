"""libnbd's async API through a shutdown grace, for tests/reliability.rs:
one read held at the upstream when SIGTERM reaches nbdgw, a second read
issued during the grace; prints how each completed, as JSON.

    shutdown_grace_probe.py PORT CERT_DIR NBDGW_PID

Talks to the test on stdin/stdout: prints "connected" and waits for a
line (the test holds the upstream's replies), prints "issued" once both
reads are out and waits for a line (the test lets the replies go).
"""

import errno
import json
import os
import signal
import sys
import time

import nbd


def step(word):
    print(word, flush=True)
    sys.stdin.readline()


def main():
    port, cert_dir, gateway = sys.argv[1], sys.argv[2], int(sys.argv[3])
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(cert_dir)
    h.connect_tcp("localhost", port)
    step("connected")
    first, second = nbd.Buffer(512), nbd.Buffer(512)
    cookies = [h.aio_pread(first, 0)]
    time.sleep(0.3)
    os.kill(gateway, signal.SIGTERM)
    time.sleep(0.3)
    cookies.append(h.aio_pread(second, 512))
    step("issued")
    outcome = {}
    deadline = time.monotonic() + 4
    while len(outcome) < 2 and time.monotonic() < deadline:
        for i, cookie in enumerate(cookies):
            if i in outcome:
                continue
            try:
                if h.aio_command_completed(cookie):
                    outcome[i] = {"ok": True, "data": first.to_bytearray()[:8].hex()}
            except nbd.Error as e:
                outcome[i] = {"ok": False, "errno": errno.errorcode.get(e.errno, str(e.errno))}
        if len(outcome) < 2:
            try:
                h.poll(100)
            except nbd.Error as e:
                outcome.setdefault("poll", str(e))
                time.sleep(0.1)
    print(json.dumps({"first": outcome.get(0), "second": outcome.get(1)}), flush=True)


if __name__ == "__main__":
    main()
