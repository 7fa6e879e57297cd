#!/bin/bash
# Runs nbdgw's tests where the kernel has kernel TLS, so that sessions are
# really handed to the kernel. This machine's kernel lacks CONFIG_TLS; a
# Debian kernel that has it boots under qemu instead (TCG: nested KVM does
# not boot here), with this machine's root shared read-only over 9p, so
# the test binaries, qemu-nbd, qemu-img and libnbd inside are the ones
# built and installed here.
#
#   scripts/ktls-vm.sh                 # kernel_tls key_update raw_protocol real_clients reliability routing kernel_nbd
#   scripts/ktls-vm.sh real_clients    # or the named test binaries
#   scripts/ktls-vm.sh handover_sessions:ktls_   # NAME:FILTER, those tests only
#   scripts/ktls-vm.sh --run FILE      # or a script of your own, as root in the VM
#
# The caller's NBDGW_* environment variables are set for the tests in
# the VM too (e.g. NBDGW_REPLACEMENTS=6 for handover_replace).
#
# KTLS_VM_SYSTEMD=1 boots systemd as PID 1 (this machine's, from its root)
# and runs the script as a unit, for tests of systemctl itself.
# KTLS_VM_QEMU_ARGS adds arguments to qemu-system-x86_64 (word-split), e.g.
# a disk the guest sees as /dev/vda (tests/vm_guest.py); KTLS_VM_IO names
# the directory shared as the guest's /tmp/io, for a caller that watches it.
#
# The kernel is Debian's linux-image-amd64 of this machine's apt sources
# (bookworm: 6.1). Another one, e.g. for TLS 1.3 key updates (Linux 6.14 on):
#
#   KTLS_VM_KERNEL=new scripts/ktls-vm.sh      # linux-image-amd64 of trixie-backports
#   KTLS_VM_KERNEL_SUITE=sid scripts/ktls-vm.sh             # ... of another suite
#   KTLS_VM_KERNEL_PKG=linux-image-7.3.4+deb13-amd64 KTLS_VM_KERNEL=new scripts/ktls-vm.sh
#
# A suite is read through an apt configuration of this script's own, under
# the cache (its lists refreshed daily), beside this machine's sources,
# which it does not change; its mirror is the one this machine's sources use.
#
# Needs root-free qemu-system-x86_64 and apt-get download (scripts/setup.sh
# installs qemu-system-x86); the kernel (per package name) and busybox
# packages are cached under ~/.cache/nbdgw/ktls-vm. Exits non-zero if any
# test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/ktls-vm
mkdir -p "$cache"

command -v qemu-system-x86_64 >/dev/null ||
    { echo "ktls-vm: qemu-system-x86_64 missing; run scripts/setup.sh" >&2; exit 1; }

# The kernel: a Debian linux-image package (CONFIG_TLS=m), and busybox.
suite=${KTLS_VM_KERNEL_SUITE:-}
case ${KTLS_VM_KERNEL:-default} in
    default) ;;
    new) suite=${suite:-trixie-backports} ;;
    *) echo "ktls-vm: KTLS_VM_KERNEL is default or new, not $KTLS_VM_KERNEL" >&2; exit 1 ;;
esac
apt_opts=()
if [ -n "$suite" ]; then
    # Only this suite, through lists of our own; the mirror of this
    # machine's main suite.
    aptdir=$cache/apt-$suite
    mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
    codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
    mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' |
        awk -v c="$codename" '$2 == c {print $1; exit}')
    [ -n "$mirror" ] || { echo "ktls-vm: no apt source for $codename (apt-get update first)" >&2; exit 1; }
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
        > "$aptdir/sources.list.new"
    if cmp -s "$aptdir/sources.list.new" "$aptdir/sources.list"; then
        rm "$aptdir/sources.list.new"
    else
        mv "$aptdir/sources.list.new" "$aptdir/sources.list"
        rm -f "$aptdir/updated"
    fi
    apt_opts=(-o "Dir::Etc::SourceList=$aptdir/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache" -o Dir::State::status=/dev/null)
    [ "$(id -u)" = 0 ] && apt_opts+=(-o APT::Sandbox::User=root)
    if [ -z "$(find "$aptdir/updated" -mmin -1440 2>/dev/null)" ]; then
        apt-get "${apt_opts[@]}" -q update > "$aptdir/update.log" 2>&1 ||
            { cat "$aptdir/update.log" >&2; echo "ktls-vm: apt-get update of $suite failed" >&2; exit 1; }
        touch "$aptdir/updated"
    fi
fi
kernel_pkg=${KTLS_VM_KERNEL_PKG:-linux-image-amd64}
# A metapackage (linux-image-amd64) stands for the kernel it depends on.
meta_dep=$(apt-cache "${apt_opts[@]}" depends "$kernel_pkg" 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
kernel_pkg=${meta_dep:-$kernel_pkg}
apt-cache "${apt_opts[@]}" show "$kernel_pkg" >/dev/null 2>&1 ||
    { echo "ktls-vm: apt knows no $kernel_pkg${suite:+ in $suite}" >&2; exit 1; }
if [ ! -x "$cache/busybox/bin/busybox" ]; then
    rm -rf "$cache/busybox" "$cache/dl-busybox" && mkdir "$cache/dl-busybox"
    (cd "$cache/dl-busybox" && apt-get -q download busybox-static > log 2>&1) ||
        { cat "$cache/dl-busybox/log" >&2; exit 1; }
    dpkg -x "$cache"/dl-busybox/busybox-static_*.deb "$cache/busybox"
    rm -rf "$cache/dl-busybox"
fi
if [ ! -d "$cache/$kernel_pkg" ]; then
    # Newer Debian kernels split the image into linux-binary-* (vmlinuz),
    # linux-modules-* and linux-base-* (config, modules.builtin).
    parts=("$kernel_pkg" $(apt-cache "${apt_opts[@]}" depends "$kernel_pkg" |
        awk '/Depends: linux-(binary|modules|base)-[0-9]/ {print $2}' | sort -u))
    dl=$cache/dl-$kernel_pkg
    rm -rf "$dl" "$cache/$kernel_pkg.new" && mkdir "$dl"
    (cd "$dl" && apt-get "${apt_opts[@]}" -q download "${parts[@]}" > log 2>&1) ||
        { cat "$dl/log" >&2; echo "ktls-vm: could not download ${parts[*]}" >&2; exit 1; }
    for deb in "$dl"/*.deb; do dpkg -x "$deb" "$cache/$kernel_pkg.new"; done
    mv "$cache/$kernel_pkg.new" "$cache/$kernel_pkg"
    rm -rf "$dl"
fi
kroot=$cache/$kernel_pkg
moddir=$kroot/lib/modules
[ -d "$moddir" ] || moddir=$kroot/usr/lib/modules
version=$(ls "$moddir")
vmlinuz=$kroot/boot/vmlinuz-$version
[ -e "$vmlinuz" ] || vmlinuz=$moddir/$version/vmlinuz
[ -e "$vmlinuz" ] || { echo "ktls-vm: no vmlinuz in $kernel_pkg" >&2; exit 1; }

# initramfs: busybox, the modules for 9p, TLS and its ciphers, the block
# drivers (nbd, for tests/kernel_nbd.rs), and an init
# that mounts this machine's root, runs the script, and powers off.
initrd=$(mktemp -d)
if [ -n "${KTLS_VM_IO:-}" ]; then
    # The caller's directory, which it watches while the VM runs (the
    # guest's /tmp/io); the caller removes it.
    io=$KTLS_VM_IO
    trap 'rm -rf "$initrd"' EXIT
else
    io=$(mktemp -d)
    trap 'rm -rf "$initrd" "$io"' EXIT
fi
mkdir -p "$initrd/bin" "$initrd/lib/modules/$version/kernel"
cp "$cache/busybox/bin/busybox" "$initrd/bin/"
for dir in crypto arch/x86/crypto lib/crypto net/tls net/9p fs/9p fs/netfs fs/fscache drivers/virtio drivers/block; do
    [ -d "$moddir/$version/kernel/$dir" ] || continue
    mkdir -p "$initrd/lib/modules/$version/kernel/$dir"
    cp -r "$moddir/$version/kernel/$dir/." "$initrd/lib/modules/$version/kernel/$dir/"
done
[ -e "$moddir/$version/modules.builtin" ] && cp "$moddir/$version/modules.builtin" "$initrd/lib/modules/$version/"
# Newer kernels' modules are compressed (.ko.xz); busybox modprobe wants
# them plain.
find "$initrd/lib/modules" -name '*.ko.xz' -exec "$initrd/bin/busybox" unxz {} +
find "$initrd/lib/modules" -name '*.ko.gz' -exec "$initrd/bin/busybox" gunzip {} +
if [ -n "$(find "$initrd/lib/modules" -name '*.ko.zst' -print -quit)" ]; then
    command -v zstd >/dev/null || { echo "ktls-vm: zstd missing, for $kernel_pkg's modules" >&2; exit 1; }
    find "$initrd/lib/modules" -name '*.ko.zst' -exec zstd -q -d --rm {} +
fi
(cd "$initrd" && ./bin/busybox depmod -b . "$version")
cat > "$initrd/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin /proc /sys /dev /mnt
/bin/busybox --install -s
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in virtio_pci 9pnet_virtio 9p tls nbd virtio_blk; do
    grep -qs "/$m.ko\$" /lib/modules/*/modules.builtin || modprobe $m || echo "ktls-vm: modprobe $m failed"
done
# The ciphers' modules, those that this kernel has (names vary by version).
for m in aesni_intel gcm ghash_clmulni_intel chacha20poly1305 chacha_x86_64 poly1305_x86_64 chacha libpoly1305; do
    modprobe -q $m
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose host /mnt
mount -t tmpfs tmp /mnt/tmp; mkdir -p /mnt/tmp/io
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 io /mnt/tmp/io
# A checkout under /tmp (or /run, /root) is hidden by the tmpfs above.
repo=$(cat /mnt/tmp/io/repo)
if [ ! -e "/mnt$repo/Cargo.toml" ]; then
    mkdir -p "/mnt$repo"
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose repo "/mnt$repo"
fi
mount -t tmpfs run /mnt/run; mount -t tmpfs root /mnt/root
mount --bind /proc /mnt/proc; mount --bind /sys /mnt/sys; mount --bind /dev /mnt/dev
echo "ktls-vm: kernel $(uname -r), ULPs: $(cat /proc/sys/net/ipv4/tcp_available_ulp)"
if [ -e /mnt/tmp/io/systemd ]; then
    # systemd as PID 1 (KTLS_VM_SYSTEMD=1): the script runs as a unit of
    # its own, and the VM powers off when it ends.
    mkdir -p /mnt/run/systemd/system
    cat > /mnt/run/systemd/system/ktls-vm.service <<'UNIT'
[Unit]
Description=ktls-vm's script
[Service]
Type=oneshot
ExecStart=/bin/bash -c '/bin/bash /tmp/io/run.sh > /tmp/io/out.log 2>&1; echo $? > /tmp/io/status; sync; systemctl poweroff -ff'
UNIT
    umount /mnt/proc /mnt/sys /mnt/dev
    exec switch_root /mnt /lib/systemd/systemd --unit=ktls-vm.service --log-target=console --show-status=no
fi
chroot /mnt /bin/bash /tmp/io/run.sh > /mnt/tmp/io/out.log 2>&1
echo "$?" > /mnt/tmp/io/status
sync
poweroff -f
EOF
chmod +x "$initrd/init"
(cd "$initrd" && find . | ./bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 > "$io/initrd.gz")
echo "$root" > "$io/repo"
rm -f "$io/systemd"
[ "${KTLS_VM_SYSTEMD:-0}" = 1 ] && touch "$io/systemd"

if [ "${1:-}" = "--run" ]; then
    cp "$2" "$io/run.sh"
else
    [ $# -gt 0 ] || set -- kernel_tls key_update raw_protocol real_clients reliability routing kernel_nbd
    # NAME or NAME:FILTER (only the tests of NAME whose names contain
    # FILTER, e.g. handover_sessions:ktls_).
    args=()
    : > "$io/filters"
    for t in "$@"; do
        args+=(--test "${t%%:*}")
        [ "${t%%:*}" = "$t" ] || echo "${t%%:*} ${t#*:}" >> "$io/filters"
    done
    cargo test --locked --no-run --lib "${args[@]}" 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))/\1/p' > "$io/bins"
    # The caller's NBDGW_* settings go in with the tests, as on the host
    # (scripts/test.sh's NBDGW_HANDOVER_OTHER, NBDGW_REPLACEMENTS).
    settings=$(for v in $(compgen -e); do
        case $v in NBDGW_*) printf 'export %s=%q\n' "$v" "${!v}" ;; esac
    done)
    cat > "$io/run.sh" <<EOF
set -u
cd "$root"
export HOME=/root
$settings
ip link set lo up
# As on the host, so that nbdgw's 2 MiB upstream SO_SNDBUF is not clipped
# (a warning the tests count).
echo 4194304 > /proc/sys/net/core/wmem_max
# As systemd gives its services (a hard RLIMIT_NOFILE of 524288): the
# kernel's own 4096, which a bare init passes on, is below what nbdgw's
# default bounds need, and nbdgw says so in a warning the tests count.
ulimit -Hn 524288
grep -qw tls /proc/sys/net/ipv4/tcp_available_ulp || { echo "ktls-vm: no tls ULP in the VM"; exit 1; }
failed=0
while read -r bin; do
    case \$bin in */nbdgw-*) filter=kernel ;; *) filter= ;; esac
    named=\$(awk -v b="\$(basename "\$bin")" 'index(b, \$1 "-") == 1 {print \$2}' /tmp/io/filters)
    filter=\${named:-\$filter}
    echo "=== \$bin"
    timeout 600 "\$bin" \$filter --test-threads 2 --show-output > /tmp/test.log 2>&1 || failed=1
    grep -E '^test |^test result|^mode: ' /tmp/test.log
    grep -q '^test result: ok' /tmp/test.log || { failed=1; tail -60 /tmp/test.log; }
done < /tmp/io/bins
exit \$failed
EOF
fi

timeout "${KTLS_VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg -cpu max -m 4096 -smp 2 \
    -kernel "$vmlinuz" -initrd "$io/initrd.gz" \
    -append "console=ttyS0 quiet panic=-1" -nographic -no-reboot \
    -virtfs "local,path=/,mount_tag=host,security_model=none,readonly=on" \
    -virtfs "local,path=$io,mount_tag=io,security_model=none" \
    -virtfs "local,path=$root,mount_tag=repo,security_model=none,readonly=on" \
    ${KTLS_VM_QEMU_ARGS:-} \
    > "$io/console.log" 2>&1 || true
cat "$io/out.log" 2>/dev/null || true
if [ "$(cat "$io/status" 2>/dev/null)" != 0 ]; then
    echo "ktls-vm: FAILED (console:)" >&2
    tail -20 "$io/console.log" >&2
    exit 1
fi
echo "ktls-vm: passed under $(grep -o 'kernel [^,]*' "$io/console.log" | head -1)"
