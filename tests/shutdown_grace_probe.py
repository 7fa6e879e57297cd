"""libnbd's async API through a shutdown grace, for tests/reliability.rs,
in the shape of issue 27 item 3: one read held at a paused (SIGSTOP) real
qemu-nbd when SIGTERM reaches nbdgw, a second read issued 0.2 s after
nbdgw's listener closed, the upstream resumed 1 s after that. Prints how
each read completed, and when (seconds after the listener closed), as
JSON.

    shutdown_grace_probe.py PORT CERT_DIR NBDGW_PID QEMU_NBD_PID ADMIN_PORT

The first read is in flight once nbdgw's metrics count it (it is counted
once nbdgw has decided to forward it), and only then is SIGTERM sent.

Every wait is bounded; the upstream is resumed whatever happens.
"""

import errno
import json
import os
import signal
import socket
import sys
import time
import urllib.request

import nbd

# How long the second read may stay unfinished, from its issue.
ANSWER_WITHIN = 4.0


def listener_closed(port, within):
    """Waits until a connect to the port is refused: the listener is gone."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def reads_counted(admin):
    url = f"http://127.0.0.1:{admin}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith('nbdgw_requests_total{command="READ"}'):
                return float(line.split()[-1])
    return 0


def read_arrived(h, admin, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if reads_counted(admin) >= 1:
            return True
        h.poll(10)
    return False


def outcome_of(h, cookie, buf):
    try:
        if not h.aio_command_completed(cookie):
            return None
        return {"ok": True, "data": buf.to_bytearray()[:8].hex()}
    except nbd.Error as e:
        return {"ok": False, "errno": errno.errorcode.get(e.errno, str(e.errno))}


def main():
    port, cert_dir = int(sys.argv[1]), sys.argv[2]
    gateway, upstream, admin = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(cert_dir)
    h.connect_tcp("localhost", str(port))
    first, second = nbd.Buffer(512), nbd.Buffer(512)
    os.kill(upstream, signal.SIGSTOP)
    try:
        cookies = [h.aio_pread(first, 0)]
        if not read_arrived(h, admin, 10):
            print(json.dumps({"error": "nbdgw did not count the first read within 10 s"}), flush=True)
            return
        os.kill(gateway, signal.SIGTERM)
        if not listener_closed(port, 10):
            print(json.dumps({"error": "the listener did not close within 10 s"}), flush=True)
            return
        closed = time.monotonic()
        time.sleep(0.2)
        cookies.append(h.aio_pread(second, 512))
        issued = time.monotonic()
        resumed = False
        results = [None, None]
        buffers = [first, second]
        while None in results and time.monotonic() < issued + ANSWER_WITHIN:
            if not resumed and time.monotonic() >= issued + 1.0:
                os.kill(upstream, signal.SIGCONT)
                resumed = True
            for i, cookie in enumerate(cookies):
                if results[i] is None:
                    done = outcome_of(h, cookie, buffers[i])
                    if done is not None:
                        done["after"] = round(time.monotonic() - closed, 1)
                        results[i] = done
            if None in results:
                try:
                    h.poll(20)
                except nbd.Error:
                    # Closed or dead: what is unfinished stays so.
                    time.sleep(0.02)
        print(json.dumps({"first": results[0], "second": results[1]}), flush=True)
    finally:
        os.kill(upstream, signal.SIGCONT)


if __name__ == "__main__":
    main()
