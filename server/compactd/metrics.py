"""compactd's metrics: the one seam every module records through (OpenTelemetry metrics API).

One ``Metrics`` per server, over the server's ``MeterProvider`` (``Metrics()`` alone records
nothing, so code and tests that do not care pass nothing). Business code calls the methods below;
it never creates instruments or sees the SDK. Exporting is the composition root's business
(``telemetry.meter_provider``): OTLP as ``OTEL_METRICS_EXPORTER`` selects, and the optional
Prometheus endpoint ``metrics_listen``.

Instruments (attribute keys in brackets):

=====================================  ===========  ===============================================
``compactd.pressure.ratio``            histogram    measured / trigger tokens of each pressure
                                                    report [route, state]
``compactd.pressure.tokens``           histogram    measured tokens of each report [route, state]
``compactd.compactions``               counter      brackets by outcome: committed, declined,
                                                    relieved (pruning sufficed), failed, skipped
                                                    (failure memory), masked [trigger, outcome,
                                                    reason, rung]
``compactd.summary.gate``              counter      summaries the quality gate judged: passed,
                                                    rejected, fallback [summarizer, outcome]
``compactd.summary.probe_retention``   histogram    share of its span's probes a judged summary
                                                    kept [summarizer]
``compactd.compaction.tokens_freed``   counter      route tokens a committed bracket freed
``compactd.prunes``                    counter      tool results pruned
``compactd.ahead.candidates``          counter      summaries prepared ahead of the trigger, by
                                                    outcome: started, ready, failed, applied,
                                                    discarded, fallback (the bounded wait ran
                                                    out), cancelled [outcome]
``compactd.ahead.wait``                histogram    seconds a step at the trigger waited for a
                                                    candidate it applied (0: it was ready)
``compactd.bracket.step.duration``     histogram    seconds per bracket step [step]
``compactd.summary.duration``          histogram    seconds per summary [summarizer, outcome]
``gen_ai.client.operation.duration``   histogram    seconds per model call (GenAI conventions)
``gen_ai.client.token.usage``          histogram    tokens per model call [gen_ai.token.type]
``compactd.events.appended``           counter      events appended by clients
``compactd.sessions.live``             gauge        sessions resident in memory
``compactd.store.commits``             counter      write transactions the store committed
``compactd.store.commit.time``         counter      seconds those transactions took, start to
                                                    commit (the fsync included)
``compactd.store.queue.time``          counter      seconds writes waited for their transaction
                                                    (SQLite's writer queue, PostgreSQL's pool)
``compactd.quota.refusals``            counter      calls refused over a tenant quota [tenant,
                                                    quota]
``rpc.server.call.duration``           histogram    seconds per RPC [rpc.method, status code]
=====================================  ===========  ===============================================
"""

from __future__ import annotations

import functools
import inspect
import operator
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.metrics import CallbackOptions, MeterProvider, NoOpMeterProvider, Observation
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics, rpc_metrics
from opentelemetry.trace import Span, Tracer

from compactd import __version__, logs

if TYPE_CHECKING:
    from compactd.store.base import StoreStats

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_RATIOS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
_TOKENS = (256, 1024, 4096, 16384, 65536, 131072, 262144, 1048576)
_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    """Every metric compactd records (see the module docstring); thread- and task-safe."""

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        provider = meter_provider or NoOpMeterProvider()
        #: Whether anything records: a no-op provider's RPCs are not timed at all.
        self.recording = not isinstance(provider, NoOpMeterProvider)
        meter = provider.get_meter("compactd", __version__)
        self._pressure_ratio = meter.create_histogram(
            "compactd.pressure.ratio", unit="1", explicit_bucket_boundaries_advisory=_RATIOS,
            description="Measured tokens over the trigger, per pressure report",
        )  # fmt: skip
        self._pressure_tokens = meter.create_histogram(
            "compactd.pressure.tokens", unit="{token}", explicit_bucket_boundaries_advisory=_TOKENS,
            description="Measured tokens of the request envelope, per pressure report",
        )  # fmt: skip
        self._compactions = meter.create_counter(
            "compactd.compactions", unit="{compaction}", description="Brackets, by outcome"
        )
        self._freed = meter.create_counter(
            "compactd.compaction.tokens_freed", unit="{token}",
            description="Route tokens freed by committed brackets",
        )  # fmt: skip
        self._prunes = meter.create_counter(
            "compactd.prunes", unit="{tool_result}", description="Tool results pruned"
        )
        self._steps = meter.create_histogram(
            "compactd.bracket.step.duration", unit="s",
            explicit_bucket_boundaries_advisory=_SECONDS,
            description="Duration of each bracket step",
        )  # fmt: skip
        self._summaries = meter.create_histogram(
            "compactd.summary.duration", unit="s", explicit_bucket_boundaries_advisory=_SECONDS,
            description="Duration of each summary, by summarizer",
        )  # fmt: skip
        self._model_calls = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, unit="s",
            explicit_bucket_boundaries_advisory=_SECONDS,
            description="Duration of each summary model call",
        )  # fmt: skip
        self._model_tokens = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE, unit="{token}",
            explicit_bucket_boundaries_advisory=_TOKENS,
            description="Tokens of each summary model call, input and output",
        )  # fmt: skip
        self._gate = meter.create_counter(
            "compactd.summary.gate", unit="{summary}",
            description="Summaries the quality gate judged, by outcome",
        )  # fmt: skip
        self._retention = meter.create_histogram(
            "compactd.summary.probe_retention", unit="1",
            explicit_bucket_boundaries_advisory=_SHARES,
            description="Share of its span's probes a judged summary kept",
        )  # fmt: skip
        self._ahead = meter.create_counter(
            "compactd.ahead.candidates", unit="{candidate}",
            description="Summaries prepared ahead of the trigger, by outcome",
        )  # fmt: skip
        self._ahead_wait = meter.create_histogram(
            "compactd.ahead.wait", unit="s", explicit_bucket_boundaries_advisory=_SECONDS,
            description="Seconds a step at the trigger waited for the candidate it applied",
        )  # fmt: skip
        self._appended = meter.create_counter(
            "compactd.events.appended", unit="{event}", description="Events appended by clients"
        )
        self._quota_refusals = meter.create_counter(
            "compactd.quota.refusals", unit="{call}",
            description="Calls refused over a tenant quota, by tenant and quota",
        )  # fmt: skip
        self._rpcs = meter.create_histogram(
            rpc_metrics.RPC_SERVER_CALL_DURATION, unit="s",
            explicit_bucket_boundaries_advisory=_SECONDS, description="Duration of each RPC",
        )  # fmt: skip
        self._meter = meter

    # ---- pressure and compaction -----------------------------------------------------------

    def pressure(self, provider: str, model: str, state: str, measured: int, trigger: int) -> None:
        """One pressure report for a session routed to ``provider``/``model``."""
        attributes = {"compactd.route": f"{provider}/{model}", "compactd.pressure.state": state}
        self._pressure_tokens.record(measured, attributes)
        if trigger > 0:
            self._pressure_ratio.record(measured / trigger, attributes)

    def compaction(
        self, trigger: str, outcome: str, *, reason: str = "", freed: int = 0, rung: str = ""
    ) -> None:
        """One bracket ended: ``committed`` (by the ladder's ``rung``: ``summary`` or
        ``extractive``), ``declined``, ``relieved``, ``failed``; or older tool outputs were
        ``masked`` (the ladder's masking rung)."""
        attributes = {"compactd.trigger": trigger, "compactd.outcome": outcome}
        if reason:
            attributes["compactd.reason"] = reason
        if rung:
            attributes["compactd.rung"] = rung
        self._compactions.add(1, attributes)
        if freed > 0:
            self._freed.add(freed, {"compactd.trigger": trigger})

    def ahead(self, outcome: str, *, waited: float | None = None) -> None:
        """A candidate prepared ahead of the trigger moved on (``started``, ``ready``, ``failed``,
        ``applied`` after ``waited`` seconds, ``discarded``, ``fallback``, ``cancelled``)."""
        self._ahead.add(1, {"compactd.outcome": outcome})
        if waited is not None:
            self._ahead_wait.record(waited)

    def gate(self, summarizer: str, outcome: str, retention: float) -> None:
        """The quality gate judged a summary (``passed``, ``rejected`` or ``fallback``)."""
        self._gate.add(1, {"compactd.summarizer": summarizer, "compactd.outcome": outcome})
        self._retention.record(retention, {"compactd.summarizer": summarizer})

    def pruned(self, count: int) -> None:
        """``count`` tool results were pruned."""
        if count:
            self._prunes.add(count)

    def step(self, step: str, seconds: float) -> None:
        """One bracket step (``start``, ``summarize``, ``summary``, ...) took ``seconds``."""
        self._steps.record(seconds, {"compactd.step": step})

    def summary(self, summarizer: str, outcome: str, seconds: float) -> None:
        """One summary by ``summarizer`` ended (``ok`` or the failure's reason)."""
        attributes = {"compactd.summarizer": summarizer, "compactd.outcome": outcome}
        self._summaries.record(seconds, attributes)

    def model_call(
        self, attributes: Mapping[str, Any], seconds: float, input_tokens: int, output_tokens: int
    ) -> None:
        """One model call, with its GenAI attributes (operation, provider, model, error)."""
        base = dict(attributes)
        self._model_calls.record(seconds, base)
        for kind, tokens in (("input", input_tokens), ("output", output_tokens)):
            if tokens:
                self._model_tokens.record(tokens, {**base, genai.GEN_AI_TOKEN_TYPE: kind})

    def appended(self, events: int) -> None:
        """A client append committed ``events`` events."""
        self._appended.add(events)

    def quota_refused(self, tenant: str, quota: str) -> None:
        """A call of ``tenant`` was refused over its ``quota`` (a setting name)."""
        self._quota_refusals.add(1, {"tenant": tenant, "quota": quota})

    def observe_sessions(self, resident: Callable[[], int]) -> None:
        """Report ``resident()`` as the live-sessions gauge at every collection."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            yield Observation(resident())

        self._meter.create_observable_gauge(
            "compactd.sessions.live", [observe], unit="{session}",
            description="Sessions resident in memory",
        )  # fmt: skip

    def observe_store(self, stats: Callable[[], StoreStats]) -> None:
        """Report the store's write counters (``stats()``, a snapshot) at every collection: its
        commits, and the time its write transactions took and its writes waited for them. Read
        when collected, nothing is recorded per write."""
        for name, unit, description, field in _STORE_COUNTERS:
            observe = functools.partial(_observed, stats, operator.attrgetter(field))
            self._meter.create_observable_counter(
                name, [observe], unit=unit, description=description
            )

    def rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """One RPC ``/package.Service/Method`` ended with ``code``."""
        service, _, name = method.strip("/").rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name,
                      "rpc.grpc.status_code": code.value[0]}  # fmt: skip
        self._rpcs.record(seconds, attributes)

    # ---- seams for the engine and the server ---------------------------------------------------

    def timed(self, tracer: Tracer) -> Tracer:
        """``tracer``, with the duration of every ``compaction.<step>`` span recorded as a step."""
        return _StepTimer(tracer, self)

    def interceptor(self) -> grpc.aio.ServerInterceptor:  # type: ignore[type-arg]
        """A server interceptor: RPC latency, appends, pressure reports, log context."""
        return _RpcInterceptor(self)


class _StepTimer(Tracer):
    """A tracer that times the spans it starts (bracket steps) into ``Metrics.step``."""

    def __init__(self, tracer: Tracer, metrics: Metrics) -> None:
        self._tracer = tracer
        self._metrics = metrics

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> Span:
        return self._tracer.start_span(name, *args, **kwargs)

    def start_as_current_span(  # type: ignore[override]
        self, name: str, *args: Any, **kwargs: Any
    ) -> _TimedSpan:
        step = name.removeprefix("compaction.") if name.startswith("compaction.") else None
        return _TimedSpan(self._tracer.start_as_current_span(name, *args, **kwargs), step, self)


class _TimedSpan:
    """The tracer's current-span context, timed into ``Metrics.step`` when it is a bracket step
    (a plain class: a generator-based context manager costs a frame and a generator per span)."""

    __slots__ = ("_inner", "_started", "_step", "_timer")

    def __init__(self, inner: AbstractContextManager[Span], step: str | None, timer: _StepTimer):
        self._started = time.perf_counter()
        self._inner, self._step, self._timer = inner, step, timer

    def __enter__(self) -> Span:
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        try:
            return self._inner.__exit__(*exc)
        finally:
            if self._step is not None:
                self._timer._metrics.step(self._step, time.perf_counter() - self._started)


class _RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Times every RPC, counts appended events, records pressure reports the RPCs answer, and
    binds the request's session id to the log context of its handler."""

    resolves_per_method = True  # see ``api.interceptors.Composed``

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._handlers: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        # The timed handler is built once per method (grpc.aio asks on every call).
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        timed = self._timed(method, handler)
        self._handlers[method] = (handler, timed)
        return timed

    def _timed(self, method: str, handler: Any) -> Any:
        if not self._metrics.recording:  # nothing to time or count: the log context alone
            return _bound(handler)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # no client-streaming RPCs in compactd

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            _bind_session(request)
            try:
                response = await behavior(request, context)
            finally:
                self._metrics.rpc(method, _code(context), time.perf_counter() - started)
            self._observe(response)
            return response

        return unary

    def _stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(behavior):  # writes with context.write

            async def writer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                started = time.perf_counter()
                _bind_session(request)
                try:
                    await behavior(request, _ObservedWrites(context, self._observe))
                finally:
                    self._metrics.rpc(method, _code(context), time.perf_counter() - started)

            return writer

        async def stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            started = time.perf_counter()
            _bind_session(request)
            try:
                async for response in behavior(request, context):
                    self._observe(response)
                    yield response
            finally:
                self._metrics.rpc(method, _code(context), time.perf_counter() - started)

        return stream

    def _observe(self, response: Any) -> None:
        """Pressure reports and append results carried by a response."""
        if type(response).__name__ == "AppendEventsResponse":  # carries no report
            self._metrics.appended(len(response.seqs))
            return
        for report in _reports(response):
            self._metrics.pressure(
                report.route.provider, report.route.model, _state_name(report.state),
                report.measured_tokens, report.trigger_tokens,
            )  # fmt: skip


def _bound(handler: Any) -> Any:
    """``handler`` binding its request's session id to the log context, timing nothing."""
    if handler.unary_unary is not None:
        behavior = handler.unary_unary
        factory = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream is not None:
        behavior = handler.unary_stream
        factory = grpc.unary_stream_rpc_method_handler
    else:
        return handler  # no client-streaming RPCs in compactd
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            _bind_session(request)
            async for response in behavior(request, context):
                yield response

        wrapped: Callable[..., Any] = stream
    else:

        async def call(request: Any, context: Any) -> Any:
            _bind_session(request)
            return await behavior(request, context)

        wrapped = call
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


#: ``observe_store``'s counters: name, unit, description, the ``StoreStats`` field.
_STORE_COUNTERS = (
    ("compactd.store.commits", "{commit}", "Write transactions the store committed", "commits"),
    ("compactd.store.commit.time", "s",
     "Time committed write transactions took, start to commit (fsync included)",
     "commit_seconds"),
    ("compactd.store.queue.time", "s",
     "Time writes waited for their transaction to start (summed per write)", "queued_seconds"),
)  # fmt: skip


def _observed(
    stats: Callable[[], StoreStats], value: Callable[[StoreStats], float], options: CallbackOptions
) -> Iterable[Observation]:
    yield Observation(value(stats()))


class _ObservedWrites:
    """A servicer context whose ``write`` observes each response first (a handler that streams
    through ``context.write``); everything else is the context's own."""

    __slots__ = ("_context", "_observe")

    def __init__(self, context: Any, observe: Callable[[Any], None]) -> None:
        self._context = context
        self._observe = observe

    async def write(self, message: Any) -> None:
        self._observe(message)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _reports(response: Any) -> Iterator[Any]:
    """The ``PressureReport``s of CheckPressure, WatchPressure and PrepareStep responses."""
    if _has(response, "report"):
        yield response.report
    result = response.result if _has(response, "result") else None
    if result is not None and type(result).__name__ == "PrepareStepResult":
        if _has(result, "before"):
            yield result.before
        # A step that changed nothing measured once: its ``after`` is its ``before``.
        changed = result.pruned_count or result.compactions or _has(result, "header_seq")
        if changed and _has(result, "after"):
            yield result.after


def _has(message: Any, name: str) -> bool:
    # Asking the descriptor first spares most responses a raised and caught ValueError.
    fields = getattr(getattr(message, "DESCRIPTOR", None), "fields_by_name", None)
    if fields is not None and name not in fields:
        return False
    try:
        return bool(message.HasField(name))
    except (ValueError, AttributeError):
        return False


def _state_name(state: int) -> str:
    from compactd.v1 import compaction_service_pb2 as cpb

    return cpb.PressureState.Name(state).removeprefix("PRESSURE_STATE_")  # type: ignore[arg-type]


def _bind_session(request: Any) -> None:
    session_id = getattr(request, "session_id", "")
    if isinstance(session_id, str) and session_id:
        logs.bind(session_id=session_id)


def _code(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODES.get(code, grpc.StatusCode.OK)  # grpc.aio reports an int once a handler aborted


_CODES = {candidate.value[0]: candidate for candidate in grpc.StatusCode}
