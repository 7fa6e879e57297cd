use super::*;
use proptest::prelude::*;

const MAX: usize = 512;

/// Feeds `bytes` as a reader would: exactly what `parse` asks for each
/// time. Returns the outcome and how many bytes were read.
fn feed(bytes: &[u8]) -> (Result<Header, ProxyError>, usize) {
    let mut read = 0;
    loop {
        match parse(&bytes[..read], MAX) {
            Ok(Parsed::Done(header)) => return (Ok(header), read),
            Err(e) => return (Err(e), read),
            Ok(Parsed::Incomplete { need }) => {
                assert!(need >= 1);
                if read + need > bytes.len() {
                    // The input ran out: as a reader at EOF.
                    return (Err(ProxyError::V1TooLong), read);
                }
                read += need;
            }
        }
    }
}

fn sock(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn haproxy_lines_and_headers_parse() {
    let v1 = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\nGET /";
    let (header, read) = feed(v1);
    assert_eq!(read, 47);
    assert_eq!(
        header.unwrap(),
        Header {
            version: Version::V1,
            address: Address::Proxied(sock("192.168.0.1:56324")),
            len: 47
        }
    );
    let v6 = b"PROXY TCP6 2001:db8::1 ::1 1 65535\r\n";
    assert_eq!(
        feed(v6).0.unwrap().address,
        Address::Proxied(sock("[2001:db8::1]:1"))
    );
    let unknown = b"PROXY UNKNOWN\r\n";
    assert_eq!(feed(unknown).0.unwrap().address, Address::Unknown);
    let unknown = b"PROXY UNKNOWN ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff 65535 65535\r\n";
    assert_eq!(unknown.len(), V1_MAX);
    assert_eq!(feed(unknown).0.unwrap().address, Address::Unknown);
}

#[test]
fn a_v2_local_header_skips_its_addresses_and_a_proxy_over_unix_is_unknown() {
    let mut local = V2_SIGNATURE.to_vec();
    local.extend([0x20, 0x11, 0, 12]);
    local.extend([7; 12]);
    let (header, read) = feed(&local);
    assert_eq!(read, 28);
    assert_eq!(header.unwrap().address, Address::Local);
    let mut unix = V2_SIGNATURE.to_vec();
    unix.extend([0x21, 0x31, 0, 216]);
    unix.extend([0; 216]);
    assert_eq!(feed(&unix).0.unwrap().address, Address::Unknown);
    let mut unspec = V2_SIGNATURE.to_vec();
    unspec.extend([0x21, 0x00, 0, 0]);
    assert_eq!(feed(&unspec).0.unwrap().address, Address::Unknown);
}

#[test]
fn what_the_spec_forbids_is_refused() {
    let refused: &[&[u8]] = &[
        b"PROXY TCP4 01.2.3.4 1.2.3.4 1 1\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 01 1\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 +1 1\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 65536 1\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 1 1 \r\n",
        b"PROXY TCP4  1.2.3.4 1.2.3.4 1 1\r\n",
        b"PROXY TCP4 1.2.3.256 1.2.3.4 1 1\r\n",
        b"PROXY TCP4 ::1 ::1 1 1\r\n..........",
        b"PROXY TCP6 ::ffff:1.2.3.4 ::1 1 1\r\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 1 1\n",
        b"PROXY TCP4 1.2.3.4 1.2.3.4 1 1\r\r\n",
        b"PROXY UDP4 1.2.3.4 1.2.3.4 1 1\r\n",
        b"proxy TCP4 1.2.3.4 1.2.3.4 1 1\r\n",
        b"\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
    ];
    for bytes in refused {
        assert!(
            feed(bytes).0.is_err(),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    let mut long = b"PROXY UNKNOWN ".to_vec();
    long.resize(200, b'f');
    assert_eq!(feed(&long).0, Err(ProxyError::V1TooLong));
    for (ver_cmd, family, error) in [
        (0x11, 0x11, ProxyError::V2Version(1)),
        (0x22, 0x11, ProxyError::V2Command(2)),
        (0x21, 0x41, ProxyError::V2Family(0x41)),
        (0x21, 0x13, ProxyError::V2Family(0x13)),
    ] {
        let mut h = V2_SIGNATURE.to_vec();
        h.extend([ver_cmd, family, 0, 12]);
        h.extend([0; 12]);
        assert_eq!(feed(&h).0, Err(error));
    }
    let mut short = V2_SIGNATURE.to_vec();
    short.extend([0x21, 0x21, 0, 12]);
    short.extend([0; 12]);
    assert_eq!(feed(&short).0, Err(ProxyError::V2Short { length: 12 }));
    let mut huge = V2_SIGNATURE.to_vec();
    huge.extend([0x21, 0x11, 0xff, 0xff]);
    assert_eq!(
        feed(&huge).0,
        Err(ProxyError::V2TooLong {
            length: 65535,
            limit: MAX
        })
    );
}

fn address() -> impl Strategy<Value = (SocketAddr, SocketAddr)> {
    prop_oneof![
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(s, d, sp, dp)| (
                SocketAddr::from((Ipv4Addr::from(s), sp)),
                SocketAddr::from((Ipv4Addr::from(d), dp))
            )),
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(s, d, sp, dp)| (
                SocketAddr::from((Ipv6Addr::from(s), sp)),
                SocketAddr::from((Ipv6Addr::from(d), dp))
            )),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Read exactly as asked, a header is read to its last byte and not
    /// one further, whatever follows it, and gives the source it carries.
    #[test]
    fn a_header_is_read_exactly_to_its_end(
        (source, dest) in address(),
        v2 in any::<bool>(),
        tlvs in proptest::collection::vec(any::<u8>(), 0..64),
        after in proptest::collection::vec(any::<u8>(), 0..128),
    ) {
        let mut bytes = match v2 {
            true => encode_v2(source, dest, &tlvs),
            false => encode_v1(source, dest),
        };
        let len = bytes.len();
        bytes.extend(&after);
        let (header, read) = feed(&bytes);
        let header = header.unwrap();
        prop_assert_eq!(read, len);
        prop_assert_eq!(header.len, len);
        prop_assert_eq!(header.address, Address::Proxied(source));
        prop_assert_eq!(header.version, if v2 { Version::V2 } else { Version::V1 });
    }

    /// Any prefix of a header asks for more and never for more than the
    /// header still has.
    #[test]
    fn a_prefix_asks_for_no_more_than_the_rest(
        (source, dest) in address(),
        v2 in any::<bool>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = match v2 {
            true => encode_v2(source, dest, &[]),
            false => encode_v1(source, dest),
        };
        let at = cut.index(bytes.len());
        match parse(&bytes[..at], MAX) {
            Ok(Parsed::Incomplete { need }) => {
                prop_assert!(need >= 1 && at + need <= bytes.len());
            }
            other => prop_assert!(false, "{:?} at {}", other, at),
        }
    }

    /// Arbitrary bytes: no panic, and a decision within the bounds (107
    /// bytes for v1, 16 plus the limit for v2).
    #[test]
    fn any_bytes_are_decided_within_the_bounds(
        start in prop_oneof![Just(b"PROXY ".to_vec()), Just(V2_SIGNATURE.to_vec()), Just(Vec::new())],
        rest in proptest::collection::vec(any::<u8>(), 0..700),
    ) {
        let mut bytes = start;
        bytes.extend(rest);
        let mut read = 0;
        loop {
            match parse(&bytes[..read], MAX) {
                Ok(Parsed::Incomplete { need }) => {
                    prop_assert!(need >= 1);
                    read += need;
                    prop_assert!(read <= (V2_PREFIX + MAX).max(V1_MAX));
                    if read > bytes.len() {
                        break;
                    }
                }
                Ok(Parsed::Done(h)) => {
                    prop_assert!(h.len <= read);
                    break;
                }
                Err(_) => break,
            }
        }
    }
}
