#!/usr/bin/python3
"""Verified soak: many clients through nbdgw to qemu-nbd while faults are injected.

Each client owns a region of the export and does random reads, writes (a
pattern of offset, generation and client id), write-zeroes, trims, flushes
and block-status queries; every read is checked against what that client
last had acknowledged. On a schedule: clients vanish in the middle of a
write payload, clients stop reading their replies, qemu-nbd is killed and
restarted, the server certificate is rotated, and SIGHUP comes in storms.

    bench/soak.py --seconds 60                 # what CI runs
    bench/soak.py --seconds 14400 --clients 64 # a long run by hand
    bench/soak.py --through-client --seconds 60
    bench/soak.py --immutable --seconds 60     # the read cache
    bench/soak.py --handover --seconds 40      # replaced every 4 s

--through-client puts `nbdgw client --reconnect` between the clients and
the gateway (they speak plaintext NBD to its Unix socket) and adds three
faults: the gateway killed (SIGKILL) and started again; the gateway
stopped gracefully (SIGTERM: it drains, answering new requests ESHUTDOWN)
and started again; and a gateway that drops again and again (killed
moments after each start, several times in a row). Then no client may see
any error at all: every outage is shorter than --reconnect-timeout, so
client mode must hide each one, sending the requests in flight again.

With --immutable the export is declared immutable (nbdgw --immutable,
with --cache-size smaller than the image so blocks are evicted, and
read-ahead): clients only read, small random reads and sequential runs,
every byte compared with the image; writes must be refused. The faults
include restarting qemu-nbd on an image of another size (and content),
whose blocks the cache must drop, and swapping the image for another of
the same size and other content behind the same socket (a new qemu-nbd
on it), which the cache must notice too. Each connection checks every
read against the one image it opened: the one its upstream served at
some moment between its connect and that read, the same for its whole
life.

With --handover the gateway runs with --handover-socket and is replaced
every --handover-every seconds by a successor started with --take-over
(the same flags; alternately the binary in NBDGW_HANDOVER_OTHER when
set), among the faults, minus the upstream restart: a new qemu-nbd ends
every session whatever the gateway does, and here no client may see an
error. Every established session must move to the successor: no client
error, no reconnect, each predecessor exits 0, and the last gateway's
descriptors and memory come back to the first one's baseline. Until the
session hand-over lands (issue 29) this fails: sessions drain.

Prints operations, acknowledged writes, mismatches (must be 0), errors by
kind, faults injected, latency percentiles, nbdgw's peak RSS, and its
descriptors before and after (must come back to the baseline). Exits
non-zero on any mismatch, descriptor leak, or nbdgw dying.
"""

import argparse
import collections
import os
import random
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time

import nbd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NBDGW=target/release/nbdgw to soak an optimised build.
NBDGW = os.environ.get("NBDGW", os.path.join(ROOT, "target", "debug", "nbdgw"))
IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
OPT_STARTTLS, OPT_GO, OPT_STRUCTURED_REPLY = 5, 7, 8
CMD_READ, CMD_WRITE = 0, 1
BLOCK = 4096
# How far above its idle RSS nbdgw may stay once every client is gone.
RSS_MARGIN_MIB = 16


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = collections.Counter()
        self.errors = collections.Counter()
        self.faults = collections.Counter()
        self.latency = collections.defaultdict(list)
        self.acked_writes = 0
        self.connects = 0
        self.mismatches = []
        # (start, end) of each fault that may make a connect fail (the
        # upstream down, the client's CA file being rewritten), and of
        # each failed connect attempt with its error.
        self.windows = []
        self.connect_errors = []

    def window(self, start, end):
        with self.lock:
            self.windows.append((start, end))

    def connect_failed(self, start, end, error):
        with self.lock:
            self.connect_errors.append((start, end, error))

    def unexplained_connect_errors(self, slack=1.0):
        """Failed connects that overlap no fault window (widened by
        `slack` seconds for the attempt already under way and the
        restarted upstream's first moments)."""
        return [(s, e, err) for s, e, err in self.connect_errors
                if not any(s <= we + slack and e >= ws - slack for ws, we in self.windows)]

    def op(self, kind, seconds):
        with self.lock:
            self.ops[kind] += 1
            self.latency[kind].append(seconds)

    def error(self, kind):
        with self.lock:
            self.errors[kind] += 1

    def fault(self, kind):
        with self.lock:
            self.faults[kind] += 1


class Region:
    """What one client knows its part of the disk holds: bytes it had
    acknowledged, and blocks whose content is unknown (a write whose reply
    never came, a trim)."""

    def __init__(self, start, length):
        self.start, self.length = start, length
        self.data = bytearray(length)
        self.known = [False] * (length // BLOCK)

    def set(self, offset, data):
        rel = offset - self.start
        self.data[rel:rel + len(data)] = data
        for b in range(rel // BLOCK, (rel + len(data)) // BLOCK):
            self.known[b] = True

    def forget(self, offset, length):
        rel = offset - self.start
        for b in range(rel // BLOCK, (rel + length) // BLOCK):
            self.known[b] = False

    def check(self, offset, got):
        """Offsets of blocks whose content differs from what is known."""
        rel = offset - self.start
        bad = []
        for i in range(len(got) // BLOCK):
            b = rel // BLOCK + i
            if self.known[b] and got[i * BLOCK:(i + 1) * BLOCK] != self.data[b * BLOCK:(b + 1) * BLOCK]:
                bad.append(offset + i * BLOCK)
        return bad


def pattern(offset, generation, client, length):
    head = struct.pack(">QQQ", offset, generation, client)
    return (head * (length // len(head) + 1))[:length]


def connect(uri):
    h = nbd.NBD()
    h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.set_uri_allow_local_file(True)
    h.connect_uri(uri)
    return h


def client_loop(cid, region, uri, stats, stop, start_together):
    rng = random.Random(cid)
    h, generation = None, 0
    # Every client's first connect at the same instant: a host's VMs
    # after a gateway restart.
    start_together.wait()
    while not stop.is_set():
        if h is None:
            attempt = time.time()
            try:
                h = connect(uri)
            except nbd.Error as e:
                stats.error("connect")
                stats.connect_failed(attempt, time.time(), short(e))
                time.sleep(0.2)
                continue
            with stats.lock:
                stats.connects += 1
        blocks = rng.choice([1, 1, 1, 4, 16])
        offset = region.start + rng.randrange(region.length // BLOCK - blocks + 1) * BLOCK
        length = blocks * BLOCK
        kind = rng.choices(["read", "write", "zero", "trim", "flush", "block-status"],
                           [40, 35, 8, 4, 8, 5])[0]
        t = time.perf_counter()
        try:
            if kind == "read":
                got = h.pread(length, offset)
                bad = region.check(offset, got)
                if bad:
                    with stats.lock:
                        stats.mismatches.append((cid, bad[:4]))
            elif kind == "write":
                generation += 1
                data = pattern(offset, generation, cid, length)
                region.forget(offset, length)
                h.pwrite(data, offset)
                region.set(offset, data)
                with stats.lock:
                    stats.acked_writes += 1
            elif kind == "zero":
                region.forget(offset, length)
                h.zero(length, offset)
                region.set(offset, bytes(length))
            elif kind == "trim":
                # qemu-nbd may or may not discard: the content is unknown.
                region.forget(offset, length)
                h.trim(length, offset)
            elif kind == "flush":
                h.flush()
            else:
                h.block_status(length, offset, lambda *args: 0)
            stats.op(kind, time.perf_counter() - t)
        except nbd.Error as e:
            stats.error(f"{kind}: {short(e)}")
            try:
                h.shutdown()
            except nbd.Error:
                pass
            h = None
    if h is not None:
        try:
            h.shutdown()
        except nbd.Error:
            pass


def immutable_loop(cid, served, uri, stats, stop, start_together):
    """Reads only: small random reads (a boot) and sequential runs (a
    read-ahead's pattern), each compared with the image the connection
    opened; now and then a write, which must be refused.

    Which image a connection opened is not told: it is one of those the
    upstream served between its connect's start and end (`served` keeps
    that history), of the size the connection reports. Every read must
    match one of them, and the same one for the connection's life: bytes
    of an image replaced before the connect began (a stale cache) match
    none."""
    rng = random.Random(cid)
    h, candidates, run = None, None, None
    start_together.wait()
    while not stop.is_set():
        if h is None:
            attempt = time.time()
            try:
                h = connect(uri)
                size = h.get_size()
                candidates = served.between(attempt, time.time(), size)
                if not candidates:
                    stats.error(f"connect: no image of size {size} was served")
                if not h.is_read_only():
                    with stats.lock:
                        stats.mismatches.append((cid, "immutable export not advertised read-only"))
            except nbd.Error as e:
                stats.error("connect")
                stats.connect_failed(attempt, time.time(), short(e))
                h = None
                time.sleep(0.2)
                continue
            if not candidates:
                h.shutdown()
                h = None
                time.sleep(0.2)
                continue
        size = len(candidates[0][1])
        kind = rng.choices(["read", "sequential", "write"], [60, 38, 2])[0]
        if kind == "sequential":
            if run is None or run >= size or rng.random() < 1 / 128:
                run = rng.randrange(size // BLOCK) * BLOCK
            length = min(rng.choice([4096, 4096, 16384, 65536, 131072]), size - run)
            offset, run = run, run + length
        else:
            length = rng.choice([512, 4096, 4096, 4096, 16384, 65536])
            offset = rng.randrange((size - length) // 512) * 512
        t = time.perf_counter()
        try:
            if kind == "write":
                try:
                    h.pwrite(b"x" * 4096, offset)
                    with stats.lock:
                        stats.mismatches.append((cid, f"a write to the immutable export at {offset} succeeded"))
                except nbd.Error:
                    stats.op("refused write", time.perf_counter() - t)
                continue
            got = h.pread(length, offset)
            matching = [(name, data) for name, data in candidates
                        if got == data[offset:offset + length]]
            if not matching:
                with stats.lock:
                    stats.mismatches.append((cid, (offset, length, [n for n, _ in candidates])))
            else:
                candidates = matching
            stats.op("read", time.perf_counter() - t)
        except nbd.Error as e:
            stats.error(f"{kind}: {short(e)}")
            try:
                h.shutdown()
            except nbd.Error:
                pass
            h = None
    if h is not None:
        try:
            h.shutdown()
        except nbd.Error:
            pass


class Served:
    """Which image the upstream served from when: (time it may first have
    served, image name). An image is entered before its qemu-nbd starts
    (the old one is dead by then), so a connect's window always covers
    the image it reached."""

    def __init__(self, images, first):
        self.images, self.lock = images, threading.Lock()
        self.history = [(0.0, first)]

    def now(self, name):
        with self.lock:
            self.history.append((time.time(), name))

    def between(self, start, end, size):
        """The images of this size served at some moment in [start, end]:
        (name, bytes) each."""
        with self.lock:
            names = [n for i, (t, n) in enumerate(self.history)
                     if t <= end and (i + 1 == len(self.history) or self.history[i + 1][0] >= start)]
        return [(n, self.images[n]) for n in dict.fromkeys(names) if len(self.images[n]) == size]


def immutable_images(work, size, seed):
    """Four images: two sizes, and for each size two contents (a swap
    behind the same socket changes the content and keeps the size), each
    with a hole. Returns {name: bytes} and {name: path}."""
    images, paths = {}, {}
    for i, (length, content) in enumerate([(size, "a"), (size - (1 << 20), "a"),
                                           (size, "b"), (size - (1 << 20), "b")]):
        data = bytearray(random.Random(seed + i).randbytes(length))
        hole = slice(length // 4, length // 4 + (2 << 20))
        data[hole] = bytes(hole.stop - hole.start)
        name = f"{content}{length >> 20}M"
        path = os.path.join(work, f"golden-{name}.img")
        with open(path, "wb") as f:
            f.write(data[:hole.start])
            f.seek(hole.stop)
            f.write(data[hole.stop:])
        images[name] = bytes(data)
        paths[name] = path
    return images, paths


def cache_metrics(port):
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as e:
        return f"(metrics unavailable: {e})"
    return "\n".join(line for line in text.splitlines() if line.startswith("nbdgw_cache"))


def short(error):
    text = str(error)
    for known in ("Connection reset", "server reported", "Broken pipe", "ESHUTDOWN",
                  "end of file", "connection is dead", "Transport endpoint"):
        if known in text:
            return known
    return text[:60]


def raw_tls(host, port, certs):
    """A raw client in transmission (structured replies), for faults
    libnbd cannot make: a partial write payload, replies never read."""
    s = socket.create_connection((host, port))
    s.recv(18, socket.MSG_WAITALL)
    s.sendall(struct.pack(">I", 3) + struct.pack(">QII", IHAVEOPT, OPT_STARTTLS, 0))
    s.recv(20, socket.MSG_WAITALL)
    ctx = ssl.create_default_context(cafile=os.path.join(certs, "ca-cert.pem"))
    ctx.load_cert_chain(os.path.join(certs, "client-cert.pem"), os.path.join(certs, "client-key.pem"))
    t = ctx.wrap_socket(s, server_hostname=host)
    for option, data in ((OPT_STRUCTURED_REPLY, b""), (OPT_GO, struct.pack(">IH", 0, 0))):
        t.sendall(struct.pack(">QII", IHAVEOPT, option, len(data)) + data)
        while True:
            h = recv_exact(t, 20)
            _, _, kind, length = struct.unpack(">QIII", h)
            recv_exact(t, length)
            if kind == 1 or kind & 0x80000000:
                break
    return t


def recv_exact(t, n):
    out = b""
    while len(out) < n:
        chunk = t.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def request(command, cookie, offset, length):
    return struct.pack(">IHHQQI", REQUEST_MAGIC, 0, command, cookie, offset, length)


class Processes:
    def __init__(self, work, image, certs, host, port, netns, gw_extra=(), images=None,
                 through_client=False, served=None, handover=False):
        self.work, self.image, self.certs = work, image, certs
        # --handover: the hand-over socket, in a directory of our own;
        # the generations started so far, and the predecessors replaced
        # (each must exit 0).
        self.handover = None
        if handover:
            run = os.path.join(work, "run")
            os.mkdir(run, 0o700)
            self.handover = os.path.join(run, "handover.sock")
        self.generation, self.predecessors, self.pauses = 0, [], []
        self.handing_over = False
        # `nbdgw certs` rewrites the TLS files in place, not atomically: a
        # successor that read them half-written would rightly fail its
        # start, so a rotation and a successor's start never overlap.
        self.files = threading.Lock()
        # --immutable: the images ({name: path}) an upstream resize or
        # swap switches between, and the history of which was served.
        self.images, self.served = images or {}, served
        self.current = next(iter(self.images), None)
        self.host, self.port, self.netns = host, port, netns
        self.gw_extra = list(gw_extra)
        self.sock = os.path.join(work, "nbd.sock")
        self.qemu = None
        self.start_qemu()
        self.log = open(os.path.join(work, "nbdgw.log"), "w")
        self.start_gateway()
        self.client = None
        if through_client:
            self.client_sock = os.path.join(work, "client.sock")
            self.client_log = open(os.path.join(work, "client.log"), "w")
            self.client = subprocess.Popen(
                [NBDGW, "client", "--listen", self.client_sock, "--server", f"{host}:{port}",
                 "--tls-dir", certs, "--reconnect", "--reconnect-timeout", "30"],
                stderr=self.client_log, env={**os.environ, "RUST_LOG": "info"})
            deadline = time.time() + 10
            while not os.path.exists(self.client_sock):
                if time.time() > deadline:
                    sys.exit("soak: nbdgw client did not start")
                time.sleep(0.05)

    def gateway_command(self, binary=NBDGW):
        # `ip netns exec` execs nbdgw in place: the pid is nbdgw's.
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        handover = ["--handover-socket", self.handover, "--handover-timeout", "30"] if self.handover else []
        return [*inside, binary, "--listen", f"{self.host}:{self.port}", "--upstream", self.sock,
                "--tls-dir", self.certs, "--tls-reload-interval", "1", "--stall-timeout", "3",
                "--handshake-timeout", "5", "--shutdown-grace", "5", *handover, *self.gw_extra]

    def start_gateway(self):
        self.gw = subprocess.Popen(self.gateway_command(), stderr=self.log,
                                   env={**os.environ, "RUST_LOG": "info"})
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection((self.host, self.port)).close()
                return
            except OSError:
                time.sleep(0.05)
        sys.exit("soak: nbdgw did not start")

    def hand_over(self):
        """Starts a successor with --take-over (alternately the binary in
        NBDGW_HANDOVER_OTHER) and waits until it serves; the predecessor
        is reaped later (`predecessors_exit`), so a slow drain does not
        hold up the next hand-over."""
        n = self.generation + 1
        binary = os.environ.get("NBDGW_HANDOVER_OTHER", NBDGW) if n % 2 else NBDGW
        path = os.path.join(self.work, f"nbdgw-{n}.log")
        self.handing_over = True
        try:
            with self.files:
                self.start_successor(binary, path)
            old, self.gw, self.generation = self.gw, self.successor, n
            self.predecessors.append((n - 1, old))
        finally:
            self.handing_over = False

    def start_successor(self, binary, path):
        with open(path, "w") as log:
            new = subprocess.Popen(self.gateway_command(binary) + ["--take-over", self.handover],
                                   stderr=log, env={**os.environ, "RUST_LOG": "info"})
        deadline = time.time() + 60
        while True:
            exited = new.poll() is not None
            with open(path, errors="replace") as f:
                text = f.read()
            if "take-over: serving" in text:
                break
            if exited or time.time() > deadline:
                new.kill()
                new.wait()
                raise OSError(f"successor did not take over (exit {new.returncode}): {text[-300:]!r}")
            time.sleep(0.05)
        self.successor = new
        pause = [w for w in text.split() if w.startswith("pause_ms=")]
        if pause:
            self.pauses.append(float(pause[0].split("=")[1]))

    def predecessors_exit(self, timeout=60):
        """The exit code of every replaced gateway: (generation, code)."""
        codes = []
        for n, old in self.predecessors:
            try:
                codes.append((n, old.wait(timeout=timeout)))
            except subprocess.TimeoutExpired:
                old.kill()
                codes.append((n, "still running"))
        return codes

    def restart_gateway(self):
        """SIGKILL, as a crash or a node's eviction would: no drain."""
        self.gw.kill()
        self.gw.wait()
        time.sleep(0.3)
        self.start_gateway()

    def stop_gateway_gracefully(self):
        """SIGTERM, as systemd or Kubernetes would stop it: it drains
        (--shutdown-grace) and exits 0; then a new one starts, as a
        rolling upgrade would."""
        self.gw.send_signal(signal.SIGTERM)
        code = self.gw.wait(timeout=60)
        if code != 0:
            raise OSError(f"the gateway stopped by SIGTERM exited {code}")
        self.start_gateway()

    def flap_gateway(self, times=4):
        """A gateway that drops again and again: each new one killed
        moments after it accepts, then one that stays."""
        for _ in range(times):
            self.gw.kill()
            self.gw.wait()
            self.start_gateway()
            time.sleep(0.3)
        self.restart_gateway()

    def start_qemu(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.qemu = subprocess.Popen(
            ["qemu-nbd", "-f", "raw", "--persistent", "--shared=0", "--cache=writeback",
             "--discard=unmap", "-k", self.sock, self.image], stderr=subprocess.DEVNULL)
        while not os.path.exists(self.sock):
            time.sleep(0.01)

    def restart_qemu(self, to=None):
        """Kills qemu-nbd and starts another on the same socket, on image
        `to` (a name in `images`) when given."""
        self.qemu.kill()
        self.qemu.wait()
        time.sleep(0.3)
        if to is not None:
            self.current, self.image = to, self.images[to]
            self.served.now(to)
        self.start_qemu()

    def other_image(self, same_size):
        """The image a resize (same content, other size) or a swap (same
        size, other content) switches to: names are content, then size."""
        content, size = self.current[0], self.current[1:]
        for name in self.images:
            if same_size and name[1:] == size and name[0] != content:
                return name
            if not same_size and name[0] == content and name[1:] != size:
                return name
        raise ValueError(f"no image to switch to from {self.current}")

    def stop(self):
        if self.client is not None:
            self.client.send_signal(signal.SIGTERM)
            try:
                self.client.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.client.kill()
        self.gw.send_signal(signal.SIGTERM)
        try:
            self.gw.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.gw.kill()
        for _, old in self.predecessors:
            if old.poll() is None:
                old.kill()
                old.wait()
        self.qemu.kill()
        self.qemu.wait()


def failed_handshakes(host, port, certs, count, stranger):
    """`count` handshakes that fail: garbage where the TLS ClientHello
    belongs, and (one in ten) a client certificate from another CA."""
    failures = collections.Counter()
    for i in range(count):
        try:
            s = socket.create_connection((host, port))
            s.recv(18, socket.MSG_WAITALL)
            s.sendall(struct.pack(">I", 3) + struct.pack(">QII", IHAVEOPT, OPT_STARTTLS, 0))
            s.recv(20, socket.MSG_WAITALL)
            if i % 10:
                s.sendall(b"\x16\x03\x01\x00\x05garbage")
                s.recv(64)
                failures["garbage"] += 1
            else:
                ctx = ssl.create_default_context(cafile=os.path.join(certs, "ca-cert.pem"))
                ctx.load_cert_chain(os.path.join(stranger, "client-cert.pem"),
                                    os.path.join(stranger, "client-key.pem"))
                t = ctx.wrap_socket(s, server_hostname=host)
                t.sendall(struct.pack(">QII", IHAVEOPT, 3, 0))
                t.recv(20)
                failures["unexpectedly admitted"] += 1
            s.close()
        except (OSError, ssl.SSLError):
            failures["refused as expected" if i % 10 == 0 else "garbage"] += 1
    return failures


def settle(pid, fds_before, rss_idle):
    """Waits for nbdgw's descriptors, then its RSS, to come back."""
    deadline = time.time() + 15
    while fds(pid) > fds_before and time.time() < deadline:
        time.sleep(0.25)
    # Freed memory goes back to the system within the allocator's decay
    # time (jemalloc: 10 s, gradually).
    deadline = time.time() + 30
    while rss_mib(pid) > rss_idle + RSS_MARGIN_MIB and time.time() < deadline:
        time.sleep(0.5)
    return fds(pid), rss_mib(pid)


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def faults(procs, certs, stats, stop, rng, every):
    """One fault every `every` seconds, in turn."""
    kinds = ["vanish mid-write", "stop reading", "upstream restart", "certificate rotation", "SIGHUP storm"]
    if procs.client is not None:
        kinds[1:1] = ["gateway restart", "graceful gateway restart", "gateway flapping"]
    if len(procs.images) > 1:
        kinds[3:3] = ["upstream resize", "image swap"]
    if procs.handover:
        # A new qemu-nbd ends every session, which --handover forbids.
        kinds.remove("upstream restart")
    i = 0
    while not stop.wait(every):
        kind = kinds[i % len(kinds)]
        i += 1
        try:
            if kind == "vanish mid-write":
                t = raw_tls(procs.host, procs.port, certs)
                t.sendall(request(CMD_WRITE, 1, 0, 1 << 20) + b"x" * 5000)
                t.close()
            elif kind == "stop reading":
                t = raw_tls(procs.host, procs.port, certs)
                t.sendall(b"".join(request(CMD_READ, c, 0, 1 << 20) for c in range(32)))
                threading.Timer(8, t.close).start()
            elif kind == "gateway restart":
                began = time.time()
                procs.restart_gateway()
                stats.window(began, time.time())
            elif kind == "upstream restart":
                began = time.time()
                procs.restart_qemu()
                stats.window(began, time.time())
            elif kind == "graceful gateway restart":
                began = time.time()
                procs.stop_gateway_gracefully()
                stats.window(began, time.time())
            elif kind == "gateway flapping":
                began = time.time()
                procs.flap_gateway()
                stats.window(began, time.time())
            elif kind in ("upstream resize", "image swap"):
                began = time.time()
                procs.restart_qemu(to=procs.other_image(same_size=kind == "image swap"))
                stats.window(began, time.time())
            elif kind == "certificate rotation":
                # Clients read the same files (the CA is kept, rewritten).
                began = time.time()
                with procs.files:
                    subprocess.run([NBDGW, "certs", "--out", certs, "--force", "--server-name", procs.host,
                                    "--ca-cert", os.path.join(certs, "ca-cert.pem"),
                                    "--ca-key", os.path.join(certs, "ca-key.pem")],
                                   check=True, stdout=subprocess.DEVNULL)
                stats.window(began, time.time())
                if not serves_new_certificate(procs, certs):
                    stats.error("rotation: new sessions never got the new certificate")
            else:
                for _ in range(20):
                    procs.gw.send_signal(signal.SIGHUP)
            stats.fault(kind)
        except (OSError, ssl.SSLError, ConnectionError, subprocess.CalledProcessError) as e:
            stats.error(f"fault {kind}: {e}")


def handovers(procs, stats, stop, every):
    """A hand-over every `every` seconds (from the end of the last)."""
    while not stop.wait(every):
        try:
            procs.hand_over()
            stats.fault("hand-over")
        except OSError as e:
            stats.error(f"hand-over: {e}")


def serves_new_certificate(procs, certs, within=5.0):
    """Whether new sessions get the certificate now in the files (nbdgw
    polls them every second), while the clients' sessions go on."""
    with open(os.path.join(certs, "server-cert.pem")) as f:
        expected = ssl.PEM_cert_to_DER_cert(f.read())
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            t = raw_tls(procs.host, procs.port, certs)
            served = t.getpeercert(binary_form=True)
            t.close()
            if served == expected:
                return True
        except (OSError, ssl.SSLError, ConnectionError):
            pass
        time.sleep(0.25)
    return False


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] * 1e6 if values else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--size-mib", type=int, default=None, help="export size (default 256, 64 with --immutable)")
    ap.add_argument("--immutable", action="store_true", help="reads only, through nbdgw's read cache")
    ap.add_argument("--cache-mib", type=int, default=16, help="--cache-size with --immutable")
    ap.add_argument("--read-ahead-kib", type=int, default=1024, help="--read-ahead with --immutable")
    ap.add_argument("--cache-block-kib", type=int, default=64, help="--cache-block-size with --immutable")
    ap.add_argument("--fault-every", type=float, default=4)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--failed-handshakes", type=int, default=10000)
    ap.add_argument("--host", default="127.0.0.1", help="address nbdgw listens on and clients dial")
    ap.add_argument("--gateway-netns", help="run nbdgw in this network namespace")
    ap.add_argument("--through-client", action="store_true",
                    help="clients go through `nbdgw client --reconnect`, and the gateway is restarted too")
    ap.add_argument("--drain-answer", choices=["close", "eshutdown"],
                    help="the gateway's --drain-answer (default: the gateway's own default)")
    ap.add_argument("--max-op-seconds", type=float, default=0,
                    help="fail if a successful operation took longer (0: no limit)")
    ap.add_argument("--handover", action="store_true",
                    help="replace the gateway every --handover-every seconds (--take-over): no client error allowed")
    ap.add_argument("--handover-every", type=float, default=4,
                    help="seconds between hand-overs with --handover")
    args = ap.parse_args()
    if args.size_mib is None:
        args.size_mib = 64 if args.immutable else 256
    if args.handover and (args.through_client or args.immutable or args.gateway_netns):
        sys.exit("soak: --handover goes with the plain mode only")
    if not os.access(NBDGW, os.X_OK):
        sys.exit(f"soak: build nbdgw first (cargo build): {NBDGW}")
    with tempfile.TemporaryDirectory() as work:
        image = os.path.join(work, "disk.img")
        size = args.size_mib << 20
        with open(image, "wb") as f:
            f.truncate(size)
        images, gw_extra, paths, served, margin = None, [], None, None, RSS_MARGIN_MIB
        if args.immutable:
            images, paths = immutable_images(work, size, args.seed)
            first = next(iter(paths))
            image, served = paths[first], Served(images, first)
            admin = free_port()
            gw_extra = ["--immutable", "--cache-size", str(args.cache_mib << 20),
                        "--read-ahead", str(args.read_ahead_kib << 10),
                        "--cache-block-size", str(args.cache_block_kib << 10),
                        "--admin-listen", f"127.0.0.1:{admin}"]
            # The cache keeps what it holds once the clients are gone.
            margin += args.cache_mib * 2
        if args.drain_answer:
            gw_extra += ["--drain-answer", args.drain_answer]
        certs = os.path.join(work, "certs")
        subprocess.run([NBDGW, "certs", "--out", certs, "--keep-ca-key", "--server-name", args.host],
                       check=True, stdout=subprocess.DEVNULL)
        port = args.port or free_port()
        procs = Processes(work, image, certs, args.host, port, args.gateway_netns, gw_extra, paths,
                          args.through_client, served, args.handover)
        # Through client mode the gateway is restarted: the process whose
        # descriptors and memory are watched is client mode's.
        pid = procs.client.pid if procs.client else procs.gw.pid
        time.sleep(0.5)
        fds_before, rss_idle = fds(pid), rss_mib(pid)
        uri = f"nbds://{args.host}:{port}/?tls-certificates={certs}"
        if procs.client:
            uri = f"nbd+unix:///?socket={procs.client_sock}"
        stats, stop = Stats(), threading.Event()
        span = size // args.clients // BLOCK * BLOCK
        start_together = threading.Barrier(args.clients)
        if args.immutable:
            workers = [threading.Thread(target=immutable_loop,
                                        args=(c, served, uri, stats, stop, start_together))
                       for c in range(args.clients)]
        else:
            workers = [threading.Thread(target=client_loop,
                                        args=(c, Region(c * span, span), uri, stats, stop, start_together))
                       for c in range(args.clients)]
        faulter = threading.Thread(target=faults, args=(procs, certs, stats, stop, random.Random(args.seed),
                                                        args.fault_every))
        replacer = threading.Thread(target=handovers, args=(procs, stats, stop, args.handover_every))
        for w in workers:
            w.start()
        faulter.start()
        if args.handover:
            replacer.start()
        started, peak = time.time(), rss_idle
        while time.time() - started < args.seconds:
            time.sleep(0.5)
            gw = procs.gw
            # A predecessor exits once it has handed over, maybe before
            # procs.gw names its successor: its exit code is checked
            # with the others' at the end.
            replaced = args.handover and (procs.handing_over or gw is not procs.gw)
            if gw.poll() is not None and not (procs.client and stats.faults["gateway restart"]) \
                    and not replaced:
                stop.set()
                sys.exit(f"soak: nbdgw died with {procs.gw.returncode}")
            if procs.client and procs.client.poll() is not None:
                stop.set()
                sys.exit(f"soak: nbdgw client died with {procs.client.returncode}")
            if not args.handover:
                peak = max(peak, rss_mib(pid))
                continue
            # The process watched is the gateway serving now.
            pid = procs.gw.pid
            try:
                peak = max(peak, rss_mib(pid))
            except FileNotFoundError:
                pass  # replaced between the two lines
        stop.set()
        for w in workers:
            w.join()
        faulter.join()
        if args.handover:
            replacer.join()
            pid = procs.gw.pid
        # The stalled readers are closed by the stall timeout; then every
        # connection nbdgw held is gone.
        fds_after, rss_after = settle(pid, fds_before, rss_idle + margin - RSS_MARGIN_MIB)
        if args.immutable:
            print(cache_metrics(admin))
        stranger = os.path.join(work, "stranger")
        subprocess.run([NBDGW, "certs", "--out", stranger], check=True, stdout=subprocess.DEVNULL)
        failures = failed_handshakes(args.host, port, certs, args.failed_handshakes, stranger)
        fds_burst, rss_burst = settle(pid, fds_before, rss_idle + margin - RSS_MARGIN_MIB)
        procs.stop()
        report(args, stats, peak, rss_idle, rss_after, fds_before, fds_after)
        print(f"after {args.failed_handshakes} failed handshakes {dict(failures)}: "
              f"RSS {rss_burst:.1f} MiB, descriptors {fds_burst}")
        slowest = max((max(v) for v in stats.latency.values() if v), default=0.0)
        print(f"slowest successful operation: {slowest * 1000:.0f} ms")
        unexplained = stats.unexplained_connect_errors()
        print(f"connect errors: {len(stats.connect_errors)}, not explained by an injected fault: "
              f"{len(unexplained)} {unexplained[:5]}")
        # Through client mode every restart is shorter than its reconnect
        # timeout: a client must see no error at all (the faults' own raw
        # clients, which go to the gateway directly, aside).
        seen = {k: v for k, v in stats.errors.items() if not k.startswith("fault ")}
        if procs.client:
            print(f"errors seen through client mode: {seen}")
            if seen:
                # What client mode said of each drop and give-up: which
                # case leaked (a reply cut beyond --reply-buffer, a
                # give-up, or something new).
                with open(os.path.join(work, "client.log"), errors="replace") as log:
                    said = [line for line in log if "WARN" in line or "ERROR" in line]
                for line in said[-40:]:
                    print("client mode:", line.rstrip()[:400])
                print(f"client mode: {len(said)} warnings and errors in all, the last 40 shown")
        handover_checks = {}
        if args.handover:
            client_errors = {k: v for k, v in seen.items() if not k.startswith("hand-over: ")}
            failed_handovers = {k: v for k, v in seen.items() if k.startswith("hand-over: ")}
            exits = procs.predecessors_exit()
            reconnects = stats.connects - args.clients
            pauses = sorted(procs.pauses)
            print(f"hand-overs done: {stats.faults['hand-over']}, failed: {failed_handovers}")
            print(f"predecessors' exit codes other than 0: {[(n, c) for n, c in exits if c != 0]}")
            print(f"client errors: {sum(client_errors.values())} {client_errors}")
            print(f"reconnects: {reconnects} ({stats.connects} connects by {args.clients} clients)")
            if pauses:
                print(f"listeners' pause (successor's pause_ms): median {pauses[len(pauses) // 2]:.0f} ms, "
                      f"max {pauses[-1]:.0f} ms")
            handover_checks = {
                "hand-overs done": stats.faults["hand-over"] > 0 and not failed_handovers,
                "no client error": not client_errors,
                "no reconnect": reconnects == 0,
                "every predecessor exited 0": all(c == 0 for _, c in exits),
            }
        checks = {
            **handover_checks,
            "no mismatch": not stats.mismatches,
            "nbdgw exited 0": procs.gw.returncode == 0,
            "no unexplained connect error": not unexplained,
            "nothing seen through client mode": not (procs.client and seen),
            "nbdgw client exited 0": not (procs.client and procs.client.returncode != 0),
            "rotations served": not any(k.startswith("rotation") for k in stats.errors),
            "no slow operation": not args.max_op_seconds or slowest <= args.max_op_seconds,
            "descriptors back": max(fds_after, fds_burst) <= fds_before,
            "memory back": max(rss_after, rss_burst) <= rss_idle + margin,
            "strangers refused": failures["unexpectedly admitted"] == 0,
        }
        ok = all(checks.values())
        failed = [name for name, passed in checks.items() if not passed]
        print("soak:", "PASSED" if ok else f"FAILED ({', '.join(failed)})")
        sys.exit(0 if ok else 1)


def report(args, stats, peak, rss_idle, rss_after, fds_before, fds_after):
    ops = sum(stats.ops.values())
    print(f"# soak: {args.clients} clients, {args.seconds:.0f} s, {args.size_mib} MiB export")
    print(f"operations: {ops} ({', '.join(f'{k} {v}' for k, v in sorted(stats.ops.items()))})")
    print(f"acknowledged writes: {stats.acked_writes}")
    print(f"mismatches: {len(stats.mismatches)} {stats.mismatches[:5]}")
    print(f"faults injected: {dict(stats.faults)}")
    print(f"errors by kind: {dict(stats.errors)}")
    for kind in ("read", "write"):
        lat = stats.latency.get(kind, [])
        print(f"{kind} latency: p50 {percentile(lat, 0.5):.0f} us, p99 {percentile(lat, 0.99):.0f} us")
    print(f"nbdgw RSS: idle {rss_idle:.1f} MiB, peak {peak:.1f} MiB, after {rss_after:.1f} MiB")
    print(f"nbdgw descriptors: before {fds_before}, after {fds_after}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
