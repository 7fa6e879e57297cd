# Sourced by scripts/container-test.sh: the three base images the
# Containerfiles name, made locally from Debian's packages and this
# machine's Rust toolchain, since no registry is reachable:
#
#   docker.io/library/debian:bookworm-slim -> minbase (debootstrap, podman import)
#   gcr.io/distroless/cc-debian12:nonroot  -> runtime (apt-get download, dpkg-deb -x)
#   docker.io/library/rust:1.95-bookworm   -> builder (minbase + gcc + the toolchain)
#
# Each is cached as a tarball under $cache, and as an image tagged with a
# key hashed from its inputs (the functions that make it among them), so
# a second run reuses it and a change of input (a Debian point release,
# another toolchain, an edit here) makes a new one; prune_bases then drops
# the others.

mirror="${NBDGW_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm
# What distroless/cc-debian12 carries, as Debian packages.
runtime_packages=(libc6 libgcc-s1 base-files netbase tzdata ca-certificates)
# What rust:bookworm's build needs here: cc and make (aws-lc-sys,
# tikv-jemalloc-sys) and CA certificates for cargo's downloads.
builder_packages=(gcc libc6-dev make ca-certificates)

key_of() { sha256sum | cut -c1-16; }

# The minbase root as a tarball: the slow part (about a minute), shared by
# the minbase image and the builder.
minbase_tar() {
    local key tar root
    # The month too: debootstrap takes the suite as the mirror has it
    # today, so the root is made afresh monthly (security updates).
    key=$( { echo "$suite $mirror"; dpkg-query -W -f='${Version}' debootstrap; date +%Y-%m; declare -f minbase_tar; } | key_of)
    tar="$cache/minbase-$suite-$key.tar"
    if [ ! -s "$tar" ]; then
        root=$(mktemp -d "$work/minbase.XXXX")
        log "debootstrap --variant=minbase $suite (cached as $tar)"
        nice -n 10 timeout 600 debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
            { tail -20 "$work/debootstrap.log" >&2; return 1; }
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" -cf "$tar.part" . && mv "$tar.part" "$tar"
        rm -rf "$root"
    fi
    echo "$tar"
}

image_exists() { podman image exists "$1"; }

# podman import of a root tarball as an image with the given settings; the
# tag says which tarball and which settings.
import_root() {
    local tar=$1 name=$2 changes=() tag
    shift 2
    for change in "$@"; do changes+=(--change "$change"); done
    tag="$(basename "$tar" .tar | sed 's/^[a-z]*-//')-$(printf '%s\n' "$@" | key_of | cut -c1-6)"
    image_exists "$name:$tag" || podman import --quiet "${changes[@]}" "$tar" "$name:$tag" >/dev/null
    echo "$name:$tag"
}
path_env='ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'

minbase_image() {
    # In its own assignment: a failure inside "$(...)" as an argument is
    # not seen by set -e.
    local tar
    tar=$(minbase_tar)
    import_root "$tar" localhost/nbdgw-test/bookworm-minbase "$path_env" 'CMD ["bash"]'
}

# distroless/cc's content from the packages themselves: unpacked, not
# installed (no maintainer scripts, no dpkg database, no shell), plus the
# users and the CA bundle their scripts would have made.
runtime_image() {
    local key tar root debs got
    # Fresh lists: after a security update the old ones name .debs the
    # mirror no longer has (404).
    apt-get update -qq >&2
    key=$( { apt-get download --print-uris "${runtime_packages[@]}" 2>/dev/null | awk '{print $2}' | sort
        declare -f runtime_image make_runtime_root; } | key_of)
    tar="$cache/runtime-$key.tar"
    if [ ! -s "$tar" ]; then
        log "runtime base from ${runtime_packages[*]} (cached as $tar)"
        root=$(mktemp -d "$work/runtime.XXXX")
        debs=$(mktemp -d "$work/debs.XXXX")
        # apt downloads as _apt where it can.
        chown _apt "$debs" 2>/dev/null || true
        (cd "$debs" && apt-get download "${runtime_packages[@]}" >/dev/null)
        got=$(find "$debs" -name '*.deb' | wc -l)
        [ "$got" -eq "${#runtime_packages[@]}" ] ||
            { echo "container-test: $got .debs downloaded for ${#runtime_packages[@]} packages" >&2; return 1; }
        for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$root"; done
        make_runtime_root "$root"
        tar -C "$root" -cf "$tar.part" . && mv "$tar.part" "$tar"
        rm -rf "$root" "$debs"
    fi
    import_root "$tar" localhost/nbdgw-test/distroless-cc "$path_env" \
        'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' 'USER 65532:65532' 'WORKDIR /home/nonroot'
}

make_runtime_root() {
    local root=$1
    printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' 'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
        'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$root/etc/passwd"
    printf '%s\n' 'root:x:0:' 'nobody:x:65534:' 'nonroot:x:65532:' >"$root/etc/group"
    install -d -m 0700 -o 65532 -g 65532 "$root/home/nonroot"
    install -d -m 0700 "$root/root"
    install -d -m 1777 "$root/tmp"
    # What update-ca-certificates would write from the packaged certificates.
    mkdir -p "$root/etc/ssl/certs"
    cat "$root"/usr/share/ca-certificates/mozilla/*.crt >"$root/etc/ssl/certs/ca-certificates.crt"
    # What nbdgw cannot run without, checked before the root is cached.
    # (The file itself: /lib64's link is absolute, so -e on it would
    # look at the host's.)
    [ -L "$root/lib64/ld-linux-x86-64.so.2" ] && [ -f "$root/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ] ||
        { echo "container-test: no ld-linux in the runtime base" >&2; return 1; }
    [ -s "$root/etc/ssl/certs/ca-certificates.crt" ] ||
        { echo "container-test: an empty CA bundle in the runtime base" >&2; return 1; }
    # The point of distroless: nothing to run but the program.
    if [ -n "$(find "$root" -name sh -o -name bash -o -name dash)" ]; then
        echo "container-test: a shell slipped into the runtime base" >&2
        return 1
    fi
}

# rust:1.95-bookworm stand-in: the minbase root, a C toolchain from Debian,
# and this machine's Rust toolchain (rustc, cargo and the standard library,
# copied, not downloaded), so that the Containerfile's build stage really
# compiles inside it. Sets $builder, not printed: run outside "$(...)",
# so that its build_pid is the main shell's, which the cleanup kills.
builder_image() {
    local base=$1 sysroot key image context
    sysroot=$(rustc --print sysroot)
    key=$( { echo "$base ${builder_packages[*]}"; rustc -vV; cargo -V; declare -f builder_image builder_containerfile
        cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true; } | key_of)
    image="localhost/nbdgw-test/rust-builder:$key"
    if ! image_exists "$image"; then
        log "builder from $base and $(rustc -V)"
        context=$(mktemp -d "$work/builder.XXXX")
        mkdir -p "$context/rust/bin"
        cp -a "$sysroot/bin/rustc" "$sysroot/bin/cargo" "$context/rust/bin/"
        cp -a "$sysroot/lib" "$context/rust/"
        # The machine's own CAs (a proxy's, here), so cargo reaches the
        # registry as the host's cargo does.
        mkdir -p "$context/local-ca"
        cp /usr/local/share/ca-certificates/*.crt "$context/local-ca/" 2>/dev/null || true
        builder_containerfile "$base" >"$context/Containerfile"
        # In the background and waited for, so that an INT or TERM trap runs
        # at once, not after the build.
        nice -n 10 timeout 900 podman build --quiet --pull=never -t "$image" "$context" >"$work/build-builder.log" 2>&1 &
        build_pid=$!
        wait "$build_pid" ||
            { tail -20 "$work/build-builder.log" >&2; return 1; }
        build_pid=""
        rm -rf "$context"
    fi
    builder=$image
}

builder_containerfile() {
    cat <<EOF
FROM $1
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${builder_packages[*]} \\
    && rm -rf /var/lib/apt/lists/*
COPY local-ca /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
COPY rust /usr/local/rust
ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
}

# Every other tag of the three bases' repositories, and every other
# tarball, once the current ones are made: each change of input would
# otherwise leave a builder of about 1 GB behind. Builders first (they are
# the minbase's children).
prune_bases() {
    local keep=" $* " repo ref tar
    for repo in rust-builder distroless-cc bookworm-minbase; do
        for ref in $(podman images --format '{{.Repository}}:{{.Tag}}' "localhost/nbdgw-test/$repo"); do
            [[ $keep == *" $ref "* ]] || { log "pruning $ref"; podman rmi "$ref" >/dev/null || true; }
        done
    done
    for tar in "$cache"/minbase-*.tar "$cache"/runtime-*.tar; do
        [ -e "$tar" ] || continue
        [[ $keep == *":$(basename "$tar" .tar | sed 's/^[a-z]*-//')-"* ]] || { log "pruning $tar"; rm -f "$tar"; }
    done
}
