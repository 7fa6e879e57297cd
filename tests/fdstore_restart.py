#!/usr/bin/python3
"""`systemctl restart nbdgw` keeps a session (issue 29, systemd's
file-descriptor store), with the real systemd.

scripts/ktls-vm.sh boots this machine's systemd (Debian 12: 252) as PID 1
in its test VM (KTLS_VM_SYSTEMD=1) and runs the script below as a unit.
There qemu-nbd runs as a unit of its own (systemd-run), and nbdgw as the
shipped deploy/systemd/nbdgw.service and nbdgw.socket, copied to
/run/systemd/system with a drop-in that changes only paths (the binary
under test, the TLS directory) and what the VM has not (the groups), and
turns kernel TLS off unless --ktls. ExecStart keeps the unit's own flags,
--handover-fdstore included, and FileDescriptorStoreMax= is the unit's.

With --ktls (and --kernel new, whose kernel re-keys) the client's
session is in the kernel's record layer from its handshake on, and goes
through the store as a socket with the kernel's TLS on it: each instance
serves it in the kernel, and the journal shows one handshake handed to
the kernel in all. Then, in the same boot, the unit is switched to
--ktls off and a second client's rustls session goes through two
restarts the same way, then two more in a row (the second as soon as the
first returns, at READY=1: the session must have been restored before
READY=1 and be stored again), so that one VM covers both paths.

A python3-libnbd client holds ONE connection and writes generations of
patterns, flushes, reads them back and compares, without pause, while
`systemctl restart nbdgw.service` runs 5 times (--restarts).

Passes when: the client saw no error and no mismatch on its one
connection and went on after each restart; each restart changed the main
PID; the journal shows each old instance storing the session and each new
one serving it from the store, one TLS handshake for that client, and no
instance failing. Then the commit point with the real store: a third
client's session, and a new instance (a debug build's hook) that marks it
taken and aborts before removing it; the instance systemd starts next
(Restart=on-failure, the store kept) must close it without serving it.
Then a second client's session through `systemctl stop`
and `start`, which is not a restart: systemd empties the store at the
stop, so that session must end (the guide says so) and not be served.

    tests/fdstore_restart.py [--restarts 5] [--kernel default|new] [--ktls]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NBDGW = os.environ.get("NBDGW_UNDER_TEST") or os.environ.get("NBDGW") or os.path.join(ROOT, "target", "debug", "nbdgw")

# The client, in the guest: one connection for the whole run.
CLIENT = r'''
import json, os, sys, time
import nbd
BLOCK, BLOCKS = 64 * 1024, 16
def pattern(gen, i):
    head = f"gen {gen:08d} block {i:04d} ".encode()
    return (head * (BLOCK // len(head) + 1))[:BLOCK]
tag = sys.argv[1]
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates("/tmp/io/certs")
h.connect_tcp("localhost", "10809")
gen, ops, errors, mismatches, error = 0, 0, 0, 0, ""
try:
    while not os.path.exists(f"/tmp/stop{tag}"):
        gen += 1
        for i in range(BLOCKS):
            h.pwrite(pattern(gen, i), i * BLOCK)
            ops += 1
        h.flush()
        for i in range(BLOCKS):
            if h.pread(BLOCK, i * BLOCK) != pattern(gen, i):
                mismatches += 1
            ops += 1
        with open(f"/tmp/io/progress{tag}.new", "w") as f:
            f.write(f"{gen}\n")
        os.rename(f"/tmp/io/progress{tag}.new", f"/tmp/io/progress{tag}")
    h.shutdown()
except nbd.Error as e:
    errors, error = 1, f"{e.string} (errno {e.errno}) in round {gen}"
print("client: " + json.dumps({"rounds": gen, "requests": ops, "errors": errors, "mismatches": mismatches, "error": error}))
sys.exit(0 if errors == 0 and mismatches == 0 else 1)
'''

# The guest's script, as root, in a unit of systemd (PID 1).
GUEST = r'''
set -u
export HOME=/root
repo=$(cat /tmp/io/repo)
restarts=$(cat /tmp/io/restarts)
nbdgw=$(cat /tmp/io/nbdgw)
ktls=$(cat /tmp/io/ktls)
log() { echo "fdstore: $*"; }
journal() { journalctl -u nbdgw.service --no-pager -o cat; }
fail() {
    log "FAILED: $*"
    journal | tail -120
    cat /tmp/io/client.out 2>/dev/null
    exit 1
}
wait_for() {  # what, seconds, command...: by the clock (TCG is slow)
    local what=$1 until=$((SECONDS + $2)); shift 2
    while [ $SECONDS -lt $until ]; do "$@" && return 0; sleep 0.2; done
    fail "timed out waiting for $what"
}
progress() { cat /tmp/io/progress${2:-A} 2>/dev/null || echo 0; }
past() { [ "$(progress "" "${2:-A}")" -gt "$1" ]; }
restart() {  # n, client tag: a restart the client rides through
    local before seen after
    before=$(systemctl show -p MainPID --value nbdgw.service)
    seen=$(progress "" "$2")
    timeout 120 systemctl restart nbdgw.service || fail "restart $1"
    after=$(systemctl show -p MainPID --value nbdgw.service)
    [ "$after" != 0 ] && [ "$after" != "$before" ] || fail "restart $1: main PID $before, then $after"
    wait_for "a client $2 round after restart $1" 120 past "$seen" "$2"
    log "restart $1: PID $before -> $after, client $2 at round $(progress "" "$2")"
}
# --ktls: the session of client A was the kernel's, each instance served
# it there; then a rustls session (--ktls off) through two restarts.
ktls_rustls_too() {
    local kernel handed served
    kernel=$(count 'serving a session handed over.*tls="\?kernel')
    handed=$(count "TLS handed to the kernel (kTLS)")
    log "kernel TLS: $handed handshake(s) handed to the kernel, $kernel session(s) served in the kernel"
    [ "$handed" = 1 ] || fail "$handed sessions handed to the kernel, not 1"
    [ "$kernel" = "$restarts" ] || fail "$kernel sessions served in the kernel, not $restarts"
    # Client A's session closed (its NBD_CMD_DISC) before the unit
    # changes: it is not stored for an instance that would refuse it.
    wait_for "client A's close" 60 sh -c "journalctl -u nbdgw.service --no-pager -o cat | grep -q 'client sent NBD_CMD_DISC'"
    ktls_off
    systemctl daemon-reload
    timeout 120 systemctl restart nbdgw.service || fail "restart with --ktls off"
    python3 /tmp/io/client.py R > /tmp/io/clientR.out 2>&1 &
    local rustls=$!
    wait_for "client R's first round" 120 past 0 R
    restart R1 R
    restart R2 R
    # Two restarts in a row, the second as soon as the first returns
    # (at READY=1): the session is restored before READY=1, so the
    # second stores it again (review M2).
    local seen
    seen=$(progress "" R)
    timeout 120 systemctl restart nbdgw.service || fail "restart R3 (first of two in a row)"
    timeout 120 systemctl restart nbdgw.service || fail "restart R4 (second of two in a row)"
    wait_for "a client R round after two restarts in a row" 120 past "$seen" R
    log "restarts R3 and R4 in a row: client R at round $(progress "" R)"
    touch /tmp/stopR
    wait $rustls || fail "client R ended with $?: $(cat /tmp/io/clientR.out)"
    cat /tmp/io/clientR.out
    grep -q '"errors": 0, "mismatches": 0' /tmp/io/clientR.out || fail "client R errors"
    j=$(journal)
    served=$(count "serving a session from systemd's file-descriptor store")
    [ "$served" = $((restarts + 4)) ] || fail "$served sessions served from the store, not $((restarts + 4))"
    [ "$(count "TLS established")" = 2 ] || fail "client R reconnected"
    [ "$(count "TLS handed to the kernel (kTLS)")" = 1 ] || fail "client R's session went to the kernel"
    restarts=$((restarts + 4))
}

# TLS files readable by the unit's dynamic user (a test's keys, in the VM).
mkdir -p /run/nbdgw-tls
cp /tmp/io/certs/ca-cert.pem /tmp/io/certs/server-cert.pem /tmp/io/certs/server-key.pem /run/nbdgw-tls/
chmod 0755 /run/nbdgw-tls; chmod 0644 /run/nbdgw-tls/*

truncate -s 64M /tmp/disk.img
systemd-run --unit=nbd-upstream -p RuntimeDirectory=nbd -p RuntimeDirectoryMode=0755 -p UMask=0000 \
    qemu-nbd --format=raw --persistent --shared=8 --socket=/run/nbd/disk.sock /tmp/disk.img ||
    fail "qemu-nbd's unit"
wait_for "qemu-nbd's socket" 60 test -S /run/nbd/disk.sock

# The shipped units; a drop-in changes paths only.
cp "$repo/deploy/systemd/nbdgw.service" "$repo/deploy/systemd/nbdgw.socket" /run/systemd/system/
mkdir -p /run/systemd/system/nbdgw.service.d
exec_start=$(sed -n 's/^ExecStart=//p' "$repo/deploy/systemd/nbdgw.service" |
    sed "s#/usr/local/bin/nbdgw#$nbdgw#; s#/etc/nbdgw/tls#/run/nbdgw-tls#")
case $exec_start in *--handover-fdstore*) ;; *) fail "the shipped ExecStart has no --handover-fdstore" ;; esac
cat > /run/systemd/system/nbdgw.service.d/test.conf <<EOF
[Service]
ExecStart=
ExecStart=$exec_start
# Groups the VM's /etc does not have.
SupplementaryGroups=
EOF
# Kernel TLS (the VM's kernel has it) only where the test asks for it.
ktls_off() { printf '[Service]\nEnvironment=NBDGW_KTLS=off\n' > /run/systemd/system/nbdgw.service.d/ktls.conf; }
[ "$ktls" = 1 ] || ktls_off
systemctl daemon-reload
grep -q "^FileDescriptorStoreMax=" /run/systemd/system/nbdgw.service || fail "no FileDescriptorStoreMax= in the unit"
log "FileDescriptorStoreMax=$(systemctl show -p FileDescriptorStoreMax --value nbdgw.service)"
systemctl start nbdgw.socket nbdgw.service || fail "starting nbdgw"

python3 /tmp/io/client.py A > /tmp/io/client.out 2>&1 &
client=$!
wait_for "the client's first rounds" 120 past 1

for n in $(seq "$restarts"); do
    restart "$n" A
    kill -0 $client 2>/dev/null || fail "the client ended at restart $n"
done

touch /tmp/stopA
wait $client; status=$?
cat /tmp/io/client.out
[ $status = 0 ] || fail "the client ended with $status"
grep -q '"errors": 0, "mismatches": 0' /tmp/io/client.out || fail "client errors"

j=$(journal)
count() { printf '%s\n' "$j" | grep -c "$1"; }
stored=$(count "the session is in systemd's file-descriptor store")
served=$(count "serving a session from systemd's file-descriptor store")
tls=$(count "TLS established")
closed=$(count "stored session cannot be served")
log "journal: $stored stored, $served served from the store, $tls TLS handshake(s), $closed closed"
printf '%s\n' "$j" | grep -E "restart: (taking|serving|the session is)" | head -20
[ "$stored" = "$restarts" ] || fail "$stored sessions stored, not $restarts"
[ "$served" = "$restarts" ] || fail "$served sessions served from the store, not $restarts"
[ "$tls" = 1 ] || fail "$tls TLS handshakes: the client reconnected"
[ "$closed" = 0 ] || fail "a stored session was closed"
journalctl --no-pager -o cat -u nbdgw.service | grep -E "Failed with result|Main process exited, code=(killed|dumped)|status=[1-9]" &&
    fail "an instance failed"
[ "$ktls" = 1 ] && ktls_rustls_too

# The commit point with the real store: a new instance that marks the
# session taken and dies before removing it from the store (a debug
# build's hook); systemd restarts it (Restart=on-failure) with the store
# kept, and that instance finds the mark: it closes the session without
# writing on it, and serves on.
python3 /tmp/io/client.py C > /tmp/io/clientC.out 2>&1 &
third=$!
wait_for "the third client's first round" 120 past 0 C
printf '[Service]\nEnvironment=NBDGW_DEBUG_FDSTORE_DIE_AFTER_MARK=1\n' > /run/systemd/system/nbdgw.service.d/zz-die.conf
systemctl daemon-reload
timeout 120 systemctl restart nbdgw.service  # fails if the abort comes before READY=1
rm /run/systemd/system/nbdgw.service.d/zz-die.conf
systemctl daemon-reload
until=$((SECONDS + 120))
while kill -0 $third 2>/dev/null && [ $SECONDS -lt $until ]; do sleep 0.2; done
kill -0 $third 2>/dev/null && fail "the third client still runs after its session was marked taken"
wait $third
cat /tmp/io/clientC.out
grep -q '"errors": 1, "mismatches": 0' /tmp/io/clientC.out || fail "the third client did not see its connection end"
wait_for "nbdgw active again" 120 systemctl -q is-active nbdgw.service
j=$(journal)
aborted=$(count "aborting with a stored session marked taken")
refused=$(count "an earlier instance took it (and then failed): closed without writing")
log "crash after the mark: $aborted abort(s), $refused session(s) closed by the next instance"
[ "$aborted" = 1 ] && [ "$refused" = 1 ] || fail "the crash after the mark did not go as expected"

# A stop and a start are not a restart: systemd empties the store at the
# stop, so a session open then ends (at a request boundary) and the next
# instance finds nothing to serve.
python3 /tmp/io/client.py B > /tmp/io/clientB.out 2>&1 &
second=$!
wait_for "the second client's first round" 120 past 0 B
systemctl stop nbdgw.service || fail "stop"
systemctl start nbdgw.service || fail "start after the stop"
until=$((SECONDS + 120))
while kill -0 $second 2>/dev/null && [ $SECONDS -lt $until ]; do sleep 0.2; done
kill -0 $second 2>/dev/null && fail "the second client still runs after a stop and a start"
wait $second
cat /tmp/io/clientB.out
grep -q '"errors": 1, "mismatches": 0' /tmp/io/clientB.out || fail "the second client did not see its connection end"

j=$(journal)
[ "$(count "the session is in systemd's file-descriptor store")" = $((restarts + 2)) ] ||
    fail "the sessions of the crash and the stop were not stored"
[ "$(count "serving a session from systemd's file-descriptor store")" = "$restarts" ] ||
    fail "a session was served after the crash or the stop"
log "passed"
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--kernel", choices=["default", "new"], default="default")
    ap.add_argument("--ktls", action="store_true",
                    help="kernel TLS on (needs --kernel new): the session in the kernel, then a rustls one")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = ap.parse_args()
    if opts.ktls and opts.kernel != "new":
        ap.error("--ktls needs --kernel new: nbdgw puts sessions in the kernel only where it re-keys")
    work = tempfile.mkdtemp(prefix="nbdgw-fdstore-")
    io = os.path.join(work, "io")
    os.mkdir(io)
    subprocess.run([NBDGW, "certs", "--out", os.path.join(io, "certs")], check=True, capture_output=True)
    for name, text in (("client.py", CLIENT), ("restarts", f"{opts.restarts}\n"), ("nbdgw", f"{os.path.abspath(NBDGW)}\n"),
                       ("ktls", "1\n" if opts.ktls else "0\n")):
        with open(os.path.join(io, name), "w") as f:
            f.write(text)
    script = os.path.join(work, "run.sh")
    with open(script, "w") as f:
        f.write(GUEST)
    env = dict(os.environ, KTLS_VM_SYSTEMD="1", KTLS_VM_IO=io, KTLS_VM_TIMEOUT=str(300 + 120 * (opts.restarts + 3 * opts.ktls)))
    if opts.kernel == "new":
        env["KTLS_VM_KERNEL"] = "new"
    vm = subprocess.run([os.path.join(ROOT, "scripts", "ktls-vm.sh"), "--run", script],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(vm.stdout, end="")
    if vm.returncode != 0 or "fdstore: passed" not in vm.stdout:
        print(f"fdstore_restart: FAILED (VM exit {vm.returncode}); work kept in {work}")
        sys.exit(1)
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    kind = " in the kernel, then 4 in rustls, 2 of them in a row" if opts.ktls else ""
    print(f"fdstore_restart: passed ({opts.restarts} restarts{kind})")


if __name__ == "__main__":
    main()
