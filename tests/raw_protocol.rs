//! The gateway driven byte by byte by a raw client, in front of a real
//! qemu-nbd: negotiation rules before and after TLS, all three reply
//! framings, refusals, protocol violations and disconnects. After each
//! fault a well-behaved client must still be served.

mod common;

use std::time::{Duration, Instant};

use common::raw::{assemble, go_data, meta_context_data, RawClient};
use common::{Env, Gateway, RecordCounter, Served};
use nbdgw::proto::consts::*;
use nbdgw::proto::transmission::ReplyMode;

const SIZE: usize = 4 << 20;

fn setup_with(qemu_args: &[&str], tune: impl FnOnce(&mut nbdgw::Config)) -> Served {
    Served::start((SIZE, 1), qemu_args, tune)
}

fn setup() -> Served {
    setup_with(&[], |_| {})
}

#[test]
fn client_without_fixed_newstyle_or_with_unknown_flags_is_dropped() {
    let s = setup();
    for flags in [0u32, 2, 1 | 4, 0x8000_0001] {
        let mut c = RawClient::connect(s.gateway.addr);
        c.greeting();
        c.send(&flags.to_be_bytes());
        c.expect_closed();
    }
    s.assert_still_serving();
}

#[test]
fn options_before_tls_get_tls_reqd_and_their_data_is_consumed() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    for (option, data) in [
        (OPT_GO, go_data("", &[])),
        (OPT_INFO, go_data("x", &[0, 3])),
        (OPT_LIST, vec![]),
        (OPT_STRUCTURED_REPLY, vec![]),
        (99, vec![0xab; 1000]),
    ] {
        let r = c.option(option, &data);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].reply_type, REP_ERR_TLS_REQD, "option {option}");
        assert!(
            r[0].message().contains("TLS is required"),
            "{}",
            r[0].message()
        );
    }
    // Still in step: STARTTLS and the rest work.
    c.starttls(&s.env.certs());
    c.go(ReplyMode::Simple);
    c.disconnect();
}

#[test]
fn structured_reply_before_tls_does_not_survive_starttls() {
    // CVE-2021-3716: nothing negotiated in plaintext may carry over.
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    assert_eq!(
        c.option(OPT_STRUCTURED_REPLY, &[])[0].reply_type,
        REP_ERR_TLS_REQD
    );
    c.starttls(&s.env.certs());
    c.go(ReplyMode::Simple);
    c.send_request(0, CMD_READ, 5, 0, 512, &[]);
    let chunk = c.read_chunk(512);
    assert!(chunk.simple, "read reply must be a simple reply");
    assert_eq!(
        chunk.payload,
        std::fs::read(&s.upstream.image).unwrap()[..512]
    );
}

#[test]
fn starttls_with_data_is_invalid_and_the_session_goes_on() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    let r = c.option(OPT_STARTTLS, b"junk");
    assert_eq!(r[0].reply_type, REP_ERR_INVALID);
    c.starttls(&s.env.certs());
    c.go(ReplyMode::Structured);
    c.disconnect();
}

#[test]
fn export_name_before_tls_closes() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    c.send_option(OPT_EXPORT_NAME, b"");
    c.expect_closed();
    s.assert_still_serving();
}

#[test]
fn abort_before_tls_is_acknowledged_then_closed() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    let r = c.option(OPT_ABORT, &[]);
    assert_eq!(r[0].reply_type, REP_ACK);
    c.expect_closed();
}

#[test]
fn bad_option_magic_and_oversize_option_close_the_connection() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    c.send(b"IHAVEOPX\0\0\0\x05\0\0\0\0");
    c.expect_closed();

    let mut c = RawClient::handshake(s.gateway.addr);
    // 1 MiB of option data announced, over the 64 KiB default: dropped
    // without the gateway waiting for (or buffering) the data.
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&OPT_INFO.to_be_bytes());
    h.extend_from_slice(&(1u32 << 20).to_be_bytes());
    c.send(&h);
    c.expect_closed();

    // The same after TLS.
    let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
    c.send(&h);
    c.expect_closed();
    s.assert_still_serving();
}

#[test]
fn garbage_instead_of_a_tls_handshake_closes() {
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    assert_eq!(c.option(OPT_STARTTLS, &[])[0].reply_type, REP_ACK);
    c.send(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
    // rustls answers garbage with an alert record at most, then closes.
    let mut all = Vec::new();
    let _ = std::io::Read::read_to_end(&mut c.stream, &mut all);
    assert!(all.len() < 64, "unexpected data after garbage: {all:02x?}");
    s.assert_still_serving();
}

#[test]
fn client_hello_sent_right_behind_starttls_is_not_lost() {
    // A client may pipeline its ClientHello right after STARTTLS; those
    // bytes are buffered and must go to TLS, not to the NBD parser.
    let s = setup();
    let mut c = RawClient::handshake(s.gateway.addr);
    let mut starttls = IHAVEOPT.to_be_bytes().to_vec();
    starttls.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    starttls.extend_from_slice(&0u32.to_be_bytes());
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn =
        rustls::ClientConnection::new(common::raw::tls_config(&s.env.certs()), name).unwrap();
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).unwrap();
    starttls.extend_from_slice(&hello);
    c.send(&starttls);
    let r = c.read_option_reply();
    assert_eq!(r.reply_type, REP_ACK);
    let common::raw::Stream::Plain(mut tcp) =
        std::mem::replace(&mut c.stream, common::raw::Stream::Gone)
    else {
        unreachable!()
    };
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .expect("handshake with pipelined ClientHello");
    }
    c.stream = common::raw::Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp)));
    c.go(ReplyMode::Extended);
    c.disconnect();
}

#[test]
fn after_tls_second_starttls_is_invalid_and_unknown_options_unsupported() {
    let s = setup();
    let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
    let r = c.option(OPT_STARTTLS, &[]);
    assert_eq!(r[0].reply_type, REP_ERR_INVALID);
    assert!(r[0].message().contains("already"), "{}", r[0].message());
    let r = c.option(4242, b"some data");
    assert_eq!(r[0].reply_type, REP_ERR_UNSUP);
    assert!(r[0].message().contains("4242"), "{}", r[0].message());
    // LIST is relayed: qemu-nbd's single default export comes back.
    let r = c.option(OPT_LIST, &[]);
    assert_eq!(r.last().unwrap().reply_type, REP_ACK);
    assert!(r.iter().any(|x| x.reply_type == REP_SERVER));
    c.go(ReplyMode::Extended);
    c.disconnect();
}

#[test]
fn abort_after_tls_is_acknowledged_with_close_notify() {
    let s = setup();
    let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
    assert_eq!(c.option(OPT_ABORT, &[])[0].reply_type, REP_ACK);
    let mut b = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut c.stream, &mut b).expect("clean TLS close"),
        0
    );
}

#[test]
fn export_name_after_tls_gets_padding_per_client_flags() {
    let s = setup();
    for (flags, expected_len) in [(1u32, 134usize), (3, 10)] {
        let mut c = RawClient::connect(s.gateway.addr);
        c.greeting();
        c.send(&flags.to_be_bytes());
        c.starttls(&s.env.certs());
        c.send_option(OPT_EXPORT_NAME, b"");
        let mut reply = vec![0u8; expected_len];
        std::io::Read::read_exact(&mut c.stream, &mut reply).unwrap();
        assert_eq!(
            u64::from_be_bytes(reply[..8].try_into().unwrap()),
            SIZE as u64
        );
        assert!(reply[10..].iter().all(|&b| b == 0));
        // Transmission with simple replies follows directly.
        let data = c.read(1, 0, 4096);
        assert_eq!(data, std::fs::read(&s.upstream.image).unwrap()[..4096]);
        c.disconnect();
    }
}

/// Write, read back, flush and block status in one framing; data checked
/// against the image and against the upstream read directly.
fn exercise_framing(mode: ReplyMode) {
    let s = setup_with(&["-A"], |_| {});
    let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
    if mode != ReplyMode::Simple {
        let opt = if mode == ReplyMode::Extended {
            OPT_EXTENDED_HEADERS
        } else {
            OPT_STRUCTURED_REPLY
        };
        assert_eq!(c.option(opt, &[])[0].reply_type, REP_ACK);
        let r = c.option(
            OPT_SET_META_CONTEXT,
            &meta_context_data("", &["base:allocation"]),
        );
        assert_eq!(r.last().unwrap().reply_type, REP_ACK);
        assert_eq!(r[0].reply_type, REP_META_CONTEXT);
        // Undo the framing option so go() does not repeat it.
    }
    let tflags = {
        let replies = c.option(OPT_GO, &go_data("", &[]));
        assert_eq!(replies.last().unwrap().reply_type, REP_ACK);
        c.mode = mode;
        let info = replies
            .iter()
            .find(|r| r.reply_type == REP_INFO && r.data[..2] == [0, 0])
            .unwrap();
        u16::from_be_bytes([info.data[10], info.data[11]])
    };
    assert_eq!(tflags & TFLAG_READ_ONLY, 0);

    let data = common::pattern(256 * 1024 + 512, 99);
    // Several requests in flight at once, replies read afterwards.
    c.write(10, 65536, &data);
    c.write(11, 1 << 20, &data[..4096]);
    c.send_request(0, CMD_FLUSH, 12, 0, 0, &[]);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let reply = c.read_reply(0);
        assert_eq!(reply.last().unwrap().error_code(), 0);
        seen.push(reply[0].cookie);
    }
    seen.sort();
    assert_eq!(seen, [10, 11, 12]);
    assert_eq!(c.read(13, 65536, data.len()), data);
    // A read larger than one TLS record and not a multiple of it.
    let image = std::fs::read(&s.upstream.image).unwrap();
    assert_eq!(
        c.read(14, 3 << 20, 100_003),
        image[3 << 20..(3 << 20) + 100_003]
    );
    assert_eq!(image[65536..65536 + data.len()], data[..]);
    assert_eq!(s.upstream.read_direct(), image);

    if mode != ReplyMode::Simple {
        c.send_request(0, CMD_BLOCK_STATUS, 15, 0, SIZE as u64, &[]);
        let reply = c.read_reply(0);
        let kind = if mode == ReplyMode::Extended {
            REPLY_TYPE_BLOCK_STATUS_EXT
        } else {
            REPLY_TYPE_BLOCK_STATUS
        };
        assert!(reply.iter().any(|ch| ch.kind == kind), "{reply:?}");
    }
    c.disconnect();
}

#[test]
fn simple_replies_relay() {
    exercise_framing(ReplyMode::Simple);
}

#[test]
fn structured_replies_relay() {
    exercise_framing(ReplyMode::Structured);
}

#[test]
fn extended_headers_relay() {
    exercise_framing(ReplyMode::Extended);
}

#[test]
fn writes_to_a_read_only_export_get_eperm_and_the_session_goes_on() {
    let s = setup_with(&["-r"], |_| {});
    let before = std::fs::read(&s.upstream.image).unwrap();
    for mode in [
        ReplyMode::Simple,
        ReplyMode::Structured,
        ReplyMode::Extended,
    ] {
        let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
        let tflags = c.go(mode);
        assert_ne!(tflags & TFLAG_READ_ONLY, 0);
        c.write(1, 0, &[0x55; 8192]);
        let reply = c.read_reply(0);
        assert_eq!(reply.last().unwrap().error_code(), EPERM, "{mode:?}");
        if mode != ReplyMode::Simple {
            assert!(reply.last().unwrap().error_message().contains("read-only"));
        }
        c.send_request(0, CMD_TRIM, 2, 0, 4096, &[]);
        assert_eq!(c.read_reply(0).last().unwrap().error_code(), EPERM);
        c.send_request(0, CMD_WRITE_ZEROES, 3, 0, 4096, &[]);
        assert_eq!(c.read_reply(0).last().unwrap().error_code(), EPERM);
        // The refused payload was consumed: the next request is in step.
        assert_eq!(c.read(4, 0, 8192), before[..8192]);
        c.disconnect();
    }
    assert_eq!(std::fs::read(&s.upstream.image).unwrap(), before);
}

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let s = setup();
    let mut other = s.client(ReplyMode::Structured);
    let mut c = s.client(ReplyMode::Structured);
    let mut req = c.request_bytes(0, CMD_READ, 1, 0, 512);
    req[0] ^= 0xff;
    c.send(&req);
    c.expect_closed();
    // A bystander connection keeps working.
    let image = std::fs::read(&s.upstream.image).unwrap();
    assert_eq!(other.read(2, 4096, 512), image[4096..4608]);
    other.disconnect();
    s.assert_still_serving();
}

#[test]
fn oversize_payload_closes_and_oversize_read_is_einval() {
    let s = setup_with(&[], |c| c.relay.max_payload = 1 << 20);
    let mut c = s.client(ReplyMode::Structured);
    // A read over --max-payload: refused locally, session goes on.
    c.send_request(0, CMD_READ, 1, 0, 2 << 20, &[]);
    let reply = c.read_reply(0);
    assert_eq!(reply.last().unwrap().error_code(), EINVAL);
    let image = std::fs::read(&s.upstream.image).unwrap();
    assert_eq!(c.read(2, 0, 1 << 20), image[..1 << 20]);
    // A write payload over it: the connection is dropped before the data.
    let header = c.request_bytes(0, CMD_WRITE, 3, 0, 2 << 20);
    c.send(&header);
    c.expect_closed();
    s.assert_still_serving();
}

#[test]
fn disconnect_with_writes_in_flight_loses_no_write() {
    let s = setup();
    let mut c = s.client(ReplyMode::Structured);
    let mut expected = std::fs::read(&s.upstream.image).unwrap();
    // Queue writes and DISC back to back, before reading any reply.
    let mut burst = Vec::new();
    for i in 0..24u64 {
        let data = common::pattern(65536, 1000 + i);
        let offset = i * 65536 * 2;
        expected[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        burst.extend_from_slice(&c.request_bytes(0, CMD_WRITE, 100 + i, offset, data.len() as u64));
        burst.extend_from_slice(&data);
    }
    burst.extend_from_slice(&c.request_bytes(0, CMD_DISC, 999, 0, 0));
    c.send(&burst);
    let mut cookies: Vec<u64> = (0..24)
        .map(|_| {
            let r = c.read_reply(0);
            assert_eq!(r.last().unwrap().error_code(), 0);
            r[0].cookie
        })
        .collect();
    cookies.sort();
    assert_eq!(cookies, (100..124).collect::<Vec<_>>());
    // Then a clean TLS close.
    let mut b = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut c.stream, &mut b).expect("close_notify"),
        0
    );
    assert_eq!(s.upstream.read_direct(), expected);
}

#[test]
fn duplicate_cookies_in_flight_are_served_in_order() {
    let s = setup();
    let mut c = s.client(ReplyMode::Extended);
    let image = std::fs::read(&s.upstream.image).unwrap();
    let mut burst = c.request_bytes(0, CMD_READ, 7, 0, 65536);
    burst.extend_from_slice(&c.request_bytes(0, CMD_READ, 7, 65536, 65536));
    c.send(&burst);
    let first = c.read_reply(65536);
    let second = c.read_reply(65536);
    assert_eq!(common::raw::assemble(&first, 7, 0, 65536), image[..65536]);
    assert_eq!(
        common::raw::assemble(&second, 7, 65536, 65536),
        image[65536..131072]
    );
    c.disconnect();
}

#[test]
fn client_vanishing_mid_request_does_not_disturb_others() {
    let s = setup();
    let mut c = s.client(ReplyMode::Structured);
    let mut partial = c.request_bytes(0, CMD_WRITE, 1, 0, 65536);
    partial.extend_from_slice(&[0x11; 1000]);
    c.send(&partial);
    drop(c);
    let mut c = s.client(ReplyMode::Simple);
    let header = c.request_bytes(0, CMD_READ, 1, 0, 4096);
    c.send(&header[..10]);
    drop(c);
    s.assert_still_serving();
    // The half-sent write never reached the disk.
    assert_ne!(
        std::fs::read(&s.upstream.image).unwrap()[..1000],
        [0x11; 1000]
    );
}

#[test]
fn upstream_death_closes_clients_and_new_clients_get_an_error_until_it_returns() {
    let mut s = setup();
    let mut c = s.client(ReplyMode::Structured);
    s.upstream.kill();
    let started = Instant::now();
    c.expect_closed();
    assert!(started.elapsed() < Duration::from_secs(5));

    let mut c = RawClient::tls(s.gateway.addr, &s.env.certs());
    let r = c.option(OPT_GO, &go_data("", &[]));
    assert_eq!(r[0].reply_type, REP_ERR_SHUTDOWN);
    assert!(
        r[0].message().contains("upstream NBD server unavailable"),
        "{}",
        r[0].message()
    );

    s.upstream.restart();
    s.assert_still_serving();
}

#[test]
fn handshake_timeout_and_connection_limit() {
    let s = setup_with(&[], |c| {
        c.handshake_timeout = Duration::from_secs(1);
        c.max_connections = 2;
    });
    let mut slow = RawClient::connect(s.gateway.addr);
    slow.greeting();
    let started = Instant::now();
    slow.expect_closed();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(5),
        "{waited:?}"
    );

    let mut a = s.client(ReplyMode::Structured);
    let mut b = s.client(ReplyMode::Structured);
    // --max-connections counts authenticated sessions: a third client is
    // told why once it has authenticated.
    let mut third = RawClient::tls(s.gateway.addr, &s.env.certs());
    let refused = third.option(OPT_GO, &go_data("", &[]));
    assert_eq!(refused[0].reply_type, REP_ERR_SHUTDOWN);
    assert!(
        refused[0]
            .message()
            .contains("--max-connections (2) reached"),
        "{}",
        refused[0].message()
    );
    a.disconnect();
    b.disconnect();
    std::thread::sleep(Duration::from_millis(200));
    s.assert_still_serving();
}

#[test]
fn idle_timeout_closes_idle_connections() {
    let s = setup_with(&[], |c| c.relay.idle_timeout = Some(Duration::from_secs(1)));
    let mut c = s.client(ReplyMode::Structured);
    let image = std::fs::read(&s.upstream.image).unwrap();
    assert_eq!(c.read(1, 0, 512), image[..512]);
    let started = Instant::now();
    c.expect_closed();
    assert!(started.elapsed() >= Duration::from_millis(800));
}

/// TLS 1.3 adds one content-type byte and a 16-byte tag to each record.
const TLS13_OVERHEAD: usize = 17;

fn counted_client(s: &Served) -> (RecordCounter, RawClient) {
    // Greeting (18) and the STARTTLS ACK (20) are plaintext.
    let counter = RecordCounter::start(s.gateway.addr, 18 + 20);
    let mut c = RawClient::tls(counter.addr, &s.env.certs());
    c.go(ReplyMode::Extended);
    // Warm up so session tickets and negotiation records are all behind us.
    c.read(1, 0, 512);
    std::thread::sleep(Duration::from_millis(100));
    (counter, c)
}

#[test]
fn a_4k_read_reply_is_one_tls_record() {
    let s = setup();
    let (counter, mut c) = counted_client(&s);
    for i in 0..5u64 {
        let before = counter.records().len();
        c.read(10 + i, i * 4096, 4096);
        std::thread::sleep(Duration::from_millis(50));
        let new = counter.records()[before..].to_vec();
        // 32-byte extended chunk header, 8-byte offset, 4096 bytes of data.
        assert_eq!(
            new,
            vec![32 + 8 + 4096 + TLS13_OVERHEAD],
            "records for one 4 KiB read"
        );
    }
    c.disconnect();
}

#[test]
fn a_1m_read_reply_fills_every_record_but_the_last() {
    let s = setup();
    let (counter, mut c) = counted_client(&s);
    let before = counter.records().len();
    let image = std::fs::read(&s.upstream.image).unwrap();
    assert_eq!(c.read(2, 1 << 20, 1 << 20), image[1 << 20..2 << 20]);
    std::thread::sleep(Duration::from_millis(50));
    let new = counter.records()[before..].to_vec();
    let plaintext: usize = 32 + 8 + (1 << 20);
    assert_eq!(new.len(), plaintext.div_ceil(16384), "{new:?}");
    let (last, full) = new.split_last().unwrap();
    assert!(full.iter().all(|&r| r == 16384 + TLS13_OVERHEAD), "{new:?}");
    assert_eq!(*last, plaintext % 16384 + TLS13_OVERHEAD);
    c.disconnect();
}

#[test]
fn shutdown_stops_accepting_and_ends_idle_sessions_at_once() {
    let Served {
        env,
        upstream: _upstream,
        mut gateway,
        ..
    } = setup_with(&[], |c| c.shutdown_grace = Duration::from_secs(2));
    let mut c = RawClient::tls(gateway.addr, &env.certs());
    c.go(ReplyMode::Structured);
    let addr = gateway.addr;
    let started = Instant::now();
    let stopper = std::thread::spawn(move || gateway.stop());
    // An idle session has nothing to finish: it ends at once...
    c.expect_closed();
    // ...and no new clients are taken.
    assert!(std::net::TcpStream::connect(addr).is_err());
    stopper.join().unwrap().expect("run() returns Ok");
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1500), "{took:?}");
}

#[test]
fn a_connection_finishing_during_shutdown_lets_the_gateway_stop_early() {
    let Served {
        env,
        upstream: _upstream,
        mut gateway,
        ..
    } = setup_with(&[], |c| c.shutdown_grace = Duration::from_secs(30));
    let mut c = RawClient::tls(gateway.addr, &env.certs());
    c.go(ReplyMode::Extended);
    let started = Instant::now();
    let stopper = std::thread::spawn(move || gateway.stop());
    std::thread::sleep(Duration::from_millis(200));
    c.disconnect();
    stopper.join().unwrap().expect("run() returns Ok");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn clients_still_negotiating_at_shutdown_get_err_shutdown() {
    let Served {
        env,
        upstream: _upstream,
        mut gateway,
        ..
    } = setup_with(&[], |c| c.shutdown_grace = Duration::from_secs(3));
    let mut plain = RawClient::handshake(gateway.addr);
    let mut tls = RawClient::tls(gateway.addr, &env.certs());
    let stopper = std::thread::spawn(move || gateway.stop());
    std::thread::sleep(Duration::from_millis(300));
    for c in [&mut plain, &mut tls] {
        let r = c.option(OPT_GO, &go_data("", &[]));
        assert_eq!(r[0].reply_type, REP_ERR_SHUTDOWN);
        assert!(
            r[0].message().contains("shutting down"),
            "{}",
            r[0].message()
        );
        assert_eq!(c.option(OPT_ABORT, &[])[0].reply_type, REP_ACK);
    }
    stopper.join().unwrap().expect("run() returns Ok");
}

#[test]
fn every_cork_mode_relays_pipelined_reads_and_keeps_small_replies_in_one_record() {
    use nbdgw::config::Cork;
    for cork in [Cork::Deferred, Cork::PerReply, Cork::Off] {
        let s = setup_with(&[], |c| c.cork = cork);
        let image = std::fs::read(&s.upstream.image).unwrap();
        let (counter, mut c) = counted_client(&s);
        // Sixteen reads in flight at once, small and large mixed.
        let reads: Vec<(u64, u64, usize)> = (0..16u64)
            .map(|i| (100 + i, i * 65536, if i % 4 == 0 { 300_000 } else { 4096 }))
            .collect();
        for &(cookie, offset, len) in &reads {
            c.send_request(0, CMD_READ, cookie, offset, len as u64, &[]);
        }
        for _ in &reads {
            let reply = c.read_reply(0);
            let &(cookie, offset, len) = reads.iter().find(|r| r.0 == reply[0].cookie).unwrap();
            let data = assemble(&reply, cookie, offset, len);
            assert!(
                data == image[offset as usize..offset as usize + len],
                "{cork:?}: wrong data for cookie {cookie}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        let before = counter.records().len();
        c.read(200, 8192, 4096);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            counter.records()[before..],
            [32 + 8 + 4096 + TLS13_OVERHEAD],
            "{cork:?}"
        );
        c.disconnect();
    }
}

#[test]
fn upstream_data_before_any_request_closes_that_connection() {
    // A fake upstream: qemu-nbd never sends unsolicited bytes.
    let env = Env::new();
    let fake = common::fake_upstream::FakeUpstream::go_then_send(
        &env.path("fake.sock"),
        1 << 20,
        b"unsolicited",
    );
    let gateway = Gateway::start(env.config(&fake.socket));
    let mut c = RawClient::tls(gateway.addr, &env.certs());
    // The GO replies themselves arrive; the stray bytes behind them end
    // the connection instead of being taken for a reply.
    c.go(ReplyMode::Simple);
    c.expect_closed();
}
