"""Prepare-ahead: a session's summary written in the background before the trigger, applied at it.

With ``prepareAheadRatio`` set, an append (``after_append``) or a step (``consider``) that finds
the envelope at or past the prepare-ahead point but below the trigger starts a background task
that selects the span selection would choose now, claims the session's *candidate* in the store
(``store.candidates``: one per session, a lease its preparer renews, so any replica may apply it
and a dead preparer's lapses), writes its summary off the log while the runtime keeps
appending, and stores it. Nothing is appended to the log while a candidate is prepared.

At or above the trigger a step (``StepService``) calls ``apply`` first: a ready candidate whose
span is unchanged (``core.ahead``) is applied at once by an ordinary bracket whose five steps
follow one another (``Bracket.prepared``: the quality gate and the shrink check run as for any
summary, and ``compaction/start`` records ``prepared_ahead``); a candidate still being prepared
is waited for at most ``prepareAheadWaitMs``; otherwise the step summarizes itself as it always
did. A candidate whose span changed (a prune, a replacement, an offload inside it), or whose
preparer died, is dropped. With the option off nothing here runs: not even a store read.

Shutdown (``close``) cancels the background summaries and drops their candidates; a process
that dies leaves its candidate's lease to lapse (another replica prepares again).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from compactd import genai
from compactd.core import events as ev
from compactd.core.ahead import (
    CandidateView,
    StepChoice,
    extends,
    frees_enough,
    span_digest,
    span_now,
    step_choice,
    worth_preparing,
)
from compactd.core.bracket import checkpoint_message, checkpoint_text
from compactd.core.fold import SessionFold
from compactd.core.lock import live_bracket
from compactd.core.pins import head_length
from compactd.core.planner import SHAPES, PlanMode, choose_span, node_pricer, span_pricer
from compactd.core.policy import CompactSpec, TargetPolicy
from compactd.core.pricing import heuristic_price
from compactd.core.projection import project
from compactd.core.selection import DeclineCode, Declined, Selection, SelectionMode
from compactd.errors import CompactdError, CompactionBusy
from compactd.metrics import Metrics
from compactd.providers.base import SummaryError, SummaryRequest, SummaryResult
from compactd.routes import Route
from compactd.service.bracket import (
    Bracket,
    BracketFailed,
    Brackets,
    PreparedSummary,
    Progress,
    record_error,
    redact_error,
    summary_request,
)
from compactd.service.pressure import PressureService
from compactd.service.screening import SummaryRejected
from compactd.service.sessions import SessionHandle, SessionManager
from compactd.store.base import EventStore
from compactd.store.candidates import Candidate, CandidateClaim
from compactd.v1 import compaction_service_pb2 as cpb
from compactd.v1 import events_pb2

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: How often a step waiting for another replica's candidate looks at the store again.
POLL_S = 0.05


@dataclass(frozen=True)
class _Preparation:
    """What a background summary works from, chosen under the session's lock."""

    claim: CandidateClaim
    selection: Selection
    target: Route
    policy: TargetPolicy
    #: The ready candidate this one extends (``_extension``), which stays applicable until this
    #: one replaces it; None for a candidate written from its whole span.
    base: Candidate | None = None
    #: An extension's summary request (its base's summary, then the history after its span),
    #: built under the lock with the digest; None: built from the span when the summary starts.
    request: SummaryRequest | None = None


class AheadService:
    """Prepares summaries ahead of the trigger and applies them at it; one per server.

    Args:
        manager: The sessions (``WatchPressure`` names one by id).
        store: Where candidates live (every replica's shared store).
        pressure: Routes, policies and reports.
        brackets: Runs the bracket that applies a candidate; its summarizers write them.
        tracer: Where ``compaction.prepare_ahead`` spans go.
        metrics: ``compactd.ahead.*``.
    """

    def __init__(
        self,
        manager: SessionManager,
        store: EventStore,
        pressure: PressureService,
        brackets: Brackets,
        *,
        tracer: trace.Tracer,
        metrics: Metrics,
    ) -> None:
        self._manager = manager
        self._store = store
        self._pressure = pressure
        self._brackets = brackets
        self._tracer = tracer
        self._metrics = metrics
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        #: Sessions whose ready candidate's last extension failed the quality gate: the next
        #: candidate summarizes its whole span instead (and replaces it the same way).
        self._whole: set[Key] = set()
        #: Per session, after its candidate failed the gate: (its span's start seq, the smallest
        #: span a new candidate from there must take). Without it the next append would start
        #: the same summary for a span hardly larger, to be rejected the same way.
        self._grown: dict[Key, tuple[int, int]] = {}
        self._closed = False

    # ---- starting a candidate --------------------------------------------------------------

    def after_append(self, handle: SessionHandle) -> None:
        """An append committed: start a candidate if it took the envelope past the point."""
        try:
            self.consider(handle, self._pressure.logged_route(handle))
        except CompactdError:
            return  # no route, no capacity, a policy that does not fit: the step reports it

    def consider(self, handle: SessionHandle, route: Route) -> None:
        """Start a background candidate for ``handle`` on ``route`` when the envelope is at or
        past the prepare-ahead point and below the trigger, and none runs here already.

        Raises:
            CompactdError: The route cannot be priced (as ``PressureService.report``).
        """
        policy = self._pressure.target_policy(handle, route)
        if not policy.prepares_ahead or not policy.auto or self._closed:
            return
        key = (handle.tenant, handle.session_id)
        if key in self._tasks or live_bracket(handle.fold.lock) is not None:
            return
        spec = self._pressure.spec(handle, route)
        measured = self._pressure.report(handle, route).measured_tokens
        if not worth_preparing(measured, spec.prepare_ahead, spec.trigger):
            return
        # A fresh context: the task outlives the call that started it (its span, its log fields).
        task = asyncio.get_running_loop().create_task(
            self._prepare(handle, route, policy, spec), context=contextvars.Context()
        )
        self._tasks[key] = task
        task.add_done_callback(partial(self._forget, key))

    def _forget(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled() and task.exception() is not None:
            log.warning("a summary prepared ahead failed", exc_info=task.exception())

    def preparing(self, handle: SessionHandle) -> bool:
        """Whether this process is writing a candidate of ``handle`` now."""
        return (handle.tenant, handle.session_id) in self._tasks

    async def close(self) -> None:
        """Cancel every background summary (their candidates are dropped) and wait for them."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _prepare(
        self, handle: SessionHandle, route: Route, policy: TargetPolicy, spec: CompactSpec
    ) -> None:
        """The background task: choose, claim, summarize, store (or drop on any failure)."""
        current = await self._current(handle)
        if current is not None and current.summary is None:
            return  # one per session: being prepared (here, or by a live replica)
        prepared = await self._chosen(handle, route, policy, spec, current)
        if prepared is None:
            return
        if prepared.base is None:
            claimed = await self._store.claim_candidate(
                handle.session_id, prepared.claim, handle.leases.ttl_s, tenant=handle.tenant
            )
            if not claimed:  # another replica (or task) holds the session's candidate
                return
        self._metrics.ahead("started")
        try:
            summary, name = await self._summarized(handle, prepared)
            rejected = await self._brackets.prescreen(
                handle, prepared.selection, summary, summarizer=name, target=prepared.target,
                policy=prepared.policy, shrink_route=route,
            )  # fmt: skip
        except BaseException as error:
            if prepared.base is None:
                await asyncio.shield(self._drop(handle, prepared.claim.candidate_id))
            self._metrics.ahead("cancelled" if isinstance(error, asyncio.CancelledError) else
                                "failed")  # fmt: skip
            if isinstance(error, SummaryError | asyncio.CancelledError):
                return  # the step at the trigger summarizes itself (and reports a failure)
            raise
        if rejected is not None:
            await self._rejected(handle, prepared, rejected)
            return
        encoded = encode_summary(summary, prepared.target, name)
        stored = await self._stored(handle, prepared, encoded)
        self._metrics.ahead("ready" if stored else "discarded")

    async def _rejected(
        self, handle: SessionHandle, prepared: _Preparation, rejected: SummaryRejected
    ) -> None:
        """A summary the quality gate would reject at the trigger is never stored: a step there
        would spend its one bracket on it. A candidate of its own span is dropped (failure
        memory holds the span back, as a bracket's failure does: the step at the trigger
        summarizes a larger one); a rejected extension leaves its base ready, and the session's
        next candidate summarizes its whole span instead."""
        self._metrics.ahead("discarded")
        if prepared.request is not None:  # an extension
            self._whole.add((handle.tenant, handle.session_id))
            return
        if prepared.base is None:
            await self._drop(handle, prepared.claim.candidate_id)
        selection = prepared.selection
        self._grown[(handle.tenant, handle.session_id)] = (
            selection.start_seq,
            regrown(rejected, selection.shadowed_price, self._min_span(handle, prepared)),
        )

    def _min_span(self, handle: SessionHandle, prepared: _Preparation) -> int:
        route = self._pressure.logged_route(handle)
        return self._brackets.guard.min_span_tokens(route, prepared.policy, handle.fold)

    async def _stored(self, handle: SessionHandle, prepared: _Preparation, summary: bytes) -> bool:
        """Store ``prepared``'s summary; an extension replaces the ready candidate it was
        written from (the session keeps one), unless that one was applied or dropped meanwhile.
        False when the candidate is gone."""
        claim, session_id, tenant = prepared.claim, handle.session_id, handle.tenant
        if prepared.base is not None:
            base = prepared.base.candidate_id
            if not await self._store.drop_candidate(session_id, base, tenant=tenant):
                return False
            if not await self._store.claim_candidate(
                session_id, claim, handle.leases.ttl_s, tenant=tenant
            ):
                return False
        return await self._store.finish_candidate(
            session_id, claim.candidate_id, claim.owner, summary, tenant=tenant
        )

    async def _current(self, handle: SessionHandle) -> Candidate | None:
        """The session's candidate while it still fits its span; one that no longer does, or
        that was abandoned, is dropped here (None)."""
        current = await self._store.get_candidate(handle.session_id, tenant=handle.tenant)
        if current is None:
            return None
        if not current.abandoned and span_now(handle.fold, view_of(current)) is not None:
            return current
        await self._drop(handle, current.candidate_id)
        self._metrics.ahead("discarded")
        return None

    async def _chosen(
        self,
        handle: SessionHandle,
        route: Route,
        policy: TargetPolicy,
        spec: CompactSpec,
        base: Candidate | None,
    ) -> _Preparation | None:
        """The span selection would choose now (the step's rules: retention, balanced cuts, the
        open tail, the minimum span, failure memory), its digest and its summary target; with
        ``base`` (the session's ready candidate), that span's extension of it (``_extension``).
        None when nothing is selectable, the target cannot be resolved, or ``base`` is not
        worth extending."""
        brackets = self._brackets
        async with handle.lock:
            fold, meter = handle.fold, handle.context.meter
            min_span = brackets.guard.min_span_tokens(route, policy, fold)
            chosen = choose_span(
                fold, node_pricer(meter, fold, route), selection=SelectionMode.PRESSURE,
                retained_budget=spec.retained_budget, min_span_tokens=min_span,
                span_price=span_pricer(meter, fold, route),
            )  # fmt: skip
            if isinstance(chosen, Declined):
                return None
            try:
                target = brackets.summarizers.target(policy, fold.header)
            except CompactdError:
                return None  # the step's bracket reports a misconfigured target
            if brackets.guard.hold(handle, chosen, target, policy) is not None:
                return None  # the span failed with this target lately
            request = None
            if base is None and _new_history(handle, route, chosen) < min_span:
                return None  # mostly the last checkpoint: its summary would only echo it
            grown = self._grown.get((handle.tenant, handle.session_id), (-1, 0))
            if grown[0] == chosen.start_seq and chosen.shadowed_price < grown[1]:
                return None  # a span hardly larger than one the gate rejected
            if base is not None:
                delta = _delta(handle, route, chosen, base, target, min_span)
                if delta is None:
                    return None
                key = (handle.tenant, handle.session_id)
                if key in self._whole:
                    self._whole.discard(key)  # the whole span this time, replacing the base
                else:
                    request = _extension(handle, chosen, delta, base, target, policy)
            nodes = fold.surface.nodes[chosen.start_position : chosen.end_position + 1]
            claim = CandidateClaim(
                uuid.uuid4().hex, handle.owner, span_digest(fold, nodes), chosen.start_seq,
                chosen.end_seq,
            )  # fmt: skip
        return _Preparation(claim, chosen, target, policy, base, request)

    async def _summarized(
        self, handle: SessionHandle, prepared: _Preparation
    ) -> tuple[SummaryResult, str]:
        """The span's summary, written off the log while the candidate's lease is renewed, and
        its summarizer's name."""
        claim, target = prepared.claim, prepared.target
        summarizer = self._brackets.summarizers.for_route(target)
        request = prepared.request
        if request is None:
            async with handle.lock:  # the span's messages as the fold holds them now
                request, _ = summary_request(
                    handle, prepared.selection, target, prepared.policy, None
                )
        with self._tracer.start_as_current_span("compaction.prepare_ahead") as span:
            span.set_attribute("compactd.session_id", handle.session_id)
            span.set_attribute("compactd.candidate_id", claim.candidate_id)
            span.set_attribute("compactd.range.start_seq", claim.start_seq)
            span.set_attribute("compactd.range.end_seq", claim.end_seq)
            span.set_attribute("compactd.summarizer", summarizer.name)
            with genai.summary_call(
                self._tracer, self._metrics, target, request, summarizer
            ) as call:
                writing = asyncio.ensure_future(summarizer.summarize(request))
                try:
                    if prepared.base is None:
                        summary = await self._renewing(handle, claim, writing)
                    else:  # no lease: the ready base stays applicable meanwhile
                        summary = await writing
                except SummaryError as error:
                    redact_error(error, self._brackets.redact)
                    record_error(span, error)
                    call.failed(error)
                    raise
                call.answered(summary)
        text = self._brackets.redact_summary(summary.text)
        redacted = SummaryResult(text, summary.usage, summary.provider, summary.model,
                                 summary.finish_reason, None, summary.response_id)  # fmt: skip
        return redacted, summarizer.name

    async def _renewing(
        self, handle: SessionHandle, claim: CandidateClaim, writing: asyncio.Future[SummaryResult]
    ) -> SummaryResult:
        """``writing``'s result, renewing the candidate's lease a few times per ttl meanwhile
        (a lost candidate, claimed over after a pause, stops the summary)."""
        every = max(handle.leases.ttl_s / 3, 0.01)
        try:
            while True:
                done, _ = await asyncio.wait([writing], timeout=every)
                if done:
                    return writing.result()
                renewed = await self._store.renew_candidate(
                    handle.session_id, claim.candidate_id, claim.owner, handle.leases.ttl_s,
                    tenant=handle.tenant,
                )  # fmt: skip
                if not renewed:
                    raise asyncio.CancelledError("the candidate was claimed over")
        finally:
            if not writing.done():
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)

    async def _drop(self, handle: SessionHandle, candidate_id: str) -> None:
        # A store that fails here leaves it to lapse: the next claim replaces it.
        with contextlib.suppress(CompactdError):
            await self._store.drop_candidate(handle.session_id, candidate_id, tenant=handle.tenant)

    # ---- applying it at the trigger ----------------------------------------------------------

    async def apply(
        self, handle: SessionHandle, job: Bracket, progress: Progress, *, need: int = 0
    ) -> cpb.CompactionOutcome | None:
        """At or above the trigger: the session's candidate, applied by a bracket shaped like
        ``job`` (the step's first bracket); None when there is none to apply (none, it no longer
        fits, its bounded wait ran out, or its bracket did not commit): the step then goes on
        as it always did. Off (``prepareAheadRatio`` unset): None at once, no store read.
        ``need``: the tokens a request over the window must lose to come below the trigger (0:
        it is not over the window): then only a candidate that frees them
        (``core.ahead.frees_enough``; one being written, with the largest summary it may
        return) is applied or waited for, and otherwise the step's own bracket takes the
        maximal span.

        Raises:
            CompactionBusy: Another bracket is live (as any bracket raises it).
            BracketFailed, SummaryRejected: The candidate's bracket opened and closed without
                committing (its span drifted, the quality gate rejected the prepared summary):
                it was the step's one bracket.
        """
        if not job.policy.prepares_ahead:
            return None
        began = time.monotonic()
        if need > 0 and not await self._may_free(handle, job, need):
            return None
        stored = await self._awaited(handle, job.policy, began, progress)
        if stored is None or (need > 0 and not _frees_enough(job, stored, need)):
            return None
        waited = time.monotonic() - began
        try:
            committed = await self._brackets.run(self._applying(job, stored, waited), progress)
        except (BracketFailed, SummaryRejected):  # it opened and closed without committing
            self._metrics.ahead("discarded")
            raise
        except CompactionBusy:
            raise
        except CompactdError:
            committed = None  # nothing opened: the step's own ladder goes on
        finally:
            await self._drop(handle, stored.candidate_id)
            self._cancel(handle)  # an extension of it, written here: its base is gone
        if isinstance(committed, cpb.CompactionOutcome):
            self._metrics.ahead("applied", waited=waited)
            return committed
        self._metrics.ahead("discarded")
        return None

    async def _may_free(self, handle: SessionHandle, job: Bracket, need: int) -> bool:
        """Whether the session's candidate could free ``need`` tokens: a ready one by its
        summary's price, one being written by the largest summary it may return (the policy's
        ``maxTokens``): only then is it waited for over the window."""
        stored = await self._store.get_candidate(handle.session_id, tenant=handle.tenant)
        if stored is None or span_now(handle.fold, view_of(stored)) is None:
            return False
        return _frees_enough(job, stored, need)

    async def _awaited(
        self, handle: SessionHandle, policy: TargetPolicy, began: float, progress: Progress
    ) -> Candidate | None:
        """The ready candidate a step applies, waiting at most ``prepareAheadWaitMs`` for one
        being prepared; None when there is none to apply (a stale one is dropped)."""
        deadline, waiting = began + policy.prepare_ahead_wait_ms / 1000, False
        while True:
            stored = await self._store.get_candidate(handle.session_id, tenant=handle.tenant)
            choice = step_choice(handle.fold, None if stored is None else view_of(stored))
            if stored is None or choice is StepChoice.SUMMARIZE:
                return None
            if choice is StepChoice.APPLY:
                return stored
            named = f"candidate {stored.candidate_id}"
            if choice is StepChoice.DISCARD:
                await self._drop(handle, stored.candidate_id)
                self._metrics.ahead("discarded")
                await progress(_ahead(f"{named} discarded: its span changed or its preparer died"))
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                self._metrics.ahead("fallback")
                self._cancel(handle)  # the step summarizes the span itself
                wait = policy.prepare_ahead_wait_ms
                await progress(_ahead(f"{named} not ready within {wait} ms: summarizing now"))
                return None
            if not waiting:
                waiting = True
                wait = policy.prepare_ahead_wait_ms
                await progress(_ahead(f"waiting up to {wait} ms for {named}"))
            await self._until_changed(handle, min(left, POLL_S))

    async def _until_changed(self, handle: SessionHandle, seconds: float) -> None:
        """Wait ``seconds`` at most: less when this process's background task ends first."""
        task = self._tasks.get((handle.tenant, handle.session_id))
        if task is None:
            await asyncio.sleep(seconds)
        else:
            await asyncio.wait([task], timeout=seconds)

    def _cancel(self, handle: SessionHandle) -> None:
        task = self._tasks.get((handle.tenant, handle.session_id))
        if task is not None:
            task.cancel()

    def _applying(self, job: Bracket, stored: Candidate, waited: float) -> Bracket:
        """The bracket that applies ``stored``: ``job``'s, on the candidate's span and summary,
        not held back by failure memory (this summary never failed)."""
        summary, (provider, model), summarizer = decode_summary(stored.summary or b"")
        target = self._pressure.route_for(provider, model) if provider else Route("", "")
        record = events_pb2.PreparedAhead(
            candidate_id=stored.candidate_id, agent_wait_ms=round(waited * 1000)
        )
        record.start_time.CopyFrom(_timestamp(stored.started.timestamp()))
        if stored.ready is not None:
            record.ready_time.CopyFrom(_timestamp(stored.ready.timestamp()))
        view = view_of(stored)
        prepared = PreparedSummary(
            summary, target, summarizer, partial(_priced_span, job, view), record
        )
        shape = SHAPES[PlanMode.AUTO]
        return Bracket(
            job.handle, shape.trigger, SelectionMode.PRESSURE, job.route, job.shrink_route,
            job.policy, job.retained_budget, job.turn, prepared=prepared,
        )  # fmt: skip

    # ---- what WatchPressure shows -----------------------------------------------------------

    async def candidate_of(self, session_id: str) -> cpb.AheadCandidate | None:
        """The session's candidate as ``WatchPressure`` reports it; None when it has none.

        Raises:
            NotFound: The session does not exist.
        """
        handle = await self._manager.get(session_id)
        stored = await self._store.get_candidate(handle.session_id, tenant=handle.tenant)
        if stored is None:
            return None
        shown = cpb.AheadCandidate(
            candidate_id=stored.candidate_id, start_seq=stored.claim.start_seq,
            end_seq=stored.claim.end_seq, ready=stored.summary is not None,
            owner=stored.claim.owner,
        )  # fmt: skip
        shown.start_time.CopyFrom(_timestamp(stored.started.timestamp()))
        return shown


def view_of(stored: Candidate) -> CandidateView:
    """What ``core.ahead`` decides on of a stored candidate."""
    claim = stored.claim
    return CandidateView(
        claim.start_seq, claim.end_seq, claim.digest, stored.summary is not None, stored.abandoned
    )


def regrown(rejected: SummaryRejected, span_price: int, min_span: int) -> int:
    """The smallest span a candidate may take after one of ``span_price`` tokens was rejected:
    one its checkpoint (about as large again) would reduce enough when only the reduction
    failed, else one larger by a minimum span."""
    checks = {failure.check for failure in rejected.gate.failures}
    gate = rejected.gate
    if checks == {events_pb2.SUMMARY_CHECK_REDUCTION} and 0 < gate.min_reduction_ratio < 1:
        checkpoint = span_price * (1 - gate.reduction)
        return math.ceil(checkpoint / (1 - gate.min_reduction_ratio))
    return span_price + max(1, min_span)


def _new_history(handle: SessionHandle, route: Route, chosen: Selection) -> int:
    """The route price of ``chosen`` less a checkpoint it opens with (the last compaction's)."""
    nodes = handle.fold.surface.nodes[chosen.start_position : chosen.end_position + 1]
    if nodes and ev.checkpoint_compaction_id(nodes[0].event):
        nodes = nodes[1:]
    return span_pricer(handle.context.meter, handle.fold, route)(nodes)


def _delta(
    handle: SessionHandle,
    route: Route,
    chosen: Selection,
    base: Candidate,
    target: Route,
    min_span: int,
) -> Selection | None:
    """The history ``chosen`` holds after the ready candidate ``base``'s span; None when
    ``chosen`` does not extend ``base`` (another start, no further end, another target) or the
    delta is not worth it (``core.ahead.extends``). Called under the session's lock."""
    fold = handle.fold
    prior = span_now(fold, view_of(base))
    written_by = decode_summary(base.summary or b"")[1]
    if (
        prior is None
        or prior.start_seq != chosen.start_seq
        or chosen.end_position <= prior.end_position
        or written_by != (target.provider, target.model)
    ):
        return None
    nodes = fold.surface.nodes[prior.end_position + 1 : chosen.end_position + 1]
    price = span_pricer(handle.context.meter, fold, route)(nodes)
    if not extends(price, min_span):
        return None
    return Selection(
        prior.end_position + 1, chosen.end_position, nodes[0].seq, chosen.end_seq,
        tuple(node.seq for node in nodes), price,
    )  # fmt: skip


def _extension(
    handle: SessionHandle,
    chosen: Selection,
    delta: Selection,
    base: Candidate,
    target: Route,
    policy: TargetPolicy,
) -> SummaryRequest:
    """The summary request of ``chosen`` written from the ready candidate ``base``: the system
    head and tools, ``base``'s summary framed as the checkpoint it would be, then ``delta``,
    the history after ``base``'s span (resending the whole span would cost the summary model
    it all again). Called under the session's lock."""
    summary = decode_summary(base.summary or b"")[0]
    request, _ = summary_request(handle, delta, target, policy, None)
    framed = checkpoint_text(summary.text, base.claim.start_seq)
    checkpoint = project(checkpoint_message(base.candidate_id, framed))
    messages = list(request.messages)
    if checkpoint is not None:
        messages.insert(head_length(messages), checkpoint)
    return replace(request, messages=messages, span_tokens=chosen.shadowed_price)


def _frees_enough(job: Bracket, stored: Candidate, need: int) -> bool:
    """Whether applying ``stored`` frees ``need`` tokens, by the span's route price and the
    checkpoint's reference price (``core.ahead.frees_enough``); for one still being written,
    the largest checkpoint it may bring."""
    span = _priced_span(job, view_of(stored), job.handle.fold)
    if isinstance(span, Declined):
        return False
    if stored.summary is None:  # being written: at most the policy's cap, framed
        checkpoint = job.policy.max_tokens + heuristic_price(checkpoint_message("", ""))
    else:
        summary = decode_summary(stored.summary)[0]
        framed = checkpoint_text(summary.text, stored.claim.start_seq)
        checkpoint = heuristic_price(checkpoint_message("", framed))
    return frees_enough(span.shadowed_price, checkpoint, need)


def _priced_span(job: Bracket, view: CandidateView, fold: SessionFold) -> Selection | Declined:
    """The candidate's span now, priced on the job's route (the bracket's step 1 calls it under
    the lock), or why it can no longer be applied."""
    selection = span_now(fold, view)
    if selection is None:
        return Declined(DeclineCode.SPAN_CHANGED, "the span prepared ahead changed since")
    meter = job.handle.context.meter
    price = meter.route_price_of_nodes(fold, selection.shadowed_seqs, job.route)
    return Selection(
        selection.start_position, selection.end_position, selection.start_seq,
        selection.end_seq, selection.shadowed_seqs, price,
    )  # fmt: skip


def encode_summary(summary: SummaryResult, target: Route, summarizer: str) -> bytes:
    """A prepared summary as the store keeps it (opaque to the store): JSON."""
    usage = b"" if summary.usage is None else summary.usage.SerializeToString()
    return json.dumps({
        "text": summary.text, "usage": base64.b64encode(usage).decode() if usage else None,
        "provider": summary.provider, "model": summary.model,
        "finish_reason": summary.finish_reason, "response_id": summary.response_id,
        "target": [target.provider, target.model], "summarizer": summarizer,
    }).encode()  # fmt: skip


def decode_summary(data: bytes) -> tuple[SummaryResult, tuple[str, str], str]:
    """``encode_summary``'s inverse: the summary, its target's (provider, model) and its
    summarizer's name."""
    fields = json.loads(data)
    usage = None
    if fields["usage"]:
        usage = events_pb2.Usage.FromString(base64.b64decode(fields["usage"]))
    summary = SummaryResult(
        fields["text"], usage, fields["provider"], fields["model"], fields["finish_reason"],
        None, fields["response_id"],
    )  # fmt: skip
    provider, model = fields["target"]
    return summary, (provider, model), fields["summarizer"]


def _ahead(detail: str) -> cpb.CompactionProgress:
    return cpb.CompactionProgress(step=cpb.COMPACTION_STEP_AHEAD, seq=-1, detail=detail)


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMicroseconds(int(seconds * 1_000_000))
    return stamp
