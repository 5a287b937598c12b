"""The engine fuzzer's phones (`tests/engine/test_engine_fuzz.py`) through the services a replica runs: concurrent
asyncio callers of `VerifierService` (the engine on its own thread) and of `EngineProcess` (the engine core in a
process of its own, every request and reply through its socket and codec), timing left to the threads. Callers go
away mid-request (their task cancelled: the work is withdrawn, in the core too), sessions are closed under requests
in flight (a VERIFY then fails with SessionLostError), forwards raise in the core, phones pause, and the engine's
process is killed mid-run and replaced by another with the same secret (a lost replica: every call in flight fails
with EngineProcessError, and the phones resume on the new one with the tokens they hold). Each phone resumes from the
tokens it knows and sends its request again, as `DeviceConnection` does. Whatever the interleaving, every phone's
replies and tokens must be the plain engine's (docs/architecture.md, *Determinism*), and the service must end with
no session and nothing running."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal

import pytest
import torch

from ciar.collab.protocol import CapacityError, SessionLostError
from ciar.engine.process import CoreSpec, EngineProcess, EngineProcessError
from ciar.engine.service import VerifierService
from test_engine_fuzz import Disruption, InjectedFault, Phone, codebook, make_phones, next_verify, run

FACTORY = f"{__name__}:fuzz_core"  # the core imports this module by the name pytest gave it (the same sys.path)
RETRY = (SessionLostError, CapacityError, InjectedFault)  # CapacityError: also ForwardFault (retryable)


def fuzz_core(max_sessions: int, overlap: bool = False, forward_fault: float = 0.0, seed: int = 0):
    """The core's factory: the tests' small random-weight cloud and stub caption encoder, its forwards raising with
    probability `forward_fault` (drawn from `seed`)."""
    from ciar.engine.verifier import CloudVerifier
    from ciar.testing import StubTextEncoder, tiny_cloud_model

    cloud = tiny_cloud_model()
    v = CloudVerifier(cloud, StubTextEncoder(), max_sessions=max_sessions, overlap=overlap, codebook=codebook(cloud))
    rng, forward = random.Random(seed), v.runner.execute_step

    def maybe(pieces):
        if forward_fault and rng.random() < forward_fault:
            raise InjectedFault("injected: forward")
        return forward(pieces)

    v.runner.execute_step = maybe
    return v


class Pool:
    """The service the phones call now. `lose()` kills its engine process (a lost replica: every call in flight and
    later fails with EngineProcessError) and starts another with the same secret, as Serve replaces a replica; the
    phones then resume their sessions on it with the tokens they hold."""

    def __init__(self, make):
        self.make, self.service = make, make()
        self.services, self.up, self.lost = [self.service], asyncio.Event(), 0
        self.up.set()

    async def lose(self) -> None:
        self.up.clear()
        os.kill(self.service.proc.pid, signal.SIGKILL)
        self.service = await asyncio.to_thread(self.make)
        self.services.append(self.service)
        self.lost += 1
        self.up.set()

    def shutdown(self) -> None:
        for s in self.services:
            s.shutdown()


async def drive(pool: Pool, phones: list[Phone], vocab: int, block: int, seed: int, cancel: float, close: float,
                think: int, kills: int = 0) -> dict:
    """Every phone to its end at once; a request may be cancelled by its caller (`cancel`) or its session closed
    under it by another task (`close`) after a few loop turns; `kills` times the replica is lost while they run.
    -> counts of what happened."""
    rng = random.Random(seed)
    counts = {"cancelled": 0, "closed": 0, "retried": 0, "resumed": 0}

    async def call(p: Phone, make):
        """One request, disrupted or not: -> its reply, or None when it must be sent again."""
        task = asyncio.ensure_future(make())
        roll = rng.random()
        if roll < cancel + (close if p.token else 0.0):
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            if roll < cancel:
                counts["cancelled"] += 1
                task.cancel()
            else:
                counts["closed"] += 1
                with contextlib.suppress(EngineProcessError):
                    await pool.service.close(session_id=p.sid, device_id="d", token=p.token)
        try:
            return await task
        except asyncio.CancelledError:
            return None
        except RETRY:
            counts["retried"] += 1
            return None
        except EngineProcessError:  # the replica is gone: wait for its replacement
            counts["retried"] += 1
            await pool.up.wait()
            return None

    async def resume(p: Phone) -> None:
        while await call(p, lambda: pool.service.resume(p.open, torch.tensor(p.tokens, dtype=torch.long), None,
                                                        session_id=p.sid, device_id="d", token=p.token)) is None:
            await asyncio.sleep(0)
        counts["resumed"] += 1

    async def phone(p: Phone) -> None:
        got = None
        while got is None:
            got = await call(p, lambda: pool.service.open(p.open, session_id=p.sid, device_id="d"))
            if got is None:
                await asyncio.sleep(0)
        reply, p.token = got
        p.took_open(reply)
        while (req := next_verify(p, vocab, block)) is not None:
            for _ in range(rng.randint(0, think)):
                await asyncio.sleep(0)
            while (r := await call(p, lambda: pool.service.verify(req, session_id=p.sid, device_id="d",
                                                                   token=p.token))) is None:
                await resume(p)  # (the session may have moved on, or be gone: RESUME replaces any copy)
            p.took_verify(req, r)
        with contextlib.suppress(EngineProcessError):  # (a lost replica holds nothing any more)
            await pool.service.close(session_id=p.sid, device_id="d", token=p.token)
        p.finished = True

    async def killer() -> None:  # the replica is lost once the phones have had a few more replies
        for _ in range(kills):
            due = sum(len(p.replies) for p in phones) + rng.randint(1, 2 * len(phones))
            while sum(len(p.replies) for p in phones) < due and not all(p.finished for p in phones):
                await asyncio.sleep(0.001)
            if not all(p.finished for p in phones):
                await pool.lose()

    before = await pool.service.ready()
    jobs = asyncio.gather(*(phone(p) for p in phones))
    kill = asyncio.ensure_future(killer())
    try:
        await jobs
    finally:
        for p in phones:
            p.finished = True
        await kill
    assert pool.up.is_set()
    # every session closed and its slots free: asked after one more OPEN's reply (the closes above are applied
    # before the step that answers it), so the answer does not depend on when the engine ran them
    sentinel = dataclasses.replace(phones[0].open, session_id="sentinel", prefix_len=1)
    while True:
        try:
            await pool.service.open(sentinel, session_id="sentinel", device_id="d")
            break
        except RETRY:  # (an injected fault: sent again)
            pass
    rows = 2 if sentinel.sampling.uses_cfg else 1
    assert await pool.service.ready() == {"sessions": 1, "free_slots": before["free_slots"] - rows}, before
    counts["replicas_lost"] = pool.lost
    return counts


def fuzz_service(cloud, text, seed: int, process: bool, overlap: bool, disrupt: Disruption, kills: int = 0) -> dict:
    n = random.Random(seed).randint(2, 6)
    vocab, block = cloud.config.vocab_size, cloud.config.block_size
    ref = make_phones(seed, n, vocab, block)
    run(cloud, text, ref, {}, Disruption(), seed)
    kwargs = dict(max_sessions=n, overlap=overlap, forward_fault=disrupt.forward_fault, seed=seed)
    pool = Pool(lambda: EngineProcess(CoreSpec(factory=FACTORY, factory_kwargs=kwargs), "secret",
                                      batch_wait_s=0.001) if process else
                VerifierService(fuzz_core(**kwargs), "secret", batch_wait_s=0.001))
    try:
        got = make_phones(seed, n, vocab, block)
        counts = asyncio.run(drive(pool, got, vocab, block, seed + 1, disrupt.cancel, disrupt.drop, disrupt.think,
                                   kills if process else 0))
    finally:
        pool.shutdown()
    for a, b in zip(ref, got):
        assert b.replies == a.replies, (seed, a.sid, a.kind, process, overlap, disrupt)
        assert b.tokens == a.tokens, (seed, a.sid, a.kind, process, overlap, disrupt)
    return counts


DISRUPT = Disruption(cancel=0.1, drop=0.08, think=3, forward_fault=0.03)


@torch.no_grad()
@pytest.mark.parametrize("process", [False, True])
def test_services_give_every_phone_the_reference_replies(tiny_cloud, stub_text, process):
    """Three seeds each way; with the engine's own process, its replica is also lost once a seed (killed, and
    replaced by another with the same secret)."""
    seen: dict = {}
    for seed in range(3):
        for k, x in fuzz_service(tiny_cloud, stub_text, seed, process, overlap=seed % 2 == 1, disrupt=DISRUPT,
                                 kills=1).items():
            seen[k] = seen.get(k, 0) + x
    if not process:
        assert seen.pop("replicas_lost") == 0
    assert min(seen.values()) > 0, seen  # callers went away, sessions were closed under requests, phones resumed


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("process", [False, True])
def test_services_many_seeds(tiny_cloud, stub_text, process):
    for seed in range(int(os.environ.get("CIAR_FUZZ_SEEDS", 20))):
        fuzz_service(tiny_cloud, stub_text, 1000 + seed, process, overlap=seed % 2 == 1, disrupt=DISRUPT,
                     kills=seed % 3)
