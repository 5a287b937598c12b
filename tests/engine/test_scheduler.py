"""The verifier's scheduler on its own (ciar.engine.scheduler): pure Python, driven here by hand-made requests."""

import subprocess
import sys

import pytest

from ciar.engine.scheduler import DECODE, HISTORY, PREFILL, SPAN, Request, Scheduler, SchedulerConfig, schedule


class Fake(Request):
    """A request with a fixed class and feed (a unit-test stand-in for the verifier's works)."""

    def __init__(self, kind, pending, position=0, rows=2, sid="s"):
        self._kind, self._pending, self._position, self.rows, self.session_id = kind, pending, position, rows, sid
        self.seq, self.done = 0, False

    def kind(self):
        return self._kind

    def pending(self):
        return self._pending

    def position(self):
        return self._position


def _submit(s, *requests):
    for r in requests:
        s.submit(r)
    s.start(s.take_waiting())
    return requests


def test_the_scheduler_imports_no_torch():
    code = "import sys, ciar.engine.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_classes_in_priority_order_fifo_within_a_class():
    s = Scheduler(SchedulerConfig(token_budget=10_000, max_works=10, prefill_chunk=64))
    prefill, decode1, span, history, decode2 = _submit(s, Fake(PREFILL, 120), Fake(DECODE, 1), Fake(SPAN, 5),
                                                       Fake(HISTORY, 30), Fake(DECODE, 1))
    batch = s.schedule()
    assert [p.request for p in batch] == [span, decode1, decode2, history, prefill]
    assert [p.n for p in batch] == [5, 1, 1, 30, 64]  # the first feeds all it has; later chunks <= prefill_chunk


def test_the_first_piece_takes_the_budget_and_the_others_shrink_to_it():
    s = Scheduler(SchedulerConfig(token_budget=64, max_works=8, prefill_chunk=16))
    wide, span, decode = _submit(s, Fake(SPAN, 100, position=7), Fake(SPAN, 20), Fake(DECODE, 1))
    batch = s.schedule()
    # the first span feeds 64 // 2 rows = 32 positions (from position 7: 39 keys); the second span's chunk of 16
    # (prefill_chunk) would make 4 rows x 32 > 64: it shrinks to 64 // 4 = 16; the decode: 64 // 6 = 10 >= 1
    assert [(p.request, p.n) for p in batch] == [(wide, 32), (span, 16), (decode, 1)]
    assert (batch[0].start, batch[0].keys, batch[0].rows) == (7, 39, 2)
    s = Scheduler(SchedulerConfig(token_budget=8, max_works=8, prefill_chunk=16))
    first, tall = _submit(s, Fake(SPAN, 3, rows=2), Fake(DECODE, 1, rows=8))
    assert [p.request for p in s.schedule()] == [first]  # 10 rows: 8 // 10 = 0 positions, it waits


def test_the_budget_bounds_each_joining_piece_and_max_works_caps_the_step():
    import random

    rng = random.Random(0)
    for _ in range(200):
        cfg = SchedulerConfig(token_budget=rng.choice([8, 24, 64, 1024]), max_works=rng.choice([1, 3, 64]),
                              prefill_chunk=rng.choice([1, 8, 64]))
        reqs = [Fake(rng.choice([SPAN, DECODE, HISTORY, PREFILL]), rng.choice([0, 1, 5, 9, 120]),
                     rows=rng.choice([1, 2])) for _ in range(rng.randint(1, 80))]
        for i, r in enumerate(reqs):
            r.seq = i + 1
        batch = schedule(reqs, cfg)
        assert len(batch) <= cfg.max_works and all(1 <= p.n <= p.request.pending() for p in batch)
        if batch:
            assert batch[0].n == min(batch[0].request.pending(), max(1, cfg.token_budget // batch[0].rows))
        for k, p in enumerate(batch[1:], start=1):  # a joining piece: the rows so far x its width within budget
            assert p.n <= cfg.prefill_chunk and sum(q.rows for q in batch[:k + 1]) * p.n <= cfg.token_budget
        assert bool(batch) == any(r.pending() for r in reqs)  # something ready is never left with an empty step
        kinds = [(p.kind, p.request.seq) for p in batch]
        assert kinds == sorted(kinds)  # priority order, FIFO within a class


def test_waiting_requests_and_finished_ones_are_not_scheduled():
    s = Scheduler()
    judged, done, live = _submit(s, Fake(SPAN, 0), Fake(SPAN, 3), Fake(SPAN, 2))
    done.done = True
    assert [p.request for p in s.schedule()] == [live]
    assert s.retire() == [done] and s.running == [judged, live]


def test_accounting_and_the_queues():
    s = Scheduler(SchedulerConfig(token_budget=100))
    a, b = Fake(SPAN, 5, position=10, sid="a"), Fake(PREFILL, 3, sid="b")
    s.submit(a)
    assert s.busy and s.waiting == [a] and a.seq == 1
    assert s.of_session("a") == [a] and s.drop(a) and not s.busy and not s.drop(a)
    _submit(s, a, b)
    batch = s.schedule()
    s.record(batch)
    assert s.steps == 1 and s.kind_positions == [5, 0, 0, 3]
    assert (s.real_positions, s.padded_positions) == (2 * 5 + 2 * 3, 4 * 5)
    assert s.step_log[-1] == {"works": 2, "rows": 4, "width": 5, "kinds": ["span", "prefill"],
                              "pieces": [("span", 10, 5, 2), ("prefill", 0, 3, 2)]}
    b.done = True
    s.purge()
    assert s.running == [a]
    s.clear()
    assert not s.busy


def test_schedule_is_a_pure_function_of_its_inputs():
    reqs = [Fake(SPAN, 7, rows=1), Fake(DECODE, 1), Fake(PREFILL, 50)]
    for i, r in enumerate(reqs):
        r.seq = i + 1
    cfg = SchedulerConfig(token_budget=32, max_works=4, prefill_chunk=8)
    first = [(p.request, p.n, p.start) for p in schedule(reqs, cfg)]
    assert first == [(p.request, p.n, p.start) for p in schedule(list(reversed(reqs)), cfg)]
    assert [r.pending() for r in reqs] == [7, 1, 50]  # nothing was consumed


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_config_is_checked(bad):
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(token_budget=bad)
