#!/usr/bin/python3
"""Where one QD1 request's time goes (issue 22, item 3).

Runs QD1 4 KiB reads by qemu's NBD client (qemu-io) and by libnbd's
(bench/nbdclient.py qd1) against nbdgw and against qemu-nbd's own TLS,
with the servers of bench/run.py, and records the system calls and the
scheduler's wake-ups and switches of the whole machine (`perf trace record
-a`, formatted after the run by `perf script --ns`, so recording costs the
traced processes far less than a live trace). Each request is then cut
into steps at the system calls that move it:

    client sends        the client's first write of the request (enter)
    front has it        the front end's last read of it from the client (exit)
    sent upstream       nbdgw's write to the upstream (enter)
    upstream has it     the upstream's last read of it (exit)
    upstream answers    the upstream's first write of the reply (enter)
    front has reply     nbdgw's last read of the reply (exit)
    front answers       the front end's first write to the client (enter)
    reply sent          its last write or uncork (TCP_CORK off) of the reply (exit)
    client has it       the client's last read before its next request (exit)

and prints, per client and front end, the median and mean of each step;
how long a woken thread waited for a CPU (where the trace has the wake-up:
perf does not deliver every scheduler event, and a thread woken onto an
idle CPU is the one most often missing); the steps that carry a request
or reply across, split by whether the receiver ran on the sender's CPU;
and the system calls each process made per request (by kind, how many
found nothing to read, how many waits slept). Only 4 KiB reads are cut:
the handshake, options, a flush and the disconnect are left out. Tracing
costs every system call something and costs the front ends unevenly (a
server making more calls pays more), so the rows say where time goes,
and the untraced mean latency of the same client and front end is
printed beside them (a run without the trace); the ratios between front
ends are bench/run.py's.

    sudo bench/timeline.py [--modes loopback,lan] [--requests 2000] [--placement one|split|free]
"""

import argparse
import bisect
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import run as bench

# x86_64 system call numbers of the calls that move a request or wait.
NAMES = {0: "read", 1: "write", 7: "poll", 19: "readv", 20: "writev", 44: "sendto", 45: "recvfrom",
         46: "sendmsg", 47: "recvmsg", 54: "setsockopt", 202: "futex", 232: "epoll_wait", 271: "ppoll",
         281: "epoll_pwait", 426: "io_uring_enter", 441: "epoll_pwait2"}
READS = {"read", "readv", "recvfrom", "recvmsg"}
WRITES = {"write", "writev", "sendto", "sendmsg"}
# A poll or wait this long is counted as the thread having slept in it
# (one that finds something ready returns in a few microseconds).
SLEPT_US = 10.0
EVENT = re.compile(r"^\s*(.*?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s+(.*)$")
ENTER = re.compile(r"NR (\d+) \(([0-9a-f]+)")
EXIT = re.compile(r"NR (\d+) = (-?\d+)")
WAKEUP = re.compile(r"pid=(\d+) .*target_cpu=(\d+)")
SWITCH = re.compile(r"prev_pid=(\d+) .*==> .*next_pid=(\d+)")


class Call:
    __slots__ = ("start", "end", "tid", "name", "fd", "ret", "cpu")

    def __init__(self, start, end, tid, name, fd, ret, cpu):
        self.start, self.end, self.tid, self.name, self.fd, self.ret, self.cpu = \
            start, end, tid, name, fd, ret, cpu


class Trace:
    """`perf script` of a `perf trace record`: system calls as Calls, and
    the scheduler's wake-ups and switches; times in us."""

    def __init__(self, path):
        self.calls, self.wakeups, self.switch_in = [], collections.defaultdict(list), \
            collections.defaultdict(list)
        pending = {}
        with open(path, errors="replace") as f:
            for line in f:
                m = EVENT.match(line)
                if not m:
                    continue
                tid, cpu, ts, event, rest = int(m.group(2)), int(m.group(3)), float(m.group(4)) * 1e6, \
                    m.group(5), m.group(6)
                if event == "raw_syscalls:sys_enter":
                    e = ENTER.match(rest)
                    if e and int(e.group(1)) in NAMES:
                        pending[tid] = (NAMES[int(e.group(1))], int(e.group(2), 16), ts)
                elif event == "raw_syscalls:sys_exit":
                    e = EXIT.match(rest)
                    if e and tid in pending and pending[tid][0] == NAMES.get(int(e.group(1))):
                        name, fd, began = pending.pop(tid)
                        self.calls.append(Call(began, ts, tid, name, fd, int(e.group(2)), cpu))
                elif event == "sched:sched_wakeup":
                    e = WAKEUP.search(rest)
                    if e:
                        self.wakeups[int(e.group(1))].append((ts, int(e.group(2))))
                elif event == "sched:sched_switch":
                    e = SWITCH.search(rest)
                    if e:
                        self.switch_in[int(e.group(2))].append((ts, cpu))
        self.calls.sort(key=lambda c: c.start)

    def woken(self, tid, after, before):
        """The last wake-up of tid in (after, before), the CPU it was put on,
        and when it ran: (woken at, cpu, ran at), or None if the trace has
        no such wake-up or no switch to tid between it and `before`. Not
        every wake-up is in the trace: on this VM's perf, the idle task's
        events on the second CPU were missing, so a thread woken onto an
        idle CPU is often not found (the counts say how often it was)."""
        wakeups = self.wakeups.get(tid, [])
        i = bisect.bisect_left(wakeups, (before,)) - 1
        if i < 0 or wakeups[i][0] <= after:
            return None
        at, cpu = wakeups[i]
        switches = self.switch_in.get(tid, [])
        j = bisect.bisect_left(switches, (at,))
        if j == len(switches) or switches[j][0] > before:
            return None
        return at, cpu, switches[j][0]


def socket_kinds(pid):
    """{inode: 'tcp' | 'unix'} in pid's network namespace (TCP listeners
    left out)."""
    kinds = {}
    for table, kind in (("tcp", "tcp"), ("tcp6", "tcp"), ("unix", "unix")):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for row in f:
                    cols = row.split()
                    if kind == "tcp" and cols[3] != "0A":
                        kinds[cols[9]] = kind
                    elif kind == "unix":
                        kinds[cols[6]] = kind
        except (OSError, StopIteration, IndexError):
            pass
    return kinds


class Watch(threading.Thread):
    """Samples, while a client connects, which of each process's fds are
    TCP connections or Unix sockets, and the threads of each process; it
    stops a few samples after each process has the sockets it needs, so it
    takes no CPU from the run it watches (sampling /proc every 20 ms for
    the whole run took a quarter of a CPU)."""

    def __init__(self, needs):
        super().__init__(daemon=True)
        self.needs = needs  # {pid: {"tcp", "unix"}}
        self.fds = {p: {} for p in needs}
        self.tids = {p: set() for p in needs}
        self.stop = threading.Event()

    def sample(self):
        for pid in self.needs:
            kinds = socket_kinds(pid)
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        kind = kinds.get(link[8:-1])
                        if kind:
                            self.fds[pid].setdefault(int(fd), kind)
                self.tids[pid].update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass

    def complete(self):
        return all(need <= set(self.fds[pid].values()) for pid, need in self.needs.items())

    def run(self):
        after = 0
        while not self.stop.is_set() and after < 3:
            self.sample()
            after += self.complete()
            time.sleep(0.1 if after else 0.02)


def steps(trace, roles):
    """Cuts the trace into requests. roles: {'client'|'front'|'upstream':
    (tids, {fd: kind})}. Returns, for each 4 KiB read, a dict of the times
    of its points (us), step durations that are not between points
    ("waits"), and per-process call counts. Windows that are not a 4 KiB
    read (the TLS handshake, options, a flush, the disconnect) are left
    out, and so are reads with an event missing from the trace."""
    calls = trace.calls
    client_fd = {fd for fd, k in roles["client"][1].items() if k == "tcp"}
    f_tcp = {fd for fd, k in roles["front"][1].items() if k == "tcp"}
    f_unix = {fd for fd, k in roles["front"][1].items() if k == "unix"}
    relayed = "upstream" in roles
    u_unix = {fd for fd, k in roles["upstream"][1].items() if k == "unix"} if relayed else set()
    events = []
    for c in calls:
        for role, (tids, _) in roles.items():
            if c.tid in tids:
                events.append((role, c))
                break
    # Requests start at each client write on its TCP socket that follows a read.
    starts, last_was_read = [], True
    for i, (role, c) in enumerate(events):
        if role == "client" and c.fd in client_fd and c.ret > 0:
            if c.name in WRITES and last_was_read:
                starts.append(i)
                last_was_read = False
            elif c.name in READS:
                last_was_read = True
    out, not_reads, missing = [], 0, 0
    for a, b in zip(starts, starts[1:]):
        window = events[a:b]
        send = window[0][1]
        fronts = [c for role, c in window if role == "front"]
        ups = [c for role, c in window
               if role == "upstream" and (c.fd in u_unix or c.name not in READS | WRITES)]
        cl = [c for role, c in window if role == "client"]
        to_client = [c for c in fronts if c.name in WRITES and c.fd in f_tcp and c.ret > 0]
        if sum(c.ret for c in to_client) < 4096:
            not_reads += 1
            continue
        first_out = next((c for c in fronts if c.name in WRITES and c.ret > 0
                          and c.fd in (f_unix if relayed else f_tcp)), None)
        got = [c for c in fronts if c.name in READS and c.fd in f_tcp and c.ret > 0
               and first_out and c.start < first_out.start]
        reads = [c for c in cl if c.name in READS and c.fd in client_fd and c.ret > 0]
        if not got or not reads:
            missing += 1
            continue
        r = {"client sends": send.start, "front has it": got[-1].end}
        counts = collections.Counter()
        waits = {}

        def wake(label, tid, after, before, cpu_of_peer):
            w = trace.woken(tid, after, before)
            if w:
                waits[f"{label} woken -> runs"] = w[2] - w[0]
                counts[f"{label} woken on its peer's CPU"] += int(w[1] == cpu_of_peer)
                counts[f"{label} woken"] += 1

        wake("front (request)", got[-1].tid, send.start, got[-1].start, send.cpu)
        if relayed:
            r["sent upstream"] = first_out.start
            uin = [c for c in ups if c.name in READS and c.ret > 0 and c.start > first_out.start]
            uout = [c for c in ups if c.name in WRITES and c.ret > 0 and uin and c.start > uin[0].start]
            back = [c for c in fronts if c.name in READS and c.fd in f_unix and c.ret > 0
                    and uout and uout[0].start < c.start < to_client[0].start]
            if not uin or not uout or not back:
                missing += 1
                continue
            r["upstream answers"] = uout[0].start
            r["upstream has it"] = max(c.end for c in uin if c.start < uout[0].start)
            r["front has reply"] = back[-1].end
            wake("upstream", uin[-1].tid, first_out.start, uin[-1].start, first_out.cpu)
            wake("front (reply)", back[-1].tid, uout[0].start, back[-1].start, uout[0].cpu)
        # A reply may leave in several writes, and under TCP_CORK some of it
        # only when the cork comes off: "reply sent" is the end of the last
        # write or uncork on the client's socket before the client has it.
        r["front answers"] = to_client[0].start
        sent = [c for c in fronts if c.fd in f_tcp and (c in to_client or c.name == "setsockopt")
                and to_client[0].start <= c.start < reads[-1].end]
        r["reply sent"] = max(c.end for c in sent)
        r["client has it"] = reads[-1].end
        r["next request"] = events[b][1].start
        wake("client", reads[-1].tid, to_client[0].start, reads[-1].start, to_client[-1].cpu)
        # The sender's system call carries the receiver's network stack and
        # the wake-up of its thread; how long it takes depends on where the
        # receiver runs.
        where = "same CPU" if got[-1].cpu == send.cpu else "other CPU"
        waits[f"client's send call, front end on the {where}"] = send.end - send.start
        waits[f"client sends -> front has it, front end on the {where}"] = got[-1].end - send.start
        counts["front end read the request on the client's CPU"] += int(where == "same CPU")
        last = to_client[-1]
        where = "same CPU" if reads[-1].cpu == last.cpu else "other CPU"
        waits[f"front end's last reply write, client on the {where}"] = last.end - last.start
        waits[f"reply sent -> client has it, client on the {where}"] = reads[-1].end - r["reply sent"]
        for role, c in window:
            kind = {"futex": "futex", "setsockopt": "setsockopt"}.get(c.name, "wait")
            if c.name in READS | WRITES:
                kind = "read" if c.name in READS else "write"
            counts[f"{role} {kind}"] += 1
            if c.ret == -11:
                counts[f"{role} EAGAIN"] += 1
            if kind == "wait" and c.end - c.start >= SLEPT_US:
                counts[f"{role} slept"] += 1
        r["counts"], r["waits"] = counts, waits
        out.append(r)
    if missing:
        print(f"timeline: {missing} of {len(out) + missing} reads had an event missing from the trace",
              file=sys.stderr)
    return out


ORDER = ["client sends", "front has it", "sent upstream", "upstream has it", "upstream answers",
         "front has reply", "front answers", "reply sent", "client has it", "next request"]


def summarise(reqs):
    """Median and mean of each step (us), and mean calls per request. The
    median is the common case: unpinned, a step takes one of two times
    (the two threads on one CPU or on two), and the median is whichever
    is the more common; the mean carries the rest and the long tail."""
    durations = collections.defaultdict(list)
    counts = collections.Counter()
    for r in reqs:
        points = [p for p in ORDER if p in r]
        for a, b in zip(points, points[1:]):
            durations[f"{a} -> {b}"].append(r[b] - r[a])
        durations["request (client sends -> client has it)"].append(r["client has it"] - r["client sends"])
        counts.update(r["counts"])
        for k, v in r["waits"].items():
            durations[k].append(v)
    def place(key):
        first = key.split(" -> ")[0]
        return ORDER.index(first) if first in ORDER else len(ORDER)
    keys = sorted(durations, key=place)
    return ({k: (statistics.median(durations[k]), statistics.fmean(durations[k]), len(durations[k]))
             for k in keys},
            {k: v / len(reqs) for k, v in counts.items()})


def client_cmd(fronts, client, name, n, placement):
    """The client's command, placed as bench/run.py places it."""
    return fronts.net.client(bench.on_cpu(placement, bench.qd1_command(fronts, client, name, n)))


def untraced(fronts, client, name, n, placement):
    """Mean us per request without the trace: n+1 requests less 1."""
    def took(k):
        t = time.monotonic()
        bench.run(client_cmd(fronts, client, name, k, placement), stdout=subprocess.DEVNULL)
        return time.monotonic() - t
    return (took(n + 1) - took(1)) * 1e6 / n


def traced(fronts, client, name, n, placement, work, keep=None):
    data, out = os.path.join(work, "trace.data"), os.path.join(work, "trace.txt")
    # Recorded by the kernel into buffers and formatted afterwards: a live
    # `perf trace` took CPU from the processes it traced (5x the latency).
    with open(os.path.join(work, "perf.log"), "w") as log:
        tracer = subprocess.Popen(["perf", "trace", "record", "-a", "-m", "16M", "-e",
                                   "sched:sched_wakeup,sched:sched_switch", "-o", data],
                                  stdout=log, stderr=log)
    time.sleep(1.0)
    if tracer.poll() is not None:
        sys.exit(f"timeline: perf trace record failed: {open(os.path.join(work, 'perf.log')).read()}")
    pids = {"front": fronts.pids[name]}
    needs = {pids["front"]: {"tcp"}}
    if name != bench.REFERENCE:
        pids["upstream"] = fronts.upstream.pid
        needs = {pids["front"]: {"tcp", "unix"}, pids["upstream"]: {"unix"}}
    proc = subprocess.Popen(client_cmd(fronts, client, name, n, placement), stdout=subprocess.DEVNULL)
    pids["client"] = proc.pid
    needs[proc.pid] = {"tcp"}
    watch = Watch(needs)
    watch.start()
    failed = proc.wait()
    watch.stop.set()
    watch.join()
    time.sleep(0.2)
    tracer.send_signal(signal.SIGINT)
    tracer.wait()
    if failed:
        sys.exit(f"timeline: the {client} client against {name} failed ({failed})")
    with open(out, "w") as f:
        bench.run(["perf", "script", "--ns", "-i", data], stdout=f, stderr=subprocess.DEVNULL)
    with open(os.path.join(work, "perf.log")) as log:
        for line in log:
            if "lost" in line.lower():
                print(f"timeline: perf: {line.strip()}", file=sys.stderr)
    roles = {}
    for role, pid in pids.items():
        tids = watch.tids[pid] | {pid}
        if role == "client":
            tids = {pid}  # both clients do their NBD I/O on the main thread
        roles[role] = (tids, watch.fds[pid])
    if keep:
        shutil.copy(out, os.path.join(keep[0], f"timeline-{keep[1]}-{client}-{name}.txt"))
    return steps(Trace(out), roles)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="loopback,lan")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--placement", choices=sorted(bench.PLACEMENTS), default="free",
                    help="one: client and servers on CPU 0; split: servers on CPU 0, the client "
                         "on CPU 1; free: where the scheduler puts them")
    ap.add_argument("--nbdgw-args", default="", help="also run nbdgw with these flags (as nbdgw-x)")
    ap.add_argument("--keep", metavar="DIR", help="keep each run's `perf script` text in DIR")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("timeline: run as root (perf trace -a, namespaces)")
    for tool in ("perf", "qemu-nbd", "qemu-io", "nbdkit", "taskset", "ethtool"):
        if not shutil.which(tool):
            sys.exit(f"timeline: {tool} missing: run bench/setup.sh")
    bench.run(["cargo", "build", "--release", "--locked", "-q"], cwd=bench.ROOT)
    fronts_under = ("nbdgw", bench.REFERENCE)
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes.split(","):
            net = bench.Network(mode == "lan")
            net.up()
            variants = [("nbdgw-x", args.nbdgw_args.split(), None)] if args.nbdgw_args else []
            fronts = bench.Fronts(work, net, 1 << 30, variants)
            try:
                fronts.start()
                bench.pin_for(fronts, args.placement)
                if args.placement != "free":
                    # perf and this process stay off the servers' CPU.
                    os.sched_setaffinity(0, {1})
                names = list(fronts_under) + [v[0] for v in variants]
                results = collections.defaultdict(list)
                plain = collections.defaultdict(list)
                for rep in range(args.reps):
                    for client in ("qemu", "libnbd"):
                        order = names[rep % len(names):] + names[:rep % len(names)]
                        for name in order:
                            plain[(client, name)].append(
                                untraced(fronts, client, name, args.requests, args.placement))
                            keep = (args.keep, f"{mode}-{args.placement}-{rep}") if args.keep else None
                            results[(client, name)] += traced(fronts, client, name, args.requests,
                                                              args.placement, work, keep)
                print(f"\n## {net.name}, placement {args.placement}: "
                      f"{args.requests} QD1 4 KiB reads x {args.reps} reps\n")
                for client in ("qemu", "libnbd"):
                    for name in names:
                        reqs = results[(client, name)]
                        if not reqs:
                            print(f"{client} -> {name}: no request could be cut from the trace")
                            continue
                        med, counts = summarise(reqs)
                        pl = plain[(client, name)]
                        print(f"### {client} client -> {name}: untraced mean "
                              f"{statistics.median(pl):.1f} us ({min(pl):.1f}-{max(pl):.1f}), "
                              f"{len(reqs)} traced requests\n")
                        print("| step | median us | mean us | requests |\n|---|---|---|---|")
                        for k, (median, mean, n) in med.items():
                            print(f"| {k} | {median:.1f} | {mean:.1f} | {n} |")
                        print("\n| calls per request | mean |\n|---|---|")
                        for k in sorted(counts):
                            print(f"| {k} | {counts[k]:.2f} |")
                        print()
            finally:
                fronts.stop()
                net.down()


if __name__ == "__main__":
    main()
