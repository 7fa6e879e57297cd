"""TLS records and TCP segments per reply, from a packet capture.

tshark gives each data segment of the capture (stream, direction, relative
sequence number, payload). The server's byte stream is rebuilt per
connection; TLS record boundaries are found by walking record headers from
the end of the plaintext NBD prefix; and segments are grouped into replies
by the client's requests between them (the workloads captured are QD1, so
every server burst between two client segments is one reply).
"""

import subprocess
from collections import defaultdict

# Greeting (18 bytes) and the ACK to STARTTLS (20 bytes): what every front
# end sends in plaintext before its first TLS record to a libnbd client.
PLAINTEXT_PREFIX = 18 + 20


def segments(pcap, server_port):
    """Yields (stream, from_server, seq, payload) for every data segment."""
    out = subprocess.run(
        ["tshark", "-r", pcap, "-o", "tcp.desegment_tcp_streams:FALSE",
         "-Y", "tcp.len > 0", "-T", "fields",
         "-e", "tcp.stream", "-e", "tcp.srcport", "-e", "tcp.seq", "-e", "tcp.payload"],
        check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        stream, srcport, seq, payload = line.split("\t")
        yield int(stream), int(srcport) == server_port, int(seq), bytes.fromhex(payload.replace(":", ""))


def record_starts(stream_bytes):
    """Offsets where TLS records start, walking headers from the prefix."""
    starts = []
    at = PLAINTEXT_PREFIX
    while at + 5 <= len(stream_bytes):
        content_type = stream_bytes[at]
        if content_type not in (20, 21, 22, 23) or stream_bytes[at + 1] != 3:
            raise ValueError(f"no TLS record header at stream offset {at}")
        starts.append(at)
        at += 5 + int.from_bytes(stream_bytes[at + 3:at + 5], "big")
    return starts


def replies(pcap, server_port, reply_len):
    """Per reply of about `reply_len` payload bytes: (records, segments,
    segments shorter than the largest segment seen, i.e. the MSS)."""
    by_stream = defaultdict(list)
    for stream, from_server, seq, payload in segments(pcap, server_port):
        by_stream[stream].append((from_server, seq, payload))
    return analyze(by_stream.values(), reply_len)


def analyze(streams, reply_len):
    """`streams`: per connection, its data segments in capture order as
    (from_server, relative seq, payload). Returns (per-reply tuples, MSS)."""
    mss = max((len(p) for packets in streams for f, _, p in packets if f), default=0)
    results = []
    for packets in streams:
        server = {}
        for from_server, seq, payload in packets:
            if from_server:
                server.setdefault(seq, payload)  # retransmissions: first copy
        data = bytearray()
        for seq in sorted(server):
            if seq == len(data) + 1:  # relative sequence numbers start at 1
                data += server[seq]
        starts = record_starts(bytes(data))
        # A QD1 reply: the server's segments between two client segments.
        groups, current = [], []
        for from_server, seq, payload in packets:
            if from_server:
                current.append((seq - 1, len(payload)))
            elif current:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
        for group in groups:
            first = group[0][0]
            end = group[-1][0] + group[-1][1]
            # Only the read replies: payload plus framing and TLS overhead.
            if not reply_len <= end - first <= reply_len + reply_len // 16 + 512:
                continue
            records = sum(1 for s in starts if first <= s < end)
            short = sum(1 for _, n in group if n < mss)
            results.append((records, len(group), short))
    return results, mss


def summarize(results):
    if not results:
        return {"replies": 0}
    records = sorted(r[0] for r in results)
    segs = sorted(r[1] for r in results)
    return {
        "replies": len(results),
        "records_median": records[len(records) // 2],
        "records_max": records[-1],
        "segments_median": segs[len(segs) // 2],
        "replies_with_2plus_short_segments": sum(1 for r in results if r[2] > 1),
    }
