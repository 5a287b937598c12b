"""KV-cache slots: sized by memory ("auto"), and when every slot is taken an open queues, then is refused with a
CapacityError (503 + Retry-After at the API) - never an out-of-memory error."""

import asyncio
import time

import pytest
import torch

from ciar.collab.protocol import CapacityError, OpenRequest
from ciar.engine.runner import AUTO_CPU_SESSIONS, memory_plan, plan_sessions, slot_bytes
from ciar.engine.service import VerifierService, session_token
from ciar.engine.verifier import CloudVerifier
from ciar.decoding.sampling import SamplingParams

PARAMS = SamplingParams(cfg_scale=2.0, temperature=1.0)


def _open(sid, seed=0):
    return OpenRequest(sid, "a small red circle", seed=seed, sampling=PARAMS, prefix_len=2)


def test_slot_bytes_is_what_the_cache_allocates(tiny_cloud):
    cache = tiny_cloud.new_cache(3)
    assert 3 * slot_bytes(tiny_cloud) == cache.memory_bytes() + cache.key_valid.numel()
    valid = cache.key_valid.shape[1]  # one bool per position, whatever the dtype
    assert (slot_bytes(tiny_cloud, torch.bfloat16) - valid) * 2 == slot_bytes(tiny_cloud) - valid


def test_the_sizing_rule():
    gib = 2**30
    # 80 GiB x 0.9 = 72 GiB - 4 GiB weights in use - 2 GiB activations = 66 GiB over 144 MiB sessions -> 469
    plan = memory_plan("gpu", 80 * gib, 4 * gib, 2 * gib, 0.9, 144 * 2**20)
    assert plan.sessions == (int(80 * gib * 0.9) - 6 * gib) // (144 * 2**20) == 469
    with pytest.raises(RuntimeError, match="no room for a KV cache.*raise the memory utilization"):
        memory_plan("gpu", 24 * gib, 20 * gib, 2 * gib, 0.9, 144 * 2**20)
    with pytest.raises(ValueError, match="utilization"):
        plan_sessions(torch.nn.Linear(1, 1), 1024, 128, utilization=1.5)


def test_auto_on_a_cpu_is_a_fixed_count_and_a_count_wins(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions="auto")
    assert v.table.max_sessions == AUTO_CPU_SESSIONS and "no accelerator" in v.memory.how
    assert CloudVerifier(tiny_cloud, stub_text, max_sessions=3).table.max_sessions == 3
    for bad in (0, "all", 2.5, True):
        with pytest.raises(ValueError, match="max_sessions"):
            CloudVerifier(tiny_cloud, stub_text, max_sessions=bad)


def _until(cond, what):
    for _ in range(3000):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(what)


@torch.no_grad()
@pytest.mark.parametrize("engine_thread", [True, False], ids=["thread", "loop"])
def test_a_full_verifier_queues_opens_in_order_then_refuses(tiny_cloud, stub_text, engine_thread):
    """One session's slots, three devices: the second and third OPEN wait (parked, not failed); each CLOSE gives
    the freed slot to the longest waiting; an OPEN that waits past slot_wait_s is refused with a CapacityError that
    says how long it waited. Nothing runs out of memory: the cache never grows. The same with the engine on its own
thread (the Verifier's) and on the caller's loop (`AsyncStepper`)."""
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1, slot_wait_s=60.0)
    slots = v.cache.slots
    service = VerifierService(v, "s", engine_thread=engine_thread)

    async def run():
        first, _ = await service.open(_open("a"), session_id="a", device_id="d")
        second = asyncio.ensure_future(service.open(_open("b", 1), session_id="b", device_id="d"))
        await asyncio.to_thread(_until, lambda: len(v.engine.scheduler.parked) == 1, "the second open parks")
        third = asyncio.ensure_future(service.open(_open("c", 2), session_id="c", device_id="d"))
        await asyncio.to_thread(_until, lambda: len(v.engine.scheduler.parked) == 2, "the third open parks")
        assert not second.done() and not third.done()
        await service.close(session_id="a", device_id="d", token=session_token("s", "a", "d"))
        b, _ = await asyncio.wait_for(second, 30)  # the longest waiting gets the slot
        assert not third.done() and set(v.sessions) == {"b"}
        await service.close(session_id="b", device_id="d", token=session_token("s", "b", "d"))
        c, _ = await asyncio.wait_for(third, 30)
        assert len(first.prefix_tokens) == len(b.prefix_tokens) == len(c.prefix_tokens) == 2
        alone = CloudVerifier(tiny_cloud, stub_text, max_sessions=1)
        assert c.prefix_tokens.tolist() == alone.open_batch([_open("c", 2)])[0].prefix_tokens.tolist()
        # nobody frees a slot: the wait ends in a refusal (the engine thread wakes for the deadline by itself)
        v.slot_wait_s = 0.3
        with pytest.raises(CapacityError, match=r"verifier full.*waited \d"):
            await asyncio.wait_for(service.open(_open("d", 3), session_id="d", device_id="d"), 30)
        assert not v.engine.scheduler.parked and set(v.sessions) == {"c"}

    try:
        asyncio.run(run())
    finally:
        service.shutdown()
    assert v.cache.slots == slots


@torch.no_grad()
def test_a_parked_open_whose_caller_goes_away_is_dropped(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1, slot_wait_s=60.0)
    service = VerifierService(v, "s")

    async def run():
        await service.open(_open("a"), session_id="a", device_id="d")
        waiting = asyncio.ensure_future(service.open(_open("b", 1), session_id="b", device_id="d"))
        await asyncio.to_thread(_until, lambda: v.engine.scheduler.parked, "the open parks")
        waiting.cancel()
        await asyncio.to_thread(_until, lambda: not v.engine.scheduler.parked, "the withdrawn open leaves")
        await service.close(session_id="a", device_id="d", token=session_token("s", "a", "d"))
        await service.stepper.settled()
        assert v.num_sessions == 0  # the withdrawn open never took the freed slot

    try:
        asyncio.run(run())
    finally:
        service.shutdown()


def test_the_synchronous_batch_api_refuses_at_once(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1, slot_wait_s=60.0)
    v.open_batch([_open("a")])
    with pytest.raises(CapacityError, match="verifier full"):  # it reserves before it queues: nothing to wait on
        v.open_batch([_open("b")])


def test_a_synchronous_run_waits_for_the_slot_deadline_without_spinning(tiny_cloud, stub_text):
    v = CloudVerifier(tiny_cloud, stub_text, max_sessions=1, slot_wait_s=0.2)
    v.open_batch([_open("a")])
    w = v.submit_open(_open("b"))  # queued with a deadline: parks, nobody frees a slot, then it is refused
    steps, calls, real_step = v.engine.steps, [0], v.engine.step
    v.engine.step = lambda: calls.__setitem__(0, calls[0] + 1) or real_step()
    v.engine.run([w])
    assert isinstance(w.error, CapacityError) and "waited" in str(w.error)
    assert v.engine.steps == steps and calls[0] <= 3  # no forward meanwhile; slept to the deadline, not spun
