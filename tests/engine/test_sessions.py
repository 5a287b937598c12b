"""The verifier's session table (ciar.engine.sessions): slots taken and freed, lookups, idle expiry, capacity; the
verifier's use of it is covered by test_recovery.py and test_engine.py."""

import time

import pytest

from ciar.collab.protocol import CapacityError, OpenRequest, SessionError, SessionLostError
from ciar.engine.sessions import SessionTable, slots_needed
from ciar.decoding.sampling import SamplingParams

CFG, PLAIN = SamplingParams(cfg_scale=2.0), SamplingParams()


class Cache:
    def __init__(self):
        self.resets = []

    def reset(self, slots):
        self.resets.append(list(slots))


def req(sid: str, sampling=CFG, seed: int = 0) -> OpenRequest:
    return OpenRequest(sid, "a red circle", seed, sampling, 0)


def test_open_get_close():
    cache = Cache()
    t = SessionTable(cache, max_sessions=2)
    a = t.open(req("a", seed=7))
    b = t.open(req("b", PLAIN))
    assert (a.slots, b.slots, t.free_slots) == ([0, 1], [2], [3])
    assert slots_needed(req("a")) == 2 and slots_needed(req("b", PLAIN)) == 1
    assert t.get("a") is a and "a" in t and len(t) == 2 and a.seed == 7 and a.tokens == []
    with pytest.raises(SessionError, match="already open"):
        t.open(req("a"))
    t.close("a")
    assert cache.resets == [[0, 1]] and sorted(t.free_slots) == [0, 1, 3]
    with pytest.raises(SessionLostError) as e:
        t.get("a")
    assert e.value.session_id == "a"
    t.close("a")  # closing a session that is not open does nothing
    assert cache.resets == [[0, 1]]


def test_capacity_and_idle_eviction_least_recently_used_first():
    t = SessionTable(Cache(), max_sessions=3, idle_timeout_s=5.0)  # 6 slots
    t.open(req("a"))
    t.open(req("busy")).work = object()  # a request in flight: never idle
    t.open(req("c", PLAIN))
    t.open(req("d", PLAIN))
    t.sessions["a"].last_used -= 20
    t.sessions["c"].last_used -= 10
    t.sessions["busy"].last_used -= 30
    t.open(req("e"))  # 2 slots: the least recently used idle session ("a") goes, and only it
    assert set(t.sessions) == {"busy", "c", "d", "e"}
    t.open(req("f", PLAIN))  # then "c"; "d" has not been idle for 5 s
    assert set(t.sessions) == {"busy", "d", "e", "f"}
    with pytest.raises(CapacityError, match="verifier full"):
        t.open(req("g", PLAIN))
    assert set(t.sessions) == {"busy", "d", "e", "f"}
    strict = SessionTable(Cache(), max_sessions=1)  # no idle timeout: nothing is evicted on demand
    strict.open(req("a"))
    strict.sessions["a"].last_used -= 1e6
    with pytest.raises(CapacityError):
        strict.open(req("b"))
    assert set(strict.sessions) == {"a"}


def test_evict_idle_closes_only_idle_sessions():
    t = SessionTable(Cache(), max_sessions=3)
    for sid in "abc":
        t.open(req(sid, PLAIN))
    t.sessions["a"].last_used -= 100
    t.sessions["b"].last_used -= 100
    t.sessions["b"].work = object()
    assert t.evict_idle(50.0) == ["a"] and set(t.sessions) == {"b", "c"}
    assert t.evict_idle(1e9) == []
