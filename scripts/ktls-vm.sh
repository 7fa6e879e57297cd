#!/bin/bash
# Runs nbdgw's tests where the kernel has kernel TLS, so that sessions are
# really handed to the kernel. This machine's kernel lacks CONFIG_TLS; a
# Debian kernel that has it boots under qemu instead (TCG: nested KVM does
# not boot here), with this machine's root shared read-only over 9p, so
# the test binaries, qemu-nbd, qemu-img and libnbd inside are the ones
# built and installed here.
#
#   scripts/ktls-vm.sh                 # kernel_tls key_update raw_protocol real_clients reliability routing
#   scripts/ktls-vm.sh real_clients    # or the named test binaries
#   scripts/ktls-vm.sh --run FILE      # or a script of your own, as root in the VM
#
# Needs root-free qemu-system-x86_64 and apt-get download (scripts/setup.sh
# installs qemu-system-x86); the kernel and busybox packages are cached
# under ~/.cache/nbdgw/ktls-vm. Exits non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${XDG_CACHE_HOME:-$HOME/.cache}/nbdgw/ktls-vm
mkdir -p "$cache"

command -v qemu-system-x86_64 >/dev/null ||
    { echo "ktls-vm: qemu-system-x86_64 missing; run scripts/setup.sh" >&2; exit 1; }

# The kernel of Debian's linux-image-amd64 (CONFIG_TLS=m), and busybox.
kernel_pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kernel_pkg" ] || { echo "ktls-vm: apt knows no linux-image-amd64" >&2; exit 1; }
if [ ! -d "$cache/$kernel_pkg" ]; then
    (cd "$cache" && rm -f ./*.deb && apt-get download "$kernel_pkg" busybox-static 2>/dev/null)
    dpkg -x "$cache/$kernel_pkg"_*.deb "$cache/$kernel_pkg"
    dpkg -x "$cache"/busybox-static_*.deb "$cache/busybox"
    rm -f "$cache"/*.deb
fi
kroot=$cache/$kernel_pkg
version=$(ls "$kroot/lib/modules")

# initramfs: busybox, the modules for 9p, TLS and its ciphers, and an init
# that mounts this machine's root, runs the script, and powers off.
initrd=$(mktemp -d)
io=$(mktemp -d)
trap 'rm -rf "$initrd" "$io"' EXIT
mkdir -p "$initrd/bin" "$initrd/lib/modules/$version/kernel"
cp "$cache/busybox/bin/busybox" "$initrd/bin/"
for dir in crypto arch/x86/crypto lib/crypto net/tls net/9p fs/9p fs/netfs fs/fscache drivers/virtio; do
    mkdir -p "$initrd/lib/modules/$version/kernel/$dir"
    cp -r "$kroot/lib/modules/$version/kernel/$dir/." "$initrd/lib/modules/$version/kernel/$dir/"
done
(cd "$initrd" && ./bin/busybox depmod -b . "$version")
cat > "$initrd/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin /proc /sys /dev /mnt
/bin/busybox --install -s
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in virtio_pci 9pnet_virtio 9p tls aesni_intel gcm ghash_clmulni_intel chacha20poly1305 chacha_x86_64 poly1305_x86_64; do
    modprobe $m || echo "ktls-vm: modprobe $m failed"
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
chroot /mnt /bin/bash /tmp/io/run.sh > /mnt/tmp/io/out.log 2>&1
echo "$?" > /mnt/tmp/io/status
sync
poweroff -f
EOF
chmod +x "$initrd/init"
(cd "$initrd" && find . | ./bin/busybox cpio -o -H newc 2>/dev/null | gzip -1 > "$io/initrd.gz")
echo "$root" > "$io/repo"

if [ "${1:-}" = "--run" ]; then
    cp "$2" "$io/run.sh"
else
    [ $# -gt 0 ] || set -- kernel_tls key_update raw_protocol real_clients reliability routing
    args=()
    for t in "$@"; do args+=(--test "$t"); done
    cargo test --locked --no-run --lib "${args[@]}" 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))/\1/p' > "$io/bins"
    cat > "$io/run.sh" <<EOF
set -u
cd "$root"
export HOME=/root
ip link set lo up
# As on the host, so that nbdgw's 2 MiB upstream SO_SNDBUF is not clipped
# (a warning the tests count).
echo 4194304 > /proc/sys/net/core/wmem_max
grep -qw tls /proc/sys/net/ipv4/tcp_available_ulp || { echo "ktls-vm: no tls ULP in the VM"; exit 1; }
failed=0
while read -r bin; do
    case \$bin in */nbdgw-*) filter=kernel ;; *) filter= ;; esac
    echo "=== \$bin"
    timeout 600 "\$bin" \$filter --test-threads 2 > /tmp/test.log 2>&1 || failed=1
    grep -E '^test |^test result' /tmp/test.log
    grep -q '^test result: ok' /tmp/test.log || { failed=1; tail -60 /tmp/test.log; }
done < /tmp/io/bins
exit \$failed
EOF
fi

timeout "${KTLS_VM_TIMEOUT:-900}" qemu-system-x86_64 -accel tcg -cpu max -m 4096 -smp 2 \
    -kernel "$kroot/boot/vmlinuz-$version" -initrd "$io/initrd.gz" \
    -append "console=ttyS0 quiet panic=-1" -nographic -no-reboot \
    -virtfs "local,path=/,mount_tag=host,security_model=none,readonly=on" \
    -virtfs "local,path=$io,mount_tag=io,security_model=none" \
    -virtfs "local,path=$root,mount_tag=repo,security_model=none,readonly=on" \
    > "$io/console.log" 2>&1 || true
cat "$io/out.log" 2>/dev/null || true
if [ "$(cat "$io/status" 2>/dev/null)" != 0 ]; then
    echo "ktls-vm: FAILED (console:)" >&2
    tail -20 "$io/console.log" >&2
    exit 1
fi
echo "ktls-vm: passed under $(grep -o 'kernel [^,]*' "$io/console.log" | head -1)"
