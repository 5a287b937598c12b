"""ciar.engine.heap: an engine process's start-up frozen out of the cyclic collector's reach, its pauses counted."""

import gc

import pytest

from ciar.engine import heap


@pytest.fixture
def frozen():
    """heap.freeze() in this test's process, undone after (the rest of the suite's process keeps its collector)."""
    lines = []
    n = heap.freeze(log=lambda fmt, *args: lines.append(fmt % args))
    try:
        yield n, lines
    finally:
        heap.unfreeze()


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_moves_the_heap_out_of_reach_and_collections_still_free_new_cycles(frozen):
    n, lines = frozen
    assert n > 1000 and "heap frozen" in lines[0] and f"{n} objects" in lines[0]
    before = heap.stats()  # (frozen objects that reference counting frees since leave the count)
    assert 1000 < before["frozen"] <= n and len(before["collections"]) == 3
    cycles = [_Cycle() for _ in range(100)]  # made after the freeze: the collector still walks these
    del cycles
    assert gc.collect() >= 100  # ... and frees them
    after = heap.stats()
    assert after["pauses"][2] == before["pauses"][2] + 1  # that full collection was timed
    assert after["pause_max_ms"][2] >= 0.0 and after["pause_total_ms"][2] >= before["pause_total_ms"][2]
    assert after["collections"][2] == before["collections"][2] + 1
    assert after["frozen"] <= before["frozen"]  # nothing new was frozen by collecting


def test_freezing_twice_times_collections_once(frozen):
    n, _ = frozen
    heap.freeze(log=lambda *a: None)
    assert gc.callbacks.count(heap._on_gc) == 1 and gc.get_freeze_count() >= n


def test_unfreeze_gives_the_heap_back_and_stops_timing():
    heap.freeze(log=lambda *a: None)
    heap.unfreeze()
    assert gc.get_freeze_count() == 0 and heap._on_gc not in gc.callbacks


def test_stats_while_collections_run_inside_it(frozen):
    """`stats` allocates while it holds the pause table's lock, and a collection started by one of those allocations
    ends in `_on_gc`, on the same thread, which takes that lock too. With a collection on nearly every allocation
    (threshold 1) every call meets it. A plain Lock hung there for good: a Verifier replica's `stats` call (the
    capacity, soak and reliability runs') never answered, and its process collected nothing more. Run on a thread, so
    that a hang fails this test instead of the suite."""
    import threading

    thresholds = gc.get_threshold()
    answered = []
    gc.set_threshold(1)
    try:
        t = threading.Thread(target=lambda: answered.extend(heap.stats() for _ in range(200)), daemon=True)
        t.start()
        t.join(120)  # a hang guard, not a time limit: 200 calls take milliseconds
    finally:
        gc.set_threshold(*thresholds)
    assert not t.is_alive(), "heap.stats() deadlocked against a collection that started inside it"
    assert len(answered) == 200 and answered[-1]["pauses"][0] > answered[0]["pauses"][0]  # collections were timed


_FAULTS = """
import resource, sys, torch
from ciar.engine import heap
torch.set_num_threads(1)
kept = heap.keep_freed_memory(log=lambda *a: None) if sys.argv[1] == "keep" else None
faults = 0
for step in range(20):  # a judge's guidance and softmax over 640 rows of LlamaGen's 16,384 codes: 40 MiB tensors
    c, u = torch.randn(640, 16384), torch.randn(640, 16384)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = torch.softmax(u + (c - u) * 7.5, -1)
    faults += (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) if step >= 4 else 0
print(kept, faults)
"""


def test_keep_freed_memory_stops_the_steps_faulting_their_tensors_in_again():
    """40 MiB tensors made and freed step after step, as a judge's are at 128 sessions of LlamaGen's vocabulary: glibc
    maps each such block apart and unmaps it when freed (past its largest threshold, 32 MiB), so every step faults
    its tensors' pages in again (40,964 faults a step, on the box this was written on); kept, the heap hands its
    blocks out again, and faults only where it grows to a new high-water mark (a few tensors' pages in all, mostly in
    the first steps). Each in a fresh process (the setting is the process's). Page faults are counted, not timed."""
    import subprocess
    import sys

    runs = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        kept, faults = out.stdout.split()
        runs[mode] = (kept, int(faults))
    if runs["keep"][0] != "True":
        pytest.skip("the C library is not glibc: no mallopt to set")
    assert runs["default"][0] == "None"
    pages = 640 * 16384 * 4 // 4096  # one tensor's pages
    assert 16 * pages <= runs["default"][1], runs  # each of the 16 steps counted faults a tensor in, at least
    assert runs["keep"][1] < runs["default"][1] / 4, runs
