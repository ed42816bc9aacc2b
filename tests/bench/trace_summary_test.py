#!/usr/bin/env python3
"""bench/trace_summary.py: self times subtract nested children on one thread only, and the GPU's
busy time is the union of its kernels' intervals across streams, not their sum."""
import importlib.util
import pathlib
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "bench" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)


def op(name, ts, dur, tid=0, cat="cpu_op"):
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": tid}


class SelfTimes(unittest.TestCase):
    def test_children_are_subtracted_from_their_parent_only(self):
        # step [0, 100): mm [10, 40) holding copy [15, 25); add [50, 60); then add [100, 105).
        ops = [(0, 100, "step"), (10, 30, "mm"), (15, 10, "copy"), (50, 10, "add"),
               (100, 5, "add")]
        got = {k: tuple(v) for k, v in trace_summary.self_times(ops).items()}
        self.assertEqual(got, {"step": (60.0, 1), "mm": (20.0, 1), "copy": (10.0, 1),
                               "add": (15.0, 2)})
        # The total of self times is the busy time of the thread: 105 µs.
        self.assertEqual(sum(v[0] for v in got.values()), 105.0)

    def test_equal_starts_and_empty_events_nest_under_the_longer(self):
        # step and mm both start at 0; a zero-length mark sits at mm's end.
        ops = [(0, 10, "mm"), (0, 50, "step"), (10, 0, "mark"), (10, 5, "add")]
        got = {k: tuple(v) for k, v in trace_summary.self_times(ops).items()}
        self.assertEqual(got, {"step": (35.0, 1), "mm": (10.0, 1), "mark": (0.0, 1),
                               "add": (5.0, 1)})

    def test_a_child_past_its_parents_end_counts_to_that_end(self):
        # copy is reported ending at 12, after mm's end at 10 (clocks read apart).
        ops = [(0, 100, "step"), (0, 10, "mm"), (5, 7, "copy"), (20, 5, "add")]
        got = {k: tuple(v) for k, v in trace_summary.self_times(ops).items()}
        self.assertEqual(got, {"step": (85.0, 1), "mm": (5.0, 1), "copy": (5.0, 1),
                               "add": (5.0, 1)})

    def test_a_broken_nesting_is_seen(self):
        # Control: ignoring nesting (the sum of durations) counts copy twice.
        ops = [(0, 100, "step"), (10, 30, "mm"), (15, 10, "copy")]
        self.assertNotEqual(sum(d for _, d, _ in ops),
                            sum(v[0] for v in trace_summary.self_times(ops).values()))

    def test_threads_nest_separately(self):
        events = [op("a", 0, 100, tid=1), op("b", 10, 50, tid=2)]
        lines = "\n".join(trace_summary.summarize(events, 10))
        self.assertIn("| a | 0.100 | 1 |", lines)
        self.assertIn("| b | 0.050 | 1 |", lines)


class GpuBusy(unittest.TestCase):
    def test_union_of_overlapping_streams(self):
        self.assertEqual(trace_summary.union_us([(0, 10), (5, 20), (30, 40), (32, 35)]), 30.0)
        self.assertEqual(trace_summary.union_us([]), 0.0)

    def test_summary_reports_busy_share(self):
        events = [op("launch", 0, 200), op("k1", 0, 50, cat="kernel"),
                  op("k2", 25, 50, cat="kernel"), op("k1", 150, 50, cat="kernel")]
        lines = "\n".join(trace_summary.summarize(events, 10))
        self.assertIn("GPU busy 0.125 ms of the span (62.5%), 3 kernels", lines)
        self.assertIn("| k1 | 0.100 | 2 | 80.0% |", lines)
        # Control: the kernels' summed time (150 µs) is not what is reported as busy.
        self.assertNotIn("GPU busy 0.150", lines)


if __name__ == "__main__":
    unittest.main()
