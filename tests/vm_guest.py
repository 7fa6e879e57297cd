#!/usr/bin/python3
"""A real VM's disk through nbdgw while nbdgw is replaced (issue 29).

qemu-system-x86_64 (the test VM of scripts/ktls-vm.sh: a Debian kernel,
busybox, this machine's root over 9p) gets its virtio disk from qemu's own
NBD client over TLS (tls-creds-x509), without reconnect-delay: qemu's
default, under which any session that ends becomes an I/O error in the
guest. The disk is a raw image behind qemu-nbd behind nbdgw. In the guest a
program writes generations of patterns to the disk with O_DIRECT, fsyncs,
reads them back and compares, without pause, until told to stop. Meanwhile
nbdgw is replaced with --take-over --replacements times, alternating the
binary under test ($NBDGW, default target/debug/nbdgw) and
$NBDGW_HANDOVER_OTHER (default the same).

Passes when: the guest saw no error and no mismatch, its kernel log (dmesg)
and qemu's own messages show no I/O error, every old gateway exited 0, no
successor accepted a connection or did a TLS handshake (the VM's one
session moved, it never reconnected), and the guest finished more rounds
after the last replacement.

    tests/vm_guest.py [--replacements 5] [--kernel default|new]
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBDGW = os.environ.get("NBDGW_UNDER_TEST") or os.environ.get("NBDGW") or os.path.join(ROOT, "target", "debug", "nbdgw")
OTHER = os.environ.get("NBDGW_HANDOVER_OTHER") or NBDGW

# Runs in the guest (chroot into this machine's root): the disk is
# /dev/vda. Each round writes BLOCKS blocks of a pattern naming the round
# and the block, fsyncs, reads all back and compares. Progress goes to
# /tmp/io/progress (the host watches it); /tmp/io/stop ends it.
GUEST = r'''
import mmap, os, subprocess, sys, time
BLOCK, BLOCKS = 64 * 1024, 64
def pattern(gen, i):
    head = f"gen {gen:08d} block {i:04d} ".encode()
    return (head * (BLOCK // len(head) + 1))[:BLOCK]
for _ in range(600):
    if os.path.exists("/dev/vda"):
        break
    time.sleep(0.1)
fd = os.open("/dev/vda", os.O_RDWR | os.O_DIRECT)
buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
gen, errors, mismatches, ops = 0, 0, 0, 0
try:
    while not os.path.exists("/tmp/io/stop"):
        gen += 1
        for i in range(BLOCKS):
            buf[:] = pattern(gen, i)
            if os.pwritev(fd, [buf], i * BLOCK) != BLOCK:
                raise OSError("short write")
            ops += 1
        os.fsync(fd)
        for i in range(BLOCKS):
            if os.preadv(fd, [buf], i * BLOCK) != BLOCK:
                raise OSError("short read")
            ops += 1
            if buf[:] != pattern(gen, i):
                mismatches += 1
        with open("/tmp/io/progress.new", "w") as f:
            f.write(f"{gen}\n")
        os.rename("/tmp/io/progress.new", "/tmp/io/progress")
except OSError as e:
    errors += 1
    print(f"guest: I/O failed in round {gen}: {e}")
dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
bad = [l for l in dmesg.splitlines() if "I/O error" in l or "blk_update_request" in l or "Buffer I/O" in l]
print(f"guest: {gen} rounds, {ops} requests, {errors} errors, {mismatches} mismatches, {len(bad)} kernel I/O errors")
for l in bad[:10]:
    print("guest dmesg:", l)
sys.exit(0 if errors == 0 and mismatches == 0 and not bad else 1)
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, holds, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if holds():
            return
        time.sleep(0.1)
    raise SystemExit(f"vm_guest: timed out waiting for {what}")


class Gateway:
    """One generation of nbdgw, its log in a file."""

    def __init__(self, binary, work, n, args):
        self.log_path = os.path.join(work, f"nbdgw-{n}.log")
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen([binary, *args], stdout=self.log_file, stderr=subprocess.STDOUT)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_log(self, text, timeout=60):
        wait_for(f"'{text}' in {self.log_path}", lambda: text in self.log() or self.proc.poll() is not None, timeout)
        if text not in self.log():
            raise SystemExit(f"vm_guest: gateway exited ({self.proc.returncode}) before '{text}':\n{self.log()}")


def progress(io):
    try:
        with open(os.path.join(io, "progress")) as f:
            return int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replacements", type=int, default=5)
    ap.add_argument("--kernel", choices=["default", "new"], default="default")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = ap.parse_args()
    work = tempfile.mkdtemp(prefix="nbdgw-vm-guest-")
    io = os.path.join(work, "io")
    run = os.path.join(work, "run")
    os.mkdir(io)
    os.mkdir(run, 0o700)
    certs = os.path.join(work, "certs")
    subprocess.run([NBDGW, "certs", "--out", certs], check=True, capture_output=True)
    image = os.path.join(work, "disk.img")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    upstream = os.path.join(work, "up.sock")
    qemu_nbd = subprocess.Popen(["qemu-nbd", "--format=raw", "--persistent", "--shared=8",
                                 f"--socket={upstream}", image], stderr=subprocess.DEVNULL)
    wait_for("qemu-nbd's socket", lambda: os.path.exists(upstream), 30)
    port = free_port()
    handover = os.path.join(run, "handover.sock")
    args = ["--tls-dir", certs, "--upstream", upstream, "--listen", f"127.0.0.1:{port}",
            "--handover-socket", handover, "--shutdown-grace", "20", "--handover-timeout", "20"]
    gateways = [Gateway(NBDGW, work, 0, args)]
    gateways[0].wait_log("nbdgw listening")
    with open(os.path.join(work, "run.sh"), "w") as f:
        f.write("exec python3 /tmp/io/guest.py\n")
    with open(os.path.join(io, "guest.py"), "w") as f:
        f.write(GUEST)
    qemu_args = (f"-object tls-creds-x509,id=tls0,endpoint=client,dir={certs} "
                 f"-blockdev driver=nbd,node-name=disk0,server.type=inet,server.host=127.0.0.1,"
                 f"server.port={port},tls-creds=tls0,cache.direct=on "
                 f"-device virtio-blk-pci,drive=disk0")
    vm_env = dict(os.environ, KTLS_VM_IO=io, KTLS_VM_QEMU_ARGS=qemu_args,
                  KTLS_VM_TIMEOUT=str(600 + 60 * opts.replacements))
    if opts.kernel == "new":
        vm_env["KTLS_VM_KERNEL"] = "new"
    vm = subprocess.Popen([os.path.join(ROOT, "scripts", "ktls-vm.sh"), "--run", os.path.join(work, "run.sh")],
                          env=vm_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failures, rounds_before_stop = [], 0
    try:
        wait_for("the guest's first rounds", lambda: progress(io) >= 2 or vm.poll() is not None, 600)
        for n in range(1, opts.replacements + 1):
            if vm.poll() is not None:
                failures.append(f"the VM ended before replacement {n}")
                break
            binary = OTHER if n % 2 else NBDGW
            new = Gateway(binary, work, n, [*args, "--take-over", handover])
            new.wait_log("take-over: serving")
            old = gateways[-1]
            try:
                status = old.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                status = "still running after 120 s"
            if status != 0:
                failures.append(f"replacement {n}: the old gateway ended with {status}")
            gateways.append(new)
            seen = progress(io)
            wait_for(f"a guest round after replacement {n}", lambda: progress(io) > seen or vm.poll() is not None, 300)
        rounds_before_stop = progress(io)
    finally:
        open(os.path.join(io, "stop"), "w").close()
        try:
            out, _ = vm.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            vm.kill()
            out, _ = vm.communicate()
        for g in gateways:
            if g.proc.poll() is None:
                g.proc.terminate()
        qemu_nbd.terminate()
    print(out, end="")
    console = open(os.path.join(io, "console.log"), errors="replace").read() if os.path.exists(os.path.join(io, "console.log")) else ""
    if vm.returncode != 0:
        failures.append(f"the VM run failed ({vm.returncode})")
    if "guest: " not in out:
        failures.append("the guest printed no summary")
    for line in console.splitlines():
        if "I/O error" in line or "nbd" in line.lower() and "error" in line.lower():
            failures.append(f"console: {line.strip()}")
    for n, g in enumerate(gateways[1:], 1):
        log = g.log()
        for needle in ("TLS established", "accepted"):
            count = log.count(needle)
            if count:
                failures.append(f"generation {n} logged '{needle}' {count} times: the VM reconnected")
    print(f"vm_guest: {opts.replacements} replacements, {rounds_before_stop} guest rounds before the stop")
    if failures:
        for f in failures:
            print("vm_guest: FAILED:", f)
        print(f"vm_guest: logs kept in {work}")
        sys.exit(1)
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("vm_guest: passed")


if __name__ == "__main__":
    main()
