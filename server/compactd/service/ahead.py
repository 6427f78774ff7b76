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
import time
import uuid
from dataclasses import dataclass
from functools import partial

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from compactd import genai
from compactd.core.ahead import (
    CandidateView,
    StepChoice,
    span_digest,
    span_now,
    step_choice,
    worth_preparing,
)
from compactd.core.fold import SessionFold
from compactd.core.lock import live_bracket
from compactd.core.planner import SHAPES, PlanMode, choose_span, node_pricer, span_pricer
from compactd.core.policy import CompactSpec, TargetPolicy
from compactd.core.selection import DeclineCode, Declined, Selection, SelectionMode
from compactd.errors import CompactdError, CompactionBusy
from compactd.metrics import Metrics
from compactd.providers.base import SummaryError, SummaryResult
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
        self._closed = False

    # ---- starting a candidate --------------------------------------------------------------

    def after_append(self, handle: SessionHandle) -> None:
        """An append committed: start a candidate if it took the envelope past the point."""
        try:
            route = self._pressure.named_route(handle)
            if route is not None:  # none yet: nothing to price
                self.consider(handle, route)
        except CompactdError:
            return  # an unknown route, no capacity, a policy that does not fit: the step says so

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
        if not await self._room_for_one(handle):
            return
        prepared = await self._chosen(handle, route, policy, spec)
        if prepared is None:
            return
        claimed = await self._store.claim_candidate(
            handle.session_id, prepared.claim, handle.leases.ttl_s, tenant=handle.tenant
        )
        if not claimed:  # another replica (or task) holds the session's candidate
            return
        self._metrics.ahead("started")
        try:
            summary, name = await self._summarized(handle, prepared)
        except BaseException as error:
            await asyncio.shield(self._drop(handle, prepared.claim.candidate_id))
            self._metrics.ahead("cancelled" if isinstance(error, asyncio.CancelledError) else
                                "failed")  # fmt: skip
            if isinstance(error, SummaryError | asyncio.CancelledError):
                return  # the step at the trigger summarizes itself (and reports a failure)
            raise
        stored = await self._store.finish_candidate(
            handle.session_id, prepared.claim.candidate_id, prepared.claim.owner,
            encode_summary(summary, prepared.target, name), tenant=handle.tenant,
        )  # fmt: skip
        self._metrics.ahead("ready" if stored else "discarded")

    async def _room_for_one(self, handle: SessionHandle) -> bool:
        """Whether the session may take a new candidate: it holds none, or only one that no
        longer fits its span or was abandoned (dropped here)."""
        current = await self._store.get_candidate(handle.session_id, tenant=handle.tenant)
        if current is None:
            return True
        if not current.abandoned and span_now(handle.fold, view_of(current)) is not None:
            return False  # one per session: still good, being prepared or ready
        await self._drop(handle, current.candidate_id)
        self._metrics.ahead("discarded")
        return True

    async def _chosen(
        self, handle: SessionHandle, route: Route, policy: TargetPolicy, spec: CompactSpec
    ) -> _Preparation | None:
        """The span selection would choose now (the step's rules: retention, balanced cuts, the
        open tail, the minimum span, failure memory), its digest and its summary target; None
        when nothing is selectable or the target cannot be resolved."""
        brackets = self._brackets
        async with handle.lock:
            fold, meter = handle.fold, handle.context.meter
            chosen = choose_span(
                fold, node_pricer(meter, fold, route), selection=SelectionMode.PRESSURE,
                retained_budget=spec.retained_budget,
                min_span_tokens=brackets.guard.min_span_tokens(route, policy, fold),
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
            nodes = fold.surface.nodes[chosen.start_position : chosen.end_position + 1]
            claim = CandidateClaim(
                uuid.uuid4().hex, handle.owner, span_digest(fold, nodes), chosen.start_seq,
                chosen.end_seq,
            )  # fmt: skip
        return _Preparation(claim, chosen, target, policy)

    async def _summarized(
        self, handle: SessionHandle, prepared: _Preparation
    ) -> tuple[SummaryResult, str]:
        """The span's summary, written off the log while the candidate's lease is renewed, and
        its summarizer's name."""
        claim, target = prepared.claim, prepared.target
        summarizer = self._brackets.summarizers.for_route(target)
        async with handle.lock:  # the span's messages as the fold holds them now
            request, _ = summary_request(handle, prepared.selection, target, prepared.policy, None)
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
                    summary = await self._renewing(handle, claim, writing)
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
        self, handle: SessionHandle, job: Bracket, progress: Progress
    ) -> cpb.CompactionOutcome | None:
        """At or above the trigger: the session's candidate, applied by a bracket shaped like
        ``job`` (the step's first bracket); None when there is none to apply (none, it no longer
        fits, its bounded wait ran out, or its bracket did not commit): the step then goes on
        as it always did. Off (``prepareAheadRatio`` unset): None at once, no store read.

        Raises:
            CompactionBusy: Another bracket is live (as any bracket raises it).
            BracketFailed, SummaryRejected: The candidate's bracket opened and closed without
                committing (its span drifted, the quality gate rejected the prepared summary):
                it was the step's one bracket.
        """
        if not job.policy.prepares_ahead:
            return None
        began = time.monotonic()
        stored = await self._awaited(handle, job.policy, began, progress)
        if stored is None:
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
        if isinstance(committed, cpb.CompactionOutcome):
            self._metrics.ahead("applied", waited=waited)
            return committed
        self._metrics.ahead("discarded")
        return None

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
