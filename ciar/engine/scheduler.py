"""The verifier's scheduler: which requests feed how many positions in the next forward. Pure Python (no torch).

    scheduler = Scheduler(SchedulerConfig(token_budget=1024, max_works=64, prefill_chunk=64))
    scheduler.submit(request)              # queued (waiting) until the engine admits it
    new = scheduler.take_waiting()         # the engine admits these (sessions, slots, captions), then:
    scheduler.start(admitted)              # running
    batch = scheduler.schedule()           # [Scheduled(request, kind, start, n)]: the next forward's pieces
    ...                                    # the model runner runs them, the requests take their outputs
    scheduler.record(batch)                # step accounting (step_log, positions per class, padding)
    finished = scheduler.retire()          # the requests that are done leave the running set

The scheduler decides from request state and budgets alone; it never touches tensors, the cache or the model. A
request is anything with the attributes of `Request` below: the works (`ciar.engine.works`: opens,
verifications, resumes, driving the real model through `ciar.engine.runner.ModelRunner`) and the capacity model's
modelled works (`ciar.capacity.gpu_model`, priced by a modelled runner in simulated time) are both scheduled here, so
the GPU capacity plan runs the policy the replicas run.

Policy (`SchedulerConfig`): spans first (a phone is waiting on each), then one-token decodes, then history and
prefill chunks; FIFO (arrival order) within a class; at most `max_works` requests per forward; the first request
feeds all it has up to the budget (`token_budget // rows` positions), the others at most `prefill_chunk` each, and a
piece shrinks to keep the step's padded size (batch rows x width; a row per session and CFG branch) within
`token_budget` as far as its own width goes (`token_budget // rows`; a request that cannot fit even one position
waits for the next step). A step whose first piece is wide (a long span or a prefill chunk) can therefore pass the
budget in padded positions: the runner runs such ragged steps packed (projections and feed-forward on the real
positions only), so their padding costs attention only. Holding the padded total strictly was tried and measured
in the capacity model: it cut the modelled H100 capacity for CIAR phones from 1,024 to 256
(`benchmarks/results/2026-11-26/capacity_real_scheduler/README.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

SPAN, DECODE, HISTORY, PREFILL = 0, 1, 2, 3  # priority classes, in scheduling order
KINDS = ("span", "decode", "history", "prefill")
STEP_LOG = 256  # steps kept in `Scheduler.step_log`


@dataclass
class SchedulerConfig:
    """token_budget: padded positions (batch rows x width) per forward; max_works: works per forward (1 = no
    batching); prefill_chunk: the longest piece (prefill, history, catch-up) a work feeds in a step it shares."""

    token_budget: int = 1024
    max_works: int = 64
    prefill_chunk: int = 64

    def __post_init__(self):
        for name in ("token_budget", "max_works", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")


class Request:
    """What the scheduler reads of a request in flight (the verifier's `Work` and the capacity model's modelled
    works implement it):

      seq        arrival order (set by `Scheduler.submit`)
      done       finished (result or error): leaves the running set at the next `retire`
      rows       batch rows its pieces take (a row per CFG branch)
      kind()     its priority class now (SPAN, DECODE, HISTORY or PREFILL)
      pending()  positions it could feed in the next forward (0: it waits for something else, e.g. the judge)
      position() the absolute sequence position of its next piece's first position
    """

    seq: int = 0
    done: bool = False
    rows: int = 1

    def kind(self) -> int:
        raise NotImplementedError

    def pending(self) -> int:
        raise NotImplementedError

    def position(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class Scheduled:
    """One piece of the next forward: `request` feeds `n` positions from absolute position `start` (class `kind`)."""

    request: object
    kind: int
    start: int
    n: int

    @property
    def rows(self) -> int:
        return self.request.rows

    @property
    def keys(self) -> int:
        """Cached keys its rows read (its last position + 1)."""
        return self.start + self.n


def schedule(requests, config: SchedulerConfig) -> list[Scheduled]:
    """The policy (module docstring) over `requests` (running, in any order). -> the next forward's pieces, in
    priority order."""
    budget = config.token_budget
    order = [r for r in sorted((r for r in requests if not r.done), key=lambda r: (r.kind(), r.seq))
             if r.pending() > 0][:config.max_works]
    out: list[Scheduled] = []
    rows = width = 0
    for r in order:
        limit = config.prefill_chunk if out else max(1, budget // r.rows)
        n = min(limit, r.pending())
        new_rows = rows + r.rows
        if out and new_rows * max(width, n) > budget:
            n = min(budget // new_rows, n)  # shrink the piece to the step's budget
            if n < 1:
                continue
        out.append(Scheduled(r, r.kind(), r.position(), n))
        rows, width = new_rows, max(width, n)
    return out


class Scheduler:
    """The queues (waiting, running), the policy and the step accounting of one engine."""

    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.waiting: list = []  # submitted, not admitted yet
        self.running: list = []  # admitted, not finished
        self.parked: list = []  # admitted once, waiting for a resource (a free KV-cache slot): not busy
        self._seq = 0
        self.steps = 0
        self.step_log: list[dict] = []  # last steps: {"works", "rows", "width", "kinds", "pieces"}, bounded
        self.kind_positions = [0, 0, 0, 0]  # fed positions per class since start (cost accounting)
        self.real_positions = 0  # fed positions x rows (CFG branches), summed over forwards
        self.padded_positions = 0  # rows x width of every forward (what the dense ragged batch computes)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, request):
        self._seq += 1
        request.seq = self._seq
        self.waiting.append(request)
        return request

    def take_waiting(self) -> list:
        """The waiting requests, in arrival order, for the engine to admit (they are in no queue until `start`)."""
        new, self.waiting = self.waiting, []
        return new

    def park(self, requests) -> None:
        """Requests that wait for a resource: out of the step loop until `unpark`."""
        self.parked.extend(requests)

    def unpark(self, due=None) -> None:
        """Parked requests (those `due(request)` says, or all) go back to the front of the waiting queue, in arrival
        order."""
        back = [r for r in self.parked if due is None or due(r)]
        if back:
            self.parked = [r for r in self.parked if r not in back]
            self.waiting = sorted(back, key=lambda r: r.seq) + self.waiting

    def start(self, requests) -> None:
        """Admitted requests join the running set (the finished ones are dropped)."""
        self.running.extend(r for r in requests if not r.done)

    def schedule(self, requests=None) -> list[Scheduled]:
        """The next forward's pieces from `requests` (default: the running ones)."""
        return schedule(self.running if requests is None else requests, self.config)

    def record(self, batch: list[Scheduled]) -> None:
        """Account one forward over `batch` (not empty)."""
        for p in batch:
            self.kind_positions[p.kind] += p.n
        rows = sum(p.rows for p in batch)
        width = max(p.n for p in batch)
        self.real_positions += sum(p.rows * p.n for p in batch)
        self.padded_positions += rows * width
        self.steps += 1
        self.step_log.append({"works": len(batch), "rows": rows, "width": width,
                              "kinds": [KINDS[p.kind] for p in batch],
                              "pieces": [(KINDS[p.kind], p.start, p.n, p.rows) for p in batch]})
        del self.step_log[:-STEP_LOG]

    def retire(self) -> list:
        """-> the running requests that are done (they leave the running set)."""
        finished = [r for r in self.running if r.done]
        if finished:
            self.running = [r for r in self.running if not r.done]
        return finished

    def of_session(self, session_id: str) -> list:
        return [r for r in self.all() if r.session_id == session_id and not r.done]

    def drop(self, request) -> bool:
        """Remove a waiting or parked request (-> True), or leave it (-> False: it is running)."""
        for queue in (self.waiting, self.parked):
            if request in queue:
                queue.remove(request)
                return True
        return False

    def purge(self) -> None:
        """Drop the finished requests from the queues (after works were failed from outside a step)."""
        self.waiting = [r for r in self.waiting if not r.done]
        self.running = [r for r in self.running if not r.done]
        self.parked = [r for r in self.parked if not r.done]

    def all(self) -> list:
        return self.waiting + self.running + self.parked

    def clear(self) -> None:
        self.waiting, self.running, self.parked = [], [], []
