"""--handover-fdstore against a FAKE systemd (named "fake": it plays
systemd's part on the host, so that scripts/test.sh can run these cases
without the VM; tests/fdstore_restart.py runs the real one).

The fake holds the listening socket, keeps what nbdgw sends with
FDSTORE=1 (SCM_RIGHTS) under its FDNAME, removes it at FDSTOREREMOVE=1,
answers BARRIER=1 by closing its descriptor, and starts each instance
with LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID and NOTIFY_SOCKET as
systemd does (the store's descriptors after the socket's), one instance
at a time as a restart job does. Real qemu-nbd upstream, real
python3-libnbd clients. From the review of the fd store
(reviews/fdstore-review.md, experiments e2 and e3).

    fdstore_fake.py [NBDGW_BINARY [CASE ...]]
        (binary default: $NBDGW_UNDER_TEST, else target/debug/nbdgw; cases:
        all; tests/fdstore_fake.rs runs each)

Cases:
- back_to_back: 20 sessions, a restart, then a second one as soon as the
  new instance says READY=1 (two `systemctl restart` in a row): all 20
  must be in the store after it and answer on the third instance (M2:
  before, the second instance drained the ones it had not finished
  restoring).
- term_during_restore: 40 sessions, SIGTERM to the new instance as soon
  as it has claimed the first stored one: it finishes the restore, then
  stores all 40 again (M2).
- store_room: FDSTORE=4 (FileDescriptorStoreMax=4, room for one session;
  the fake closes the descriptors beyond it, as systemd does), 3 sessions:
  one is stored whole, the other two drain (S1: before, all three were
  taken, one stored, one cut in part, one lost).
- half_sent_write: one idle libnbd session reading in a loop, another
  client leaves a WRITE's payload half sent; SIGTERM: the idle session's
  longest gap must stay under 20 s (M1: the drain held it for
  --shutdown-grace 30, 37 s in all).

Every wait is bounded; exit status 0 only if every case passed.
"""

import array
import fcntl
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import nbd

HERE = os.path.dirname(os.path.abspath(__file__))
NBDGW = (sys.argv[1] if len(sys.argv) > 1 else None) or os.environ.get(
    "NBDGW_UNDER_TEST") or os.path.join(HERE, "..", "target", "debug", "nbdgw")
CASES = sys.argv[2:]


class FakeSystemd:
    """systemd's part, as described above (fake)."""

    def __init__(self, work, store_max=3136):
        self.work = work
        self.store_max = store_max
        self.notify_path = os.path.join(work, "notify")
        self.ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ns.bind(self.notify_path)
        self.ns.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        self.port = self.listener.getsockname()[1]
        self.store = []  # (name, fd)
        self.events = []  # (pid, tags)
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            msg, anc, _f, _a = self.ns.recvmsg(
                65536, socket.CMSG_SPACE(64 * 4) + socket.CMSG_SPACE(12))
            fds, pid = [], None
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds += list(a)
                elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", data)[0]
            tags = [t for t in msg.decode(errors="replace").split("\n") if t]
            name = next((t[7:] for t in tags if t.startswith("FDNAME=")), "stored")
            with self.cond:
                if "FDSTORE=1" in tags:
                    # service_add_fd_store_set: one by one, the ones
                    # beyond FileDescriptorStoreMax= closed.
                    while fds and len(self.store) < self.store_max:
                        self.store.append((name, fds.pop(0)))
                elif "FDSTOREREMOVE=1" in tags:
                    for n, fd in self.store:
                        if n == name:
                            os.close(fd)
                    self.store = [(n, fd) for n, fd in self.store if n != name]
                self.events.append((pid, tags))
                self.cond.notify_all()
            for fd in fds:
                os.close(fd)

    def start(self, args, log, extra_env=None):
        """Forks and execs nbdgw with the socket and the store as
        descriptors 3.. (as systemd passes them); its Instance."""
        with self.cond:
            items = [("nbd", self.listener.fileno())] + list(self.store)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        env = dict(os.environ, LISTEN_FDS=str(len(items)),
                   LISTEN_FDNAMES=":".join(n for n, _ in items),
                   NOTIFY_SOCKET=self.notify_path, **(extra_env or {}))
        pid = os.fork()
        if pid == 0:
            try:
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 2000 + i) for i, (_, fd) in enumerate(items)]
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
                for i, h in enumerate(high):
                    os.dup2(h, 3 + i, inheritable=True)
                os.closerange(3 + len(items), 65536)
                env["LISTEN_PID"] = str(os.getpid())
                os.execve(NBDGW, [NBDGW] + args, env)
            finally:
                os._exit(127)
        os.close(out)
        return Instance(pid)

    def wait_ready(self, p, timeout=120):
        with self.cond:
            ok = self.cond.wait_for(
                lambda: any(pid == p.pid and "READY=1" in t for pid, t in self.events)
                or p.exited(), timeout)
        if not ok or p.exited():
            raise AssertionError(f"no READY=1 from nbdgw {p.pid}")

    def fds(self, name):
        with self.cond:
            return sum(1 for n, _ in self.store if n == name)

    def names(self):
        with self.cond:
            return sorted({n for n, _ in self.store})


class Instance:
    """One nbdgw the fake started (a child of this process)."""

    def __init__(self, pid):
        self.pid = pid
        self.status = None

    def exited(self):
        if self.status is None:
            p, status = os.waitpid(self.pid, os.WNOHANG)
            if p == self.pid:
                self.status = status
        return self.status is not None


def stop(p, timeout=60):
    """SIGTERM, and its exit waited for (bounded)."""
    os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not p.exited():
        if time.monotonic() > deadline:
            os.kill(p.pid, signal.SIGKILL)
            raise AssertionError(f"nbdgw {p.pid} did not exit within {timeout} s of SIGTERM")
        time.sleep(0.02)


def client(certs, port):
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(certs)
    h.connect_tcp("127.0.0.1", str(port))
    return h


def back_to_back(env):
    sd, args, log, certs = env
    a = sd.start(args, log)
    sd.wait_ready(a)
    hs = []
    for _ in range(20):
        h = client(certs, sd.port)
        h.pread(512, 0)
        hs.append(h)
    stop(a)
    assert len(sd.names()) == 20, f"A stored {len(sd.names())} of 20"
    b = sd.start(args, log)
    sd.wait_ready(b)
    stop(b)  # the second restart, right at READY=1
    stored = sd.names()
    assert len(stored) == 20 and all(f".{b.pid}." in n for n in stored), \
        f"after a restart at READY=1 the store holds {len(stored)} of 20: {stored}"
    c = sd.start(args, log)
    sd.wait_ready(c)
    alive = 0
    for h in hs:
        try:
            h.pread(512, 0)
            alive += 1
        except nbd.Error:
            pass
    stop(c)
    assert alive == 20, f"{alive} of 20 sessions answer after two restarts in a row"


def store_room(env):
    sd, args, log, certs = env
    sd.store_max = 4  # FileDescriptorStoreMax=4: room for one session
    room = {"FDSTORE": "4"}
    a = sd.start(args, log, room)
    sd.wait_ready(a)
    hs = []
    for _ in range(3):
        h = client(certs, sd.port)
        h.pread(512, 0)
        hs.append(h)
    stop(a)
    names = sd.names()
    assert len(names) == 1 and sd.fds(names[0]) == 3, \
        f"FDSTORE=4: the store should hold one whole session, not {[(n, sd.fds(n)) for n in names]}"
    b = sd.start(args, log, room)
    sd.wait_ready(b)
    seen = []
    for h in hs:
        try:
            h.pread(512, 0)
            seen.append("ok")
        except nbd.Error as e:
            seen.append(e.string)
    stop(b)
    # The two not stored drained: a close at a request boundary, which
    # libnbd reports as ENOTCONN, not a TLS connection cut by systemd.
    assert seen.count("ok") == 1 and all("not connected" in x for x in seen if x != "ok"), seen


def term_during_restore(env):
    sd, args, log, certs = env
    a = sd.start(args, log)
    sd.wait_ready(a)
    hs = []
    for _ in range(40):
        h = client(certs, sd.port)
        h.pread(512, 0)
        hs.append(h)
    stop(a)
    assert len(sd.names()) == 40, f"A stored {len(sd.names())} of 40"
    b = sd.start(args, log)
    # SIGTERM as soon as B has claimed its first stored session (a
    # restart while the previous one is still restoring).
    with sd.cond:
        assert sd.cond.wait_for(lambda: any(
            pid == b.pid and "FDSTOREREMOVE=1" in t for pid, t in sd.events), 120), \
            "B removed no stored session"
    stop(b)
    stored = sd.names()
    assert len(stored) == 40 and all(f".{b.pid}." in n for n in stored), \
        f"a SIGTERM during the restore: the store holds {len(stored)} of 40 from B"
    c = sd.start(args, log)
    sd.wait_ready(c)
    alive = sum(1 for h in hs if answers(h))
    stop(c)
    assert alive == 40, f"{alive} of 40 sessions answer after a SIGTERM during the restore"


def answers(h):
    try:
        h.pread(512, 0)
        return True
    except nbd.Error:
        return False


def writes_counted(admin):
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('nbdgw_requests_total{command="WRITE"}'):
                return float(line.split()[-1])
    return 0


def half_sent_write(env):
    sd, args, log, certs = env
    admin = free_port()
    a = sd.start(args + ["--admin-listen", f"127.0.0.1:{admin}"], log)
    sd.wait_ready(a)
    h = client(certs, sd.port)
    gaps, stopping = [], threading.Event()

    def reader():
        last = time.monotonic()
        while not stopping.is_set():
            try:
                h.pread(4096, 0)
            except nbd.Error as e:
                gaps.append(f"error: {e}")
                return
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            stopping.wait(0.05)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    y = raw_tls_session(certs, sd.port)
    y.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 1, 7, 0, 1 << 20))
    y.sendall(b"y" * (1 << 19))  # half the payload, then nothing
    deadline = time.monotonic() + 30
    while writes_counted(admin) < 1:
        assert time.monotonic() < deadline, "the WRITE was never counted"
        time.sleep(0.05)
    stop(a)
    b = sd.start(args, log)
    sd.wait_ready(b)
    # Two reads on the new instance end the measured pause.
    n = len(gaps)
    deadline = time.monotonic() + 30
    while len(gaps) < n + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stopping.set()
    th.join(30)
    stop(b)
    y.close()
    errors = [g for g in gaps if isinstance(g, str)]
    assert not errors, errors
    worst = max(gaps)
    assert worst < 20, f"the idle session paused {worst:.1f} s behind a half-sent write"
    print(f"  idle session's longest pause: {worst:.1f} s")


def raw_tls_session(certs, port):
    """A raw NBD client: STARTTLS, then NBD_OPT_GO on the default export."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    recvn(s, 18)
    s.sendall(struct.pack(">I", 3))
    option(s, 5)
    reply(s)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(f"{certs}/ca-cert.pem")
    ctx.load_cert_chain(f"{certs}/client-cert.pem", f"{certs}/client-key.pem")
    t = ctx.wrap_socket(s)
    option(t, 7, struct.pack(">IH", 0, 0))
    while reply(t) != 1:
        pass
    return t


def recvn(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError(f"closed after {len(b)} of {n} bytes")
        b += c
    return b


def option(s, o, data=b""):
    s.sendall(b"IHAVEOPT" + struct.pack(">II", o, len(data)) + data)


def reply(s):
    _magic, _o, typ, ln = struct.unpack(">QIII", recvn(s, 20))
    recvn(s, ln)
    assert typ < 0x80000000 or typ == 1, f"option refused: {typ:#x}"
    return typ


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    work = tempfile.mkdtemp(prefix="nbdgw-fdstore-fake-")
    failed = []
    qemu = None
    try:
        certs = os.path.join(work, "certs")
        subprocess.run([NBDGW, "certs", "--out", certs], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        disk, sock = os.path.join(work, "disk.img"), os.path.join(work, "nbd.sock")
        subprocess.run(["truncate", "-s", "64M", disk], check=True)
        qemu = subprocess.Popen(["qemu-nbd", "--format=raw", "--persistent", "--shared=0",
                                 f"--socket={sock}", disk])
        for _ in range(400):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        for case in (back_to_back, term_during_restore, half_sent_write, store_room):
            if CASES and case.__name__ not in CASES:
                continue
            d = os.path.join(work, case.__name__)
            os.mkdir(d)
            sd = FakeSystemd(d)
            log = os.path.join(d, "nbdgw.log")
            args = ["--tls-dir", certs, "--upstream", sock, "--listen", f"127.0.0.1:{sd.port}",
                    "--drain-delay", "0", "--shutdown-grace", "30", "--handover-fdstore"]
            print(f"fdstore_fake: {case.__name__}", flush=True)
            try:
                case((sd, args, log, certs))
                print(f"fdstore_fake: {case.__name__}: ok", flush=True)
            except (AssertionError, nbd.Error, OSError) as e:
                failed.append(case.__name__)
                print(f"fdstore_fake: {case.__name__}: FAILED: {e}", flush=True)
                with open(log, errors="replace") as f:
                    lines = [x for x in f if "WARN" in x or "ERROR" in x or "sessions=" in x
                             or "stored=" in x or "listening" in x or "stopped" in x]
                    print("".join(lines[-60:]), flush=True)
    finally:
        if qemu:
            qemu.terminate()
            qemu.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
