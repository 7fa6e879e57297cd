"""Unit tests for the benchmark's ordering of front ends."""

import unittest

import run


class Rotation(unittest.TestCase):
    NAMES = ["nbdgw", "variant", "qemu-nbd-tls", "nbdkit-proxy", "qemu-nbd-tcp", "unix"]

    def test_each_order_is_every_front_end_once(self):
        for rep in range(3):
            for index in range(15):
                order = run.rotation(self.NAMES, rep, 3, index)
                self.assertEqual(sorted(order), sorted(self.NAMES))

    def test_no_front_end_is_first_in_every_rep(self):
        for index in range(15):
            firsts = {run.rotation(self.NAMES, rep, 3, index)[0] for rep in range(3)}
            self.assertEqual(len(firsts), 3, f"workload {index}: {firsts}")

    def test_one_rep_still_turns_with_the_workload(self):
        firsts = {run.rotation(self.NAMES, 0, 1, index)[0] for index in range(6)}
        self.assertEqual(firsts, set(self.NAMES))


if __name__ == "__main__":
    unittest.main()
