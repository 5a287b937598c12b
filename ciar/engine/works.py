"""The request state: one *work* per request in flight (`OpenWork`, `ResumeWork`, `VerifyWork`), as the engine core
(`ciar.engine.core.StepEngine`) steps it. docs/architecture.md §6.

A work is data about its request: what the scheduler reads (its kind, rows, pending positions, position), its next
piece for the model runner (`piece`), where its outputs are after a forward (`take`), and the decision it needs
(`draw`: a token to sample; `span`: drafts to judge) and what it does with it (`drawn`, `commit`). It reads its
session (`ciar.engine.sessions.Session`, which its owner found or opened for it and hands to `admit`) and writes the
session's committed tokens; it never opens or closes a session (it sets `drop_session`), never touches the KV cache
(the core writes lengths from `kv_state`) and never calls its owner: what it reads besides its request and its
session is a `WorkContext` (the model's shape, the projector).

Cache invariant per session (CFG: a cond slot and an uncond slot with the same tokens): the session's committed
image tokens t_0..t_{c-1} are in `tokens`; the cache holds the condition and t_0..t_{c-2} ("fed" = c - 1); the
last committed token is fed by the next forward. A verification with m new tokens and k drafts feeds
t_{fed}..t_{c+m-1}, x_1..x_k (catch-up and drafts, in one piece or chunks), reads the target distributions
p_1..p_{k+1} at the positions of t_{c+m-1}, x_1..x_k, is judged with the session's acceptance rule, commits the
accepted drafts plus the next token, and the core rolls the cache back to the accepted prefix (pointer move).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ciar.collab.protocol import (InjectedFeatures, OpenReply, OpenRequest, RuleConfig, SessionConflictError,
                                  SessionError, SessionLostError, VerifyReply, VerifyRequest, verify_tensors)
from ciar.engine.core import Work
from ciar.decoding.sampling import keyed_uniform, sample_at, stream_keys
from ciar.engine.judge import Draw, Jacobi, Redraft, Span
from ciar.engine.runner import Piece
from ciar.engine.scheduler import DECODE, HISTORY, PREFILL, SPAN
from ciar.engine.transfer import to_device
from ciar.engine.sessions import Session
from ciar_device.maths import JACOBI_STREAM

__all__ = ["WorkContext", "SessionWork", "SpanFeed", "OpenWork", "JacobiWork", "ResumeWork", "VerifyWork",
           "check_projector_inputs"]


@dataclass(frozen=True)
class WorkContext:
    """What a work reads besides its request and its session: the cloud model's shape, the interval projector
    (features the device sent, added at their positions) and a function giving the caption a device conditions on
    (an OPEN that asks for it)."""

    cls: int  # condition positions before the first image token (cls_token_num)
    block_size: int  # image tokens
    vocab_size: int
    device: torch.device
    projector: torch.nn.Module | None = None
    caption: Callable[[torch.Tensor], torch.Tensor] | None = None  # cond -> the device's caption (float)
    encodes_captions: bool = True  # the owner encodes captions (False: opens must bring caption embeddings)


class SessionWork(Work):
    """A work on one session (`s`, set at admission): the session's cache slots are its rows (2 with CFG).
    `admit(session)`: the session its owner found (a verification) or opened (an open, a resume) for it."""

    s: Session | None = None

    def admit(self, session: Session) -> None:
        raise NotImplementedError

    @property
    def slots(self) -> list[int]:
        return self.s.slots

    @property
    def rows(self) -> int:
        return len(self.s.slots)


class SpanFeed:
    """What a span's feed keeps (a verification's, a Jacobi round's): the feed (`feed`, from image index `start`),
    the positions fed so far (`fed`), where its targets are: `want`, the feed indices whose outputs are the targets
    (-1: the target before the feed, the prefill's logits in `s.first_logits`), found in one piece (`targets`) or
    gathered from several (`got`). The span is judged once its last position is fed (`phase` "judge")."""

    ctx: WorkContext

    def take_feed(self, piece: Piece, out) -> None:
        if len(piece.want) == len(self.want):  # every target in this piece (the usual case): where they are
            self.targets = out
        elif piece.want:
            logits, hidden = out.logits, out.hidden
            for j, i in enumerate(piece.want):
                self.got[piece.start - self.ctx.cls - self.start + i] = (logits[:, j], hidden[j])
        self.fed += piece.n
        if self.fed >= len(self.feed):
            self.phase = "judge"

    def feed_window(self, drafts: list[int]) -> None:
        """A Jacobi round's feed: the last committed token (none before the first) and `drafts`; its targets sit at
        the outputs after the committed token and each draft (with no token committed yet, the first is the
        prefill's: -1)."""
        tokens = self.s.tokens
        self.drafts = drafts
        self.start = max(len(tokens) - 1, 0)
        self.feed = tokens[self.start:] + drafts
        first = len(tokens) - 1 - self.start
        self.want = [first + j for j in range(len(drafts) + 1)]
        self.fed, self.got, self.targets = 0, {}, None
        self.phase = "feed"

    def target_logits(self):
        """The distributions the drafts and the next token are judged by: the piece's outputs when one piece held
        them all (`PieceOutput`), else [rows, k+1, V] gathered from the pieces that fed them."""
        if self.targets is not None:
            return self.targets
        return torch.stack([self.s.first_logits if i < 0 else self.got[i][0] for i in self.want], dim=1)

    def target_hidden(self) -> torch.Tensor | None:
        if self.targets is not None:
            return self.targets.hidden
        if any(i < 0 for i in self.want):
            return None
        return torch.stack([self.got[i][1] for i in self.want])


class OpenWork(SessionWork):
    """An open: prefill chunks, then `prefix_len` tokens sampled one decode step at a time (a cloud-only image is
    an open with prefix_len = N)."""

    REPEATABLE = True  # the same OPEN sent again is answered as this one was (a resume replaces its session instead)

    def __init__(self, ctx: WorkContext, request: OpenRequest, caption_emb=None, caption_mask=None, owner: str = ""):
        super().__init__(request.session_id)
        self.ctx, self.request, self.owner = ctx, request, owner
        self.caption_emb, self.caption_mask = caption_emb, caption_mask
        self.leader: OpenWork | None = None  # a repeated OPEN waits for the first one (then finishes with it)
        self.followers: list[OpenWork] = []  # repeated OPENs waiting for this one
        self.abandoned = False  # its caller went away while repeated OPENs still wait for it
        self.encode_s = 0.0  # its share of the caption encoding (CloudVerifier._start)
        c = ctx
        if not ctx.encodes_captions and caption_emb is None:
            raise SessionError("this verifier has no text encoder: pass caption embeddings")
        if not 0 <= request.prefix_len <= c.block_size:
            raise SessionError(f"prefix_len must be in [0, {c.block_size}], got {request.prefix_len}")
        request.sampling.validate()
        window = request.jacobi_window
        if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= c.block_size:
            raise SessionError(f"jacobi_window must be an integer in [0, {c.block_size}], got {window!r}")
        self.s: Session | None = None
        self.cond: torch.Tensor | None = None  # [rows, cls, dim] embedded condition
        self.cond_pos = 0  # condition positions fed

    def admit(self, session: Session) -> None:
        """Build `session`, opened for this request (an OPEN of a session already held is a `repeat` instead)."""
        self.s = session
        session.work = self
        session.owner = self.owner
        session.open_request = self.request if self.REPEATABLE else None

    def repeat(self, held: Session) -> None:
        """An OPEN of a session this verifier holds: the same device's same OPEN (its reply was lost) is answered as
        the first was; anything else is a conflict."""
        sid = self.session_id
        if held.owner != self.owner or held.open_request != self.request:
            raise SessionConflictError(f"session {sid!r} is already open with another request")
        first = held.work
        if isinstance(first, OpenWork) and first.REPEATABLE and not first.done:
            self.leader = first  # the first OPEN is still building the session: finish with it
            first.followers.append(self)
        elif held.open_reply is not None:
            held.last_used = time.monotonic()
            self.finish(held.open_reply)
        else:
            raise SessionConflictError(f"session {sid!r} is already open and has moved on since its OPEN: RESUME it "
                                       "from its history")

    def pending(self) -> int:
        if self.leader is not None:
            return 0  # a repeated OPEN feeds nothing
        cls = self.ctx.cls
        return cls - self.cond_pos if self.cond_pos < cls else 1

    def position(self) -> int:
        cls = self.ctx.cls
        return self.cond_pos if self.cond_pos < cls else cls + len(self.s.tokens) - 1

    def abandon(self) -> None:
        """Its caller went away: a repeated OPEN stops waiting; a first OPEN that nobody else waits for fails and
        frees the session it was building."""
        if self.leader is not None:
            leader = self.leader
            if self in leader.followers:
                leader.followers.remove(self)
            self.finish(error=SessionError(f"session {self.session_id!r}: the caller went away"))
            if leader.abandoned and not leader.followers:
                leader.abandon()
        elif self.followers:
            self.abandoned = True
        else:
            self.finish(error=SessionError(f"session {self.session_id!r}: the caller went away"))

    def finish(self, result=None, error: BaseException | None = None) -> None:
        if error is not None and not self.done and self.s is not None and self.s.live:
            self.drop_session = True  # a half-built session is of no use: the verifier frees its slots
        was_done = self.done
        super().finish(result, error)
        if not was_done:
            followers, self.followers = self.followers, []
            for f in followers:  # repeated OPENs answer what the first answered
                f.finish(result, error)

    def kind(self) -> int:
        return PREFILL if self.cond_pos < self.ctx.cls else DECODE

    def piece(self, n: int) -> Piece:
        cls = self.ctx.cls
        if self.cond_pos < cls:  # a prefill chunk
            return Piece(self.slots, self.cond_pos, n, emb=self.cond[:, self.cond_pos:self.cond_pos + n],
                         want=[n - 1] if self.cond_pos + n == cls else [])
        return Piece(self.slots, cls + len(self.s.tokens) - 1, 1, tokens=[self.s.tokens[-1]], want=[0])

    def prefilled(self, piece: Piece) -> bool:
        """A prefill chunk was fed: True once the whole condition is in the cache (the embedded condition is
        dropped then)."""
        self.cond_pos += piece.n
        if self.cond_pos < self.ctx.cls:
            return False
        self.cond = None
        return True

    def take(self, piece: Piece, out) -> None:
        if piece.emb is not None:
            if not self.prefilled(piece):
                return
            if self.request.prefix_len == 0:  # the first image token's logits are kept for the first verification
                self.s.first_logits = out.logits[:, 0].clone()
                self.complete()
                return
        self.draw_from = out  # the step's decisions draw the next prefix token from it (`drawn`)

    def draw(self) -> Draw:
        """The prefix token to draw at image position len(tokens), from the cloud's stream."""
        return Draw(self.draw_from, self.s.sampling, self.s.seed, len(self.s.tokens))

    def drawn(self, token: int, stop: bool) -> None:
        self.draw_from = None
        self.s.tokens.append(token)
        if len(self.s.tokens) >= self.request.prefix_len:
            self.complete()

    def after_draw(self) -> int | None:
        """The position of the decode that feeds the token being drawn, when the work goes on after it (the
        engine's overlap schedules that decode before the draw is read); None: the draw is its last."""
        return self.ctx.cls + len(self.s.tokens) if len(self.s.tokens) + 1 < self.request.prefix_len else None

    def reply_tokens(self) -> list[int]:
        return self.s.tokens

    def kv_state(self):
        s = self.s
        if s is None or self.leader is not None or not s.live:
            return None
        cls = self.ctx.cls
        return s.slots, self.cond_pos if self.cond_pos < cls else cls + max(len(s.tokens) - 1, 0)

    def complete(self) -> None:
        self.s.work = None
        self.s.last_used = time.monotonic()
        r = self.request
        tokens = self.reply_tokens()
        emb, mask = self.caption_emb, self.caption_mask
        # the verifier's estimates read it (observe_costs): seconds, forwards, a verification?, queue, tokens made
        self.cost = (self.seconds, self.passes, False, None, len(tokens))
        # the wait before its first forward, less its caption's encoding (in cloud_s)
        started = self.started if self.started is not None else time.perf_counter()
        queue_s = max(0.0, started - self.created - self.encode_s)
        self.finish(OpenReply(
            r.session_id, torch.tensor(tokens, dtype=torch.long),
            # what the device conditions on: the caption embeddings, or a Chameleon prompt's embeddings (never its
            # ids as float16, which would round ids above 2048)
            self.ctx.caption(emb).detach().to("cpu", torch.float16) if r.want_caption else None,
            (mask.detach().cpu() if mask is not None else torch.ones(emb.shape[0], dtype=torch.bool))
            if r.want_caption else None, self.seconds, self.passes, self.ctx.vocab_size, queue_s))
        if self.REPEATABLE:
            self.s.open_reply = self.result  # until the session moves on: a repeated OPEN is answered with it


class JacobiWork(SpanFeed, OpenWork):
    """An open whose prefix tokens the cloud decodes by speculative Jacobi decoding (SJD; `OpenRequest.jacobi_window`
    > 0): after the prefill, each round feeds the last committed token and a window of drafts the cloud made itself,
    as a verification's span (scheduled, chunked and judged with the step's other spans); the judge tests the drafts
    with the session's rule (exact: SJD, the same distribution as one token a forward; gsd: GSD's groups) and drafts
    the window again from the distributions this forward computed past the commit, the rest of it uniformly
    (`ciar.engine.judge.Jacobi`). `ciar.decoding.jacobi.generate_sjd` decodes one image the
    same way outside the engine, with the same draws: the same caption and seed give the same tokens."""

    def __init__(self, ctx: WorkContext, request: OpenRequest, caption_emb=None, caption_mask=None, owner: str = ""):
        super().__init__(ctx, request, caption_emb, caption_mask, owner)
        self.window = request.jacobi_window
        self.phase = "prefill"  # prefill -> (feed -> judge) per round -> done
        self.drafts: list[int] = []
        self.q: torch.Tensor | None = None  # the drafts' distributions [k, V] on the device (None: uniform)
        self.got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # targets fed in earlier pieces, by index
        self.targets = None
        self.rounds: list[int] = []  # tokens committed per round

    def kind(self) -> int:
        return PREFILL if self.phase == "prefill" else SPAN

    def pending(self) -> int:
        if self.leader is not None:
            return 0
        if self.phase == "prefill":
            return self.ctx.cls - self.cond_pos
        return len(self.feed) - self.fed if self.phase == "feed" else 0

    def position(self) -> int:
        return self.cond_pos if self.phase == "prefill" else self.ctx.cls + self.start + self.fed

    def kv_state(self):
        s = self.s
        if s is None or self.leader is not None or not s.live:
            return None
        if self.phase == "prefill":
            return s.slots, self.cond_pos
        return s.slots, self.ctx.cls + max(len(s.tokens) - 1, 0)

    def piece(self, n: int) -> Piece:
        if self.phase == "prefill":
            return super().piece(n)
        a = self.fed
        return Piece(self.slots, self.ctx.cls + self.start + a, n, tokens=self.feed[a:a + n],
                     want=[i - a for i in self.want if a <= i < a + n])

    def take(self, piece: Piece, out) -> None:
        if self.phase == "prefill":
            if not self.prefilled(piece):
                return
            self.s.first_logits = out.logits[:, 0].clone()  # image token 0's target: the first round tests it
            k = min(self.window, self.request.prefix_len)  # the first window: uniform drafts (SJD's initialisation)
            # (image positions 0..k-1 with nothing committed: `Jacobi`'s key c * 2**32 + position at c = 0)
            u = keyed_uniform(stream_keys([self.s.seed], JACOBI_STREAM), torch.arange(k))
            self.feed_window(sample_at(torch.full((k, self.ctx.vocab_size), 1.0 / self.ctx.vocab_size), u).tolist())
            return
        self.take_feed(piece, out)

    def span(self) -> Span:
        """The round's judgement: its drafts (at least one: the window is never empty while tokens are left) with
        their distributions on the device, and the window to draft again."""
        s = self.s
        return Span(self.target_logits(), torch.tensor(self.drafts, dtype=torch.long), None, s.sampling, s.rule,
                    s.seed, len(s.tokens), jacobi=Jacobi(self.q, self.window))

    def commit(self, n: int, z: int, recovered: bool, judged: int, redraft=None) -> None:
        """The round's verdict (n drafts kept, next token z) and the window drafted again (tokens, their
        distributions on the device): commit, then the next round or the reply."""
        s = self.s
        new = (self.drafts[:n] + [z])[:self.request.prefix_len - len(s.tokens)]  # no bonus past the prefix
        s.tokens.extend(new)
        s.first_logits = None
        self.rounds.append(len(new))
        left = self.request.prefix_len - len(s.tokens)
        if left <= 0:
            self.complete()
            return
        tokens, q = redraft
        k = min(self.window, left)
        self.q = q[:k]
        self.feed_window(tokens[:k])


class ResumeWork(OpenWork):
    """A resume: prefill chunks, then the history's committed tokens (all but the last) fed in chunks with their
    injected interval features; nothing is sampled."""

    REPEATABLE = False

    def __init__(self, ctx: WorkContext, request: OpenRequest, history, injected: InjectedFeatures | None,
                 caption_emb=None, caption_mask=None, owner: str = ""):
        c = ctx
        h = torch.as_tensor(history)
        if h.dim() != 1 or (h.numel() and h.is_floating_point()):
            raise SessionError(f"session {request.session_id!r}: history must be a 1-D tensor of token ids")
        if h.numel() > c.block_size:
            raise SessionError(f"session {request.session_id!r}: history of {h.numel()} tokens exceeds the "
                               f"{c.block_size} image tokens")
        if h.numel() and (int(h.min()) < 0 or int(h.max()) >= ctx.vocab_size):
            raise SessionError(f"token ids must be in [0, {ctx.vocab_size})")
        if injected is not None:
            n = int(injected.positions.numel())
            check_projector_inputs(ctx, injected.device_hidden, injected.features, n,
                                   f"session {request.session_id!r}: injected", required=True)
            if n and (int(injected.positions.min()) < 0 or int(injected.positions.max()) >= h.numel() - 1):
                raise SessionError(f"session {request.session_id!r}: injected positions must index history[:-1]")
        super().__init__(ctx, replace(request, prefix_len=0), caption_emb, caption_mask, owner)
        self.history = h.long().tolist()
        self.injected = injected
        self.extras: dict[int, torch.Tensor] = {}
        self.fed = 0  # history tokens fed

    def admit(self, session: Session) -> None:
        super().admit(session)  # (the verifier closed a stale copy of the same session first: `admit_works`)
        self.s.tokens = list(self.history)
        inj = self.injected
        if self.ctx.projector is not None and inj is not None and inj.positions.numel():
            add = self.ctx.projector(to_device(inj.device_hidden, self.ctx.device),
                                     to_device(inj.features, self.ctx.device))
            self.extras = {int(p): add[i] for i, p in enumerate(inj.positions.tolist())}

    def kind(self) -> int:
        return PREFILL if self.cond_pos < self.ctx.cls else HISTORY

    def reply_tokens(self) -> list[int]:
        return []  # a resume generates nothing

    def pending(self) -> int:
        if self.cond_pos < self.ctx.cls:
            return super().pending()
        return len(self.history) - 1 - self.fed

    def position(self) -> int:
        cls = self.ctx.cls
        return self.cond_pos if self.cond_pos < cls else cls + self.fed

    def piece(self, n: int) -> Piece:
        if self.cond_pos < self.ctx.cls:
            return super().piece(n)
        a = self.fed
        return Piece(self.slots, self.ctx.cls + a, n, tokens=self.history[a:a + n],
                     extra=[(i - a, self.extras[i]) for i in range(a, a + n) if i in self.extras])

    def kv_state(self):
        s = self.s
        if s is None or not s.live:
            return None
        cls = self.ctx.cls
        return s.slots, self.cond_pos if self.cond_pos < cls else cls + self.fed

    def take(self, piece: Piece, out) -> None:
        if piece.emb is not None:
            if not self.prefilled(piece):
                return
            if not self.history:
                self.s.first_logits = out.logits[:, 0].clone()
        else:
            self.fed += piece.n
        if self.fed >= len(self.history) - 1:
            self.complete()


def check_projector_inputs(ctx: WorkContext, hidden, features, rows: int, what: str,
                           required: bool = False) -> None:
    """Interval features sent to the verifier: both arrays (or, unless `required`, neither), one row per token, the
    projector's widths (a malformed pair is refused with a SessionError before any session state changes)."""
    if (hidden is None) != (features is None):
        raise SessionError(f"{what}: device_hidden and features go together (one without the other)")
    if hidden is None:
        if required:
            raise SessionError(f"{what}: device_hidden and features are missing")
        return
    if hidden.dim() != 2 or features.dim() != 2 or hidden.shape[0] != rows or features.shape[0] != rows:
        raise SessionError(f"{what}: device_hidden and features need one row per token ({rows}), got "
                           f"{tuple(hidden.shape)} and {tuple(features.shape)}")
    if ctx.projector is not None:
        c = ctx.projector.config
        if hidden.shape[1] != c.device_dim or features.shape[1] != c.feature_dim:
            raise SessionError(f"{what}: device_hidden must be [{rows}, {c.device_dim}] and features "
                               f"[{rows}, {c.feature_dim}], got {tuple(hidden.shape)} and {tuple(features.shape)}")


def _ids(t: torch.Tensor) -> list[int]:
    """A request's token ids as a list (1-D as sent: one read, no reshape)."""
    return t.tolist() if t.dim() == 1 else t.reshape(-1).tolist()


class VerifyWork(SpanFeed, SessionWork):
    """A verification: its feed (committed-but-unfed token, new tokens, drafts) in one piece or chunks, one judge
    (batched with the step's other spans), then the cloud burst after a rejection: one decode step a token, or,
    when the session's OPEN asked for Jacobi windows (`Session.jacobi_window`), by Jacobi rounds (`_round`) whose
    first window is drafted from the verdict's own distributions past the rejection."""

    BURST_RULE = RuleConfig()  # a burst round's drafts are the cloud's own: judged exactly (SJD: the same distribution)

    def __init__(self, ctx: WorkContext, r: VerifyRequest):
        super().__init__(r.session_id)
        r = verify_tensors(r)
        self.ctx, self.request = ctx, r
        k, m = int(r.draft_tokens.numel()), int(r.new_tokens.numel())
        if r.draft_probs.shape[0] != k or (k and r.draft_probs.shape[-1] != ctx.vocab_size):
            raise SessionError(f"draft_probs must be [{k}, {ctx.vocab_size}], got {tuple(r.draft_probs.shape)}")
        if isinstance(r.burst, bool) or not isinstance(r.burst, int) or r.burst < 0:
            raise SessionError(f"burst must be an integer >= 0, got {r.burst!r}")
        if not 0.0 <= float(r.burst_entropy) <= 1.0:
            raise SessionError(f"burst_entropy must be in [0, 1], got {r.burst_entropy!r}")
        # as lists (one read each; what admit and commit take): 2-16 ids are checked faster in Python than by tensors
        self.new_ids, self.draft_ids = _ids(r.new_tokens), _ids(r.draft_tokens)
        for ids in (self.new_ids, self.draft_ids):
            if ids and (min(ids) < 0 or max(ids) >= ctx.vocab_size):
                raise SessionError(f"token ids must be in [0, {ctx.vocab_size})")
        if m or r.device_hidden is not None or r.features is not None:
            check_projector_inputs(ctx, r.device_hidden, r.features, m, f"session {r.session_id!r}")
        self.k, self.m = k, m
        self.s: Session | None = None
        self.phase = "feed"  # feed -> judge -> (burst) -> done
        self.got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # targets fed in earlier pieces, by index
        self.targets = None  # a PieceOutput: where all targets are when one piece fed them (the usual case)
        self.burst_tokens: list[int] = []
        self.outcome: tuple[int, int, bool, int] | None = None
        self.round: Jacobi | None = None  # a burst round in flight: its drafts' distributions, window and round
        self.drafts: list[int] = []

    def check_state(self, s: Session) -> Session:
        """`s` (the session this verification names) can take it now, or SessionError."""
        if s.work is not None:
            raise SessionError(f"session {self.session_id!r} has a request in flight")
        if len(s.tokens) + self.m + self.k > self.ctx.block_size:
            raise SessionError(f"session {self.session_id!r}: {len(s.tokens)} committed + {self.m} new + {self.k} "
                               f"drafts exceeds the {self.ctx.block_size} image tokens")
        return s

    def admit(self, session: Session) -> None:
        s = self.s = self.check_state(session)
        s.work = self
        s.open_reply = None  # the session moves on: its OPEN is no longer repeatable
        r, ctx = self.request, self.ctx
        self.start = max(len(s.tokens) - 1, 0)  # image index of the feed's first token
        self.feed = s.tokens[self.start:] + self.new_ids + self.draft_ids
        self.c_new = len(s.tokens) + self.m
        first = self.c_new - 1 - self.start  # target j sits at the output after feed entry first + j
        self.want = [first + j for j in range(self.k + 1)]
        self.extras: dict[int, torch.Tensor] = {}
        if ctx.projector is not None and r.device_hidden is not None and self.m:
            add = ctx.projector(to_device(r.device_hidden, ctx.device), to_device(r.features, ctx.device))  # [m, dim]
            off = len(s.tokens) - self.start  # new tokens follow the committed-but-unfed ones
            self.extras = {off + i: add[i] for i in range(self.m)}
        self.fed = 0
        if not self.feed:
            self.phase = "judge"

    def kind(self) -> int:
        return DECODE if self.phase == "burst" else SPAN

    def pending(self) -> int:
        if self.phase == "burst":
            return 1
        return len(self.feed) - self.fed if self.phase == "feed" else 0

    def position(self) -> int:
        cls = self.ctx.cls
        return cls + len(self.s.tokens) - 1 if self.phase == "burst" else cls + self.start + self.fed

    def piece(self, n: int) -> Piece:
        cls = self.ctx.cls
        if self.phase == "burst":
            return Piece(self.slots, cls + len(self.s.tokens) - 1, 1, tokens=[self.s.tokens[-1]], want=[0])
        a = self.fed
        return Piece(self.slots, cls + self.start + a, n, tokens=self.feed[a:a + n],
                     extra=[(i - a, self.extras[i]) for i in range(a, a + n) if i in self.extras],
                     want=[i - a for i in self.want if a <= i < a + n])

    def kv_state(self):
        s = self.s
        if s is None or not s.live:
            return None
        return s.slots, self.ctx.cls + max(len(s.tokens) - 1, 0)

    def take(self, piece: Piece, out) -> None:
        if self.phase == "burst":
            self.draw_from = out  # the step's decisions draw the burst token from it (`drawn`)
            return
        self.take_feed(piece, out)

    def fault(self, error: BaseException) -> None:
        """Its forward failed. Before its verdict the session is as before the request (its tokens and cache lengths
        are only set by `commit`): the verify fails with the retryable `error` and may be sent again as it is. After
        the verdict (a burst step failed) the session has moved past what the device knows: it is closed, and the
        device resumes it from its history (`SessionLostError`), as after a lost replica."""
        if self.outcome is None:
            self.finish(error=error)
            return
        self.drop_session = True  # the verifier closes it when this work leaves the engine
        lost = SessionLostError(f"session {self.session_id!r} was dropped: a cloud burst step failed after its "
                                f"verdict ({error}); resume it from its history", self.session_id)
        lost.origin = error  # (not chained as __cause__: the transports unwrap causes and must find this one)
        self.finish(error=lost)

    def burst_window(self) -> int:
        """Drafts in the next burst round: the session's window, within the burst's tokens and the image's."""
        return min(self.s.jacobi_window, self.request.burst - len(self.burst_tokens),
                   self.ctx.block_size - len(self.s.tokens))

    def span(self) -> Span:
        """What the step's judge needs: the targets, the drafts as sent, the session's sampling and rule, and the
        first draft's image position (the committed count after the catch-up); for a session whose bursts go by
        Jacobi windows, the burst's first window to draft. A burst round: its drafts and their distributions."""
        s, r = self.s, self.request
        if self.round is not None:
            return Span(self.target_logits(), torch.tensor(self.drafts, dtype=torch.long), None, s.sampling,
                        self.BURST_RULE, s.seed, len(s.tokens), jacobi=self.round)
        window = min(s.jacobi_window, r.burst)  # (0 without a window or a burst)
        return Span(self.target_logits(), r.draft_tokens, r.draft_probs, s.sampling, s.rule, s.seed, self.c_new,
                    self.target_hidden() if s.rule.rule == "cascade" else None,
                    redraft=Redraft(window) if window > 0 else None)

    def draw(self) -> Draw:
        """The burst token to draw at image position len(tokens), with the request's entropy stop."""
        return Draw(self.draw_from, self.s.sampling, self.s.seed, len(self.s.tokens),
                    float(self.request.burst_entropy))

    def commit(self, n: int, z: int, recovered: bool, judged: int, redraft=None, stop: int = -1) -> None:
        """Apply the judge's verdict (n drafts kept, next token z); burst on after a rejection, else reply. With
        `redraft` (tokens, their distributions on the device: the window the judge drafted past the commit) the
        burst goes by Jacobi rounds."""
        if self.round is not None:
            self._commit_round(n, z, redraft, stop)
            return
        s, r, c = self.s, self.request, self.ctx
        s.tokens.extend(self.new_ids + self.draft_ids[:n] + [z])
        s.first_logits = None
        self.got, self.targets = {}, None
        self.outcome = (n, z, recovered, judged)
        if recovered and r.burst > 0 and len(s.tokens) < c.block_size:
            if redraft is not None and self.burst_window() > 0:
                self._round(redraft)
            else:
                self.phase = "burst"
        else:
            self.complete()

    def _round(self, redraft) -> None:
        """A burst round: feed the last committed token and a window of drafts (from the judge's redraft), judged
        as a span (its drafts the cloud's own, each kept with min(1, p / q)); its tokens are burst tokens."""
        s = self.s
        k = self.burst_window()
        tokens, q = redraft
        self.round = Jacobi(q[:k], min(s.jacobi_window, self.request.burst), float(self.request.burst_entropy))
        self.extras = {}
        self.feed_window(tokens[:k])

    def _commit_round(self, n: int, z: int, redraft, stop: int) -> None:
        """A burst round's verdict: its kept drafts and next token are burst tokens, up to the burst's size and the
        image's end; the entropy stop (`stop`: the first token not taken) ends the burst, as it does one token a
        forward. Then the next round, or the reply."""
        s, r, c = self.s, self.request, self.ctx
        new = self.drafts[:stop] if stop >= 0 else self.drafts[:n] + [z]
        new = new[:min(r.burst - len(self.burst_tokens), c.block_size - len(s.tokens))]
        s.tokens.extend(new)
        self.burst_tokens.extend(new)
        self.round, self.got, self.targets = None, {}, None
        if stop >= 0 or len(self.burst_tokens) >= r.burst or len(s.tokens) >= c.block_size:
            self.complete()
        elif redraft is None:  # (the judge drafts a round's next window; were it missing: one token a forward)
            self.phase = "burst"
        else:
            self._round(redraft)

    def drawn(self, token: int, stop: bool) -> None:
        """Cloud burst: after a rejection the session's cloud samples up to `burst` more tokens itself, stopping
        early when its next distribution's normalised entropy falls to `burst_entropy` or below (`stop`: the device
        can take over there; that step's forward is spent) or at the last image token. Each token is drawn at its
        image position from the cloud's stream (`ciar.engine.judge`), as a prefix token there would be."""
        s, r, c = self.s, self.request, self.ctx
        self.draw_from = None
        if stop:
            self.complete()
            return
        s.tokens.append(token)
        self.burst_tokens.append(token)
        if len(self.burst_tokens) >= r.burst or len(s.tokens) >= c.block_size:
            self.complete()

    def after_verdict(self) -> int | None:
        """A verification (not a burst round) whose verdict may start a cloud burst one token a forward: the position
        of that burst's first decode, less the drafts the verdict keeps (the engine's overlap runs the decode before
        the verdict is read, fed its next token there, and drops it when no burst follows); None otherwise."""
        s, r = self.s, self.request
        if self.round is not None or r.burst <= 0 or s.jacobi_window > 0:
            return None
        return self.ctx.cls + self.c_new if self.c_new + 1 < self.ctx.block_size else None

    def after_draw(self) -> int | None:
        """As `OpenWork.after_draw`: a burst token's decode goes on unless the token is the burst's last or the
        image's (an entropy stop may still end it: the engine then drops the decode it scheduled)."""
        s = self.s
        goes_on = len(self.burst_tokens) + 1 < self.request.burst and len(s.tokens) + 1 < self.ctx.block_size
        return self.ctx.cls + len(s.tokens) if goes_on else None

    def complete(self) -> None:
        self.s.work = None
        self.s.last_used = time.monotonic()
        n, z, rec, judged = self.outcome
        b = self.burst_tokens
        queue_s = max(0.0, (self.started if self.started is not None else time.perf_counter()) - self.created)
        self.cost = (self.seconds, max(self.passes, 1), True, queue_s, len(b))  # read by the verifier (observe_costs)
        self.finish(VerifyReply(self.session_id, n, z, rec, self.seconds, judged, forward_passes=max(self.passes, 1),
                                burst_tokens=torch.tensor(b, dtype=torch.long) if b else None,
                                vocab_size=self.ctx.vocab_size, queue_s=queue_s))
