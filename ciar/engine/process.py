"""The verifier's engine core in a process of its own: the replica's event loop and the engine stop sharing one GIL.

    spec = CoreSpec(world=world, max_sessions=64, scheduler=SchedulerConfig(max_works=16))
    engine = EngineProcess(spec, secret, batch_wait_s=0.005)     # starts the core; returns once it is ready
    reply, token = await engine.open(request, session_id=sid, device_id=dev)
    reply = await engine.verify(request, session_id=sid, device_id=dev, token=token)
    reply = await engine.resume(request, history, injected, session_id=sid, device_id=dev, token=token)
    await engine.close(session_id=sid, device_id=dev, token=token)
    engine.configure(scheduler=..., idle_timeout_s=..., slot_wait_s=..., batch_wait_s=...)
    stats = await engine.stats()
    engine.shutdown()

Why (issue 48). With the engine on a thread of the replica's process (`ciar.engine.core.EngineThread`), everything
the replica's Python does (Ray's handle calls, unpickling requests, building works, answering) takes turns with the
engine's host work on one interpreter lock. `benchmarks.engine_thread` measured what that costs on a 2-core CPU with
the forward stubbed: the engine's steps ×1.3-1.6 longer than the same steps driven alone, ×0.67-0.72 the verifies
per second (2026-11-28e); on an H200 the saturated CIAR step's host time grew with the phones in the process. This
is vLLM v1's answer: the engine core runs in a process of its own and the replica only passes requests to it. On
the same box its steps ran at the direct pace (×0.64-1.10 the direct steps, where the thread's took ×1.12-1.87) and
the same phones got ×1.18-1.25 the thread's verifies per second (2026-11-29); with a VERIFY's own cost cut and the
stub's denormals flushed, ×1.07-1.33, and ×0.75-0.78 of the direct steps' at 256-512 phones (2026-11-29b).

`EngineProcess` has the calls of `ciar.engine.service.VerifierService` (the same ones, with the same errors: they
are raised in the core and re-raised here with their attributes), so the Verifier deployment serves either
(`verifier_engine_process`). Its core is `python -m ciar.engine.process FD`, started by `subprocess` with one end
of a Unix socket pair (not multiprocessing's spawn, which re-runs the parent's main module: a Ray worker's). The
core builds the CloudVerifier from the spec there (`build_verifier`: the world loaded, the KV cache sized and the
CUDA graphs captured in the process that owns the accelerator) and serves a `VerifierService` on one thread: an
asyncio loop that reads the socket between steps and steps the engine itself (`_CoreStepper`). Nothing in the core
shares its interpreter with the replica's loop, Ray's threads or simulated phones. A VERIFY, the hot call, is data
there: its work is built and queued as its message is read, and its reply sent by the work's callback (no task per
call). Tensors cross as dtype, shape and bytes (`ciar.engine.codec`), not by torch's storage pickling.

Messages (pickled tuples, framed by `multiprocessing.connection.Connection`; after the first frame each way, a
frame holds every message one side queued meanwhile: the replica's as a list of pickled messages, each pickled by
its caller, so that what cannot be pickled fails its own call; the core's as a list):
  replica -> core  ("start", spec, secret, batch_wait_s)    the first frame: build, then answer "ready" (or "dead")
                   ("call", id, method, args, kwargs)       a VerifierService call, `stats` or `configure` (id 0:
                                                            no reply wanted)
                   ("cancel", id)                           the caller went away: its VERIFY's work is withdrawn, as
                                                            in-process (`_Driver.run`); another call's task cancelled
                   ("turned", n)                            step n's callers have had their loop turn (below)
                   ("stop",)                                end the core (it finishes the step it is in)
  core -> replica  ("ready", info) | ("dead", traceback)    the first frame
                   ("reply", id, ok, value)                 a call's result, or the exception it raised
                   ("stepping", started)                    a step begins (time.monotonic, for the watchdog)
                   ("step", works, spans, seconds, sessions)  a step ended (metrics)
                   ("turn", n)                              step n answered callers: the core waits (at most the
                                                            company wait) until they have had a loop turn, so that
                                                            the requests they send next join the next step, as
                                                            `EngineThread._let_callers_answer` does in-process

The replica pickles its requests on its loop and a writer thread sends them, so a busy core never blocks the loop;
a reader thread unpickles what comes back and settles its callers' futures, one wake-up of each loop per frame. When
the core dies (killed, out of memory, a crash, a frame it cannot read), every call in flight fails with
`EngineProcessError`, and so do later calls and `check_stalled`, so that Serve's health check replaces the replica.
When the replica goes away the core reads the end of its socket and exits.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ciar.engine import heap
from ciar.engine.codec import dumps
from ciar.engine.core import AsyncStepper
from ciar.engine.scheduler import SchedulerConfig
from ciar.engine.service import EngineStalledError, VerifierService
from ciar.engine.works import VerifyWork

logger = logging.getLogger(__name__)

WARM_SPAN = 4  # the drafts a compiled judge warms its spans with (`Judge.warm`; lengths of two or more share them)
CALLS = ("open", "verify", "resume", "close", "evict_idle", "cost_hint", "ready", "stats", "configure")
# the socket's buffers each way (the kernel caps them at net.core.wmem_max / rmem_max: 4 MiB on the CPU box, 208 KiB
# on a kernel left at its defaults, where this changes nothing). The core reads between steps, and a CIAR span at
# 16,384 codes is a 128 KiB frame: with 208 KiB the replica's writer stalled after one or two, and a step held 57
# works where 64 were queued (2026-11-29j; verifies/s the same within the noise on that CPU)
SOCKET_BUFFER_BYTES = 4 << 20


class EngineProcessError(RuntimeError):
    """The engine's process is gone (it died, or failed to start): the replica cannot serve, and its calls fail."""


@dataclass
class CoreSpec:
    """What the core builds its CloudVerifier from (the Verifier deployment's settings; picklable). `world`: the
    served world (`ciar.world_spec`, a dict or a path; None: the shipped default); `capture_rows`: on CUDA with
    graphs, every bucket up to this many rows is captured before the first request. `factory`: "module:function"
    called with `factory_kwargs` instead, returning a ready CloudVerifier (benchmarks' stubbed engines, tests)."""

    world: dict | str | None = None
    max_sessions: int | str = 16
    threads: int = 1
    memory_utilization: float = 0.9
    cuda_graphs: bool = True
    fused_step: bool = False
    overlap: bool = False
    packed_step: bool = False
    compiled_judge: bool = False
    scheduler: SchedulerConfig | None = None
    idle_timeout_s: float | None = None
    slot_wait_s: float = 0.0
    capture_rows: int | None = None
    factory: str | None = None
    factory_kwargs: dict = field(default_factory=dict)


def build_verifier(spec: CoreSpec, log=logger.info):
    """The CloudVerifier a Verifier replica serves, built from `spec` on this process's accelerator (CUDA when there
    is one): the world loaded, the cache sized ("auto": by the accelerator's memory), the graphs captured."""
    import torch

    from ciar.engine.verifier import CloudVerifier

    torch.set_num_threads(spec.threads)
    if spec.factory:
        module, _, name = spec.factory.partition(":")
        return getattr(importlib.import_module(module), name)(**spec.factory_kwargs)
    from ciar.hub import first_line
    from ciar.world import load_world  # (after the factory: a factory's engine needs no world, nor pydantic)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = load_world(spec.world, device=device)
    core = CloudVerifier(world.cloud, world.text, max_sessions=spec.max_sessions, projector=world.projector,
                         codebook=world.codebook, idle_timeout_s=spec.idle_timeout_s, scheduler=spec.scheduler,
                         memory_utilization=spec.memory_utilization, slot_wait_s=spec.slot_wait_s,
                         static=None if spec.cuda_graphs else False,  # static steps + graphs on CUDA
                         fused=spec.fused_step and spec.cuda_graphs and device == "cuda", overlap=spec.overlap,
                         pack=spec.packed_step and spec.cuda_graphs and device == "cuda",
                         compiled_judge=spec.compiled_judge)
    if core.memory is not None:
        log("KV cache: %d sessions (%s)", core.table.max_sessions, core.memory.how)
    if core.judge.compiled:  # its compilations before any request (the world's sampling)
        t = time.perf_counter()
        try:
            core.judge.warm(world.sampling, WARM_SPAN)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raised, said as the setting that asked for it
            raise RuntimeError(f"verifier_compiled_judge: torch.compile could not compile the judge here (torch "
                               f"{torch.__version__}, {device}): {type(e).__name__}: {first_line(e)}. Serve with "
                               f"verifier_compiled_judge: false (the eager judge)") from e
        log("compiled the judge in %.1f s", time.perf_counter() - t)
    if core.runner.graphs and spec.capture_rows:  # every bucket the live config can reach, before any request
        t = time.perf_counter()
        n = core.runner.capture(spec.capture_rows)
        log("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t)
    return core


def step_counts(finished) -> int:
    """Verifications a step answered (the Verifier's spans counter)."""
    return sum(isinstance(w, VerifyWork) and w.error is None for w in finished)


# ---------------------------------------------------------------------------------------------------- the replica


class EngineProcess:
    def __init__(self, spec: CoreSpec, secret: str, batch_wait_s: float = 0.0, on_step=None):
        """Start the core and wait until it has built its verifier (`info`: its vocabulary, sessions, memory
        plan), as long as that takes (a large world, graph captures); its death ends the wait. `batch_wait_s`: an
        idle engine waits this long for company; `on_step(works, spans, seconds)`: called after each of its steps,
        on the reader thread (metrics). Raises `EngineProcessError` with the core's traceback when it fails to
        start."""
        self.on_step = on_step
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                end.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the replica's imports
        self.proc = subprocess.Popen([sys.executable, "-m", "ciar.engine.process", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, close_fds=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send_bytes(dumps(("start", spec, secret, batch_wait_s)))
        try:
            kind, *rest = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            self.proc.wait()
            raise EngineProcessError(f"the engine's process exited while starting (exit code "
                                     f"{self.proc.returncode})") from e
        if kind != "ready":
            self.proc.wait()
            raise EngineProcessError(f"the engine's process failed to start:\n{rest[0]}")
        self.info: dict = rest[0]
        self.vocab_size: int = self.info["vocab_size"]
        self.num_sessions = 0  # as of the core's last step (the sessions gauge)
        self.step_started: float | None = None
        self.steps = 0
        self._dead: str | None = None
        self._stopping = False
        self._ids = itertools.count(1)
        self._calls: dict[int, tuple] = {}  # id -> (loop, future)
        self._answered: set = set()  # the loops of callers answered since the last "turn"
        self._lock = threading.Lock()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="ciar-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="ciar-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # ---------------------------------------------------------------- the calls (VerifierService's)
    async def open(self, request, *, session_id: str, device_id: str):
        return await self._call("open", request, session_id=session_id, device_id=device_id)

    async def verify(self, request, *, session_id: str, device_id: str, token: str):
        return await self._call("verify", request, session_id=session_id, device_id=device_id, token=token)

    async def resume(self, request, history, injected=None, *, session_id: str, device_id: str, token: str):
        return await self._call("resume", request, history, injected, session_id=session_id, device_id=device_id,
                                token=token)

    async def close(self, *, session_id: str, device_id: str, token: str) -> None:
        return await self._call("close", session_id=session_id, device_id=device_id, token=token)

    async def cost_hint(self):
        return await self._call("cost_hint")

    async def ready(self) -> dict:
        return await self._call("ready")

    async def stats(self) -> dict:
        """The core's `VerifierService.stats`, its process id and resident memory, and its failed steps."""
        return {**await self._call("stats"), "step_running_s": self.stalled_s()}  # (the core answers between steps)

    def evict_idle(self, max_idle_s: float) -> None:
        self._send(("call", 0, "evict_idle", (max_idle_s,), {}))

    def configure(self, scheduler=None, idle_timeout_s: float | None = None, slot_wait_s: float | None = None,
                  batch_wait_s: float | None = None) -> None:
        """`VerifierService.configure`, applied in the core between steps."""
        self._send(("call", 0, "configure", (scheduler, idle_timeout_s, slot_wait_s, batch_wait_s), {}))

    def stalled_s(self) -> float:
        """How long the core's step running now has run (0 between steps), as its messages tell."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def check_stalled(self, limit_s: float) -> None:
        """`VerifierService.check_stalled`, and `EngineProcessError` when the core is gone (the health check)."""
        if self._dead is not None:
            raise EngineProcessError(self._dead)
        stalled = self.stalled_s()
        if stalled > limit_s:
            raise EngineStalledError(f"the verifier's forward has run for {stalled:.0f} s (limit {limit_s:g} s, "
                                     f"forward_timeout_s): the engine is stuck")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it finishes the step it is in) and wait for it; killed past `timeout_s`."""
        self._stopping = True
        if self.proc.poll() is None:
            self._send(("stop",))
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._died("the engine's process was shut down")

    # ---------------------------------------------------------------- plumbing
    async def _call(self, method: str, *args, **kwargs):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise EngineProcessError(self._dead)
            call = next(self._ids)
        data = dumps(("call", call, method, args, kwargs))  # (what cannot be pickled fails its own caller, here)
        with self._lock:
            self._calls[call] = (loop, fut)
        self._out.put(data)
        try:
            ok, value = await fut
        except asyncio.CancelledError:  # the caller went away: its work is withdrawn in the core
            with self._lock:
                self._calls.pop(call, None)
            self._send(("cancel", call))
            raise
        if not ok:
            raise value
        return value

    def _send(self, message) -> None:
        self._out.put(dumps(message))

    def _write(self) -> None:
        """Sends what the callers queued (each message pickled by its caller), every message queued meanwhile in one
        frame (one write)."""
        while True:
            batch = [self._out.get()]
            while True:
                try:
                    batch.append(self._out.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            batch = [m for m in batch if m is not None]
            try:
                if batch:
                    self._conn.send_bytes(dumps(batch))
            except OSError:  # the core is gone: the reader says so to every caller
                return
            if stop:
                return

    def _read(self) -> None:
        conn = self._conn
        while True:
            try:
                batch = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                code = self.proc.wait()
                self._died("the engine's process was shut down" if self._stopping else
                           f"the engine's process exited (exit code {code})")
                return
            except Exception as e:  # noqa: BLE001 - a message this side cannot read: a bug, said once
                logger.exception("unreadable message from the engine's process")
                self._died(f"unreadable message from the engine's process: {e!r}")
                self.proc.kill()
                return
            settle: dict = {}  # loop -> [(future, result)]: one wake-up per loop per frame
            for message in batch:
                self._take(message, settle)
            for loop, results in settle.items():
                _settle_all(loop, results)

    def _take(self, message, settle: dict) -> None:
        kind = message[0]
        if kind == "reply":
            _, call, ok, value = message
            with self._lock:
                entry = self._calls.pop(call, None)
            if entry is not None:
                loop, fut = entry
                self._answered.add(loop)
                settle.setdefault(loop, []).append((fut, (ok, value)))
        elif kind == "stepping":
            self.step_started = message[1]
        elif kind == "step":
            _, works, spans, seconds, self.num_sessions = message
            self.step_started = None
            self.steps += 1
            if self.on_step is not None:
                try:
                    self.on_step(works, spans, seconds)
                except Exception:  # noqa: BLE001 - metrics must not stop the reader
                    logger.exception("on_step failed")
        elif kind == "turn":
            for loop, results in settle.items():  # the replies before the turn are settled first
                _settle_all(loop, results)
            settle.clear()
            self._turn(message[1])

    def _turn(self, n: int) -> None:
        """Tell the core once every loop answered since the last turn has run what the replies woke up (two hops:
        the callbacks that settle the futures, then the tasks they resume)."""
        loops, self._answered = self._answered, set()
        pending = [len(loops)]

        def mark():
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self._send(("turned", n))

        if not loops:
            self._send(("turned", n))
        for loop in loops:
            try:
                loop.call_soon_threadsafe(loop.call_soon, mark)
            except RuntimeError:  # a closed loop answers nothing
                mark()

    def _died(self, why: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = why
            calls, self._calls = self._calls, {}
        self.step_started = None
        self._out.put(None)
        by_loop: dict = {}
        for loop, fut in calls.values():
            by_loop.setdefault(loop, []).append((fut, (False, EngineProcessError(why))))
        for loop, results in by_loop.items():
            _settle_all(loop, results)


def _settle_all(loop, results: list) -> None:
    """Set each (future, result) on `loop`, its futures' loop, in one wake-up of it."""
    def settle():
        for fut, result in results:
            if not fut.done():
                fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed: nobody waits any more
        pass


# ---------------------------------------------------------------------------------------------------- the core


class _CoreStepper(AsyncStepper):
    """The core's driver: the engine steps on the core's loop (one thread), the socket read between steps. Each
    step is announced and reported to the replica (`stepping`, `step`), and after a step that answered calls it
    waits, at most `wait_s`, for the replica's callers to have had their turn (`turn` / `turned`). A step that
    raises fails its works and the core goes on, as the engine thread does."""

    def __init__(self, engine, wait_s: float, send, flush, sessions):
        super().__init__(engine, wait_s)
        self.send, self.flush, self.sessions = send, flush, sessions  # sessions(): how many are open
        self.turns = 0
        self.turned: dict[int, asyncio.Future] = {}
        self.steps_failed = 0
        self.answered = False  # the last step answered callers that may send again at once
        self.replies = 0  # replies queued (the core counts them: a step that answered calls asks for a turn)

    # (`AsyncStepper._loop` steps; these are its hooks)
    def _waits_for_company(self) -> bool:
        return not self.answered  # (after a step that answered, the turn was the wait)

    def _stepping(self):
        started = time.monotonic()
        self.send(("stepping", started))
        self.flush()  # (with the replies of the calls answered since the last step)
        return started, self.engine.steps, self.replies

    def _step_failed(self, error: Exception) -> list:
        self.steps_failed += 1  # the core goes on
        return []

    async def _stepped(self, finished: list, before) -> None:
        engine = self.engine
        started, forwards, replies = before
        size = engine.step_log[-1]["works"] if engine.steps != forwards and engine.step_log else 0  # 0: no forward
        self.send(("step", size, step_counts(finished), time.monotonic() - started, self.sessions()))
        await asyncio.sleep(0)  # the calls this step finished resume and send their replies (a VERIFY's: sent)
        self.answered = self.replies > replies
        if self.answered and self.wait_s > 0:
            await self._turn()

    def _idle(self) -> None:
        self.answered = False

    async def _turn(self) -> None:
        self.turns += 1
        n = self.turns
        fut = self.turned[n] = asyncio.get_running_loop().create_future()
        self.send(("turn", n))
        try:
            await asyncio.wait_for(fut, self.wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self.turned.pop(n, None)

    def stalled_s(self) -> float:
        return 0.0  # the replica keeps the step's start (`EngineProcess.stalled_s`)


class _Core:
    """The core's side: one `VerifierService` on one thread, fed by the socket."""

    def __init__(self, conn: Connection, core, secret: str, batch_wait_s: float):
        self.conn, self.core = conn, core
        self.stepper = _CoreStepper(core.engine, batch_wait_s, self.send, self.flush, lambda: core.num_sessions)
        self.service = VerifierService(core, secret, stepper=self.stepper)
        self.tasks: dict[int, asyncio.Task] = {}
        self.stopped: asyncio.Future | None = None
        self.outbox: list = []
        self.works: dict = {}  # call id -> its VERIFY's work, until answered

    def send(self, message) -> None:
        """Queue a message for the replica: what is sent within one turn of the core's loop goes in one frame."""
        self.outbox.append(message)
        if len(self.outbox) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        batch, self.outbox = self.outbox, []
        if not batch:
            return
        try:
            data = dumps(batch)
        except Exception:  # noqa: BLE001 - a value pickle cannot take: its caller gets why, the others their own
            batch = [m if _picklable(m) else ("reply", m[1], False, EngineProcessError(
                f"the engine's reply could not be sent: {_pickle_error(m)}")) for m in batch]
            data = dumps(batch)
        self.conn.send_bytes(data)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = loop.create_future()
        loop.add_reader(self.conn.fileno(), self._readable)
        try:
            await self.stopped
        finally:
            loop.remove_reader(self.conn.fileno())
            for task in self.tasks.values():
                task.cancel()

    def _readable(self) -> None:
        try:
            while self.conn.poll(0):
                for data in pickle.loads(self.conn.recv_bytes()):  # (a frame: the messages the replica queued)
                    self._handle(pickle.loads(data))
        except (EOFError, OSError):  # the replica is gone
            if not self.stopped.done():
                self.stopped.set_result(None)
        except Exception as e:  # noqa: BLE001 - a frame the core cannot read: it exits (its calls fail), not hangs
            logger.exception("unreadable message from the replica: the engine's process exits")
            if not self.stopped.done():
                self.stopped.set_exception(e)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "call":
            _, call, method, args, kwargs = message
            if method == "verify" and call:
                self._verify(call, *args, **kwargs)
                return
            task = asyncio.get_running_loop().create_task(self._serve(call, method, args, kwargs))
            if call:
                self.tasks[call] = task
        elif kind == "cancel":
            task = self.tasks.get(message[1])
            if task is not None:
                task.cancel()
            work = self.works.pop(message[1], None)
            if work is not None:  # a VERIFY not answered yet: withdrawn (`StepEngine.withdraw`), as in-process
                self.core.engine.withdraw(work)
        elif kind == "turned":
            fut = self.stepper.turned.get(message[1])
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif kind == "stop" and not self.stopped.done():
            self.stopped.set_result(None)

    def _verify(self, call: int, request, **kwargs) -> None:
        """The hot call without a task of its own: the work built and queued now, its reply sent by its callback
        (what `VerifierService.verify` awaits, as data: a verifier's steps answer thousands a second)."""
        try:
            work = self.service.verify_work(request, **kwargs)
        except Exception as e:  # noqa: BLE001 - the caller gets the error, as in-process
            self._answer(call, e)
            return
        self.works[call] = work
        work.on_done = lambda w: self._answer(call, w)
        self.core.engine.submit(work)
        self.stepper._kick(asyncio.get_running_loop())

    def _answer(self, call: int, outcome) -> None:
        """A VERIFY's reply: its finished work's result or error, or the error that refused it."""
        self.works.pop(call, None)
        self.stepper.replies += 1
        error = outcome if isinstance(outcome, BaseException) else outcome.error
        self.send(("reply", call, False, error) if error is not None else ("reply", call, True, outcome.result))

    async def _serve(self, call: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            if method not in CALLS:
                raise ValueError(f"the engine's process has no call {method!r}")
            value = self.stats() if method == "stats" else getattr(self.service, method)(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
            ok = True
        except asyncio.CancelledError:
            return  # the caller went away (its work withdrawn by the service's own handling)
        except Exception as e:  # noqa: BLE001 - the caller gets the error, as in-process
            ok, value = False, e
        finally:
            self.tasks.pop(call, None)
        if call:
            self.stepper.replies += 1
            self.send(("reply", call, ok, value))
        elif not ok:
            logger.error("engine call %s failed: %r", method, value)

    async def stats(self) -> dict:
        return {**await self.service.stats(), "engine_process": os.getpid(), "core_rss_mb": _rss_mb(),
                "steps_failed": self.stepper.steps_failed}


def _picklable(message) -> bool:
    return _pickle_error(message) is None


def _pickle_error(message) -> str | None:
    try:
        dumps(message)
    except Exception as e:  # noqa: BLE001 - said to the caller
        return f"{type(e).__name__}: {e}"
    return None


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def _core_main(fd: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    conn = Connection(fd)
    try:
        kind, spec, secret, batch_wait_s = pickle.loads(conn.recv_bytes())
        assert kind == "start", kind
        core = build_verifier(spec)
        heap.freeze()  # (this process is the engine's: its start-up out of the collector's reach)
        heap.keep_freed_memory()  # and the steps' host tensors reuse the blocks freed before them
        info = {"vocab_size": core.vocab_size, "max_sessions": core.table.max_sessions, "pid": os.getpid(),
                "memory": core.memory.to_dict() if core.memory is not None else None}
    except (EOFError, OSError):
        return 1
    except BaseException:  # noqa: BLE001 - the replica gets the traceback
        conn.send_bytes(dumps(("dead", traceback.format_exc())))
        return 1
    conn.send_bytes(dumps(("ready", info)))
    try:
        asyncio.run(_Core(conn, core, secret, batch_wait_s).run())
    except Exception:  # noqa: BLE001 - logged where it happened; the exit code tells the replica
        return 1
    return 0


if __name__ == "__main__":  # the core: run from the module itself, so that what it pickles names ciar.engine.process
    from ciar.engine import process

    sys.exit(process._core_main(int(sys.argv[1])))
