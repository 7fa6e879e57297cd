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


class Placements(unittest.TestCase):
    def test_the_client_runs_where_the_placement_says(self):
        cmd = ["qemu-io", "-c", "read 0 4096"]
        self.assertEqual(run.on_cpu("free", cmd), cmd)
        self.assertEqual(run.on_cpu("one", cmd), ["taskset", "-c", "0", *cmd])
        self.assertEqual(run.on_cpu("split", cmd), ["taskset", "-c", "1", *cmd])


class WhoRunsWhat(unittest.TestCase):
    def test_cached_front_ends_run_only_the_reads_a_cache_is_for(self):
        for name in run.CACHED_FRONTS:
            ran = {w for w in run.WORKLOADS if run.runs(w, name, set())}
            self.assertEqual(ran, run.CACHE_WORKLOADS)

    def test_storms_and_handshakes_run_on_tls_front_ends_and_variants_only(self):
        for w in [*run.STORMS, *run.TLS_ONLY]:
            self.assertTrue(run.runs(w, "nbdgw", set()))
            self.assertTrue(run.runs(w, "nbdgw-nocork", {"nbdgw-nocork"}))
            self.assertFalse(run.runs(w, "qemu-nbd-tcp", set()))
            self.assertFalse(run.runs(w, "unix", set()))

    def test_a_metric_only_one_front_end_has_gets_its_column(self):
        results = {("boot storm 8", "nbdgw"): [{"ms": 2.0}],
                   ("boot storm 8", "nbdgw-cached"): [{"ms": 1.0, "upstream reads/req": 0.1}],
                   ("boot storm 8", "qemu-nbd-tls"): [{"ms": 4.0}]}
        text, medians = run.table(results, ["nbdgw", "qemu-nbd-tls", "nbdgw-cached"])
        self.assertIn("| ms | vs qemu-nbd-tls | upstream reads/req | vs qemu-nbd-tls |", text)
        self.assertIn("| nbdgw | 2.00 (2.00-2.00) | 0.50x | - | - |", text)
        self.assertIn("| nbdgw-cached | 1.00 (1.00-1.00) | 0.25x | 0.100 (0.100-0.100) | - |", text)
        self.assertEqual(medians[("boot storm 8", "nbdgw-cached", "upstream reads/req")], 0.1)

    def test_a_cached_variant_runs_only_the_cached_rows(self):
        name = "nbdgw-before-cached"
        ran = {w for w in run.WORKLOADS if run.runs(w, name, {name})}
        self.assertEqual(ran, run.CACHE_WORKLOADS)
        # A plain variant of another binary still runs every TLS row.
        self.assertTrue(run.runs("seq read", "nbdgw-before", {"nbdgw-before"}))
        self.assertFalse(run.is_cached("nbdgw-before"))

    def test_fio_never_reaches_the_root_owned_socket(self):
        for w in run.NOT_UNIX:
            self.assertFalse(run.runs(w, "unix", set()))
            self.assertTrue(run.runs(w, "qemu-nbd-tcp", set()))


if __name__ == "__main__":
    unittest.main()
