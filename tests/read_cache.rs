//! The shared read cache of immutable exports (issue 22, item 1): a real
//! qemu-nbd behind a relay that counts the READ requests reaching it, the
//! gateway in front, raw clients checking every framing byte for byte,
//! and qemu-img through the binary.

mod common;

use std::ffi::OsStr;
use std::sync::Arc;

use common::clients::{http_get, qemu_tls_args};
use common::metrics::sample_as;
use common::process::{NbdgwProcess, UpstreamCounter};
use common::raw::RawClient;
use common::{run_ok, Env, Gateway, QemuNbd};
use nbdgw::cache::ReadCache;
use nbdgw::exports::Immutable;
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

const SIZE: usize = 4 << 20;
const MODES: [ReplyMode; 3] = [
    ReplyMode::Simple,
    ReplyMode::Structured,
    ReplyMode::Extended,
];

struct Site {
    env: Env,
    upstream: QemuNbd,
    counter: UpstreamCounter,
    image: Vec<u8>,
    gateway: Gateway,
    metrics: Arc<nbdgw::metrics::Metrics>,
}

/// qemu-nbd on a random image, the counting relay, and a gateway in front
/// of the relay with `--immutable` (when `immutable`), the cache of
/// `cache_size` bytes and `read_ahead`.
fn site(immutable: bool, cache_size: u64, read_ahead: u32) -> Site {
    site_with_blocks(immutable, cache_size, read_ahead, nbdgw::cache::BLOCK_SIZE)
}

fn site_with_blocks(immutable: bool, cache_size: u64, read_ahead: u32, block: u64) -> Site {
    let env = Env::new();
    let path = env.random_image("golden.img", SIZE, 22);
    let image = std::fs::read(&path).unwrap();
    let upstream = QemuNbd::start(&env, &path, &[]);
    let counter = UpstreamCounter::start(&upstream.socket, &env.path("counted.sock"));
    let mut config = env.config(&counter.socket);
    config.read_cache.immutable = Arc::new(Immutable::new(immutable, vec![]).unwrap());
    if immutable && cache_size > 0 {
        config.read_cache.cache = Some(ReadCache::with_block_size(
            cache_size,
            block,
            config.metrics.cache.clone(),
        ));
    }
    config.read_cache.read_ahead = read_ahead;
    let metrics = config.metrics.clone();
    let gateway = Gateway::start(config);
    Site {
        env,
        upstream,
        counter,
        image,
        gateway,
        metrics,
    }
}

impl Site {
    fn client(&self, mode: ReplyMode) -> (RawClient, u16) {
        let mut c = RawClient::tls(self.gateway.addr, &self.env.certs());
        let tflags = c.go(mode);
        (c, tflags)
    }

    /// Reads `len` at `offset` and checks it against the image.
    fn check_read(&self, c: &mut RawClient, cookie: u64, offset: usize, len: usize) {
        let got = c.read(cookie, offset as u64, len);
        assert!(
            got == self.image[offset..offset + len],
            "{:?}: {len} bytes at {offset} differ from the image",
            c.mode
        );
    }

    fn hits(&self) -> u64 {
        self.metrics.cache.hits.get()
    }
}

/// Reads of many sizes and alignments, over the whole image.
fn reads() -> Vec<(usize, usize)> {
    let mut reads = Vec::new();
    let mut offset = 0;
    let sizes = [4096, 512, 65536, 100_000, 131_072, 7, 4096 * 3, 300_001];
    for i in 0.. {
        let len = sizes[i % sizes.len()].min(SIZE - offset);
        if len == 0 {
            break;
        }
        reads.push((offset, len));
        offset += len;
    }
    reads
}

#[test]
fn every_byte_read_through_the_cache_is_the_image_in_each_framing() {
    let s = site(true, 64 << 20, 0);
    for mode in MODES {
        // The first reader fills (in the first mode), later ones hit.
        for reader in 0..2 {
            let (mut c, _) = s.client(mode);
            for (i, (offset, len)) in reads().into_iter().enumerate() {
                s.check_read(&mut c, i as u64 + 1, offset, len);
            }
            // Backwards and overlapping, all hits after the first pass.
            for (i, (offset, len)) in reads().into_iter().rev().enumerate() {
                let offset = offset.saturating_sub(1000);
                s.check_read(&mut c, 1 << 40 | i as u64, offset, len.min(SIZE - offset));
            }
            c.disconnect();
            assert!(reader == 0 || s.hits() > 0);
        }
    }
    assert!(
        s.hits() > 100,
        "hits: {} misses {} bytes {}",
        s.hits(),
        s.metrics.cache.misses.get(),
        s.metrics.cache.cached_bytes.get()
    );
}

/// A sparse image: qemu-nbd answers structured reads of its hole with
/// OFFSET_HOLE chunks, which the cache keeps as zeros.
#[test]
fn holes_are_cached_as_zeros() {
    let env = Env::new();
    let path = env.path("sparse.img");
    let mut image = common::pattern(SIZE, 9);
    image[1 << 20..3 << 20].fill(0);
    {
        use std::io::{Seek, Write};
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&image[..1 << 20]).unwrap();
        f.seek(std::io::SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(&image[3 << 20..]).unwrap();
    }
    let upstream = QemuNbd::start(&env, &path, &[]);
    let counter = UpstreamCounter::start(&upstream.socket, &env.path("counted.sock"));
    let mut config = env.config(&counter.socket);
    config.read_cache.immutable = Arc::new(Immutable::new(true, vec![]).unwrap());
    config.read_cache.cache = Some(ReadCache::new(64 << 20, config.metrics.cache.clone()));
    config.read_cache.read_ahead = 0;
    let metrics = config.metrics.clone();
    let gateway = Gateway::start(config);
    for mode in MODES {
        let mut c = RawClient::tls(gateway.addr, &env.certs());
        c.go(mode);
        for (offset, len) in [
            (1 << 20, 65536),
            ((1 << 20) - 1000, 70_000),
            (2 << 20, 1 << 20),
            (0, SIZE / 2),
        ] {
            let got = c.read(7, offset as u64, len);
            assert!(got == image[offset..offset + len], "{mode:?} at {offset}");
        }
        c.disconnect();
    }
    assert!(metrics.cache.hits.get() >= 8);
    drop(upstream);
}

/// A hit is framed as the client negotiated: one simple reply, or one
/// OFFSET_DATA chunk flagged done carrying the request's offset (in the
/// extended header too).
#[test]
fn a_hit_is_one_reply_in_the_clients_framing() {
    let s = site(true, 64 << 20, 0);
    let (mut warm, _) = s.client(ReplyMode::Structured);
    s.check_read(&mut warm, 1, 0, 1 << 20);
    warm.disconnect();
    for mode in MODES {
        let (mut c, _) = s.client(mode);
        let hits = s.hits();
        let (offset, len) = (70_000u64, 5000usize);
        c.send_request(0, CMD_READ, 0xfeed, offset, len as u64, &[]);
        let reply = c.read_reply(len);
        assert_eq!(s.hits(), hits + 1, "{mode:?}: not a hit");
        assert_eq!(reply.len(), 1, "{mode:?}: {reply:?}");
        let chunk = &reply[0];
        assert_eq!(chunk.cookie, 0xfeed);
        let expected = &s.image[offset as usize..offset as usize + len];
        if mode == ReplyMode::Simple {
            assert!(chunk.simple);
            assert_eq!(chunk.error, 0);
            assert!(chunk.payload == expected);
        } else {
            assert!(!chunk.simple);
            assert_eq!(chunk.kind, REPLY_TYPE_OFFSET_DATA);
            assert_eq!(chunk.flags, REPLY_FLAG_DONE);
            assert_eq!(chunk.payload[..8], offset.to_be_bytes());
            assert!(&chunk.payload[8..] == expected);
            if mode == ReplyMode::Extended {
                assert_eq!(chunk.offset, offset);
            }
        }
        c.disconnect();
    }
}

#[test]
fn a_second_reader_of_the_same_blocks_does_not_reach_the_upstream() {
    second_reader(nbdgw::cache::BLOCK_SIZE);
}

#[test]
fn with_small_blocks_too() {
    second_reader(4096);
}

fn second_reader(block: u64) {
    let s = site_with_blocks(true, 64 << 20, 0, block);
    let (mut first, _) = s.client(ReplyMode::Structured);
    for i in 0..16 {
        s.check_read(&mut first, i + 1, i as usize * 65536, 65536);
    }
    first.disconnect();
    let after_first = s.counter.reads();
    assert_eq!(after_first, 16, "one upstream READ per first read");
    for mode in MODES {
        let (mut second, _) = s.client(mode);
        // Small, unaligned reads inside the blocks the first one read.
        for i in 0..256u64 {
            let offset = (i * 4096 + i * 7) as usize % ((1 << 20) - 4096);
            s.check_read(&mut second, i, offset, 4096);
        }
        second.disconnect();
    }
    assert_eq!(s.counter.reads(), after_first, "a hit reached the upstream");
    assert_eq!(s.hits(), 3 * 256);
}

/// The same reads through a gateway whose export is not immutable: every
/// one reaches the upstream, and nothing is cached.
#[test]
fn a_mutable_export_is_never_cached() {
    let s = site(false, 64 << 20, 0);
    for round in 0..2 {
        let (mut c, tflags) = s.client(ReplyMode::Structured);
        assert_eq!(tflags & TFLAG_READ_ONLY, 0);
        for i in 0..16 {
            s.check_read(&mut c, i + 1, i as usize * 65536, 65536);
        }
        c.disconnect();
        assert_eq!(s.counter.reads(), 16 * (round + 1));
    }
    assert_eq!(s.hits(), 0);
    assert_eq!(s.metrics.cache.misses.get(), 0);
    // And it is writable.
    let (mut c, _) = s.client(ReplyMode::Structured);
    c.write(1, 0, &[0x55; 4096]);
    assert_eq!(c.read_reply(0).last().unwrap().error_code(), 0);
    assert_eq!(c.read(2, 0, 4096), [0x55; 4096]);
    c.disconnect();
}

#[test]
fn writes_trims_and_zeroes_to_an_immutable_export_are_refused() {
    let s = site(true, 64 << 20, 0);
    for mode in MODES {
        let (mut c, tflags) = s.client(mode);
        assert_ne!(
            tflags & TFLAG_READ_ONLY,
            0,
            "{mode:?}: not advertised read-only"
        );
        s.check_read(&mut c, 9, 0, 8192);
        c.write(1, 0, &[0x55; 8192]);
        let reply = c.read_reply(0);
        assert_eq!(reply.last().unwrap().error_code(), EPERM, "{mode:?}");
        c.send_request(0, CMD_TRIM, 2, 0, 4096, &[]);
        assert_eq!(c.read_reply(0).last().unwrap().error_code(), EPERM);
        c.send_request(0, CMD_WRITE_ZEROES, 3, 0, 4096, &[]);
        assert_eq!(c.read_reply(0).last().unwrap().error_code(), EPERM);
        // In step, and the data (cached or not) is the image's.
        s.check_read(&mut c, 4, 0, 8192);
        c.disconnect();
    }
    assert_eq!(std::fs::read(&s.upstream.image).unwrap(), s.image);
}

#[test]
fn eviction_keeps_the_cache_within_its_size() {
    let cache_size = 256 * 1024;
    let s = site(true, cache_size, 0);
    for round in 0..2 {
        let (mut c, _) = s.client(ReplyMode::Extended);
        for (i, (offset, len)) in reads().into_iter().enumerate() {
            s.check_read(&mut c, i as u64, offset, len);
            let held = s.metrics.cache.cached_bytes.get();
            assert!(
                (0..=cache_size as i64).contains(&held),
                "round {round}: {held} bytes held"
            );
        }
        c.disconnect();
    }
    assert!(s.metrics.cache.evictions.get() > 100);
    assert_eq!(s.metrics.cache.cached_bytes.get(), cache_size as i64);
}

#[test]
fn an_upstream_restarted_with_another_size_has_its_blocks_dropped() {
    let mut s = site(true, 64 << 20, 0);
    let (mut c, _) = s.client(ReplyMode::Structured);
    s.check_read(&mut c, 1, 0, 1 << 20);
    c.disconnect();
    // Another image, of another size, behind the same socket.
    let other = s.env.random_image("other.img", SIZE / 2, 23);
    s.upstream.image = other.clone();
    s.upstream.restart();
    s.image = std::fs::read(&other).unwrap();
    let reads = s.counter.reads();
    let (mut c, _) = s.client(ReplyMode::Structured);
    s.check_read(&mut c, 2, 0, 1 << 20);
    c.disconnect();
    assert!(
        s.counter.reads() > reads,
        "served from the old image's blocks"
    );
    assert_eq!(s.metrics.cache.invalidated_blocks.get(), 16);
    // The new image's blocks are cached in turn.
    let (mut c, _) = s.client(ReplyMode::Simple);
    let reads = s.counter.reads();
    s.check_read(&mut c, 3, 4096, 65536);
    assert_eq!(s.counter.reads(), reads);
    c.disconnect();
}

#[test]
fn sequential_reads_are_fetched_ahead_in_large_reads() {
    let read_ahead = 512 * 1024;
    let s = site(true, 64 << 20, read_ahead);
    for mode in MODES {
        let (mut c, _) = s.client(mode);
        let before = s.counter.reads();
        // A VM reading its disk 4 KiB at a time.
        let span = 2 << 20;
        let start = match mode {
            ReplyMode::Simple => 0,
            ReplyMode::Structured => span,
            ReplyMode::Extended => 0,
        };
        for i in 0..span / 4096 {
            s.check_read(&mut c, i as u64, start + i * 4096, 4096);
        }
        c.disconnect();
        let upstream = s.counter.reads() - before;
        if mode != ReplyMode::Extended {
            // A few misses before the run is seen and while read-ahead is
            // on its way, then one upstream read per 512 KiB.
            assert!(upstream <= 40, "{mode:?}: {upstream} upstream reads");
        } else {
            // All cached by now.
            assert_eq!(upstream, 0);
        }
    }
    let c = &s.metrics.cache;
    assert!(
        c.read_ahead_bytes.get() >= 3 << 20,
        "{}",
        c.read_ahead_bytes.get()
    );
    assert!(c.read_ahead_used_bytes.get() >= 3 << 20);
}

/// The binary with `--export NAME=...` and `--immutable-export NAME`:
/// qemu-img copies the image twice, the second time from the cache, and
/// the metrics say so.
#[test]
fn qemu_img_reads_an_immutable_export_through_the_binary() {
    let env = Env::new();
    let path = env.random_image("golden.img", SIZE, 5);
    let upstream = QemuNbd::start(&env, &path, &[]);
    let counter = UpstreamCounter::start(&upstream.socket, &env.path("counted.sock"));
    let certs = env.certs();
    let admin = common::free_port();
    let export = format!("golden={}", counter.socket.display());
    let gw = NbdgwProcess::with_server_cert(
        &env,
        [
            OsStr::new("--export"),
            OsStr::new(&export),
            OsStr::new("--export"),
            OsStr::new(&format!("plain={}", counter.socket.display())),
            OsStr::new("--immutable-export"),
            OsStr::new("golden"),
            OsStr::new("--cache-size"),
            OsStr::new("33554432"),
            OsStr::new("--admin-listen"),
            OsStr::new(&format!("127.0.0.1:{admin}")),
            OsStr::new("--landlock"),
            OsStr::new("false"),
        ],
    );
    let [object, tls, image_opts, opts] = qemu_tls_args("localhost", gw.port, &certs);
    let opts_for = |export: &str| format!("{opts},export={export}");
    for round in 0..2 {
        let out = env.path(&format!("copy{round}.img"));
        run_ok(
            std::process::Command::new("qemu-img")
                .args(["convert", &object, &tls, &image_opts, &opts_for("golden")])
                .args(["-O", "raw"])
                .arg(&out),
        );
        assert!(std::fs::read(&out).unwrap() == std::fs::read(&path).unwrap());
        if round == 0 {
            assert!(counter.reads() > 0);
        }
    }
    let first_copy_reads = counter.reads();
    let (_, metrics) = http_get(admin, "/metrics");
    let hits = sample_as::<u64>(&metrics, "nbdgw_cache_hits_total");
    assert!(sample_as::<u64>(&metrics, "nbdgw_cache_bytes") as usize >= SIZE);
    // The second copy came from the cache: as many hits as the first
    // copy's reads, and no upstream read of its own.
    assert!(
        hits as usize >= first_copy_reads,
        "hits {hits}, upstream reads {first_copy_reads}"
    );
    // Every READ the upstream saw is one the cache counted as sent.
    assert_eq!(
        sample_as::<u64>(&metrics, "nbdgw_cache_upstream_reads_total") as usize,
        first_copy_reads
    );
    assert!(gw.log().contains("immutable=true"));
    let write = |export: &str| {
        std::process::Command::new("qemu-io")
            .args([&object, &tls, &image_opts, &opts_for(export)])
            .args(["-c", "write -P 7 0 4096"])
            .output()
            .unwrap()
    };
    // The other export, through the same socket, is not immutable.
    let out = write("plain");
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrote"),
        "{out:?}"
    );
    let out = write("golden");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("wrote"),
        "{out:?}"
    );
}

/// The whole export `export` as qemu-img copies it through the gateway.
fn copy_through(env: &Env, port: u16, export: &str, name: &str) -> Vec<u8> {
    let [object, tls, image_opts, opts] = qemu_tls_args("localhost", port, &env.certs());
    let out = env.path(name);
    run_ok(
        std::process::Command::new("qemu-img")
            .args(["convert", &object, &tls, &image_opts])
            .arg(format!("{opts},export={export}"))
            .args(["-O", "raw"])
            .arg(&out),
    );
    std::fs::read(&out).unwrap()
}

/// Asserts `got` is all `byte`, saying what it is instead.
fn assert_all(got: &[u8], byte: u8, what: &str) {
    let wrong = got.iter().filter(|&&b| b != byte).count();
    assert!(
        wrong == 0,
        "{what}: {wrong} of {} bytes are not {:?} (first: {:?})",
        got.len(),
        byte as char,
        got.iter().find(|&&b| b != byte).map(|&b| b as char)
    );
}

/// Issue 27 item 4: qemu-nbd serving image A (all `A`) read through
/// `--immutable`, then stopped, and another qemu-nbd started on the same
/// socket with image B (all `B`) of the same size: what qemu-img reads
/// through the gateway is B, as it is read from the upstream directly.
#[test]
fn a_server_started_again_on_the_same_socket_with_another_image_is_read_afresh() {
    let env = Env::new();
    let size = 1 << 20;
    let socket = env.path("golden.sock");
    let a = env.filled_image("a.img", b'A', size);
    let b = env.filled_image("b.img", b'B', size);
    let mut upstream = QemuNbd::start_at(socket.clone(), &a, &[]);
    let admin = common::free_port();
    let admin_at = format!("127.0.0.1:{admin}");
    let gw = NbdgwProcess::with_server_cert(
        &env,
        [
            OsStr::new("--upstream"),
            socket.as_os_str(),
            OsStr::new("--immutable"),
            OsStr::new("--admin-listen"),
            OsStr::new(&admin_at),
        ],
    );
    assert_all(&copy_through(&env, gw.port, "", "a1.img"), b'A', "image A");
    // Cached: a second copy reads no byte of A from anywhere else.
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(sample_as::<u64>(&metrics, "nbdgw_cache_bytes") as usize >= size);
    upstream.kill();
    let upstream = QemuNbd::start_at(socket.clone(), &b, &[]);
    assert_all(
        &upstream.read_direct(),
        b'B',
        "the new upstream, read directly",
    );
    assert_all(
        &copy_through(&env, gw.port, "", "b1.img"),
        b'B',
        "through the gateway after the swap",
    );
    // And B is cached in turn, A's blocks gone.
    assert_all(&copy_through(&env, gw.port, "", "b2.img"), b'B', "again");
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        metrics.contains("nbdgw_cache_generations_ended_total{reason=\"replaced\"} 1"),
        "{metrics}"
    );
    assert!(
        sample_as::<u64>(&metrics, "nbdgw_cache_invalidated_blocks_total") as usize >= size / 65536
    );
    assert!(sample_as::<u64>(&metrics, "nbdgw_cache_bytes") as usize <= size);
    gw.wait_for_log("another server answers at the export's socket", 1);
}

/// Issue 27 item 4, the races: the old qemu-nbd (A) keeps running on its
/// unlinked socket while a new one (B) takes the path, so sessions of
/// both are open at once. A session of A that was already reading, and
/// one that had reached A while still negotiating, read A's bytes (their
/// server's), and neither what they fetch nor their arrival puts A's bytes
/// back in the cache: every later session reads B, and the generation
/// ended once.
#[test]
fn sessions_of_the_old_server_never_bring_its_bytes_back() {
    let env = Env::new();
    let size = 1 << 20;
    let socket = env.path("golden.sock");
    let a = env.filled_image("a.img", b'A', size);
    let b = env.filled_image("b.img", b'B', size);
    let _old = QemuNbd::start_at(socket.clone(), &a, &[]);
    let gw = NbdgwProcess::with_server_cert(
        &env,
        [
            OsStr::new("--upstream"),
            socket.as_os_str(),
            OsStr::new("--immutable"),
            OsStr::new("--read-ahead"),
            OsStr::new("0"),
        ],
    );
    let connect = || common::clients::connect_as(gw.addr(), &env.certs());
    let block = 65536;
    let mut reading = connect();
    reading.go(ReplyMode::Structured);
    assert_all(&reading.read(1, 0, block), b'A', "before the swap");
    // Negotiating: LIST reaches the upstream (A) before any export.
    let mut negotiating = connect();
    negotiating.option(OPT_LIST, &[]);
    // B takes the path; A serves on, on its unlinked socket.
    std::fs::remove_file(&socket).unwrap();
    let new = QemuNbd::start_at(socket.clone(), &b, &[]);
    assert_all(&new.read_direct(), b'B', "the new upstream, read directly");
    let mut fresh = connect();
    fresh.go(ReplyMode::Structured);
    assert_all(&fresh.read(2, 0, block), b'B', "a new session, block 0");
    fresh.disconnect();
    // The old sessions read on: their server's bytes.
    assert_all(&reading.read(3, block as u64, block), b'A', "old session");
    negotiating.go(ReplyMode::Structured);
    assert_all(&negotiating.read(4, 0, 2 * block), b'A', "late session");
    let mut later = connect();
    later.go(ReplyMode::Simple);
    assert_all(&later.read(5, 0, 4 * block), b'B', "a later session");
    later.disconnect();
    reading.disconnect();
    negotiating.disconnect();
    // Each session's cache decision is logged before its audit line.
    gw.wait_for_log("cached=", 4);
    let log = gw.log();
    assert_eq!(
        log.matches("another server answers at the export's socket")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains("the upstream was replaced while this session negotiated"));
}

/// Issue 27 item 4, with `--export-dir`: tenant `t1`'s `golden.sock`
/// (image A) read through `--immutable-export '*/golden'`; the tenant is
/// deleted (server stopped, directory removed) and a new tenant takes the
/// directory name with a same-sized image B: it is served B.
#[test]
fn a_tenant_directory_name_reused_by_a_new_tenant_is_read_afresh() {
    let env = Env::new();
    let size = 1 << 20;
    let dir = env.path("exports");
    let tenant = dir.join("t1");
    std::fs::create_dir_all(&tenant).unwrap();
    let a = env.filled_image("a.img", b'A', size);
    let b = env.filled_image("b.img", b'B', size);
    let mut old = QemuNbd::start_at(tenant.join("golden.sock"), &a, &[]);
    let admin = common::free_port();
    let admin_at = format!("127.0.0.1:{admin}");
    let gw = NbdgwProcess::with_server_cert(
        &env,
        [
            OsStr::new("--export-dir"),
            dir.as_os_str(),
            OsStr::new("--immutable-export"),
            OsStr::new("*/golden"),
            OsStr::new("--admin-listen"),
            OsStr::new(&admin_at),
        ],
    );
    assert_all(
        &copy_through(&env, gw.port, "t1/golden", "a1.img"),
        b'A',
        "tenant 1",
    );
    // The old tenant's bytes are in the cache: what follows shows they
    // are not served, not that nothing was cached.
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        sample_as::<u64>(&metrics, "nbdgw_cache_bytes") as usize >= size,
        "{metrics}"
    );
    old.kill();
    std::fs::remove_dir_all(&tenant).unwrap();
    std::fs::create_dir(&tenant).unwrap();
    let new = QemuNbd::start_at(tenant.join("golden.sock"), &b, &[]);
    assert_all(
        &new.read_direct(),
        b'B',
        "the new tenant's upstream, read directly",
    );
    assert_all(
        &copy_through(&env, gw.port, "t1/golden", "b1.img"),
        b'B',
        "the new tenant through the gateway",
    );
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        metrics.contains("nbdgw_cache_generations_ended_total{reason=\"replaced\"} 1"),
        "{metrics}"
    );
}

/// An upstream that fails a read, and one that answers with data and a
/// hole: a failed fill reaches the client as the error and caches
/// nothing; data and hole are both cached.
#[test]
fn a_failed_fill_is_the_clients_error_and_caches_nothing() {
    use common::fake_upstream::{self, chunk, good_read, Answer, Asked};
    fn script(_: usize, read: Asked) -> Answer {
        let Asked { cookie, offset, .. } = read;
        match offset {
            0 => {
                let message = b"disk on fire";
                let mut c = chunk(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_ERROR,
                    cookie,
                    6 + message.len() as u32,
                );
                c.extend_from_slice(&EIO.to_be_bytes());
                c.extend_from_slice(&(message.len() as u16).to_be_bytes());
                c.extend_from_slice(message);
                c.into()
            }
            65536 => {
                // Data for the first half of the block, a hole after.
                let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + 32768);
                c.extend_from_slice(&offset.to_be_bytes());
                c.extend(std::iter::repeat_n(9u8, 32768));
                c.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, cookie, 12));
                c.extend_from_slice(&(offset + 32768).to_be_bytes());
                c.extend_from_slice(&32768u32.to_be_bytes());
                c.into()
            }
            _ => good_read(read).into(),
        }
    }
    let env = Env::new();
    let fake = fake_upstream::scripted(&env.path("fake.sock"), 1 << 20, script);
    let mut config = env.config(&fake.socket);
    config.read_cache.immutable = Arc::new(Immutable::new(true, vec![]).unwrap());
    config.read_cache.cache = Some(ReadCache::new(1 << 20, config.metrics.cache.clone()));
    config.read_cache.read_ahead = 0;
    let metrics = config.metrics.clone();
    let gateway = Gateway::start(config);
    let mut c = RawClient::tls(gateway.addr, &env.certs());
    c.go(ReplyMode::Structured);
    for cookie in [1, 2] {
        c.send_request(0, CMD_READ, cookie, 100, 4096, &[]);
        let reply = c.read_reply(4096);
        assert_eq!(reply.last().unwrap().error_code(), EIO);
    }
    assert_eq!(metrics.cache.hits.get(), 0);
    assert_eq!(metrics.cache.cached_bytes.get(), 0);
    assert_eq!(c.read(3, 65536 + 100, 4096), [9; 4096]);
    let hits = metrics.cache.hits.get();
    assert_eq!(c.read(4, 65536 + 30000, 4096)[..2768], [9; 2768]);
    assert_eq!(c.read(5, 65536 + 40000, 4096), [0; 4096]);
    assert_eq!(metrics.cache.hits.get(), hits + 2);
    assert_eq!(c.read(6, 200_000, 4096), [7; 4096]);
    c.disconnect();
}

/// Issue 27 item 7: a FAKE upstream (a real one cannot be made to break
/// the protocol so) answers its first connection's reads with two
/// OFFSET_DATA chunks, the second overlapping the first by a quarter, so
/// that as many bytes came as were asked while the last quarter was never
/// covered; its later connections answer correctly (bytes of 7). The
/// first reader's read fails with EIO (nbdgw answers it from its fill,
/// and cannot vouch for bytes no chunk brought), and nothing of it is
/// cached: a later reader of the uncovered quarter gets the upstream's
/// bytes, not zeros from the cache. Through the binary.
#[test]
fn a_fake_upstreams_overlapping_chunks_leave_no_hole_cached_as_zeros() {
    use common::fake_upstream::{self, chunk, good_read, Answer, Asked};
    fn script(connection: usize, read: Asked) -> Answer {
        let Asked {
            cookie,
            offset,
            length,
        } = read;
        if connection > 0 {
            return good_read(read).into();
        }
        let (half, quarter) = (length / 2, length / 4);
        let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + half);
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend(std::iter::repeat_n(9u8, half as usize));
        c.extend(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            cookie,
            8 + half,
        ));
        c.extend_from_slice(&(offset + u64::from(quarter)).to_be_bytes());
        c.extend(std::iter::repeat_n(9u8, half as usize));
        c.into()
    }
    let env = Env::new();
    let fake = fake_upstream::scripted(&env.path("fake.sock"), 1 << 20, script);
    let gw = NbdgwProcess::in_front_of(&env, &fake.socket, &["--immutable", "--read-ahead", "0"]);
    let mut first = common::clients::connect_as(gw.addr(), &env.certs());
    first.go(ReplyMode::Structured);
    // nbdgw reads the whole 64 KiB block at 0: its last 16 KiB uncovered.
    first.send_request(0, CMD_READ, 1, 0, 4096, &[]);
    let first_error = first.read_reply(4096).last().unwrap().error_code();
    first.disconnect();
    let mut later = common::clients::connect_as(gw.addr(), &env.certs());
    later.go(ReplyMode::Structured);
    let got = later.read(2, 50_000, 4096);
    later.disconnect();
    let zeros = got.iter().filter(|&&b| b == 0).count();
    assert!(
        got == [7; 4096],
        "the uncovered quarter, read later: {zeros} of 4096 bytes are zeros"
    );
    assert_eq!(first_error, EIO, "the read the overlapping reply answered");
    assert!(gw.log().contains("chunks that overlap"), "{}", gw.log());
}

/// The same, for replies whose chunks fill the cache as they come: a FAKE
/// upstream answers its first connection's read-ahead (reads longer than
/// a block) with two OFFSET_DATA chunks that overlap and disagree (bytes
/// of 1, then of 2 over the first's second half); every other read with
/// bytes of 7. The block the first chunk filled is forgotten when the
/// second contradicts it: a later reader gets the upstream's bytes.
#[test]
fn a_fake_upstreams_overlapping_read_ahead_chunks_are_not_cached() {
    use common::fake_upstream::{self, chunk, good_read, Answer, Asked};
    fn script(connection: usize, read: Asked) -> Answer {
        let Asked {
            cookie,
            offset,
            length,
        } = read;
        if connection > 0 || length <= 65536 {
            return good_read(read).into();
        }
        let (half, quarter) = (length / 2, length / 4);
        let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + half);
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend(std::iter::repeat_n(1u8, half as usize));
        c.extend(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            cookie,
            8 + half,
        ));
        c.extend_from_slice(&(offset + u64::from(quarter)).to_be_bytes());
        c.extend(std::iter::repeat_n(2u8, half as usize));
        c.into()
    }
    let env = Env::new();
    let fake = fake_upstream::scripted(&env.path("fake.sock"), 1 << 20, script);
    let gw = NbdgwProcess::in_front_of(&env, &fake.socket, &["--immutable"]);
    let mut first = common::clients::connect_as(gw.addr(), &env.certs());
    first.go(ReplyMode::Structured);
    // Three reads in a row: read-ahead of 64 KiB at 64 KiB (one block, a
    // good reply) and of 128 KiB at 128 KiB (the overlapping one).
    for (cookie, offset) in [(1, 0), (2, 4096), (3, 8192)] {
        assert_eq!(first.read(cookie, offset, 4096), [7; 4096]);
    }
    // Sent upstream after the read-ahead on the same connection, answered
    // after it: once it is back, the read-ahead replies are in.
    assert_eq!(first.read(4, 512 << 10, 4096), [7; 4096]);
    first.disconnect();
    let mut later = common::clients::connect_as(gw.addr(), &env.certs());
    later.go(ReplyMode::Structured);
    let got = later.read(5, 170_000, 4096);
    later.disconnect();
    let ones = got.iter().filter(|&&b| b == 1).count();
    assert!(
        got == [7; 4096],
        "a block the overlapping chunks disagree on, read later: {ones} of 4096 bytes are the first chunk's"
    );
    gw.wait_for_log("chunks that overlap in one reply", 1);
}

/// Bad cache settings stop nbdgw at start, naming the flag.
#[test]
fn bad_cache_flags_are_refused_at_start() {
    let env = Env::new();
    let certs = env.certs();
    let socket = env.path("nbd.sock");
    let base = |extra: &[&str]| {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--tls-dir".into(),
            certs.clone().into(),
            "--landlock".into(),
            "false".into(),
        ];
        args.extend(extra.iter().map(|a| a.into()));
        args
    };
    let export = format!("golden={}", socket.display());
    for (extra, says) in [
        (
            vec!["--export", export.as_str(), "--immutable"],
            "--upstream",
        ),
        (
            vec![
                "--upstream",
                socket.to_str().unwrap(),
                "--cache-block-size",
                "5000",
            ],
            "power of two",
        ),
        (
            vec![
                "--upstream",
                socket.to_str().unwrap(),
                "--read-ahead",
                "67108864",
            ],
            "--read-ahead",
        ),
        (
            vec![
                "--upstream",
                socket.to_str().unwrap(),
                "--immutable-export",
                "a\nb",
            ],
            "--immutable-export",
        ),
    ] {
        let stderr = common::process::start_must_fail(base(&extra));
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
}

/// Whether the data chunk comes before the hole in `long_read_reply`.
const DATA_FIRST: u64 = 1;

/// A FAKE upstream's reply to a read longer than `MAX_HIT` (2 MiB) on its
/// first connection: one OFFSET_DATA chunk of the whole read (bytes of 7,
/// longer than a reply nbdgw would buffer), and an OFFSET_HOLE chunk of
/// 64 KiB overlapping it at 64 KiB, in the order `data_first` says. Every
/// other read gets bytes of 7.
fn long_read_reply(
    connection: usize,
    read: common::fake_upstream::Asked,
    data_first: bool,
) -> common::fake_upstream::Answer {
    use common::fake_upstream::{chunk, good_read, Asked};
    let Asked {
        cookie,
        offset,
        length,
    } = read;
    if connection > 0 || length <= (2 << 20) {
        return good_read(read).into();
    }
    let flags = |last: bool| if last { REPLY_FLAG_DONE } else { 0 };
    let mut data = chunk(
        flags(!data_first),
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        8 + length,
    );
    data.extend_from_slice(&offset.to_be_bytes());
    data.extend(std::iter::repeat_n(7u8, length as usize));
    let mut hole = chunk(flags(data_first), REPLY_TYPE_OFFSET_HOLE, cookie, 12);
    hole.extend_from_slice(&(offset + 65536).to_be_bytes());
    hole.extend_from_slice(&65536u32.to_be_bytes());
    if data_first {
        data.extend(hole);
        data.into()
    } else {
        hole.extend(data);
        hole.into()
    }
}

/// A client's read of 4 MiB through the gateway, answered by `script`,
/// then a later session's read of 4 KiB inside the range two of its
/// chunks disagreed on: what that later read got.
fn read_after_a_long_read(script: common::fake_upstream::Script, at: u64) -> (Vec<u8>, String) {
    let env = Env::new();
    let fake = common::fake_upstream::scripted(&env.path("fake.sock"), 8 << 20, script);
    let gw = NbdgwProcess::in_front_of(&env, &fake.socket, &["--immutable", "--read-ahead", "0"]);
    let mut first = common::clients::connect_as(gw.addr(), &env.certs());
    first.go(ReplyMode::Structured);
    first.send_request(0, CMD_READ, 1, 0, 4 << 20, &[]);
    first.read_reply(4 << 20);
    first.disconnect();
    let mut later = common::clients::connect_as(gw.addr(), &env.certs());
    later.go(ReplyMode::Structured);
    let got = later.read(2, at, 4096);
    later.disconnect();
    (got, gw.log())
}

/// A client's read longer than `MAX_HIT` is relayed wholly uncached: a
/// FAKE upstream's reply to it with a data chunk too long to buffer and a
/// small hole overlapping it leaves no zeros in the cache, whichever
/// chunk comes first. (Before: the data chunk was streamed unrecorded and
/// the hole, short enough to tee, was cached as zeros.)
#[test]
fn a_long_relayed_reads_overlapping_hole_is_not_cached_data_first() {
    fn script(c: usize, read: common::fake_upstream::Asked) -> common::fake_upstream::Answer {
        long_read_reply(c, read, DATA_FIRST == 1)
    }
    let (got, _) = read_after_a_long_read(script, 70_000);
    let zeros = got.iter().filter(|&&b| b == 0).count();
    assert!(
        got == [7; 4096],
        "cached zeros from an overlapping hole: {zeros} of 4096"
    );
}

/// The same, the hole first.
#[test]
fn a_long_relayed_reads_overlapping_hole_is_not_cached_hole_first() {
    fn script(c: usize, read: common::fake_upstream::Asked) -> common::fake_upstream::Answer {
        long_read_reply(c, read, DATA_FIRST != 1)
    }
    let (got, _) = read_after_a_long_read(script, 70_000);
    let zeros = got.iter().filter(|&&b| b == 0).count();
    assert!(
        got == [7; 4096],
        "cached zeros from an overlapping hole: {zeros} of 4096"
    );
}

/// Overlap is checked for a reply's whole length: a FAKE upstream answers
/// a client's read of 2 MiB and 4 KiB (too long to answer from a fill,
/// short enough to cache as it comes) with 64 KiB of ones at 0, 70
/// one-byte chunks with gaps between them (more separate ranges than
/// nbdgw records), then a hole over the first 64 KiB. The block of ones
/// is forgotten when the hole contradicts it, although the reply stopped
/// being cached at the 65th range. (Before: once the ranges ran out,
/// nothing was checked.)
#[test]
fn overlap_is_still_checked_after_a_reply_has_too_many_ranges() {
    use common::fake_upstream::{chunk, good_read, Answer, Asked};
    const LENGTH: u32 = (2 << 20) + 4096;
    fn script(_: usize, read: Asked) -> Answer {
        let Asked {
            cookie,
            offset,
            length,
        } = read;
        if length != LENGTH {
            return good_read(read).into();
        }
        let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + 65536);
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend(std::iter::repeat_n(1u8, 65536));
        for i in 0..70u64 {
            c.extend(chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 9));
            c.extend_from_slice(&(offset + 200_000 + 2 * i).to_be_bytes());
            c.push(7);
        }
        c.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, cookie, 12));
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend_from_slice(&65536u32.to_be_bytes());
        c.into()
    }
    let env = Env::new();
    let fake = common::fake_upstream::scripted(&env.path("fake.sock"), 8 << 20, script);
    let admin = common::free_port();
    let admin_at = format!("127.0.0.1:{admin}");
    let gw = NbdgwProcess::in_front_of(
        &env,
        &fake.socket,
        &[
            "--immutable",
            "--read-ahead",
            "0",
            "--admin-listen",
            &admin_at,
        ],
    );
    let mut first = common::clients::connect_as(gw.addr(), &env.certs());
    first.go(ReplyMode::Structured);
    // Twice: each reply is a fault counted, warned of once in 10 s.
    for cookie in [1, 3] {
        first.send_request(0, CMD_READ, cookie, 0, LENGTH.into(), &[]);
        first.read_reply(LENGTH as usize);
    }
    first.disconnect();
    let mut later = common::clients::connect_as(gw.addr(), &env.certs());
    later.go(ReplyMode::Structured);
    let got = later.read(2, 0, 4096);
    later.disconnect();
    let ones = got.iter().filter(|&&b| b == 1).count();
    assert!(
        got == [7; 4096],
        "a contradicted block still cached: {ones} of 4096 bytes are ones"
    );
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        metrics.contains("nbdgw_cache_upstream_faults_total{kind=\"overlap\"} 2"),
        "{metrics}"
    );
    assert_eq!(
        gw.count_in_log("chunks that overlap in one reply"),
        1,
        "{}",
        gw.log()
    );
}

/// A connection's fills in flight are bounded (`--cache-fill-depth`):
/// each holds its blocks' buffer until its reply is complete. A FAKE
/// upstream begins its reply to every fill read (a whole 64 KiB block)
/// with 4 KiB of data and never finishes it; a read as the client sent it
/// (4 KiB) it answers whole. With a depth of 2, a client's third read
/// pipelined behind two that became fills goes upstream as it came and
/// is answered. (Before: every read became a fill, and the third hung
/// with the others.)
#[test]
fn fills_in_flight_per_connection_are_bounded() {
    use common::fake_upstream::{chunk, good_read, Answer, Asked};
    fn script(_: usize, read: Asked) -> Answer {
        let Asked {
            cookie,
            offset,
            length,
        } = read;
        if length != 65536 {
            return good_read(read).into();
        }
        let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + 4096);
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend(std::iter::repeat_n(7u8, 4096));
        c.into()
    }
    let env = Env::new();
    let fake = common::fake_upstream::scripted(&env.path("fake.sock"), 8 << 20, script);
    let gw = NbdgwProcess::in_front_of(
        &env,
        &fake.socket,
        &[
            "--immutable",
            "--read-ahead",
            "0",
            "--cache-fill-depth",
            "2",
        ],
    );
    let mut client = common::clients::connect_as(gw.addr(), &env.certs());
    client.go(ReplyMode::Structured);
    for (cookie, offset) in [(1, 0), (2, 1 << 20), (3, 2 << 20)] {
        client.send_request(0, CMD_READ, cookie, offset, 4096, &[]);
    }
    // The raw client gives up after 10 s without a reply.
    let reply = client.read_reply(4096);
    assert_eq!(
        common::raw::assemble(&reply, 3, 2 << 20, 4096),
        [7; 4096],
        "the read past the fill depth"
    );
}

/// Read-ahead longer than any client read nbdgw caches as it comes
/// (`--read-ahead 4 MiB`) is still cached: a FAKE upstream answering
/// every read whole (bytes of 7), a client reading 16 MiB on in 1 MiB
/// reads; the read-ahead windows grow to 4 MiB, each reply one chunk.
#[test]
fn read_ahead_longer_than_a_teed_client_read_is_cached() {
    use common::fake_upstream::{good_read, Answer, Asked};
    fn script(_: usize, read: Asked) -> Answer {
        good_read(read).into()
    }
    let env = Env::new();
    let fake = common::fake_upstream::scripted(&env.path("fake.sock"), 32 << 20, script);
    let admin = common::free_port();
    let admin_at = format!("127.0.0.1:{admin}");
    let gw = NbdgwProcess::in_front_of(
        &env,
        &fake.socket,
        &[
            "--immutable",
            "--read-ahead",
            "4194304",
            "--admin-listen",
            &admin_at,
        ],
    );
    let mut client = common::clients::connect_as(gw.addr(), &env.certs());
    client.go(ReplyMode::Structured);
    for i in 0..16u64 {
        assert_eq!(client.read(i + 1, i << 20, 1 << 20), vec![7; 1 << 20]);
    }
    client.disconnect();
    let (_, metrics) = http_get(admin, "/metrics");
    assert!(
        !metrics.contains("nbdgw_cache_upstream_faults_total{"),
        "{metrics}"
    );
    let read_ahead = sample_as::<u64>(&metrics, "nbdgw_cache_read_ahead_bytes_total");
    assert!(
        read_ahead >= 8 << 20,
        "read ahead: {read_ahead}\n{}",
        gw.log()
    );
}

/// A chunk outside the read it answers makes the whole reply untrusted:
/// a FAKE upstream answers a client's read of 2 MiB and 4 KiB (cached as
/// it comes) with 64 KiB of ones at 0, then 4 KiB of bytes of 7 running
/// past the read's end. The block of ones is forgotten; a later reader
/// gets the upstream's bytes. (Before: the stray chunk was only left
/// uncached, and the ones stayed.)
#[test]
fn a_chunk_outside_its_read_makes_the_reply_untrusted() {
    use common::fake_upstream::{chunk, good_read, Answer, Asked};
    const LENGTH: u32 = (2 << 20) + 4096;
    fn script(_: usize, read: Asked) -> Answer {
        let Asked {
            cookie,
            offset,
            length,
        } = read;
        if length != LENGTH {
            return good_read(read).into();
        }
        let mut c = chunk(0, REPLY_TYPE_OFFSET_DATA, cookie, 8 + 65536);
        c.extend_from_slice(&offset.to_be_bytes());
        c.extend(std::iter::repeat_n(1u8, 65536));
        c.extend(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            cookie,
            8 + 4096,
        ));
        c.extend_from_slice(&(offset + u64::from(LENGTH) - 100).to_be_bytes());
        c.extend(std::iter::repeat_n(7u8, 4096));
        c.into()
    }
    let env = Env::new();
    let fake = common::fake_upstream::scripted(&env.path("fake.sock"), 8 << 20, script);
    let gw = NbdgwProcess::in_front_of(&env, &fake.socket, &["--immutable", "--read-ahead", "0"]);
    let mut first = common::clients::connect_as(gw.addr(), &env.certs());
    first.go(ReplyMode::Structured);
    first.send_request(0, CMD_READ, 1, 0, LENGTH.into(), &[]);
    first.read_reply(LENGTH as usize);
    first.disconnect();
    let mut later = common::clients::connect_as(gw.addr(), &env.certs());
    later.go(ReplyMode::Structured);
    let got = later.read(2, 0, 4096);
    later.disconnect();
    let ones = got.iter().filter(|&&b| b == 1).count();
    assert!(
        got == [7; 4096],
        "an untrusted reply's block still cached: {ones} of 4096 bytes are ones"
    );
    assert!(
        gw.log().contains("a chunk outside the read"),
        "{}",
        gw.log()
    );
}

/// A READ that carries a payload (NBD_CMD_FLAG_PAYLOAD_LEN, extended
/// headers) is not the cache's to answer: it goes upstream, payload and
/// all, and qemu-nbd's EINVAL is the client's answer; the payload is never
/// taken for the next request's header. `warm`: the block it reads is
/// cached first (a hit otherwise), else it would be a fill.
fn a_read_with_a_payload_goes_upstream(warm: bool) {
    let s = site(true, 64 << 20, 0);
    let (mut c, _) = s.client(ReplyMode::Extended);
    if warm {
        s.check_read(&mut c, 7, 0, 512);
    }
    let reads = s.counter.reads();
    c.send_request(CMD_FLAG_PAYLOAD_LEN, CMD_READ, 1, 0, 512, &[0x5a; 512]);
    let first = c.read_reply(512);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].cookie, 1);
    assert_eq!(first[0].error_code(), EINVAL, "{first:?}");
    assert_eq!(s.counter.reads(), reads + 1, "not sent upstream");
    // The stream is still in step: the next request is read as one.
    s.check_read(&mut c, 2, 4096, 512);
    c.disconnect();
}

#[test]
fn a_read_with_a_payload_that_would_fill_goes_upstream() {
    a_read_with_a_payload_goes_upstream(false);
}

#[test]
fn a_read_with_a_payload_that_would_hit_goes_upstream() {
    a_read_with_a_payload_goes_upstream(true);
}
