#!/usr/bin/python3
"""The soak across a bad LAN: loss, delay with jitter, and reordering.

Two network namespaces made here, nbdgw in one and the soak's clients in
the other, joined by a link emulated in user space: this kernel has no
netem qdisc (and no nftables), so each namespace gets a TUN device and
this process relays packets between them, dropping, delaying and
reordering them. Everything is removed on exit. Needs root.

    sudo bench/lossy_lan.py --seconds 60                    # what CI runs
    sudo bench/lossy_lan.py --seconds 3600 --loss 0.02      # by hand

Fails if the soak fails (any mismatch, leak, or an operation that hung
for longer than nbdgw's stall timeout).
"""

import argparse
import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import sys
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
GATEWAY_IP, CLIENT_IP = "10.234.0.1", "10.234.0.2"
# The soak runs nbdgw with --stall-timeout 3: no operation may hang longer.
STALL_TIMEOUT = 3.0


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Link:
    """Packets from one TUN to the other: a fraction lost, each delayed by
    `delay` plus up to `jitter` (never overtaking the packet before it),
    and a fraction held back `reorder_extra` so that later ones pass it."""

    def __init__(self, args, seed):
        self.args = args
        self.rng = random.Random(seed)
        self.queue = []
        self.last_release = {}
        self.sequence = 0
        self.counts = {"passed": 0, "lost": 0, "reordered": 0}

    def accept(self, packet, out_fd, now):
        if self.rng.random() < self.args.loss:
            self.counts["lost"] += 1
            return
        release = now + self.args.delay + self.rng.uniform(0, self.args.jitter)
        release = max(release, self.last_release.get(out_fd, 0.0))
        self.last_release[out_fd] = release
        if self.rng.random() < self.args.reorder:
            release += self.args.reorder_extra
            self.counts["reordered"] += 1
        self.sequence += 1
        heapq.heappush(self.queue, (release, self.sequence, out_fd, packet))

    def release_due(self, now):
        while self.queue and self.queue[0][0] <= now:
            _, _, fd, packet = heapq.heappop(self.queue)
            try:
                os.write(fd, packet)
                self.counts["passed"] += 1
            except OSError:
                pass

    def run(self, a, b, stop):
        other = {a: b, b: a}
        while not stop.is_set():
            now = time.monotonic()
            self.release_due(now)
            timeout = 0.05
            if self.queue:
                timeout = max(0.0, min(timeout, self.queue[0][0] - now))
            ready, _, _ = select.select([a, b], [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                try:
                    packet = os.read(fd, 65536)
                except OSError:
                    continue
                self.accept(packet, other[fd], now)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--delay", type=float, default=0.003, help="seconds each way")
    ap.add_argument("--jitter", type=float, default=0.002, help="seconds, uniform")
    ap.add_argument("--reorder", type=float, default=0.01)
    ap.add_argument("--reorder-extra", type=float, default=0.006)
    ap.add_argument("--failed-handshakes", type=int, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("lossy_lan: run as root (network namespaces, TUN devices)")
    tag = os.getpid() % 100000
    gw_ns, cl_ns = f"nbdgw-lossy-g{tag}", f"nbdgw-lossy-c{tag}"
    gw_dev, cl_dev = f"lg{tag}", f"lc{tag}"
    stop = threading.Event()
    try:
        ip("netns", "add", gw_ns)
        ip("netns", "add", cl_ns)
        # The TUN file descriptors stay attached to their devices when the
        # devices move into the namespaces, so one process relays both.
        fds = {gw_dev: open_tun(gw_dev), cl_dev: open_tun(cl_dev)}
        for ns, dev, addr in ((gw_ns, gw_dev, GATEWAY_IP), (cl_ns, cl_dev, CLIENT_IP)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        link = Link(args, seed=tag)
        relay = threading.Thread(target=link.run, args=(fds[gw_dev], fds[cl_dev], stop), daemon=True)
        relay.start()
        print(f"# lossy LAN: loss {args.loss:.1%}, delay {args.delay * 1000:.0f} ms "
              f"+ up to {args.jitter * 1000:.0f} ms jitter each way, reordering {args.reorder:.1%}")
        soak = subprocess.run(
            ["ip", "netns", "exec", cl_ns, "/usr/bin/python3", os.path.join(BENCH, "soak.py"),
             "--seconds", str(args.seconds), "--clients", str(args.clients),
             "--host", GATEWAY_IP, "--port", "10809", "--gateway-netns", gw_ns,
             "--failed-handshakes", str(args.failed_handshakes),
             "--max-op-seconds", str(STALL_TIMEOUT)])
        stop.set()
        print(f"link: {link.counts}")
        if link.counts["lost"] == 0 or link.counts["reordered"] == 0:
            sys.exit("lossy_lan: the link lost or reordered nothing; the run proves nothing")
        sys.exit(soak.returncode)
    finally:
        stop.set()
        for ns in (gw_ns, cl_ns):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
