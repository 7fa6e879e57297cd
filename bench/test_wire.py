"""Unit tests for the capture analysis, on synthetic segments (no tshark)."""

import unittest

import wire


def record(content_type, length):
    return bytes([content_type, 3, 3]) + length.to_bytes(2, "big") + b"\xaa" * length


def segment_stream(server_bytes, cuts, request_before):
    """Server bytes cut into segments at `cuts`; a client segment before
    each segment index in `request_before`."""
    packets, seq, last = [], 1, 0
    for i, cut in enumerate([*cuts, len(server_bytes)]):
        if i in request_before:
            packets.append((False, 0, b"req"))
        packets.append((True, seq, server_bytes[last:cut]))
        seq += cut - last
        last = cut
    return packets


class Analyze(unittest.TestCase):
    def test_records_and_short_segments_per_reply(self):
        prefix = b"P" * wire.PLAINTEXT_PREFIX
        handshake = record(22, 100)
        one_record_reply = record(23, 4096 + 40 + 17)
        two_record_reply = record(23, 40 + 17) + record(23, 4096 + 17)
        stream = prefix + handshake + one_record_reply + two_record_reply
        a = len(prefix) + len(handshake)
        b = a + len(one_record_reply)
        # Reply 1 in three segments (1448, 1448, rest); reply 2 in four,
        # two of them short.
        cuts = [a, a + 1448, a + 2896, b, b + 62, b + 62 + 1448, b + 62 + 2896]
        packets = segment_stream(stream, cuts, request_before={1, 4})
        results, mss = wire.analyze([packets], 4096)
        self.assertEqual(mss, 1448)
        self.assertEqual(results, [(1, 3, 1), (2, 4, 2)])

    def test_a_stream_that_is_not_tls_is_refused(self):
        with self.assertRaises(ValueError):
            wire.record_starts(b"P" * wire.PLAINTEXT_PREFIX + b"\x99\x03\x03\x00\x01x")


if __name__ == "__main__":
    unittest.main()
