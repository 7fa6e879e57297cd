#!/usr/bin/python3
"""Side-by-side benchmark of NBD TLS front ends.

One null-co qemu-nbd upstream on a Unix socket (read-zeroes=off, so clients
cannot skip zero data). In front of it, all running at once and measured
interleaved: nbdgw, qemu-nbd's own TLS, nbdkit's TLS proxy, and the no-TLS
references (qemu-nbd over plain TCP, the Unix socket itself). Every TLS
front end uses the same ECDSA certificates and requires client
certificates. Clients are unmodified: nbdcopy, libnbd's Python bindings
(bench/nbdclient.py), qemu's own NBD client (qemu-img bench, the client a
VM uses) and fio's nbd engine. Medians of --reps runs with min-max, and
ratios to qemu-nbd's native TLS.

The order of the front ends turns with each rep and workload (`rotation`):
whichever runs first after a workload change measured slower, by up to
40 %, than the same binary run third.

Two network modes: loopback, and LAN: two network namespaces made here,
joined by a veth pair at MTU 1500 with segmentation offloads off (servers
in one, clients in the other; addresses exist only inside them; removed on
exit).

Run as root (namespaces, packet capture): sudo bench/run.py
"""

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import wire

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PYTHON = "/usr/bin/python3"  # Debian's, which has python3-libnbd
REFERENCE = "qemu-nbd-tls"
TLS_FRONTS = ("nbdgw", "qemu-nbd-tls", "nbdkit-proxy")
# Issue 22: nbdgw with the upstream declared immutable (the shared read
# cache and read-ahead, default sizes), and its nearest peer, nbdkit's
# proxy under its own readahead and cache filters (cache-max-size as
# nbdgw's --cache-size). They run only the read workloads a cache is for.
CACHED_FRONTS = ("nbdgw-cached", "nbdkit-cached")
CACHE_SIZE = 256 << 20
# The flags that make nbdgw-cached (and --variant-bin-cached's twins).
CACHE_FLAGS = ["--immutable", "--cache-size", str(CACHE_SIZE)]
LAN_SERVER_IP = "10.231.0.1"
LAN_CLIENT_IP = "10.231.0.2"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            sys.exit(f"bench: {what} did not come up")
        time.sleep(0.02)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


class Network:
    """Where servers and clients run, and how clients reach the servers."""

    def __init__(self, lan):
        self.lan = lan
        tag = os.getpid()
        self.ns_server = f"nbdbench-s{tag}"
        self.ns_client = f"nbdbench-c{tag}"
        self.host = LAN_SERVER_IP if lan else "localhost"
        self.name = "LAN (veth, MTU 1500, offloads off)" if lan else "loopback"

    def server(self, cmd):
        return ["ip", "netns", "exec", self.ns_server, *cmd] if self.lan else cmd

    def client(self, cmd):
        return ["ip", "netns", "exec", self.ns_client, *cmd] if self.lan else cmd

    def up(self):
        if not self.lan:
            return
        s, c = self.ns_server, self.ns_client
        vs, vc = f"nbs{os.getpid()}"[:15], f"nbc{os.getpid()}"[:15]
        self.veth_server = vs
        for ns in (s, c):
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "link", "add", vs, "netns", s, "type", "veth", "peer", "name", vc, "netns", c])
        for ns, dev, ip in ((s, vs, LAN_SERVER_IP), (c, vc, LAN_CLIENT_IP)):
            run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev])
            run(["ip", "-n", ns, "link", "set", dev, "mtu", "1500", "up"])
            run(["ip", "netns", "exec", ns, "ethtool", "-K", dev, "tso", "off", "gso", "off",
                 "gro", "off"], stdout=subprocess.DEVNULL)

    def down(self):
        if self.lan:
            for ns in (self.ns_server, self.ns_client):
                subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)

    def port_open(self, port):
        cmd = self.client([PYTHON, "-c",
                           f"import socket; socket.create_connection(('{self.host}', {port}), 1).close()"])
        return subprocess.run(cmd, stderr=subprocess.DEVNULL).returncode == 0


class Fronts:
    """The upstream and every front end, started once per network mode."""

    def __init__(self, work, net, size, variants):
        self.work, self.net, self.size, self.variants = work, net, size, variants
        self.procs = []
        self.certs = os.path.join(work, "certs")
        self.sock = os.path.join(work, "up.sock")
        self.nbdgw = os.path.join(ROOT, "target", "release", "nbdgw")
        # Admin ports of the nbdgw instances with a read cache, whose
        # /metrics say how many READs went upstream.
        self.admin = {}

    def spawn(self, cmd):
        p = subprocess.Popen(self.net.server(cmd), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def null(self):
        return f"driver=null-co,size={self.size},read-zeroes=off"

    def start(self, only=None):
        if not os.path.exists(self.certs):
            run([self.nbdgw, "certs", "--out", self.certs, "--server-name", "localhost",
                 "--server-name", "127.0.0.1", "--server-name", LAN_SERVER_IP],
                stdout=subprocess.DEVNULL)
        # Room for 1,000 idle clients through each proxy.
        self.upstream = self.spawn(["qemu-nbd", "--persistent", "--shared=4000", "--image-opts",
                                    self.null(), "-k", self.sock])
        wait_for(lambda: os.path.exists(self.sock), "upstream qemu-nbd")
        bind = LAN_SERVER_IP if self.net.lan else "127.0.0.1"
        self.ports = {}
        self.pids = {}
        tls_obj = f"tls-creds-x509,id=tls0,dir={self.certs},endpoint=server,verify-peer=on"

        def nbdgw(name, extra, binary):
            port = free_port()
            self.ports[name] = port
            if is_cached(name):
                self.admin[name] = free_port()
                extra = [*CACHE_FLAGS, "--admin-listen", f"127.0.0.1:{self.admin[name]}", *extra]
            self.pids[name] = self.spawn(
                [binary, "--listen", f"{bind}:{port}", "--tls-dir", self.certs,
                 "--upstream", self.sock, "--max-connections", "2000", *extra]).pid

        nbdgw("nbdgw", [], self.nbdgw)
        nbdgw("nbdgw-cached", [], self.nbdgw)
        for name, extra, binary in self.variants:
            nbdgw(name, extra, binary or self.nbdgw)
        for name, tls in ((REFERENCE, True), ("qemu-nbd-tcp", False)):
            port = free_port()
            self.ports[name] = port
            cmd = ["qemu-nbd", "--persistent", "--shared=1100", "--image-opts", self.null(),
                   "-b", bind, "-p", str(port)]
            if tls:
                cmd += ["--object", tls_obj, "--tls-creds", "tls0"]
            self.pids[name] = self.spawn(cmd).pid
        port = free_port()
        self.ports["nbdkit-proxy"] = port
        self.pids["nbdkit-proxy"] = self.spawn(
            ["nbdkit", "-f", "-i", bind, "-p", str(port), "--tls=require",
             f"--tls-certificates={self.certs}", "--tls-verify-peer", "nbd",
             f"socket={self.sock}"]).pid
        port = free_port()
        self.ports["nbdkit-cached"] = port
        self.pids["nbdkit-cached"] = self.spawn(
            ["nbdkit", "-f", "-i", bind, "-p", str(port), "--tls=require",
             f"--tls-certificates={self.certs}", "--tls-verify-peer",
             "--filter=readahead", "--filter=cache", "nbd", f"socket={self.sock}",
             f"cache-max-size={CACHE_SIZE}", "cache-on-read=true"]).pid
        for name, port in self.ports.items():
            wait_for(lambda port=port: self.net.port_open(port), name)
        self.pids["unix"] = None
        self.names = ["nbdgw", *[v[0] for v in self.variants], REFERENCE, "nbdkit-proxy",
                      *CACHED_FRONTS, "qemu-nbd-tcp"] + ([] if self.net.lan else ["unix"])
        if only:
            self.names = [n for n in self.names if n in only]

    def uri(self, name):
        if name == "unix":
            return f"nbd+unix:///?socket={self.sock}"
        if name == "qemu-nbd-tcp":
            return f"nbd://{self.net.host}:{self.ports[name]}/"
        return f"nbds://{self.net.host}:{self.ports[name]}/?tls-certificates={self.certs}"

    def qemu_client(self, name):
        """--object and --image-opts for qemu's NBD client to reach `name`."""
        if name == "unix":
            return [], f"driver=nbd,server.type=unix,server.path={self.sock}"
        opts = f"driver=nbd,server.type=inet,server.host={self.net.host},server.port={self.ports[name]}"
        if name == "qemu-nbd-tcp":
            return [], opts
        return (["--object", f"tls-creds-x509,id=tls0,dir={self.certs},endpoint=client"],
                opts + ",tls-creds=tls0")

    def fio_command(self, args):
        """fio's nbd engine cannot pass tls-certificates in the URI (libnbd
        refuses local-file parameters unless the program allows them), and
        as root libnbd looks only in /etc/pki/libnbd; as user nobody it
        finds the client certificates in $HOME/.pki/libnbd."""
        if not getattr(self, "fio_home", None):
            self.fio_home = tempfile.mkdtemp(prefix="nbdgw-bench-fio-")
            pki = os.path.join(self.fio_home, ".pki", "libnbd")
            os.makedirs(pki)
            for f in ("ca-cert.pem", "client-cert.pem", "client-key.pem"):
                shutil.copy(os.path.join(self.certs, f), pki)
            for root, dirs, files in os.walk(self.fio_home):
                for entry in [root, *(os.path.join(root, f) for f in files)]:
                    os.chown(entry, 65534, 65534)
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "env", f"HOME={self.fio_home}", "fio", *args]

    def fio_uri(self, name):
        return self.uri(name).split("?tls-certificates=")[0]

    def server_pids(self):
        return [p.pid for p in self.procs]

    def stop(self):
        if getattr(self, "fio_home", None):
            shutil.rmtree(self.fio_home, ignore_errors=True)
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


class Measure:
    """Wall time and the front end's CPU time around one client command."""

    def __init__(self, pid):
        self.pid = pid

    def __enter__(self):
        self.cpu = cpu_seconds(self.pid) if self.pid else 0.0
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.took = time.monotonic() - self.start
        self.cpu = (cpu_seconds(self.pid) - self.cpu) if self.pid else float("nan")


def client_json(fronts, args):
    cmd = [PYTHON, os.path.join(BENCH, "nbdclient.py"), *args]
    out = run(fronts.net.client(cmd), capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def pin_servers(fronts, cpus):
    for pid in fronts.server_pids():
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)


# Workloads: each takes (fronts, name, args) and returns {metric: value}.

def seq(fronts, name, args, write, requests=None, request_size=None, parallel=1):
    size = fronts.size
    opts = ["--connections=1"]
    if requests:
        opts += [f"--requests={requests}", f"--request-size={request_size}", "--no-extents"]
    uri = fronts.uri(name)
    if write:
        cmd = ["nbdcopy", *opts, "--", "[", "nbdkit", "--exit-with-parent", "pattern",
               f"size={size}", "]", uri]
    else:
        cmd = ["nbdcopy", *opts, uri, "null:"]
    with Measure(fronts.pids[name]) as m:
        procs = [subprocess.Popen(fronts.net.client(cmd)) for _ in range(parallel)]
        for p in procs:
            if p.wait() != 0:
                sys.exit(f"bench: {cmd} failed")
    gib = size * parallel / (1 << 30)
    return {"MiB/s": gib * 1024 / m.took, "CPU s/GiB": m.cpu / gib}


# Where a QD1 client runs against servers pinned to CPU 0: beside them
# ("one"), on the other CPU ("split": nbdgw beside its upstream and the
# client elsewhere, as a client on another host always is), or where the
# scheduler puts everything ("free", nothing pinned).
PLACEMENTS = {"one": "0", "split": "1", "free": None}


def pin_for(fronts, placement):
    """Pins the servers for the placement: to CPU 0 unless it is free."""
    if PLACEMENTS[placement] is not None:
        pin_servers(fronts, "0")


def unpin(fronts):
    pin_servers(fronts, "0-%d" % (os.cpu_count() - 1))


def on_cpu(placement, cmd):
    """cmd run on the client's CPU for the placement."""
    cpu = PLACEMENTS[placement]
    return cmd if cpu is None else ["taskset", "-c", cpu, *cmd]


def qd1_command(fronts, client, name, n):
    """n QD1 4 KiB reads of front end `name` by qemu's client (qemu-io,
    one read command each) or libnbd's (nbdclient.py qd1, which prints
    its latencies)."""
    if client == "qemu":
        objects, opts = fronts.qemu_client(name)
        cmd = ["qemu-io", *objects, "--image-opts", opts]
        for i in range(n):
            cmd += ["-c", f"read -q {(i * 262144) % (fronts.size - 4096)} 4096"]
        return cmd
    return [PYTHON, os.path.join(BENCH, "nbdclient.py"), "qd1", fronts.uri(name), str(n), "4096"]


def qd1_4k(fronts, name, args, placement="one"):
    """QD1 4 KiB reads by libnbd's client, in each placement qemu_qd1 is
    measured in (issue 22, item 3: the placement, not the client, is what
    set the two apart)."""
    cmd = on_cpu(placement, qd1_command(fronts, "libnbd", name, args.qd1_count))
    pin_for(fronts, placement)
    try:
        with Measure(fronts.pids[name]) as m:
            out = run(fronts.net.client(cmd), capture_output=True, text=True).stdout
    finally:
        unpin(fronts)
    r = json.loads(out.strip().splitlines()[-1])
    return {"mean us": r["mean_us"], "p99 us": r["p99_us"],
            "CPU us/req": m.cpu * 1e6 / args.qd1_count}


def replay(fronts, name, args):
    r = client_json(fronts, ["replay", fronts.uri(name), "1234"])
    return {"ms": r["ms"]}


def small_replay(fronts, name, args):
    """The boot replay dominated by small reads; a new seed each rep (the
    same for every front end within it)."""
    with Measure(fronts.pids[name]) as m:
        r = client_json(fronts, ["small-replay", fronts.uri(name), str(4321 + args.rep)])
    return {"ms": r["ms"], "CPU us/req": m.cpu * 1e6 / r["requests"]}


def qemu_qd1(fronts, name, args, placement):
    """QD1 4 KiB reads by qemu's NBD client (qemu-io; qemu-img bench has no
    --object for TLS), in a placement (PLACEMENTS). A run of one read is
    subtracted, so connecting is not counted."""
    count = args.qd1_count

    def reads(n):
        cmd = on_cpu(placement, qd1_command(fronts, "qemu", name, n))
        with Measure(fronts.pids[name]) as m:
            run(fronts.net.client(cmd), stdout=subprocess.DEVNULL)
        return m

    pin_for(fronts, placement)
    try:
        one, many = reads(1), reads(count + 1)
    finally:
        unpin(fronts)
    return {"mean us": (many.took - one.took) * 1e6 / count,
            "CPU us/req": (many.cpu - one.cpu) * 1e6 / count}


def fio(fronts, name, args, rw, bs, depth):
    """fio's nbd engine (libnbd), one job: MiB/s and front-end CPU."""
    size = min(fronts.size, 64 << 20) if bs <= 4096 else fronts.size
    opts = ["--name=nbd", "--ioengine=nbd", f"--uri={fronts.fio_uri(name)}", f"--rw={rw}",
            f"--bs={bs}", f"--iodepth={depth}", f"--size={size}", "--output-format=json"]
    if rw.startswith("rand"):
        opts.append("--randrepeat=1")
    with Measure(fronts.pids[name]) as m:
        out = run(fronts.net.client(fronts.fio_command(opts)), capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    requests = side["total_ios"]
    gib = side["io_bytes"] / (1 << 30)
    return {"MiB/s": side["bw_bytes"] / (1 << 20), "CPU us/req": m.cpu * 1e6 / requests,
            "CPU s/GiB": m.cpu / gib}


def boot_storm(fronts, name, args, n):
    """N VMs booting the same image at once: N small-read boot replays of
    one seed (a new one each rep and storm size, never the single replay's,
    so no cache starts warm), started together. The time until the last
    finished, the front end's and the upstream's CPU, and for nbdgw-cached
    the READs it sent upstream per client read."""
    seed = 9000 + 100 * n + args.rep
    up = fronts.upstream.pid
    before = cache_counters(fronts, name) if name in fronts.admin else None
    up_cpu = cpu_seconds(up)
    with Measure(fronts.pids[name]) as m:
        procs = [subprocess.Popen(fronts.net.client(
            [PYTHON, os.path.join(BENCH, "nbdclient.py"), "small-replay", fronts.uri(name), str(seed)]),
            stdout=subprocess.PIPE, text=True) for _ in range(n)]
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: a boot replay of the storm failed")
    requests = sum(json.loads(o)["requests"] for o in outs)
    # qemu-nbd's own TLS serves the image itself: there is no upstream hop.
    upstream = float("nan") if name == REFERENCE else cpu_seconds(up) - up_cpu
    row = {"ms": m.took * 1e3, "CPU us/req": m.cpu * 1e6 / requests, "upstream CPU s": upstream}
    if before is not None:
        after = cache_counters(fronts, name)
        row["upstream reads/req"] = (after - before) / requests
    return row


def cache_counters(fronts, name):
    """The READs a cached nbdgw has sent upstream (its /metrics, read in
    the servers' namespace)."""
    url = f"http://127.0.0.1:{fronts.admin[name]}/metrics"
    text = run(fronts.net.server(["curl", "-sf", "--max-time", "5", url]),
               capture_output=True, text=True).stdout
    for line in text.splitlines():
        if line.startswith("nbdgw_cache_upstream_reads_total "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} has no nbdgw_cache_upstream_reads_total")


def is_cached(name):
    """Whether a front end runs with a read cache: nbdkit's, nbdgw-cached,
    and --variant-bin-cached's twins (named ...-cached)."""
    return name in CACHED_FRONTS or (name.startswith("nbdgw-") and name.endswith("-cached"))


def many_vms(fronts, name, args):
    """16 VMs at once, each QD1 4 KiB random reads (fio's nbd engine, 16
    jobs, one connection each, 10 s): total IOPS and front-end CPU per
    request."""
    opts = ["--name=nbd", "--ioengine=nbd", f"--uri={fronts.fio_uri(name)}", "--rw=randread",
            "--bs=4096", "--iodepth=1", "--numjobs=16", "--group_reporting", "--time_based",
            "--runtime=10", f"--size={min(fronts.size, 64 << 20)}", "--randrepeat=1",
            "--output-format=json"]
    with Measure(fronts.pids[name]) as m:
        out = run(fronts.net.client(fronts.fio_command(opts)), capture_output=True, text=True).stdout
    side = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return {"IOPS": side["iops"], "CPU us/req": m.cpu * 1e6 / max(side["total_ios"], 1)}


def handshakes(fronts, name, args):
    with Measure(fronts.pids[name]) as m:
        r = client_json(fronts, ["handshakes", fronts.uri(name), str(args.handshakes)])
    return {"per s": r["per_s"], "CPU ms each": m.cpu * 1e3 / args.handshakes}


def handshakes_qemu(fronts, name, args):
    """Connections by qemu's NBD client, one qemu-io process each, up to
    four at once: TLS, NBD_OPT_EXTENDED_HEADERS, SET_META_CONTEXT and GO,
    one 512-byte read, the flush qemu-io makes as it closes, and
    NBD_CMD_DISC. The front end's CPU per connection (the upstream's is
    not counted, as in every row). A process start costs qemu-io more
    than the connection, so there is no rate."""
    objects, opts = fronts.qemu_client(name)
    cmd = fronts.net.client(["qemu-io", *objects, "--image-opts", opts, "-c", "read -q 0 512"])
    count = args.handshakes
    with Measure(fronts.pids[name]) as m:
        for start in range(0, count, 4):
            procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL) for _ in range(min(4, count - start))]
            if [p.wait() for p in procs].count(0) != len(procs):
                raise RuntimeError(f"{name}: qemu-io could not connect")
    return {"CPU ms each": m.cpu * 1e3 / count}


WORKLOADS = {
    "seq read": lambda f, n, a: seq(f, n, a, write=False),
    "seq write": lambda f, n, a: seq(f, n, a, write=True),
    "QD16 64K read": lambda f, n, a: seq(f, n, a, write=False, requests=16, request_size=65536),
    "4 conns read": lambda f, n, a: seq(f, n, a, write=False, parallel=4),
    "QD1 4K read": qd1_4k,
    "QD1 4K read split": lambda f, n, a: qd1_4k(f, n, a, "split"),
    "QD1 4K read unpinned": lambda f, n, a: qd1_4k(f, n, a, "free"),
    "VM-boot replay": replay,
    "small-read boot replay": small_replay,
    "QD1 4K read (qemu) one CPU": lambda f, n, a: qemu_qd1(f, n, a, "one"),
    "QD1 4K read (qemu) split": lambda f, n, a: qemu_qd1(f, n, a, "split"),
    "QD1 4K read (qemu)": lambda f, n, a: qemu_qd1(f, n, a, "free"),
    "fio randread 4K QD1": lambda f, n, a: fio(f, n, a, "randread", 4096, 1),
    "fio randread 4K QD16": lambda f, n, a: fio(f, n, a, "randread", 4096, 16),
    "fio write 4K QD1": lambda f, n, a: fio(f, n, a, "write", 4096, 1),
    "fio write 256K QD16": lambda f, n, a: fio(f, n, a, "write", 262144, 16),
    "TLS handshakes": handshakes,
    "TLS handshakes (qemu)": handshakes_qemu,
    "boot storm 8": lambda f, n, a: boot_storm(f, n, a, 8),
    "boot storm 16": lambda f, n, a: boot_storm(f, n, a, 16),
    "16 VMs randread 4K QD1": many_vms,
}
# The no-TLS references have no handshake to compare.
TLS_ONLY = {"TLS handshakes", "TLS handshakes (qemu)"}
# fio runs as user nobody (see Fronts.fio_command), who may not connect to
# the root-owned upstream socket.
NOT_UNIX = {w for w in WORKLOADS if w.startswith("fio") or w.startswith("16 VMs")}
# What the cached front ends run; the storms run only on the TLS front ends.
CACHE_WORKLOADS = {"small-read boot replay", "boot storm 8", "boot storm 16"}
STORMS = {"boot storm 8", "boot storm 16"}


def runs(workload, name, variant_names):
    """Whether this front end runs this workload."""
    if is_cached(name):
        return workload in CACHE_WORKLOADS
    tls = name in TLS_FRONTS or name in variant_names
    if (workload in TLS_ONLY or workload in STORMS) and not tls:
        return False
    return not (workload in NOT_UNIX and name == "unix")


def wire_stats(fronts, name, args):
    """Records and segments per reply, captured on the server's veth."""
    pcap = os.path.join(fronts.work, f"{name}.pcap")
    port = fronts.ports[name]
    out = {}
    for label, size, count in (("4K", 4096, 200), ("1M", 1 << 20, 20)):
        cap = subprocess.Popen(fronts.net.server(
            ["tshark", "-q", "-i", fronts.net.veth_server, "-f", f"tcp port {port}", "-w", pcap]),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # tshark says "Capturing on ..." once it listens.
        cap.stderr.readline()
        time.sleep(0.5)
        client_json(fronts, ["qd1", fronts.uri(name), str(count), str(size)])
        time.sleep(0.5)
        cap.send_signal(signal.SIGINT)
        cap.wait(timeout=30)
        results, mss = wire.replies(pcap, port, size)
        out[label] = wire.summarize(results)
        out[label]["mss"] = mss
    return out


def idle_rss(fronts, name, args):
    """RSS of the front end holding --idle connections, then with a
    sequential read streaming beside them."""
    pid = fronts.pids[name]
    holder = subprocess.Popen(fronts.net.client(
        [PYTHON, os.path.join(BENCH, "nbdclient.py"), "idle", fronts.uri(name), str(args.idle)]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "ready":
        sys.exit(f"bench: {name} did not take {args.idle} connections")
    time.sleep(1)
    idle = rss_mib(pid)
    stream = subprocess.Popen(fronts.net.client(["nbdcopy", fronts.uri(name), "null:"]))
    peak = idle
    while stream.poll() is None:
        peak = max(peak, rss_mib(pid))
        time.sleep(0.05)
    holder.stdin.close()
    holder.wait(timeout=60)
    return {"idle MiB": idle, "idle+stream MiB": peak}


def median_cell(values):
    if not values or all(v != v for v in values):
        return "-", float("nan")
    med = statistics.median(values)
    return f"{med:.{digits(med)}f} ({min(values):.{digits(med)}f}-{max(values):.{digits(med)}f})", med


def digits(v):
    return 0 if abs(v) >= 100 else (1 if abs(v) >= 10 else 2 if abs(v) >= 1 else 3)


def table(results, names):
    """results[(workload, name)] = [ {metric: value}, ... ]"""
    medians = {}
    cells = {}
    for (workload, name), runs in results.items():
        for metric in runs[0]:
            cells[(workload, name, metric)], medians[(workload, name, metric)] = median_cell(
                [r[metric] for r in runs])
    lines = []
    for workload in WORKLOADS:
        # Every metric any front end reported, in the order first seen:
        # some (the cache's upstream reads) only one front end has.
        metrics = []
        for (w, _), r in results.items():
            metrics += [m for m in r[0] if w == workload and m not in metrics]
        if not metrics:
            continue
        lines.append(f"\n**{workload}**\n")
        lines.append("| front end | " + " | ".join(f"{m} | vs {REFERENCE}" for m in metrics) + " |")
        lines.append("|---" * (1 + 2 * len(metrics)) + "|")
        for name in names:
            if (workload, name) not in results:
                continue
            row = []
            for m in metrics:
                if (workload, name, m) not in medians:
                    row.append("- | -")
                    continue
                med, ref = medians[(workload, name, m)], medians.get((workload, REFERENCE, m))
                ratio = f"{med / ref:.2f}x" if ref and ref == ref and med == med else "-"
                row.append(f"{cells[(workload, name, m)]} | {ratio}")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines), medians


TCP_ULP = 31  # linux/tcp.h; Python's socket module does not name it


def kernel_tls():
    """Whether this kernel can take TLS records off user space (the `tls`
    ULP that kTLS needs), asked the way a server would: on a connected
    socket."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        client.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
        return "available"
    except OSError as e:
        return f"absent (TCP_ULP \"tls\": {os.strerror(e.errno)})"
    finally:
        for s in (client, server, listener):
            s.close()


def references(net, work):
    """openssl's AES-256-GCM speed and one iperf3 stream, on this network."""
    out = run(["openssl", "speed", "-seconds", "2", "-bytes", "16384", "-evp", "aes-256-gcm"],
              capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.lower().startswith("aes-256-gcm")][-1]
    aes = float(line.split()[-1].rstrip("k")) * 1000 / (1 << 20)
    port = free_port()
    server = subprocess.Popen(net.server(["iperf3", "-s", "-p", str(port)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host = LAN_SERVER_IP if net.lan else "127.0.0.1"
    try:
        wait_for(lambda: net.port_open(port), "iperf3")
        res = json.loads(run(net.client(["iperf3", "-c", host, "-p", str(port), "-t", "3", "-J"]),
                             capture_output=True, text=True).stdout)
    finally:
        server.terminate()
        server.wait(timeout=10)
    gbit = res["end"]["sum_received"]["bits_per_second"] / 1e9
    return aes, gbit


def rotation(names, rep, reps, workload_index):
    """The front ends in the order this rep and workload run them: each
    rep starts a different share of the way round, so that over the reps
    no front end is always the first measured."""
    shift = (rep * len(names) // max(reps, 1) + workload_index) % len(names)
    return names[shift:] + names[:shift]


def bench_mode(args, lan, work):
    net = Network(lan)
    fronts = Fronts(work, net, args.size_gib << 30, args.variants)
    variant_names = {v[0] for v in args.variants}
    results = {}
    extra = {}
    try:
        net.up()
        fronts.start(args.fronts)
        aes, gbit = references(net, work)
        extra["references"] = (aes, gbit)
        for rep in range(args.reps):
            args.rep = rep
            for index, (workload, fn) in enumerate(WORKLOADS.items()):
                if workload not in args.workloads:
                    continue
                for name in rotation(fronts.names, rep, args.reps, index):
                    if not runs(workload, name, variant_names):
                        continue
                    results.setdefault((workload, name), []).append(fn(fronts, name, args))
            print(f"  {net.name}: rep {rep + 1}/{args.reps} done", file=sys.stderr)
        if lan and "wire" in args.workloads:
            tls = [n for n in [*TLS_FRONTS, *variant_names] if n in fronts.names and not is_cached(n)]
            extra["wire"] = {n: wire_stats(fronts, n, args) for n in tls}
        if not lan and "rss" in args.workloads:
            extra["rss"] = {n: idle_rss(fronts, n, args) for n in TLS_FRONTS if n in fronts.names}
    finally:
        fronts.stop()
        net.down()
    return net, fronts.names, results, extra


def print_mode(net, names, results, extra, args):
    print(f"\n## {net.name}\n")
    aes, gbit = extra["references"]
    print(f"References: openssl AES-256-GCM (16 KiB blocks, one core) {aes:.0f} MiB/s; "
          f"iperf3, one TCP stream, {gbit:.1f} Gbit/s; kernel TLS {kernel_tls()}.")
    text, medians = table(results, names)
    print(text)
    if "wire" in extra:
        print("\n**TLS records and TCP segments per reply** (QD1 reads, server side of the veth)\n")
        print("| front end | reply | replies | records median | records max | segments median "
              "| replies with >1 segment below MSS |")
        print("|---|---|---|---|---|---|---|")
        for name, by in extra["wire"].items():
            for label, s in by.items():
                print(f"| {name} | {label} | {s['replies']} | {s.get('records_median', '-')} | "
                      f"{s.get('records_max', '-')} | {s.get('segments_median', '-')} | "
                      f"{s.get('replies_with_2plus_short_segments', '-')} |")
    if "rss" in extra:
        print(f"\n**Memory** ({args.idle} idle TLS connections, then one sequential read beside them)\n")
        print("| front end | RSS idle MiB | RSS idle + stream MiB |")
        print("|---|---|---|")
        for name, r in extra["rss"].items():
            print(f"| {name} | {r['idle MiB']:.1f} | {r['idle+stream MiB']:.1f} |")
    return medians


def targets(loop, lan, extra_loop, extra_lan):
    """The issue's targets, each with the measured ratio."""
    rows = []

    def ratio(medians, workload, metric, a, b):
        x, y = medians.get((workload, a, metric)), medians.get((workload, b, metric))
        return x / y if x and y else float("nan")

    def add(what, value, limit, lower_is_better=True):
        if value != value:  # the workload was not part of this run
            return
        ok = value <= limit if lower_is_better else value >= limit
        rows.append(f"| {what} | {value:.2f} | {'≤' if lower_is_better else '≥'} {limit} | "
                    f"{'met' if ok else 'missed'} |")

    for w in ("seq read", "seq write"):
        add(f"{w}: CPU/GiB vs qemu-nbd TLS", ratio(loop, w, "CPU s/GiB", "nbdgw", REFERENCE),
            0.5 if w == "seq read" else 0.6)
        add(f"{w}: CPU/GiB vs nbdkit proxy", ratio(loop, w, "CPU s/GiB", "nbdgw", "nbdkit-proxy"), 0.5)
        add(f"{w}: throughput vs qemu-nbd TLS", ratio(loop, w, "MiB/s", "nbdgw", REFERENCE), 1.0, False)
        add(f"{w}: throughput vs nbdkit proxy", ratio(loop, w, "MiB/s", "nbdgw", "nbdkit-proxy"), 1.3, False)
    add("QD1 4K latency vs qemu-nbd TLS", ratio(loop, "QD1 4K read", "mean us", "nbdgw", REFERENCE), 1.0)
    add("QD1 4K latency vs nbdkit proxy", ratio(loop, "QD1 4K read", "mean us", "nbdgw", "nbdkit-proxy"), 0.6)
    if lan:
        add("LAN VM-boot replay vs qemu-nbd TLS", ratio(lan, "VM-boot replay", "ms", "nbdgw", REFERENCE), 1.0)
        tcp = lan.get(("VM-boot replay", "qemu-nbd-tcp", "ms"))
        ours = lan.get(("VM-boot replay", "nbdgw", "ms"))
        theirs = lan.get(("VM-boot replay", REFERENCE, "ms"))
        if tcp and ours and theirs:
            add("LAN VM-boot: TLS cost over TCP vs qemu-nbd TLS's", (ours - tcp) / (theirs - tcp), 0.6)
    # Issue 12: per-request cost on the shapes users run.
    for w in ("QD1 4K read", "QD1 4K read (qemu) one CPU", "QD1 4K read (qemu)"):
        add(f"{w}: front-end CPU per request vs qemu-nbd TLS",
            ratio(loop, w, "CPU us/req", "nbdgw", REFERENCE), 0.8)
    add("fio write 256K QD16: CPU/GiB vs qemu-nbd TLS",
        ratio(loop, "fio write 256K QD16", "CPU s/GiB", "nbdgw", REFERENCE), 0.6)
    add("QD1 4K (qemu, one CPU) latency vs qemu-nbd TLS",
        ratio(loop, "QD1 4K read (qemu) one CPU", "mean us", "nbdgw", REFERENCE), 1.3)
    if lan:
        add("LAN QD1 4K (qemu) latency vs qemu-nbd TLS",
            ratio(lan, "QD1 4K read (qemu)", "mean us", "nbdgw", REFERENCE), 1.0)
        add("LAN QD1 4K (libnbd, unpinned) latency vs qemu-nbd TLS",
            ratio(lan, "QD1 4K read unpinned", "mean us", "nbdgw", REFERENCE), 1.0)
        add("LAN QD1 4K (qemu, servers on one CPU, client on the other) latency vs qemu-nbd TLS",
            ratio(lan, "QD1 4K read (qemu) split", "mean us", "nbdgw", REFERENCE), 1.0)
        add("LAN small-read boot replay vs qemu-nbd TLS",
            ratio(lan, "small-read boot replay", "ms", "nbdgw", REFERENCE), 0.9)
    for w, metric in (("seq read", "CPU s/GiB"), ("seq write", "CPU s/GiB"),
                      ("fio write 256K QD16", "CPU s/GiB"), ("fio randread 4K QD16", "CPU us/req"),
                      ("QD1 4K read (qemu)", "CPU us/req"), ("small-read boot replay", "CPU us/req")):
        add(f"{w}: {metric} vs nbdkit proxy", ratio(loop, w, metric, "nbdgw", "nbdkit-proxy"), 0.7)
    # Issue 22: boot storms through the read cache, many VMs at once.
    for mode, medians in (("loopback", loop), ("LAN", lan)):
        if not medians:
            continue
        for n in (8, 16):
            w = f"boot storm {n}"
            add(f"{mode} {w}, cached: time vs qemu-nbd TLS", ratio(medians, w, "ms", "nbdgw-cached", REFERENCE), 0.5)
            add(f"{mode} {w}, cached: time vs nbdkit cache+readahead",
                ratio(medians, w, "ms", "nbdgw-cached", "nbdkit-cached"), 1.0)
            add(f"{mode} {w}, cached: upstream reads per client read",
                medians.get((w, "nbdgw-cached", "upstream reads/req"), float("nan")), 0.2)
            add(f"{mode} {w}, uncached: time vs qemu-nbd TLS", ratio(medians, w, "ms", "nbdgw", REFERENCE), 1.0)
        add(f"{mode} 16 VMs randread: IOPS vs qemu-nbd TLS",
            ratio(medians, "16 VMs randread 4K QD1", "IOPS", "nbdgw", REFERENCE), 1.2, False)
        add(f"{mode} 16 VMs randread: CPU per request vs qemu-nbd TLS",
            ratio(medians, "16 VMs randread 4K QD1", "CPU us/req", "nbdgw", REFERENCE), 0.8)
    if lan:
        add("LAN small-read boot replay, cached, vs qemu-nbd TLS",
            ratio(lan, "small-read boot replay", "ms", "nbdgw-cached", REFERENCE), 0.8)
    add("handshake CPU vs qemu-nbd TLS", ratio(loop, "TLS handshakes", "CPU ms each", "nbdgw", REFERENCE), 0.5)
    add("handshakes/s vs qemu-nbd TLS", ratio(loop, "TLS handshakes", "per s", "nbdgw", REFERENCE), 1.0, False)
    add("handshake CPU (qemu's client) vs qemu-nbd TLS",
        ratio(loop, "TLS handshakes (qemu)", "CPU ms each", "nbdgw", REFERENCE), 0.5)
    if extra_lan and "wire" in extra_lan:
        w = extra_lan["wire"]["nbdgw"]
        add("LAN: TLS records per 4K reply", w["4K"].get("records_max", float("nan")), 1)
        add("LAN: replies with >1 segment below MSS", w["4K"].get("replies_with_2plus_short_segments", 0)
            + w["1M"].get("replies_with_2plus_short_segments", 0), 0)
    if extra_loop and "rss" in extra_loop:
        add("RSS, 1,000 idle connections (MiB)", extra_loop["rss"]["nbdgw"]["idle MiB"], 64)
    print("\n## Targets (nbdgw against the peers, this run)\n")
    print("| target | measured | goal | |")
    print("|---|---|---|---|")
    print("\n".join(rows))


def parse_variant(text):
    name, _, flags = text.partition("=")
    return (f"nbdgw-{name}", flags.split(), None)


def parse_variant_bin(text):
    """Another nbdgw binary (a build with different constants), default flags."""
    name, _, path = text.partition("=")
    if not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{path} is not an executable")
    return (f"nbdgw-{name}", [], os.path.abspath(path))


def parse_variant_bin_cached(text):
    """Another nbdgw binary with nbdgw-cached's flags, named NAME-cached:
    the boot storms through the read cache, before and after a change."""
    name, flags, path = parse_variant_bin(text)
    return (f"{name}-cached", flags, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=int, default=1, help="export size; bytes per sequential run")
    ap.add_argument("--reps", type=int, default=3)
    # CPU time is read in 10 ms ticks: 20,000 requests keep a 10 us/request
    # figure within 5 %.
    ap.add_argument("--qd1-count", type=int, default=20000)
    ap.add_argument("--handshakes", type=int, default=300)
    ap.add_argument("--idle", type=int, default=1000, help="idle connections for the RSS figure")
    ap.add_argument("--modes", default="loopback,lan")
    ap.add_argument("--workloads", default=",".join([*WORKLOADS, "wire", "rss"]),
                    help="comma-separated subset of: " + ", ".join([*WORKLOADS, "wire", "rss"]))
    ap.add_argument("--variant", dest="variants", action="append", type=parse_variant, default=[],
                    metavar="NAME=FLAGS",
                    help="also run nbdgw with these flags, e.g. nocork='--cork off' (repeatable)")
    ap.add_argument("--variant-bin", dest="variants", action="append", type=parse_variant_bin,
                    metavar="NAME=PATH",
                    help="also run this nbdgw binary, e.g. a build with another reply chunk size")
    ap.add_argument("--variant-bin-cached", dest="variants", action="append",
                    type=parse_variant_bin_cached, metavar="NAME=PATH",
                    help="also run this nbdgw binary with nbdgw-cached's flags (as nbdgw-NAME-cached; "
                    "the cached rows only)")
    ap.add_argument("--fronts", default=None,
                    help="comma-separated front ends to measure (default: all, and the variants); "
                    "a shorter run, at the cost of the ratios to the fronts left out")
    args = ap.parse_args()
    args.workloads = set(args.workloads.split(","))
    if args.fronts:
        args.fronts = set(args.fronts.split(","))
    if os.geteuid() != 0:
        sys.exit("bench: run as root (network namespaces, packet capture, pinning)")
    # tshark and fio only for the rows that use them (a run of a subset
    # needs only its own tools).
    wants = {"tshark": "wire" in args.workloads,
             "fio": any(w in args.workloads for w in NOT_UNIX)}
    for tool in ("qemu-nbd", "qemu-io", "nbdkit", "nbdcopy", "tshark", "iperf3", "openssl", "ethtool",
                 "taskset", "fio", "setpriv", "curl"):
        if wants.get(tool, True) and not shutil.which(tool):
            sys.exit(f"bench: {tool} missing: run bench/setup.sh")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    run(["cargo", "build", "--release", "--locked", "-q"], cwd=ROOT)
    print(f"# nbdgw benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"{args.size_gib} GiB per sequential run, {args.reps} interleaved reps, medians (min-max)")
    modes = {}
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes.split(","):
            net, names, results, extra = bench_mode(args, mode == "lan", work)
            modes[mode] = (print_mode(net, names, results, extra, args), extra)
    loop, extra_loop = modes.get("loopback", ({}, {}))
    lan, extra_lan = modes.get("lan", ({}, {}))
    targets(loop, lan, extra_loop, extra_lan)


if __name__ == "__main__":
    main()
