"""The verifier's judge and sampler: every decision of an engine step in one batched pass, one copy each way.

    judge = Judge(cloud, codebook)
    decided = judge.decide(draws, spans, step_logits)   # after the step's forward: all on the accelerator
    decided.bad                                          # rows of step_logits that were not finite
    decided.tokens[i], decided.stops[i]                  # draws[i]'s token, and whether its entropy stop fired
    decided.verdicts[i]                                  # spans[i]'s (drafts kept, next token, resampled)
    deciding = judge.launch(draws, spans, step_logits)   # the same, queued: deciding.tokens on the device at once,
    decided = deciding.collect()                         # the host read later (the engine's overlap)
    judge = Judge(cloud, codebook, compiled=True)        # the arithmetic by torch.compile'd functions
    judge.warm(sampling, span=4)                         # ... compiled now, not at the first steps

A step asks two kinds of decision of the rows its forward computed:
  draw   one token the cloud samples itself (a prefix or cloud-only token, a cloud-burst token), with the burst's
         entropy stop: `Draw(logits [rows, V], sampling, seed, position, stop_entropy)`
  span   the verdict on a verification's drafts: `Span(targets [rows, k+1, V], drafts [k], draft probs [k, V]
         float16 as sent, sampling, rule, seed, position, hidden [k+1, D] | None)`; a Jacobi round's span
         (`jacobi=Jacobi(q, window, stop_entropy)`: drafts the cloud made itself, their q on the device) also
         gets its window drafted again (`Decided.redrafts`) and, for a cloud burst's round, where its entropy stop
         fired (`Decided.span_stops`); a verification whose rejection starts a burst by windows asks for the burst's
         first window (`redraft=Redraft(window)`)
`decide` computes all of them at once: every row the step's draws and spans read gathered by one index, and every
row's guidance, temperature, top-k and top-p in one call with per-row parameter tensors
(`ciar.decoding.sampling.rows_to_probs`, once a step: `_step_math`); every uniform the step draws at in one call,
counter-based and keyed by (seed, stream, image position) (`ciar.decoding.sampling.counter_uniform`: its (seed,
stream) part on the host, once per session and stream, `stream_key`; the position's part for all of the step's
uniforms at once on the accelerator, `keyed_uniform`); every draw by inverse CDF; every span of an acceptance rule
in one `verify_span` call (one call per distinct rule configuration in the step; a deployment has one). No
per-session generator, no reseeding, nothing that depends on what else the step holds. (A compiled judge computes
its draws and each of its span groups by a compiled function of their own: `compiled_math`.) The step's host inputs
(drafts, draft probabilities, seeds, positions, sampling parameters, row indices) travel in one buffer (pinned on
CUDA) by one non-blocking copy (`HostPack`); every result (the non-finite flags, the tokens, the stops, the verdicts)
comes back in one device-to-host transfer, the step's only host read.

Draw streams and positions (fixed forever: changing them changes every image for a given seed): a token the cloud
samples at image position i uses `uniform(seed, CLOUD_STREAM, i)`; a verification whose catch-up leaves c committed
tokens tests draft j (image position c + j) with `uniform(seed, ACCEPT_STREAM, c + j)` and draws its next token at
position c + n with `uniform(seed, NEXT_STREAM, c + n)` (`ciar.collab.acceptance.SpanDraws.counter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ciar.collab.acceptance import (CascadeConfig, GsdConfig, LanternConfig, NeighborTable, SpanDraws, VerifyOutput,
                                    verify_span)
from ciar.collab.gating import entropy_score
from ciar.collab.protocol import RuleConfig, SessionError, draft_distribution
from ciar.engine.runner import PieceOutput, consecutive
from ciar.engine.transfer import HostPack, HostRead
from ciar.decoding.sampling import RowSampling, SamplingParams, keyed_uniform, rows_to_probs, sample_at, stream_keys
from ciar_device.maths import ACCEPT_STREAM, CLOUD_STREAM, JACOBI_STREAM, NEXT_STREAM


@dataclass
class Draw:
    """One token the cloud samples itself from a session's logits [rows, V] (cond, then uncond with CFG) at image
    position `position`; `stop_entropy` > 0: the draw is withdrawn when the distribution's normalised entropy is at
    or below it (a cloud burst's stop: the device can take over there)."""

    logits: object  # a PieceOutput of this step (one wanted position), or [rows, V]
    sampling: SamplingParams
    seed: int
    position: int
    stop_entropy: float = 0.0


@dataclass
class Jacobi:
    """What makes a span a Jacobi round (speculative Jacobi decoding: drafts the cloud made itself): the drafts'
    distributions [k, V] float32 on the device (None: uniform, the first window), and the window to draft again
    after the verdict, from this forward's distributions past the commit and uniformly beyond, each token at
    `uniform(seed, JACOBI_STREAM, c * 2**32 + image position)`, c the committed count after the verdict
    (`ciar.decoding.jacobi`: a function of the session's tokens, so a resumed session drafts the same windows). A
    cloud burst's round also has the burst's entropy stop (`stop_entropy` > 0): the round ends before the first
    position whose distribution's entropy / log V is at or below it (`Decided.span_stops`), as a burst of one token
    a forward stops there."""

    q: torch.Tensor | None
    window: int
    stop_entropy: float = 0.0


@dataclass
class Redraft:
    """A verification whose rejection starts a cloud burst by Jacobi windows: the burst's first window (`window`
    drafts) drafted from the verdict's own distributions past the commit, as a Jacobi round's next window is
    (`Decided.redrafts`)."""

    window: int


@dataclass
class Span:
    """A verification's judgement: the target logits [rows, k+1, V], the drafts [k] and their float16 draft
    probabilities as sent [k, V] (host tensors), the first draft's image position (the committed count after the
    catch-up), and the target hidden states [k+1, D] (CASCADE's convergence test) when known."""

    targets: object  # a PieceOutput of this step (k+1 wanted positions), or [rows, k+1, V]
    drafts: torch.Tensor
    draft_probs: torch.Tensor
    sampling: SamplingParams
    rule: RuleConfig
    seed: int
    position: int
    hidden: torch.Tensor | None = None
    jacobi: Jacobi | None = None  # a Jacobi round: its q is on the device, and the window is drafted again
    redraft: Redraft | None = None  # a verification: the window a burst after its rejection starts with

    @property
    def drafting(self) -> int | None:
        """The window drafted after the verdict (its drafts), if any."""
        if self.jacobi is not None:
            return self.jacobi.window
        return self.redraft.window if self.redraft is not None else None

    @property
    def k(self) -> int:
        return int(self.drafts.numel())


@dataclass
class Decided:
    bad: list[bool]  # per row of the step's logits: not finite
    tokens: list[int]  # per draw
    stops: list[bool]  # per draw: its entropy stop fired (the token is not taken)
    verdicts: list[tuple[int, int, bool]]  # per span: (drafts kept, next token, resampled)
    errors: dict[int, BaseException]  # span index -> why it could not be judged (its rule's configuration)
    # span index -> a Jacobi round's window drafted again, or a burst's first window: (tokens [window], their
    # distributions [window, V] on the device)
    redrafts: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    # span index -> where a burst round's entropy stop fired (the index of the first token not taken), for the
    # rounds that have one and stopped
    span_stops: dict[int, int] = field(default_factory=dict)


class Judge:
    """The acceptance rules and the sampler over the cloud's logits (see the module docstring)."""

    def __init__(self, cloud, codebook: torch.Tensor | None = None, compiled: bool = False):
        """`compiled`: the step's draws and the spans of the rules in COMPILED_RULES computed by `torch.compile`d
        functions (`compiled_math`: their elementwise chains fused, far fewer kernels or operations a step);
        otherwise eagerly. Their probabilities differ from the eager ones in the last bits (the fused reductions
        sum in another order), so a draw that falls within that rounding can take the neighbouring token: the same
        request and seed give the same image on the same setting, not across the two."""
        self.cloud = cloud
        self.vocab_size, self.dim = cloud.config.vocab_size, cloud.config.dim
        self.codebook = codebook  # [V, D] raw codebook vectors, for LANTERN's neighbour sets
        self._neighbors: dict[int, NeighborTable] = {}
        self.compiled = bool(compiled)
        self._draw_math, self._span_math = compiled_math() if self.compiled else (_draw_math, _span_math)
        # what the compiled functions take (`compiles`): the acceptance rules of the spans (all of COMPILED_RULES,
        # each compiled at its first step, until a warm-up names one) and whether rows with top-p (a warm-up with
        # top-p on); the rest runs eagerly
        self.compiled_rules = set(COMPILED_RULES) if self.compiled else set()
        self.compiled_top_p = False

    @property
    def device(self) -> torch.device:
        return self.cloud.tok_embeddings.weight.device

    @torch.inference_mode()
    def warm(self, sampling: SamplingParams, span: int, rule: RuleConfig | None = None) -> int:
        """Make a compiled judge's compilations now (start-up) rather than at the first steps that need them: a step
        of two draws, one of two spans of `span` drafts and, for `span` > 1, one of two spans of several lengths
        (a lone draw or span runs as one of two rows: `launch`), with `sampling` on every row (the deployment's
        default) and `rule` (default: exact). After it nothing compiles: every other sampling setting runs on the
        same compilations (`compiles`) but top-p when `sampling` has none; such rows, and the spans of other rules,
        run eagerly. -> steps decided (0 when not compiled)."""
        if not self.compiled:
            return 0
        rule = rule or RuleConfig()
        self.compiled_top_p = sampling.top_p < 1.0
        self.compiled_rules = {rule.rule} & set(COMPILED_RULES)
        g = torch.Generator().manual_seed(0)
        rows, v, dev = 2 if sampling.uses_cfg else 1, self.vocab_size, self.device

        def span_of(k: int) -> Span:
            q = torch.full((k, v), 1.0 / v, dtype=torch.float16)
            return Span(torch.randn(rows, k + 1, v, generator=g).to(dev), torch.randint(0, v, (k,), generator=g),
                        q, sampling, rule, seed=0, position=0)

        steps = [([Draw(torch.randn(rows, v, generator=g).to(dev), sampling, i, 0, 0.5) for i in range(2)], []),
                 ([], [span_of(span), span_of(span)])]
        if span > 1:
            steps.append(([], [span_of(span), span_of(1)]))
        for draws, spans in steps:
            self.decide(draws, spans)
        return len(steps)

    def compiles(self, sampling: SamplingParams, rule: str | None = None) -> bool:
        """Whether a draw with `sampling` (a span: of acceptance `rule`) is computed by the compiled functions. They
        take every setting in one compilation (`_envelope`: temperature, greedy and top-k always on, per row), and
        top-p when the warm-up had it (`compiled_top_p`: a sort of every row's probabilities a step, not paid by a
        deployment without top-p), for the rules in `compiled_rules`; the rest runs eagerly. So a request's
        decisions never depend on what else its step holds, and after a warm-up nothing compiles while serving."""
        return self.compiled and (rule is None or rule in self.compiled_rules) and \
            (sampling.top_p >= 1.0 or self.compiled_top_p)

    def neighbor_table(self, k: int) -> NeighborTable:
        if self.codebook is None:
            raise SessionError("the LANTERN rule needs the tokenizer's codebook; this verifier was built without it")
        k = min(k, self.vocab_size)
        if k not in self._neighbors:
            self._neighbors[k] = NeighborTable.from_codebook(self.codebook, k).to(self.device)
        return self._neighbors[k]

    def decide(self, draws: list[Draw], spans: list[Span], step_logits: torch.Tensor | None = None) -> Decided:
        """Every draw and span of a step (see the module docstring), and which rows of the step's logits [S, V] are
        not finite: one copy to the device, one back."""
        return self.launch(draws, spans, step_logits).collect()

    @torch.inference_mode()
    def launch(self, draws: list[Draw], spans: list[Span], step_logits: torch.Tensor | None = None) -> "Deciding":
        """`decide` up to its host read: the step's decisions queued on the accelerator and their copy back queued
        behind them, nothing waited for. -> `Deciding`: `collect()` reads them (waiting for that copy only);
        `tokens` holds the draws' tokens on the device meanwhile (the next step's inputs can take them from
        there: the engine's overlap)."""
        dev, v_size = self.device, self.vocab_size
        pack = HostPack(dev)
        errors: dict[int, BaseException] = {}
        source = _Source(step_logits)
        # --- what the host knows, packed: row indices, sampling rows, seeds, positions, drafts, draft probabilities
        n_draws = len(draws)
        stopping = any(d.stop_entropy > 0 for d in draws)
        # the draws the compiled functions take, then those computed eagerly (each one's tokens go back to its place)
        by_path = [[i for i, d in enumerate(draws) if self.compiles(d.sampling) == c] for c in (True, False)]
        # the draws and spans computed eagerly share one pass over all their rows (`_Eager`, `_step_math`)
        eager = _Eager()
        draw_in = [self._draw_group(pack, source, [draws[i] for i in idx], idx, compiled, stopping, n_draws, eager)
                   for idx, compiled in zip(by_path, (True, False)) if idx]
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(spans):
            # one verify_span per configuration (Jacobi rounds apart: their q is already on the device; spans that
            # draft a window after the verdict apart, and those with an entropy stop)
            groups.setdefault(tuple(vars(s.rule).values()) + (
                s.jacobi is not None, s.drafting is not None, s.jacobi is not None and s.jacobi.stop_entropy > 0,
                self.compiles(s.sampling, s.rule.rule)), []).append(i)
        span_in = []
        for key, idx in groups.items():
            g = [spans[i] for i in idx]
            kmax = max(s.k for s in g)
            jacobi = g[0].jacobi is not None
            drafting = g[0].drafting is not None
            stopping_rounds = jacobi and g[0].jacobi.stop_entropy > 0
            compiled = key[-1]  # (`compiles`, part of the group's key)
            rows = [source.rows(s.targets, s.k + 1) for s in g]
            # a lone span computed twice by a compiled judge: no compilation of its own for one span (the plain
            # verdict only: no window drafted after it, so no Jacobi round and no entropy stop)
            pad = compiled and len(g) == 1 and not drafting
            if pad:
                g, rows = g * 2, rows * 2
            ragged = any(s.k != kmax for s in g)
            counts = [s.k + 1 for s in g] if ragged else kmax + 1  # each span's targets
            positions = torch.tensor([s.position for s in g], dtype=torch.long)
            if compiled:  # its own rows, sampling rows and stream keys
                own = dict(sampling=self._sampling_rows(pack, [s.sampling for s in g], [r[2] for r in rows], True,
                                                        counts),
                           rows=pack.add(consecutive([r[0] for r in rows] + [r[1] for r in rows],
                                                     counts if isinstance(counts, int) else counts + counts)),
                           accept_keys=pack.add(stream_keys([s.seed for s in g], ACCEPT_STREAM)),
                           next_keys=pack.add(stream_keys([s.seed for s in g], NEXT_STREAM)))
            else:  # its rows in the step's eager pass, and every uniform it draws at (`SpanDraws.keys_at`'s grid)
                keys, at = torch.broadcast_tensors(*SpanDraws.keys_at(stream_keys([s.seed for s in g], ACCEPT_STREAM),
                                                                      stream_keys([s.seed for s in g], NEXT_STREAM),
                                                                      positions, kmax))
                own = dict(shared=eager.add(
                    consecutive([r[0] for r in rows], counts), consecutive([r[1] for r in rows], counts),
                    [s.sampling for s in g], [r[2] for r in rows], [s.k + 1 for s in g], keys.reshape(-1),
                    at.reshape(-1)))
            if ragged:
                drafts = torch.zeros(len(g), kmax, dtype=torch.long)
                for b, s in enumerate(g):
                    drafts[b, :s.k] = s.drafts
            else:
                drafts = torch.cat([s.drafts.reshape(-1) for s in g]).to(torch.long).view(len(g), kmax)
            # where the ragged rows go in the padded [B, K+1] / [B, K] layouts
            p_at = [b * (kmax + 1) + j for b, s in enumerate(g) for j in range(s.k + 1)] if ragged else []
            q_at = [b * max(kmax, 1) + j for b, s in enumerate(g) for j in range(s.k)] if ragged else []
            span_in.append(dict(
                idx=idx, b=len(g), pad=pad, compiled=compiled, kmax=kmax, ragged=ragged, **own,
                drafts=pack.add(drafts),
                lengths=pack.add(torch.tensor([s.k for s in g], dtype=torch.long)),
                positions=pack.add(positions),
                q=None if jacobi else pack.add(torch.cat([_as_sent(s.draft_probs, s.k, v_size) for s in g])
                                               if kmax else torch.zeros(0, v_size, dtype=torch.float16)),
                jacobi=jacobi,
                redraft=dict(window=max(s.drafting for s in g),
                             keys=pack.add(stream_keys([s.seed for s in g], JACOBI_STREAM)))
                if drafting else None,
                stop=pack.add(torch.tensor([s.jacobi.stop_entropy for s in g], dtype=torch.float32))
                if stopping_rounds else None,
                p_at=pack.add(torch.tensor(p_at, dtype=torch.long)),
                q_at=pack.add(torch.tensor(q_at, dtype=torch.long))))
        eager.pack(self, pack)
        pack.send()

        # --- on the device
        logits = source.tensor()
        eager.compute(self, pack, logits)
        outs = []
        bad = None
        if step_logits is not None and step_logits.numel():
            bad = non_finite_rows(step_logits)
            outs.append(bad)
        drawn = None
        if draws:
            parts = [self._draws_on_device(d, pack, logits, eager) for d in draw_in]
            if len(parts) == 1:
                drawn, stops = parts[0]
            else:  # each path's draws back to their places
                def placed(j: int, dtype: torch.dtype) -> torch.Tensor:
                    out = torch.empty(n_draws, dtype=dtype, device=dev)
                    for d, part in zip(draw_in, parts):
                        out.index_copy_(0, pack[d["at"]], part[j])
                    return out

                drawn, stops = placed(0, torch.long), placed(1, torch.bool) if stopping else None
            outs.append(drawn)
            if stopping:
                outs.append(stops)
        judged = []
        on_device: dict[int, tuple] = {}  # span index -> (its group's drafts kept, next tokens, its row)
        for g in span_in:
            group = [spans[i] for i in g["idx"]]
            try:
                out, redraft, stop = self._judge_group(group, g, pack, logits, eager)
            except (SessionError, ValueError) as e:  # a rule this verifier cannot apply: those spans fail
                for i in g["idx"]:
                    errors[i] = e
                continue
            judged.append((g["idx"], redraft, stop is not None))
            for j, i in enumerate(g["idx"]):
                on_device[i] = (out.num_accepted, out.next_token, j)
            outs += [out.num_accepted, out.next_token, out.recovered]
            if redraft is not None:
                outs.append(redraft[0])
            if stop is not None:
                outs.append(stop)
        # the step's one host read, queued behind its decisions
        return Deciding(HostRead(outs), 0 if bad is None else int(bad.numel()), n_draws, stopping, judged,
                        len(spans), errors, drawn, on_device)

    def _judge_group(self, group: list[Span], g: dict, pack: HostPack, logits: torch.Tensor, eager: "_Eager"):
        """One acceptance rule's spans, every row at once. -> (verify_span's verdicts; for Jacobi rounds and spans
        that start a burst's window, the windows drafted: (tokens [B * window], distributions [B, window, V]), else
        None; for burst rounds, where each one's entropy stop fired: [B], -1 where it did not, else None)."""
        dev, v_size = self.device, self.vocab_size
        b, kmax = g["b"], g["kmax"]
        rule = group[0].rule
        if not g["jacobi"]:
            q_in = pack[g["q"]]  # float16 as sent, normalised by the span arithmetic
        else:  # a Jacobi round's q as its drafts were drawn from (float32 on the device; the first window uniform)
            q_in = torch.cat([s.jacobi.q if s.jacobi.q is not None else
                              torch.full((s.k, v_size), 1.0 / v_size, device=dev) for s in group])
        kwargs = {}
        if rule.rule == "lantern":
            kwargs["neighbors"] = self.neighbor_table(rule.lantern_k)
            kwargs["lantern"] = LanternConfig(k=rule.lantern_k, delta=rule.lantern_delta)
        elif rule.rule == "gsd":  # GSD's groups: distances between the cloud's input embeddings
            emb = self.cloud.tok_embeddings.weight
            if emb.shape[0] != v_size:
                raise SessionError("the gsd rule needs one input embedding per image token; this cloud's "
                                   f"embeddings have {emb.shape[0]} rows for {v_size} image tokens")
            kwargs["token_embeddings"] = emb
            kwargs["gsd"] = GsdConfig(rule.gsd_ranks, rule.gsd_prob_gap, rule.gsd_distance)  # (checked: ValueError)
        elif rule.rule == "cascade":
            kwargs["cascade"] = CascadeConfig(threshold=rule.cascade_threshold)
            kwargs["token_embeddings"] = (self.cloud.output.weight if self.cloud.output is not None
                                          else self.cloud.image_head_weight)  # a Chameleon cloud's image rows
            if all(s.hidden is not None for s in group):
                flat = torch.cat([s.hidden.float().to(dev) for s in group])
                if g["ragged"]:
                    hidden = torch.zeros(b * (kmax + 1), self.dim, device=dev)
                    hidden[pack[g["p_at"]]] = flat
                    flat = hidden
                kwargs["target_hidden"] = flat.view(b, kmax + 1, self.dim)
        p_at, q_at = (pack[g["p_at"]], pack[g["q_at"]]) if g["ragged"] else (None, None)
        if g["compiled"]:
            targets = logits.index_select(0, pack[g["rows"]])  # (as `_draws_on_device` gathers its rows)
            p, out = self._span_math(targets, self._rows(pack, g["sampling"]), self._has_uncond(pack, g["sampling"]),
                                     q_in, not g["jacobi"], pack[g["drafts"]], pack[g["accept_keys"]],
                                     pack[g["next_keys"]], pack[g["positions"]], pack[g["lengths"]], p_at, q_at, b,
                                     kmax, rule.rule, kwargs)
        else:  # its targets' probabilities and its uniforms from the step's eager pass
            row, t, at = g["shared"]
            draws = SpanDraws.from_uniforms(eager.u[at:at + b * 2 * (kmax + 1)].view(b, 2, kmax + 1), kmax)
            p, out = _spans_from_probs(eager.probs[row:row + t], q_in, not g["jacobi"], pack[g["drafts"]], draws,
                                       pack[g["lengths"]], p_at, q_at, b, kmax, rule.rule, kwargs)
        if g["pad"]:  # a lone span's twin off
            p, out = p[:1], VerifyOutput(out.num_accepted[:1], out.next_token[:1], out.recovered[:1])
        stop = None
        if g["stop"] is not None:  # the first position a token would be taken at (<= n) whose entropy is low enough
            thr = pack[g["stop"]][:, None]
            low = (entropy_score(p) <= thr) & (thr > 0) & \
                (torch.arange(kmax + 1, device=dev)[None] <= out.num_accepted.long()[:, None])
            stop = torch.where(low.any(dim=1), low.long().argmax(dim=1), torch.full((), -1, device=dev))
        if g["redraft"] is None:
            return out, None, stop
        return out, self._redraft(p, out.num_accepted, pack[g["lengths"]], pack[g["positions"]], g["redraft"],
                                  pack), stop

    def _redraft(self, p: torch.Tensor, accepted: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                 jacobi: dict, pack: HostPack) -> tuple[torch.Tensor, torch.Tensor]:
        """The Jacobi update of every round of a group at once: window position j after the commit (image position
        c + j, c = position + accepted + 1) takes this forward's distribution there (p's row accepted + 1 + j, when
        the round computed it: <= k) or the uniform one, and its draft from it at `uniform(seed, JACOBI_STREAM,
        c * 2**32 + c + j)`: keyed by the committed count, which the session's tokens alone fix (not by how many
        rounds made them), so a session resumed from its history drafts the same windows. p [B, K+1, V] -> (tokens
        [B * W], distributions [B, W, V])."""
        b, v_size, w = p.shape[0], p.shape[-1], jacobi["window"]
        j = torch.arange(w, device=p.device)
        at = accepted.long()[:, None] + 1 + j  # [B, W]: the row of p each window position takes
        q = p[torch.arange(b, device=p.device)[:, None], at.clamp(max=p.shape[1] - 1)]
        q = torch.where((at <= lengths[:, None])[..., None], q, torch.full((), 1.0 / v_size, device=p.device))
        c = positions[:, None] + accepted.long()[:, None] + 1  # [B, 1]: the committed count after the verdict
        pos = c + j + (c << 32)
        u = keyed_uniform(pack[jacobi["keys"]][:, None].expand(b, w).reshape(-1), pos.reshape(-1))
        return sample_at(q.reshape(b * w, v_size), u), q

    def _draw_group(self, pack: HostPack, source: "_Source", draws: list[Draw], idx: list[int], compiled: bool,
                    stopping: bool, n_all: int, eager: "_Eager") -> dict:
        """The host inputs of the draws one path computes (`compiled` or eagerly; `idx`: their places among the
        step's `n_all` draws), packed (compiled) or added to the step's eager pass -> their handles."""
        rows = [source.rows(d.logits, 1) for d in draws]
        n = len(draws)
        if compiled and n == 1:  # a lone draw computed twice: no compilation of its own for one row
            draws, rows = draws * 2, rows * 2
        keys = stream_keys([d.seed for d in draws], CLOUD_STREAM)
        positions = torch.tensor([d.position for d in draws], dtype=torch.long)
        if compiled:
            own = dict(idx=pack.add(torch.tensor([r[0] for r in rows] + [r[1] for r in rows], dtype=torch.long)),
                       sampling=self._sampling_rows(pack, [d.sampling for d in draws], [r[2] for r in rows], True),
                       keys=pack.add(keys), positions=pack.add(positions))
        else:
            own = dict(shared=eager.add(torch.tensor([r[0] for r in rows], dtype=torch.long),
                                        torch.tensor([r[1] for r in rows], dtype=torch.long),
                                        [d.sampling for d in draws], [r[2] for r in rows], [1] * n, keys, positions))
        return dict(
            n=n, compiled=compiled, at=pack.add(torch.tensor(idx, dtype=torch.long)) if n < n_all else None, **own,
            # (compiled: the stops always, zeros for none: one compilation for draws with and without; and both paths
            # give stops when either does)
            stop=pack.add(torch.tensor([d.stop_entropy for d in draws], dtype=torch.float32))
            if stopping or compiled else None)

    def _draws_on_device(self, d: dict, pack: HostPack, logits: torch.Tensor, eager: "_Eager"):
        """One path's draws (`_draw_group`) -> (tokens [n], stopped [n] or None)."""
        stop = None if d["stop"] is None else pack[d["stop"]]
        if not d["compiled"]:  # their probabilities and uniforms from the step's eager pass
            row, n, at = d["shared"]
            return _draws_from_probs(eager.probs[row:row + n], eager.u[at:at + n], stop)
        # (the rows gathered here: a tensor made in inference mode whatever the step's logits are, so that a compiled
        # judge meets one kind of input, as its warm-up made it)
        both = logits.index_select(0, pack[d["idx"]])
        tokens, stops = self._draw_math(both, both.shape[0] // 2, self._rows(pack, d["sampling"]),
                                        self._has_uncond(pack, d["sampling"]), pack[d["keys"]], pack[d["positions"]],
                                        stop)
        n = d["n"]
        return tokens[:n], None if stops is None else stops[:n]  # (a lone draw's twin off)

    def _sampling_rows(self, pack: HostPack, params: list[SamplingParams], has_uncond: list[bool],
                       compiled: bool = False, counts: int | list[int] = 1) -> tuple:
        """Per-row sampling tensors into the pack -> handles (cfg, temperature, top_k, top_p, has_uncond: None
        eagerly when every row has an unconditional row) and the host-side summary `RowSampling` needs (for the
        compiled functions, the one they always take: `_envelope`).
        `params` and `has_uncond` are per draw or span, whose rows are `counts` (one number for all, or one each):
        the tensors repeat them, row by row. (A session without CFG has one row: its uncond index is its cond.)"""
        distinct = list({id(p): p for p in params}.values())  # (a step's sessions mostly share their settings)
        summary = RowSampling.summary(distinct)
        uncond = torch.tensor(has_uncond, dtype=torch.bool)
        if counts != 1:
            repeats = counts if isinstance(counts, int) else torch.tensor(counts, dtype=torch.long)
            uncond = uncond.repeat_interleave(repeats)
        if len(distinct) == 1:  # every row's settings one value each
            tensors = tuple(t.expand(len(uncond)) for t in RowSampling.host_tensors(distinct))
        else:
            tensors = RowSampling.host_tensors(params)
            if counts != 1:
                tensors = tuple(t.repeat_interleave(repeats) for t in tensors)
        # (eagerly, rows that all have an unconditional row need no flags: `rows_to_probs` then guides every row
        # whose scale is not 1 without a choice; the compiled functions always take the flags)
        flags = pack.add(uncond) if compiled or not all(has_uncond) else None
        return (*(pack.add(t) for t in tensors), flags, self._envelope(summary) if compiled else summary)

    def _envelope(self, summary: tuple) -> tuple:
        """The summary the compiled functions always take, whatever the rows' settings: temperature and greedy on
        (kept per row by their parameters, as `rows_to_probs` keeps every setting), top-k by the per-row path (the
        k-th largest of the largest max(k, 2) values: the same threshold as the one-k path's; 2: dynamic shapes
        specialise on 0 and 1), top-p as `compiled_top_p` says. So no setting a request brings compiles anew; the
        rows' probabilities are each the same as with their own summary (but for the last bits, as compiled)."""
        max_top_k = min(max(summary[0], 2), self.vocab_size - 1)
        return max_top_k, self.compiled_top_p, True, True, -1

    @staticmethod
    def _rows(pack: HostPack, handles: tuple) -> RowSampling:
        return RowSampling(*(pack[h] for h in handles[:4]), *handles[5])

    @staticmethod
    def _has_uncond(pack: HostPack, handles: tuple) -> torch.Tensor | None:
        """The rows' has-an-unconditional-row flags on the device (None: every row has one)."""
        return None if handles[4] is None else pack[handles[4]]


COMPILED_RULES = ("exact", "greedy")  # the rules whose spans a compiled judge computes compiled (the others eagerly)


def _step_math(both: torch.Tensor, t: int, rows: RowSampling, has_uncond: torch.Tensor | None, keys: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager part of a step, every draw's and span's rows at once: both [2T, V] (every row's cond logits, then
    its uncond logits), their sampling rows, and every uniform the step draws at (stream keys and image positions,
    flat) -> (probabilities [T, V], uniforms). One `rows_to_probs` and one `keyed_uniform` a step."""
    return rows_to_probs(both[:t], rows, both[t:], has_uncond), keyed_uniform(keys, positions)


def _draws_from_probs(probs: torch.Tensor, u: torch.Tensor, stop: torch.Tensor | None):
    """Draws by inverse CDF: probs [n, V], their uniforms [n], entropy stops [n] or None -> (tokens [n], stopped [n]
    or None)."""
    tokens = sample_at(probs, u)
    return tokens, None if stop is None else (stop > 0) & (entropy_score(probs) <= stop)


def _spans_from_probs(p_flat: torch.Tensor, q_in: torch.Tensor, as_sent: bool, drafts: torch.Tensor,
                      draws: SpanDraws, lengths: torch.Tensor, p_at: torch.Tensor | None, q_at: torch.Tensor | None,
                      b: int, kmax: int, rule: str, kwargs: dict):
    """One rule's spans from their targets' probabilities p_flat [T, V] (T = sum(k + 1)), the drafts'
    distributions [sum k, V] (`as_sent`: float16 as sent, normalised here), drafts [b, kmax], their uniforms, lengths
    [b], and for spans of several lengths (`p_at`, `q_at` not None) where their rows go in the padded layouts ->
    (p [b, kmax + 1, V], `verify_span`'s verdicts)."""
    v_size = p_flat.shape[-1]
    q_flat = draft_distribution(q_in) if as_sent else q_in
    if p_at is not None:  # spans of several lengths: padded to the longest (padding is never read as a draw)
        p = torch.zeros(b * (kmax + 1), v_size, device=p_flat.device)
        p[p_at] = p_flat
        p = p.view(b, kmax + 1, v_size)
        q = torch.full((b * max(kmax, 1), v_size), 1.0 / v_size, device=p_flat.device)
        if kmax:
            q[q_at] = q_flat
        q = q.view(b, max(kmax, 1), v_size)[:, :kmax]
    else:  # one length (the usual case): the ragged layout is the padded one
        p, q = p_flat.view(b, kmax + 1, v_size), q_flat.view(b, kmax, v_size)
    return p, verify_span(rule, drafts, q, p, draws, span_len=lengths, check=False, **kwargs)


def _draw_math(both: torch.Tensor, n: int, rows: RowSampling, has_uncond: torch.Tensor | None,
               keys: torch.Tensor, positions: torch.Tensor, stop: torch.Tensor | None):
    """A path's draws alone (what the compiled judge compiles): both [2n, V] (the draws' cond rows, then their
    uncond rows), their sampling rows, stream keys and image positions [n], entropy stops [n] or None -> (tokens
    [n], stopped [n] or None)."""
    return _draws_from_probs(rows_to_probs(both[:n], rows, both[n:], has_uncond), keyed_uniform(keys, positions),
                             stop)


def _span_math(both: torch.Tensor, rows: RowSampling, has_uncond: torch.Tensor | None, q_in: torch.Tensor,
               as_sent: bool, drafts: torch.Tensor, accept_keys: torch.Tensor, next_keys: torch.Tensor,
               positions: torch.Tensor, lengths: torch.Tensor, p_at: torch.Tensor | None, q_at: torch.Tensor | None,
               b: int, kmax: int, rule: str, kwargs: dict):
    """One rule's spans alone (what the compiled judge compiles): both [2T, V] (every target's cond row, then its
    uncond row), the targets' sampling rows, stream keys and first positions [b], the rest as `_spans_from_probs`
    -> (p [b, kmax + 1, V], `verify_span`'s verdicts)."""
    t = both.shape[0] // 2
    return _spans_from_probs(rows_to_probs(both[:t], rows, both[t:], has_uncond), q_in, as_sent, drafts,
                             SpanDraws.keyed(accept_keys, next_keys, positions, kmax), lengths, p_at, q_at, b, kmax,
                             rule, kwargs)


_COMPILED: dict[str, object] = {}


def compiled_math():
    """(`_draw_math`, `_span_math`) compiled by `torch.compile` (dynamic shapes: one compilation serves every
    number of rows but for a few specialisations: spans of several lengths, one draft, another sampling summary or
    rule; `Judge.launch` computes a lone draw or span as one of two rows, not compiled apart). Made once per process;
    each compiles at its first call (`Judge.warm` makes those calls at start-up)."""
    if not _COMPILED:
        # Inductor's split reductions (a long row sum over few rows, computed in two passes) failed to generate
        # the spans' code on CUDA with dynamic shapes ("list indices must be integers or slices, not NoneType",
        # torch 2.11, H200: benchmarks/results/2026-11-29-gpu); a row's sum in one pass has no such path.
        options = {"split_reductions": False}
        _COMPILED["draw"] = torch.compile(_draw_math, dynamic=True, options=options)
        _COMPILED["span"] = torch.compile(_span_math, dynamic=True, options=options)
    return _COMPILED["draw"], _COMPILED["span"]


class Deciding:
    """A step's decisions queued on the accelerator (`Judge.launch`): `tokens`, the draws' tokens [draws] on the
    device (None without draws); `verdicts[i]`, span i's verdict on the device: (drafts kept, next token: tensors
    of its group, its index in them); `collect()` -> `Decided`, the one host read."""

    def __init__(self, read: HostRead, n_bad: int, n_draws: int, stopping: bool, judged: list, n_spans: int,
                 errors: dict, tokens: torch.Tensor | None, verdicts: dict):
        self.read, self.n_bad, self.n_draws, self.stopping = read, n_bad, n_draws, stopping
        self.judged, self.n_spans, self.errors, self.tokens, self.verdicts = judged, n_spans, errors, tokens, verdicts

    def collect(self) -> Decided:
        """Wait for the decisions' copy (not for what was queued after it), unpack them."""
        host = self.read.values()
        verdicts: list[tuple[int, int, bool] | None] = [None] * self.n_spans
        at = 0
        n_bad = self.n_bad
        bad_rows = [bool(x) for x in host[at:at + n_bad]]
        at += n_bad
        n = self.n_draws
        tokens = host[at:at + n]
        at += n
        stops = [bool(x) for x in host[at:at + n]] if self.stopping else [False] * n
        at += n if self.stopping else 0
        redrafts, span_stops = {}, {}
        for idx, redraft, stopped in self.judged:
            b = len(idx)
            ns, zs, rs = host[at:at + b], host[at + b:at + 2 * b], host[at + 2 * b:at + 3 * b]
            at += 3 * b
            for i, nn, z, r in zip(idx, ns, zs, rs):
                verdicts[i] = (nn, z, bool(r))
            if redraft is not None:
                w = redraft[1].shape[1]
                for j, i in enumerate(idx):
                    redrafts[i] = (host[at + j * w:at + (j + 1) * w], redraft[1][j])
                at += b * w
            if stopped:
                span_stops.update({i: x for i, x in zip(idx, host[at:at + b]) if x >= 0})
                at += b
        return Decided(bad_rows, tokens, stops, verdicts, self.errors, redrafts, span_stops)


def non_finite_rows(logits: torch.Tensor, by_extremes: bool | None = None) -> torch.Tensor:
    """logits [S, V] -> [S] bool: the rows holding a NaN or an infinity. On a CPU by each row's largest and smallest
    value (NaN propagates through both, and so do infinities: torch's `isfinite` there costs ~15x the two
    reductions); elsewhere by one elementwise test and one reduction (three operations, not six, and fewer bytes
    read). `by_extremes` forces one form (tests)."""
    if by_extremes is None:
        by_extremes = logits.device.type == "cpu"
    if by_extremes:
        return ~(torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1)))
    return ~torch.isfinite(logits).all(dim=-1)


def _as_sent(q: torch.Tensor, k: int, v_size: int) -> torch.Tensor:
    """A span's draft probabilities as [k, V] float16 (what a device sends: then as they are, no operation)."""
    if q.dtype is torch.float16 and q.dim() == 2:
        return q
    return q.reshape(k, v_size).to(torch.float16)


class _Eager:
    """The host inputs of a step's eagerly computed draws and spans, for one pass over all their rows (`_step_math`):
    one row index (every part's cond rows, then every part's uncond rows), one set of sampling rows, and one flat
    (stream key, image position) pair for every uniform they draw at. `add` a part -> (its first row, its rows, its
    first uniform); `pack` before the step's pack is sent, `compute` after: then `probs` [rows, V] and `u`."""

    def __init__(self):
        self.cond: list[torch.Tensor] = []
        self.uncond: list[torch.Tensor] = []
        self.params: list[SamplingParams] = []
        self.has_uncond: list[bool] = []
        self.counts: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.rows = self.uniforms = 0
        self.handles = self.probs = self.u = None

    def add(self, cond: torch.Tensor, uncond: torch.Tensor, params: list[SamplingParams], has_uncond: list[bool],
            counts: list[int], keys: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int]:
        """A part's rows (cond and uncond row indices, host int64; per entry its sampling, whether it has an uncond
        row and its row count) and its uniforms' keys and positions (host int64, flat)."""
        at = (self.rows, len(cond), self.uniforms)
        self.cond.append(cond)
        self.uncond.append(uncond)
        self.params += params
        self.has_uncond += has_uncond
        self.counts += counts
        self.keys.append(keys)
        self.positions.append(positions)
        self.rows += len(cond)
        self.uniforms += len(keys)
        return at

    def pack(self, judge: Judge, pack: HostPack) -> None:
        if not self.rows:
            return
        counts = self.counts if any(c != 1 for c in self.counts) else 1
        self.handles = (pack.add(torch.cat(self.cond + self.uncond)),
                        judge._sampling_rows(pack, self.params, self.has_uncond, False, counts),
                        pack.add(torch.cat(self.keys)), pack.add(torch.cat(self.positions)))

    def compute(self, judge: Judge, pack: HostPack, logits: torch.Tensor) -> None:
        if self.handles is None:
            return
        idx, sampling, keys, positions = self.handles
        # (every row in one `index_select`: the same rows as indexing, which on a CPU copied 160 rows of 16,384
        # codes in 1.7 ms against 0.3)
        both = logits.index_select(0, pack[idx])
        self.probs, self.u = _step_math(both, self.rows, judge._rows(pack, sampling), judge._has_uncond(pack, sampling),
                                        pack[keys], pack[positions])


class _Source:
    """Where a step's decisions read their logits: the step's own logits [S, V] by row index (what a piece of this
    step fed: no per-piece slicing, one gather for all), then any other rows appended (a span whose targets were fed
    over several steps, the logits a prefill kept) as [rows, j, V] tensors."""

    def __init__(self, step_logits: torch.Tensor | None):
        self.step = step_logits
        self.extra: list[torch.Tensor] = []
        self.n = 0 if step_logits is None else step_logits.shape[0]

    def rows(self, src, j_count: int) -> tuple[int, int, bool]:
        """-> (first cond row, first uncond row, has uncond) of `src` (a PieceOutput or [rows, j_count, V] /
        [rows, V]): its `j_count` cond rows follow the first, and so do its uncond rows."""
        if isinstance(src, PieceOutput) and src.step.logits is self.step:
            return src.row(0, 0), src.row(src.rows - 1, 0), src.rows > 1
        t = src.logits if isinstance(src, PieceOutput) else src
        t = t.reshape(t.shape[0], j_count, t.shape[-1])
        base = self.n
        self.extra.append(t.reshape(-1, t.shape[-1]))
        self.n += t.shape[0] * j_count
        return base, base + (t.shape[0] - 1) * j_count, t.shape[0] > 1

    def tensor(self) -> torch.Tensor | None:
        parts = ([] if self.step is None else [self.step]) + self.extra
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
