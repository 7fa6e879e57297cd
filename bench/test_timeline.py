"""Unit tests for bench/timeline.py's reading of a trace: a made-up
`perf script` of two QD1 requests through a relay, cut into steps."""

import os
import tempfile
import unittest

import timeline

CLIENT, FRONT, UPSTREAM = 100, 200, 300
T0 = 1000.0  # seconds, as perf script prints them


def call(lines, comm, tid, cpu, us, nr, fd, ret, took=1):
    at = T0 + us / 1e6
    lines.append(f"{comm:>16} {tid:6} [{cpu:03}] {at:.6f}: raw_syscalls:sys_enter: NR {nr} ({fd:x}, 0, 0, 0, 0, 0)")
    lines.append(f"{comm:>16} {tid:6} [{cpu:03}] {at + took / 1e6:.6f}:  raw_syscalls:sys_exit: NR {nr} = {ret}")


def woken(lines, tid, cpu, us, ran_us):
    lines.append(f"{'swapper':>16} {0:6} [{cpu:03}] {T0 + us / 1e6:.6f}: sched:sched_wakeup: "
                 f"comm=x pid={tid} prio=120 target_cpu={cpu:03}")
    lines.append(f"{'swapper':>16} {0:6} [{cpu:03}] {T0 + ran_us / 1e6:.6f}: sched:sched_switch: "
                 f"prev_comm=swapper prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=x next_pid={tid} "
                 f"next_prio=120")


def request(lines, t):
    """One request at t us: sendmsg 46, recvfrom 45, sendto 44, recvmsg 47,
    writev 20, epoll_wait 232; the client on CPU 0, the relay on CPU 1."""
    call(lines, "qemu-io", CLIENT, 0, t, 46, 4, 54, took=3)           # client sends at t
    call(lines, "qemu-io", CLIENT, 0, t + 4, 47, 4, -11)              # finds nothing yet
    call(lines, "tokio", FRONT, 1, t - 20, 232, 4, 1, took=28)        # relay slept until t+8
    woken(lines, FRONT, 1, t + 2, t + 7)
    call(lines, "tokio", FRONT, 1, t + 9, 45, 10, 54, took=1)         # has it at t+10
    call(lines, "tokio", FRONT, 1, t + 12, 44, 12, 32, took=2)        # sent upstream at t+12
    call(lines, "qemu-nbd", UPSTREAM, 0, t + 20, 47, 5, 32, took=1)   # upstream has it at t+21
    call(lines, "qemu-nbd", UPSTREAM, 0, t + 25, 46, 5, 4136, took=2)  # answers at t+25
    call(lines, "tokio", FRONT, 1, t + 30, 45, 12, 4136, took=1)      # has the reply at t+31
    call(lines, "tokio", FRONT, 1, t + 35, 20, 10, 4158, took=5)      # answers at t+35
    call(lines, "qemu-io", CLIENT, 0, t + 45, 47, 4, 5, took=1)
    call(lines, "qemu-io", CLIENT, 0, t + 47, 47, 4, 4153, took=2)    # has it at t+49


RELAYED = {"client": ({CLIENT}, {4: "tcp"}),
           "front": ({FRONT}, {10: "tcp", 12: "unix"}),
           "upstream": ({UPSTREAM}, {5: "unix"})}


def cut(lines, roles):
    """The reads timeline.steps finds in these perf script lines."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        trace = timeline.Trace(f.name)
    finally:
        os.unlink(f.name)
    return timeline.steps(trace, roles)


class Steps(unittest.TestCase):
    def cut(self, requests):
        lines = []
        for i in range(requests):
            request(lines, 100 + 200 * i)
        return cut(lines, RELAYED)

    def test_each_step_is_cut_at_the_call_that_moves_the_request(self):
        reqs = self.cut(3)
        self.assertEqual(len(reqs), 2)  # the last has no next request to end it
        r = reqs[0]
        got = {k: round(r[k] - r["client sends"], 3) for k in timeline.ORDER if k in r}
        self.assertEqual(got, {"client sends": 0, "front has it": 10, "sent upstream": 12,
                               "upstream has it": 21, "upstream answers": 25, "front has reply": 31,
                               "front answers": 35, "reply sent": 40, "client has it": 49,
                               "next request": 200})

    def test_wake_ups_and_placement_are_counted(self):
        med, counts = timeline.summarise(self.cut(3))
        self.assertEqual(med["front (request) woken -> runs"][0], 5)
        self.assertEqual(med["client's send call, front end on the other CPU"][0], 3)
        self.assertEqual(med["front end's last reply write, client on the other CPU"][0], 5)
        self.assertEqual(med["request (client sends -> client has it)"], (49, 49, 2))
        self.assertEqual(counts["front end read the request on the client's CPU"], 0)
        self.assertEqual(counts["client EAGAIN"], 1)
        self.assertEqual(counts["front slept"], 1)  # the 28 us epoll_wait

    def test_a_request_with_an_event_missing_is_left_out(self):
        lines = []
        request(lines, 100)
        request(lines, 300)
        request(lines, 500)
        # perf lost the upstream's read of the first request
        lines = [ln for ln in lines if not (f" {UPSTREAM:6} " in ln and "NR 47" in ln and "1000.00012" in ln)]
        reqs = cut(lines, RELAYED)
        self.assertEqual([round(r["client sends"] - T0 * 1e6) for r in reqs], [300])


def corked(lines, t):
    """A server with TLS built in (no upstream) that sends a reply as
    three records under TCP_CORK: setsockopt 54 on, sendmsg x3, off."""
    call(lines, "qemu-io", CLIENT, 0, t, 46, 4, 54, took=3)
    call(lines, "qemu-nbd", FRONT, 1, t + 8, 47, 5, 54, took=1)          # has it at t+9
    call(lines, "qemu-nbd", FRONT, 1, t + 10, 54, 5, 0, took=1)
    call(lines, "qemu-nbd", FRONT, 1, t + 12, 46, 5, 42, took=1)         # answers at t+12
    call(lines, "qemu-nbd", FRONT, 1, t + 14, 46, 5, 30, took=1)
    call(lines, "qemu-nbd", FRONT, 1, t + 16, 46, 5, 4118, took=30)
    call(lines, "qemu-nbd", FRONT, 1, t + 47, 54, 5, 0, took=3)          # uncorked at t+50
    call(lines, "qemu-io", CLIENT, 0, t + 55, 47, 4, 4190, took=2)       # has it at t+57


class NoUpstream(unittest.TestCase):
    def test_a_corked_reply_is_sent_when_its_last_write_or_uncork_ends(self):
        lines = []
        # The negotiation: small writes both ways, no 4 KiB reply.
        call(lines, "qemu-io", CLIENT, 0, 10, 46, 4, 392)
        call(lines, "qemu-nbd", FRONT, 1, 15, 47, 5, 392)
        call(lines, "qemu-nbd", FRONT, 1, 20, 46, 5, 612)
        call(lines, "qemu-io", CLIENT, 0, 30, 47, 4, 612)
        for i in range(3):
            corked(lines, 100 + 200 * i)
        reqs = cut(lines, {"client": ({CLIENT}, {4: "tcp"}), "front": ({FRONT}, {5: "tcp"})})
        self.assertEqual(len(reqs), 2)  # the negotiation is not a read
        r = reqs[0]
        got = {k: round(r[k] - r["client sends"], 3) for k in timeline.ORDER if k in r}
        self.assertEqual(got, {"client sends": 0, "front has it": 9, "front answers": 12, "reply sent": 50,
                               "client has it": 57, "next request": 200})
        med, counts = timeline.summarise(reqs)
        self.assertEqual(med["front end's last reply write, client on the other CPU"][0], 30)
        self.assertEqual(counts["front setsockopt"], 2)


if __name__ == "__main__":
    unittest.main()
