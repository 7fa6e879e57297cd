#!/usr/bin/python3
"""What the hybrid key exchange (X25519MLKEM768) costs a handshake, issue 31
item 2: CPU per handshake of each nbdgw process, and the ClientHello and
ServerHello sizes, with and without the hybrid, for nbdgw client to an
nbdgw server and for a GnuTLS client (libnbd, through bench/nbdclient.py)
to an nbdgw server. All cases side by side in one run, their order rotated
each round; medians and ranges over rounds.

    bench/pq_handshakes.py --nbdgw target/release/nbdgw [--base OLD] \\
        [--rounds 5] [--handshakes 200]

Cases (each a chain of processes on loopback, qemu-nbd behind):
  pair hybrid       nbdgw client (default groups) -> nbdgw server
  pair classical    nbdgw client --tls-groups X25519,secp256r1,secp384r1
                    -> the same server
  gnutls            libnbd -> nbdgw server (default groups)
  gnutls classical  libnbd -> nbdgw server --tls-groups X25519,secp256r1,secp384r1
  gnutls base       libnbd -> OLD nbdgw server (--base, the code before)

Sizes come from a relay in front of each server that skips the plaintext
NBD prelude (client flags and STARTTLS one way; greeting and its ACK the
other) and reads the first TLS record each way: the ClientHello, and the
ServerHello (the server's first handshake message). CPU is utime+stime
from /proc of each nbdgw process around the handshakes (not the
clients'). Not a test: it asserts nothing about time.
"""

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLASSICAL = "X25519,secp256r1,secp384r1"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.05)


def listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class Relay:
    """TCP relay that records the first TLS record's header each way after
    the NBD prelude: (handshake type, handshake length) of the ClientHello
    and of the server's first handshake message."""

    CLIENT_PRELUDE = 4 + 16  # client flags, NBD_OPT_STARTTLS header
    SERVER_PRELUDE = 18 + 20  # greeting, the option reply (ACK)

    def __init__(self, target_port):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.hellos = []  # (client hello bytes, server hello bytes)
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            for sk in (c, s):
                sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            seen = {}
            done = threading.Event()
            threading.Thread(target=self.pipe, args=(c, s, self.CLIENT_PRELUDE, seen, "client", done),
                             daemon=True).start()
            threading.Thread(target=self.pipe, args=(s, c, self.SERVER_PRELUDE, seen, "server", done),
                             daemon=True).start()

    def pipe(self, src, dst, prelude, seen, side, done):
        buf = b""
        want = prelude + 9  # record header and handshake header
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if len(buf) < want:
                    buf += data[: want - len(buf)]
                    if len(buf) == want:
                        record = buf[prelude:]
                        if record[0] == 22:  # handshake
                            length = struct.unpack(">I", b"\0" + record[6:9])[0]
                            seen[side] = 4 + length
                            if "client" in seen and "server" in seen:
                                with self.lock:
                                    self.hellos.append((seen["client"], seen["server"]))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sk in (src, dst):
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Procs:
    def __init__(self, tmp, nbdgw, base):
        self.tmp, self.nbdgw, self.base = tmp, nbdgw, base
        self.children = []

    def spawn(self, args, log):
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(self.tmp, log), "w"),
                             env={**os.environ, "RUST_LOG": "warn"})
        self.children.append(p)
        return p

    def server(self, name, binary, upstream, extra):
        port = free_port()
        p = self.spawn([binary, "--listen", f"127.0.0.1:{port}", "--upstream", upstream,
                        "--tls-dir", os.path.join(self.tmp, "certs"), "--landlock", "false", *extra],
                       f"{name}.log")
        wait_for(lambda: listening(port), name)
        return p, port

    def client_mode(self, name, port, extra):
        sock = os.path.join(self.tmp, f"{name}.sock")
        p = self.spawn([self.nbdgw, "client", "--listen", sock, "--server", f"localhost:{port}",
                        "--tls-dir", os.path.join(self.tmp, "certs"), *extra], f"{name}.log")
        wait_for(lambda: os.path.exists(sock), name)
        return p, sock

    def stop(self):
        for p in self.children:
            p.terminate()
        for p in self.children:
            p.wait()


def drive(uri, count):
    out = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "nbdclient.py"), "handshakes", uri,
                          str(count)], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nbdgw", required=True)
    ap.add_argument("--base", help="an older nbdgw binary for the 'gnutls base' case")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--handshakes", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(tmp, os.path.abspath(args.nbdgw), args.base)
        try:
            run(procs, tmp, args)
        finally:
            procs.stop()


def setup(procs, tmp):
    """The upstream, the servers, client mode and a relay in front of each
    case's server; returns the cases (URI, nbdgw processes whose CPU
    counts: "server", "client") and the relays (hello sizes) by name."""
    subprocess.run([procs.nbdgw, "certs", "--out", os.path.join(tmp, "certs")], check=True,
                   capture_output=True)
    image = os.path.join(tmp, "disk.img")
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    upstream = os.path.join(tmp, "nbd.sock")
    procs.spawn(["qemu-nbd", "-f", "raw", "--persistent", "--shared=64", "-k", upstream, image],
                "qemu-nbd.log")
    wait_for(lambda: os.path.exists(upstream), "qemu-nbd")

    certs = os.path.join(tmp, "certs")
    server, sport = procs.server("server", procs.nbdgw, upstream, [])
    classical_server, cport = procs.server("server-classical", procs.nbdgw, upstream,
                                           ["--tls-groups", CLASSICAL])
    relays = {}
    cases = {}

    def relay_for(key, port):
        relays[key] = Relay(port)
        return relays[key].port

    hy, hy_sock = procs.client_mode("client-hybrid", relay_for("pair hybrid", sport), [])
    cl, cl_sock = procs.client_mode("client-classical", relay_for("pair classical", sport),
                                    ["--tls-groups", CLASSICAL])
    cases["pair hybrid"] = (f"nbd+unix:///?socket={hy_sock}", {"server": server, "client": hy})
    cases["pair classical"] = (f"nbd+unix:///?socket={cl_sock}", {"server": server, "client": cl})
    nbds = lambda port: f"nbds://localhost:{port}/?tls-certificates={certs}"
    cases["gnutls"] = (nbds(relay_for("gnutls", sport)), {"server": server})
    cases["gnutls classical"] = (nbds(relay_for("gnutls classical", cport)), {"server": classical_server})
    if procs.base:
        base, bport = procs.server("server-base", procs.base, upstream, [])
        cases["gnutls base"] = (nbds(relay_for("gnutls base", bport)), {"server": base})
    return cases, relays


def measure(cases, args):
    """Every case each round, the order rotated: CPU us per handshake of
    each process, and handshakes per second, one sample per round."""
    names = list(cases)
    cpu = {(n, who): [] for n in names for who in cases[n][1]}
    rate = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            uri, who = cases[name]
            before = {k: cpu_seconds(p.pid) for k, p in who.items()}
            result = drive(uri, args.handshakes)
            for k, p in who.items():
                cpu[(name, k)].append((cpu_seconds(p.pid) - before[k]) * 1e6 / args.handshakes)
            rate[name].append(result["per_s"])
        print(f"round {r + 1}/{args.rounds}: {' > '.join(order)}", file=sys.stderr)
    return cpu, rate


def span(xs, fmt="{:.0f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def run(procs, tmp, args):
    cases, relays = setup(procs, tmp)
    cpu, rate = measure(cases, args)
    print(f"{args.rounds} rounds of {args.handshakes} handshakes per case, order rotated each round;"
          " medians (min–max over rounds)\n")
    print("| case | server CPU us/handshake | client mode CPU us/handshake | handshakes/s |"
          " ClientHello bytes | ServerHello bytes |")
    print("|---|---|---|---|---|---|")
    for name in cases:
        hellos = relays[name].hellos
        ch = sorted({c for c, _ in hellos})
        sh = sorted({s for _, s in hellos})
        client = span(cpu[(name, "client")]) if (name, "client") in cpu else "–"
        print(f"| {name} | {span(cpu[(name, 'server')])} | {client} | {span(rate[name])} |"
              f" {'/'.join(map(str, ch))} | {'/'.join(map(str, sh))} |")


if __name__ == "__main__":
    main()
