#!/usr/bin/python3
"""The pause a session sees while nbdgw is handed over to a successor.

Opens --idle sessions (1,000) that send nothing and --busy sessions (64)
that read and write 4 KiB without pause, all python3-libnbd over TLS
from this one address, through nbdgw in front of a real qemu-nbd; then
replaces nbdgw (--handover-socket / --take-over) --handovers times and
measures, per session and hand-over:

- busy: the longest gap between two consecutive completed requests in
  the window from a second before the hand-over starts (the predecessor
  logs "a successor connected") to a second after the predecessor exits;
  and, for comparison, the same over an equally long window just before,
  with no hand-over;
- idle: from a request sent on every idle session right when the
  hand-over starts to its reply; and, for comparison, the same requests
  sent at a quiet moment before.

Prints the median and p99 of each, in milliseconds, for bench/RESULTS.md;
sessions that failed (drained instead of handed over, as on branch i29
before the session hand-over) are counted apart and make it exit 1.

    bench/handover_pause.py                         # 1,000 idle + 64 busy, 3 hand-overs
    NBDGW=target/release/nbdgw bench/handover_pause.py --handovers 5

Descriptors: 1,064 sessions from one address must all be admitted, so
nbdgw runs with --max-connections and --max-sessions-per-identity above
the total (the default per-identity bound is a quarter of
--max-connections, and every session here has the same certificate);
the handshake bounds per source (--max-handshakes-per-source 8, a queue
of 256) are left as they are: sessions are opened by a few threads at a
time. This script raises its soft RLIMIT_NOFILE to the hard limit, which
nbdgw and qemu-nbd inherit (nbdgw needs about 3 per session).
"""

import argparse
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import nbd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBDGW = os.environ.get("NBDGW", os.path.join(ROOT, "target", "debug", "nbdgw"))
BLOCK = 4096


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_nofile(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        sys.exit(f"handover_pause: RLIMIT_NOFILE hard limit {hard} < {needed} needed")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Rig:
    """qemu-nbd and the gateway generations, each logging to its own file."""

    def __init__(self, work, sessions):
        self.work = work
        self.certs = os.path.join(work, "certs")
        subprocess.run([NBDGW, "certs", "--out", self.certs, "--server-name", "localhost"],
                       check=True, stdout=subprocess.DEVNULL)
        image = os.path.join(work, "disk.img")
        with open(image, "wb") as f:
            f.truncate(256 << 20)
        self.sock = os.path.join(work, "nbd.sock")
        self.qemu = subprocess.Popen(["qemu-nbd", "-f", "raw", "--persistent", "--shared=0",
                                      "--cache=writeback", "-k", self.sock, image])
        while not os.path.exists(self.sock):
            time.sleep(0.01)
        run = os.path.join(work, "run")
        os.mkdir(run, 0o700)
        self.handover = os.path.join(run, "handover.sock")
        self.port = free_port()
        limit = str(sessions + 64)
        self.args = [NBDGW, "--listen", f"127.0.0.1:{self.port}", "--upstream", self.sock,
                     "--tls-dir", self.certs, "--max-connections", limit,
                     "--max-sessions-per-identity", limit, "--handover-socket", self.handover,
                     "--handover-timeout", "60", "--shutdown-grace", "60"]
        self.generation = 0
        self.gw, self.log = self.start([])

    def start(self, extra):
        log = os.path.join(self.work, f"nbdgw-{self.generation}.log")
        with open(log, "w") as f:
            gw = subprocess.Popen(self.args + extra, stderr=f, env={**os.environ, "RUST_LOG": "info"})
        wait_for_line(log, "nbdgw listening", gw)
        return gw, log

    def hand_over(self, started):
        """Starts a successor; sets `started` when the predecessor says a
        successor connected; returns the time the predecessor exited."""
        old, old_log = self.gw, self.log
        self.generation += 1
        watcher = threading.Thread(target=lambda: (wait_for_line(old_log, "a successor connected", old),
                                                   started.set()))
        watcher.start()
        self.gw, self.log = self.start(["--take-over", self.handover])
        watcher.join()
        code = old.wait(timeout=120)
        ended = time.monotonic()
        if code != 0:
            sys.exit(f"handover_pause: the predecessor exited {code}")
        return ended

    def uri(self):
        return f"nbds://localhost:{self.port}/?tls-certificates={self.certs}"

    def stop(self):
        self.gw.terminate()
        self.gw.wait(timeout=120)
        self.qemu.kill()
        self.qemu.wait()


def wait_for_line(path, needle, process, within=120):
    deadline = time.time() + within
    while True:
        # Whether it had exited before the read: a line it logged just
        # before it exited is still found.
        exited = process.poll() is not None
        with open(path, errors="replace") as f:
            if needle in f.read():
                return
        if exited or time.time() > deadline:
            sys.exit(f"handover_pause: no {needle!r} in {path} (exit {process.poll()})")
        time.sleep(0.005)


def connect(uri):
    h = nbd.NBD()
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


class Busy:
    """A session reading and writing its own 4 KiB blocks back to back;
    the time of every completion, and the errors."""

    def __init__(self, h, index):
        self.h, self.index = h, index
        self.done, self.errors = [], []

    def run(self, stop):
        base = (1 + self.index) << 20
        i = 0
        while not stop.is_set():
            off = base + (i % 64) * BLOCK
            try:
                if i % 2:
                    self.h.pwrite(bytes([i % 251]) * BLOCK, off)
                else:
                    self.h.pread(BLOCK, off)
            except nbd.Error as e:
                self.errors.append(str(e))
                return
            self.done.append(time.monotonic())
            i += 1

    def longest_gap(self, start, end, failed_counts=True):
        """None (failed) if the session ended in an error, unless
        `failed_counts` is false (a window from before the hand-over)."""
        if self.errors and failed_counts:
            return None
        times = [t for t in self.done if start <= t <= end]
        return max((b - a for a, b in zip(times, times[1:])), default=None)


def idle_round(handles, within=120):
    """One read on every idle session at once: per session the seconds
    to its reply, or None if it failed."""
    sel = selectors.DefaultSelector()
    took = [None] * len(handles)
    failed = [False] * len(handles)
    buffers, left = [], len(handles)

    def completion(i, sent):
        def done(err):
            nonlocal left
            left -= 1
            if err.value:
                failed[i] = True
            else:
                took[i] = time.monotonic() - sent
            return 1
        return done

    for i, h in enumerate(handles):
        buf = nbd.Buffer(BLOCK)
        buffers.append(buf)
        try:
            h.aio_pread(buf, (200 << 20) + (i % 1024) * BLOCK, completion=completion(i, time.monotonic()))
        except nbd.Error:
            failed[i] = True
            left -= 1
            continue
        sel.register(h.aio_get_fd(), selectors.EVENT_READ, h)
    deadline = time.monotonic() + within
    while left > 0 and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            try:
                key.data.aio_notify_read()
            except nbd.Error:
                sel.unregister(key.fileobj)
        for i, h in enumerate(handles):
            if took[i] is None and not failed[i] and h.aio_is_dead():
                failed[i] = True
                left -= 1
    sel.close()
    return [None if f else t for t, f in zip(took, failed)]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1000


def line(name, values, failed):
    if not values:
        return f"{name}: no session answered ({failed} failed)"
    return (f"{name}: median {pct(values, 0.5):.1f} ms, p99 {pct(values, 0.99):.1f} ms, "
            f"max {max(values) * 1000:.1f} ms over {len(values)} sessions; {failed} failed")


def measure(rig, idle, busy, handovers, settle):
    """Baseline, then each hand-over: (name, [seconds], failed) rows."""
    rows = {k: ([], 0) for k in ("busy gap, no hand-over", "busy gap, hand-over",
                                 "idle request, no hand-over", "idle request, hand-over")}

    def add(name, values):
        good = [v for v in values if v is not None]
        old, failed = rows[name]
        rows[name] = (old + good, failed + len(values) - len(good))

    for n in range(handovers):
        time.sleep(settle)
        quiet = time.monotonic()
        add("idle request, no hand-over", idle_round(idle))
        started = threading.Event()
        result = {}
        worker = threading.Thread(target=lambda: result.update(ended=rig.hand_over(started)))
        worker.start()
        while not started.wait(0.1):
            if not worker.is_alive():
                sys.exit("handover_pause: the hand-over never started")
        began = time.monotonic()
        add("idle request, hand-over", idle_round(idle))
        worker.join()
        ended = result["ended"]
        span = ended - began + 2
        add("busy gap, hand-over", [b.longest_gap(began - 1, ended + 1) for b in busy])
        add("busy gap, no hand-over", [b.longest_gap(quiet - 1 - span, quiet - 1, False) for b in busy])
        print(f"hand-over {n + 1}: {ended - began:.2f} s from the successor's connection to the "
              f"predecessor's exit", flush=True)
        if rows["idle request, hand-over"][1] or rows["busy gap, hand-over"][1]:
            # Sessions lost (drained, not handed over): later rounds
            # would only measure dead ones.
            print("sessions were lost in this hand-over: no further rounds", flush=True)
            break
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--busy", type=int, default=64)
    ap.add_argument("--handovers", type=int, default=3)
    ap.add_argument("--settle", type=float, default=5, help="seconds of load before each round")
    args = ap.parse_args()
    sessions = args.idle + args.busy
    raise_nofile(4 * sessions + 1024)
    with tempfile.TemporaryDirectory() as work:
        rig = Rig(work, sessions)
        uri = rig.uri()
        t = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            idle = list(pool.map(lambda _: connect(uri), range(args.idle)))
            busy = [Busy(h, i) for i, h in enumerate(pool.map(lambda _: connect(uri), range(args.busy)))]
        print(f"# {args.idle} idle + {args.busy} busy sessions opened in {time.monotonic() - t:.1f} s; "
              f"nbdgw {NBDGW}", flush=True)
        stop = threading.Event()
        threads = [threading.Thread(target=b.run, args=(stop,)) for b in busy]
        for th in threads:
            th.start()
        try:
            rows = measure(rig, idle, busy, args.handovers, args.settle)
        finally:
            stop.set()
            for th in threads:
                th.join()
            rig.stop()
        for name, (values, failed) in rows.items():
            print(line(name, values, failed))
        errors = sum(len(b.errors) for b in busy)
        print(f"busy sessions that failed: {sum(1 for b in busy if b.errors)} ({errors} errors)"
              + (f", e.g. {next(b.errors[0] for b in busy if b.errors)}" if errors else ""))
        failed = errors + sum(f for _, f in rows.values())
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
