"""The server's interceptor chain: small classes with one job each, composed in ``chain``.

1. ``Tracing``: OpenTelemetry's aio server interceptor, fixed for streaming handlers that are
   coroutines writing through ``context.write`` rather than async generators (the health
   service's ``Watch``, an UNIMPLEMENTED stub): upstream wraps every response-streaming handler
   as an async generator and answers such calls UNKNOWN (opentelemetry-python-contrib #3066).
   Over a no-op tracer provider (nothing exports spans) ``CallerContext`` takes its place: the
   caller's W3C context made current for the call, no span.
2. ``api.auth.Authentication`` (when given): binds the caller's tenant, or answers
   UNAUTHENTICATED, before anything reads the request.
3. ``UndecodableRequests``: request bytes that do not parse (invalid UTF-8 in a string field, a
   truncated varint, nesting past the parser's limit) answer INVALID_ARGUMENT with reason
   ``UNDECODABLE_REQUEST``, for every method, streamed requests included. grpc.aio would raise
   the parser's error out of the handler: UNKNOWN, and a traceback in the log per request.
4. ``StreamLimits``: at most ``max_streams`` response streams at once in the process and
   ``max_streams_per_session`` per session (of the caller's tenant); more answer
   RESOURCE_EXHAUSTED with reason ``TOO_MANY_STREAMS`` (every commit wakes each watcher of its
   session).
5. ``TenantQuotas``: the calling tenant's quotas on response streams open at once and on
   ``AppendEvents`` per second (``compactd.service.quotas``), refused before the handler runs
   with RESOURCE_EXHAUSTED, reason ``QUOTA_EXCEEDED``, ``QuotaFailure`` and ``RetryInfo``.

A test's own tenant binding (``tenant_binding``) goes after authentication and before the limits,
so every limit counts the tenant the call runs as.

Neighbours whose handler depends only on the method (all of compactd's own) are served as one
``Composed`` interceptor, resolved once per method: grpc.aio resolves every call through every
interceptor, which cost more per call than the limits themselves.

Every wrapper keeps its handler's shape: an async-generator handler stays one, a coroutine
handler (unary, or streaming through ``context.write``) stays a coroutine, because grpc.aio picks
how to drive a handler by its shape.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import _aio_server, aio_server_interceptor
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from compactd.api import status
from compactd.errors import InvalidArgument, QuotaExceeded, ResourceExhausted
from compactd.reasons import Reason
from compactd.service.quotas import QuotaBook
from compactd.tenancy import current_tenant

Behavior = Callable[[Any, Any], Any]
if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
    Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    Interceptor = grpc.aio.ServerInterceptor
#: A guard around one call: given (request, context) it may abort; it yields the request the
#: handler sees (a checked iterator for a streamed request) and cleans up after the call.
Guard = Callable[[Any, Any], AbstractAsyncContextManager[Any]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]

APPEND_EVENTS = "/compactd.v1.SessionService/AppendEvents"
_SESSION_SERVICES = ("/compactd.v1.SessionService/", "/compactd.v1.CompactionService/")


def chain(
    tracer_provider: trace.TracerProvider,
    *,
    max_streams: int,
    max_streams_per_session: int,
    observe: Sequence[Interceptor] = (),
    authentication: Interceptor | None = None,
    tenant_binding: Sequence[Interceptor] = (),
    quotas: QuotaBook | None = None,
) -> list[Interceptor]:
    """The server's interceptors, outermost first: tracing and the ``observe`` ones (metrics)
    see every call and every status the others set; ``authentication`` (``api.auth``) binds
    the caller's tenant before anything reads the request (``tenant_binding``: a test's own
    binding, after it); the limits and ``quotas`` count the tenant bound."""
    tracing: Interceptor = (
        CallerContext()
        if isinstance(tracer_provider, trace.NoOpTracerProvider)
        else Tracing.for_provider(tracer_provider)
    )
    return composed(
        [
            tracing,
            *observe,
            *([authentication] if authentication is not None else []),
            UndecodableRequests(),
            *tenant_binding,
            StreamLimits(max_streams=max_streams, max_streams_per_session=max_streams_per_session),
            *([TenantQuotas(quotas)] if quotas is not None else []),
        ]
    )


def composed(interceptors: Sequence[Interceptor]) -> list[Interceptor]:
    """``interceptors`` with each run of neighbours that resolve per method (``PER_METHOD``)
    joined into one ``Composed``; the others (a test's tenant binding) stay as they are."""
    out: list[Interceptor] = []
    run: list[Interceptor] = []
    for interceptor in interceptors:
        if getattr(interceptor, PER_METHOD, False):
            run.append(interceptor)
            continue
        out += [Composed(run)] if len(run) > 1 else run
        out.append(interceptor)
        run = []
    out += [Composed(run)] if len(run) > 1 else run
    return out


#: The attribute an interceptor sets true when the handler it returns depends only on the method
#: and the handler under it (anything per call happens inside the handler, when it runs).
PER_METHOD = "resolves_per_method"


class Composed(Interceptor):
    """Interceptors that each resolve per method, resolved together once per method.

    grpc.aio resolves the handler of every call through every interceptor, a coroutine each;
    for these the answer is the same call after call while the handler under them is, so it is
    resolved through them on a method's first call (and again when that handler changes) and
    reused after.
    """

    def __init__(self, parts: Sequence[Interceptor]) -> None:
        self.parts = list(parts)
        self._by_method: dict[str, tuple[Handler | None, Handler | None]] = {}

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        method = handler_call_details.method
        cached = self._by_method.get(method)
        if cached is not None and cached[0] is handler:
            return cast(Handler, cached[1])
        built = await self._resolve(0, handler, handler_call_details)
        self._by_method[method] = (handler, built)
        return cast(Handler, built)

    async def _resolve(
        self, index: int, handler: Handler | None, details: grpc.HandlerCallDetails
    ) -> Handler | None:
        if index == len(self.parts):
            return handler

        async def inner(call_details: grpc.HandlerCallDetails) -> Handler | None:
            return await self._resolve(index + 1, handler, call_details)

        resolved: Handler | None = await self.parts[index].intercept_service(
            cast(Continuation, inner), details
        )
        return resolved


def guarded(behavior: Behavior, guard: Guard) -> Behavior:
    """``behavior`` run inside ``guard``, with the same shape (async generator or coroutine)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async with guard(request, context) as checked:
                async for response in behavior(checked, context):
                    yield response

        return stream

    awaited = coroutine(behavior)

    async def call(request: Any, context: Any) -> Any:
        async with guard(request, context) as checked:
            return await awaited(checked, context)

    return call


def coroutine(behavior: Behavior) -> Callable[[Any, Any], Awaitable[Any]]:
    """``behavior`` as a coroutine function: itself when it is one (every handler of compactd's
    own), so a wrapper awaits it without asking each call whether its result is awaitable."""
    if inspect.iscoroutinefunction(behavior):
        return cast(Callable[[Any, Any], Awaitable[Any]], behavior)

    async def call(request: Any, context: Any) -> Any:
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


#: A check before a call that needs no cleanup after it: given (request, context) it answers
#: None when the call may go on at once, or an awaitable to await first, which may abort (a
#: refusal, or a wait): a call that passes makes no coroutine for its check.
Check = Callable[[Any, Any], Awaitable[None] | None]


def checked(behavior: Behavior, check: Check) -> Behavior:
    """``behavior`` run after ``check``, with the same shape: ``guarded`` without the generator
    and context manager a ``Guard`` costs per call (checks run on every unary call)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            waiting = check(request, context)
            if waiting is not None:
                await waiting
            async for response in behavior(request, context):
                yield response

        return stream

    under: tuple[tuple[Check, ...], Behavior] | None = getattr(behavior, _CHECKS, None)
    if under is None:
        checks: tuple[Check, ...] = (check,)
    else:  # a checked call right under this one: one layer (one coroutine) runs both checks
        checks, behavior = (check, *under[0]), under[1]
    awaited = coroutine(behavior)
    if len(checks) == 1:

        async def call(request: Any, context: Any) -> Any:
            waiting = check(request, context)
            if waiting is not None:
                await waiting
            return await awaited(request, context)

    else:

        async def call(request: Any, context: Any) -> Any:
            for each in checks:  # in order: outermost first, each after the one before passed
                waiting = each(request, context)
                if waiting is not None:
                    await waiting
            return await awaited(request, context)

    setattr(call, _CHECKS, (checks, behavior))
    return call


#: The attribute of a call ``checked`` made: (its checks, outermost first; the behavior under
#: them), so that a check added around it joins them instead of adding a layer.
_CHECKS = "_compactd_checks"


def rewrapped(
    handler: Handler,
    wrap: Callable[[Behavior], Behavior],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
    response_serializer: Callable[[Any], bytes] | None = None,
) -> Handler:
    """A copy of ``handler`` whose behavior is ``wrap(behavior)`` (and maybe a new deserializer
    or serializer)."""
    behavior: Behavior | None
    if handler.request_streaming and handler.response_streaming:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    assert behavior is not None
    rebuilt: Handler = factory(
        wrap(behavior),
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=response_serializer or handler.response_serializer,
    )
    return rebuilt


class HandlerCache:
    """An interceptor's rewrapped handler per method, built at the method's first call.

    grpc.aio asks the interceptors for a handler on every call; the handler under them is the
    same object call after call (the servicer's, or the next interceptor's cached one), so what
    is wrapped around it is decided once per method, not per call. A different handler under
    the same method (a test's servicer swapped in) is wrapped afresh.
    """

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[Handler, Handler]] = {}

    def get(self, method: str, handler: Handler, build: Callable[[Handler], Handler]) -> Handler:
        """``build(handler)``, built once while ``handler`` is what ``method`` resolves to."""
        cached = self._by_method.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        built = build(handler)
        self._by_method[method] = (handler, built)
        return built


# ---- 1. tracing ----------------------------------------------------------------------------


class Tracing(_aio_server.OpenTelemetryAioServerInterceptor):
    """OpenTelemetry's server spans for every handler shape.

    A response-streaming handler that is not an async generator writes through
    ``context.write`` and returns when done: it is traced like a unary call (awaited inside the
    span), which is what it is to grpc.aio.

    A call that aborts with a status (a refusal: NOT_FOUND, QUOTA_EXCEEDED, ...) gets the status
    on its span and no ``exception`` event: upstream records grpc's ``AbortError`` twice, each
    time formatting its traceback, which made a refused call cost more than an admitted one (a
    flood of refusals is what a throttled tenant sends).
    """

    @contextmanager
    def _start_span(
        self,
        handler_call_details: grpc.HandlerCallDetails,
        context: Any,
        set_status_on_exception: bool = False,
    ) -> Iterator[Any]:
        manager = super()._start_span(  # type: ignore[no-untyped-call]
            handler_call_details, context, set_status_on_exception
        )
        span = manager.__enter__()
        try:
            yield _AbortsUnrecorded(span)
        except grpc.aio.AbortError:
            manager.__exit__(None, None, None)  # the status is on the span already
            raise
        except BaseException as error:
            if not manager.__exit__(type(error), error, error.__traceback__):
                raise
        else:
            manager.__exit__(None, None, None)

    resolves_per_method = True  # instrumentation is on or off for the whole server

    def __init__(self, tracer: trace.Tracer, filter_: Any = None) -> None:
        super().__init__(tracer, filter_=filter_)  # type: ignore[no-untyped-call]
        self._cache = HandlerCache()

    async def intercept_service(  # type: ignore[override]  # the aio interceptor's, not sync's
        self,
        continuation: Continuation,  # type: ignore[override]
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        """Upstream's, with the traced handler built once per method instead of on every call
        (upstream rebuilds it around each call's details, of which spans read only the
        method)."""
        if not is_instrumentation_enabled() or (
            self._filter is not None and not self._filter(handler_call_details)
        ):
            return await continuation(handler_call_details)
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None:
            return cast(Handler, handler)
        method = _Method(handler_call_details.method)
        return self._cache.get(method.method, handler, lambda inner: self._traced(method, inner))

    def _traced(self, method: _Method, handler: Handler) -> Handler:
        details = cast(grpc.HandlerCallDetails, method)
        if handler.response_streaming:
            return rewrapped(handler, lambda b: self._intercept_aio_server_stream(b, details))
        return rewrapped(
            handler,
            lambda b: self._intercept_aio_server_unary(b, details),  # type: ignore[no-untyped-call]
        )

    @classmethod
    def for_provider(cls, tracer_provider: trace.TracerProvider) -> Tracing:
        """The interceptor over ``tracer_provider`` (upstream's factory, this class)."""
        upstream = aio_server_interceptor(tracer_provider=tracer_provider)  # type: ignore[no-untyped-call]
        tracing = cls(upstream._tracer, filter_=upstream._filter)
        return tracing

    def _intercept_aio_server_stream(
        self, behavior: Behavior, handler_call_details: grpc.HandlerCallDetails
    ) -> Behavior:
        if inspect.isasyncgenfunction(behavior):
            traced: Behavior = super()._intercept_aio_server_stream(  # type: ignore[no-untyped-call]
                behavior, handler_call_details
            )
        else:
            traced = self._intercept_aio_server_unary(  # type: ignore[no-untyped-call]
                behavior, handler_call_details
            )
        return traced


@dataclass(frozen=True)
class _Method:
    """What a traced handler keeps of its calls' details: the method (no call's metadata)."""

    method: str
    invocation_metadata: tuple[Any, ...] = ()


class _AbortsUnrecorded:
    """A span whose ``record_exception`` ignores grpc's ``AbortError`` (a status, not a fault)."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def __getattr__(self, name: str) -> Any:
        return getattr(self._span, name)

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        if not isinstance(exception, grpc.aio.AbortError):
            self._span.record_exception(exception, *args, **kwargs)


class CallerContext(Interceptor):
    """The caller's W3C context (``traceparent``, ``tracestate``, ``baggage``: the global
    propagator's fields) current while its call runs, without a span: what ``Tracing`` over a
    no-op tracer provider leaves of a call, for a fraction of its cost (upstream starts a
    non-recording span, sets its attributes and status, and parses every call's metadata).

    Log lines and the summary calls' ``traceparent`` still carry the caller's trace; a call
    without one runs in no trace, as it would under a no-op tracer.
    """

    resolves_per_method = True

    def __init__(self) -> None:
        self._fields = frozenset(propagate.get_global_textmap().fields)
        self._cache = HandlerCache()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None:
            return cast(Handler, handler)
        return self._cache.get(
            handler_call_details.method, handler, lambda inner: rewrapped(inner, self._joined)
        )

    def _joined(self, behavior: Behavior) -> Behavior:
        if inspect.isasyncgenfunction(behavior):
            return guarded(behavior, self._guard)
        awaited = coroutine(behavior)

        async def call(request: Any, context: Any) -> Any:
            carrier = self._carrier(context)
            if not carrier:  # the caller sent no trace context: nothing to make current
                return await awaited(request, context)
            token = otel_context.attach(propagate.extract(carrier))
            try:
                return await awaited(request, context)
            finally:
                otel_context.detach(token)

        return call

    @asynccontextmanager
    async def _guard(self, request: Any, context: Any) -> AsyncIterator[Any]:
        carrier = self._carrier(context)
        token = otel_context.attach(propagate.extract(carrier)) if carrier else None
        try:
            yield request
        finally:
            if token is not None:
                otel_context.detach(token)

    def _carrier(self, context: Any) -> dict[str, str]:
        """The call's metadata the propagator reads (empty: the caller sent no context)."""
        fields = self._fields
        return {k: v for k, v in context.invocation_metadata() or () if k in fields}


# ---- 2. undecodable requests ------------------------------------------------------------------


@dataclass(frozen=True)
class Undecodable:
    """What the guarded deserializer hands the handler instead of a request it could not parse."""

    error: str


class UndecodableRequests(Interceptor):
    """Answers INVALID_ARGUMENT (reason ``UNDECODABLE_REQUEST``) for bytes that do not parse."""

    resolves_per_method = True

    def __init__(self) -> None:
        self._cache = HandlerCache()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return cast(Handler, handler)  # None: an unknown method, answered UNIMPLEMENTED
        return self._cache.get(handler_call_details.method, handler, _decoding)


def _decoding(handler: Handler) -> Handler:
    """``handler`` with a deserializer that hands bad bytes to a guard refusing them."""
    parse = handler.request_deserializer
    assert parse is not None

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as error:  # the parser's own error: the caller sent bad bytes
            return Undecodable(f"{type(error).__name__}: {error}")

    if handler.request_streaming:
        guard = _decoded_guard()
        return rewrapped(
            handler, lambda behavior: guarded(behavior, guard), request_deserializer=deserialize
        )
    return rewrapped(
        handler, lambda behavior: checked(behavior, _refuse_if_undecodable),
        request_deserializer=deserialize,
    )  # fmt: skip


def _refuse_if_undecodable(request: Any, context: Any) -> Awaitable[None] | None:
    """The refusal of a request that did not parse (a ``Check``); None for one that did."""
    if isinstance(request, Undecodable):
        return _refuse_undecodable(context, request)
    return None


def _decoded_guard() -> Guard:
    @asynccontextmanager
    async def guard(requests: Any, context: Any) -> AsyncIterator[Any]:
        yield _decoded(requests, context)

    return guard


async def _decoded(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse_undecodable(context, request)
        yield request


async def _refuse_undecodable(context: Any, request: Undecodable) -> None:
    await status.abort(
        context,
        InvalidArgument(
            f"the request message could not be decoded ({request.error})",
            reason=Reason.UNDECODABLE_REQUEST,
        ),
    )


# ---- 3. stream limits -------------------------------------------------------------------------


class StreamLimits(Interceptor):
    """Bounds concurrent response streams, per process and per session.

    A stream counts from the moment its handler starts until it returns, fails or is cancelled.
    Health and reflection streams count towards the process limit; a stream of compactd's own
    services also counts towards its session's (the request's ``session_id``).
    """

    resolves_per_method = True

    def __init__(self, *, max_streams: int, max_streams_per_session: int) -> None:
        self.max_streams = max_streams
        self.max_streams_per_session = max_streams_per_session
        self.active = 0
        self.per_session: dict[tuple[str, str], int] = {}  # (tenant, session id): streams
        self._cache = HandlerCache()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return cast(Handler, handler)
        method = handler_call_details.method
        return self._cache.get(method, handler, lambda inner: self._limited(method, inner))

    def _limited(self, method: str, handler: Handler) -> Handler:
        per_session = not handler.request_streaming and method.startswith(_SESSION_SERVICES)
        return rewrapped(handler, lambda behavior: self._counted(behavior, per_session))

    def _counted(self, behavior: Behavior, per_session: bool) -> Behavior:
        """``behavior`` counted while it runs; a coroutine handler (PrepareStep and the other
        ``context.write`` streams) is awaited directly, with no context manager per call."""
        if not inspect.iscoroutinefunction(behavior):
            return guarded(behavior, self._guard(per_session))

        async def call(request: Any, context: Any) -> Any:
            key = await self._admit(request, context, per_session)
            try:
                return await behavior(request, context)
            finally:
                self._leave(key)

        return call

    def _guard(self, per_session: bool) -> Guard:
        @asynccontextmanager
        async def guard(request: Any, context: Any) -> AsyncIterator[Any]:
            key = await self._admit(request, context, per_session)
            try:
                yield request
            finally:
                self._leave(key)

        return guard

    async def _admit(self, request: Any, context: Any, per_session: bool) -> tuple[str, str] | None:
        """Count a new stream (its session's key, if it counts per session) or refuse it."""
        session_id = str(getattr(request, "session_id", "")) if per_session else ""
        # Sessions are (tenant, id): another tenant's watchers of the same id do not count.
        key = (current_tenant().id, session_id) if session_id else None
        if self.active >= self.max_streams:
            await self._refuse(context, "process", self.max_streams)
        if key and self.per_session.get(key, 0) >= self.max_streams_per_session:
            await self._refuse(context, "session", self.max_streams_per_session, session_id)
        self._enter(key)
        return key

    def _enter(self, key: tuple[str, str] | None) -> None:
        self.active += 1
        if key:
            self.per_session[key] = self.per_session.get(key, 0) + 1

    def _leave(self, key: tuple[str, str] | None) -> None:
        self.active -= 1
        if key:
            left = self.per_session[key] - 1
            if left:
                self.per_session[key] = left
            else:
                del self.per_session[key]

    async def _refuse(self, context: Any, scope: str, limit: int, session_id: str = "") -> None:
        where = f"session {session_id!r}" if session_id else "this server"
        metadata = {"scope": scope, "limit": str(limit)}
        if session_id:
            metadata["session_id"] = session_id
        setting = "max_streams_per_session" if session_id else "max_streams"
        await status.abort(
            context,
            ResourceExhausted(
                f"{where} already serves {limit} streams, the most it allows ({setting}); "
                "close one or retry later",
                reason=Reason.TOO_MANY_STREAMS,
                metadata=metadata,
            ),
        )


# ---- 5. tenant quotas -------------------------------------------------------------------------


class TenantQuotas(Interceptor):
    """The calling tenant's stream and append-rate quotas, checked before the handler runs.

    A response stream of compactd's services counts from its start until it ends; an
    ``AppendEvents`` takes one token of the tenant's bucket, refused or not by the handler
    afterwards (a flood of bad batches is still a flood). Sessions and bytes are counted where
    they are known, in ``SessionManager``.
    """

    resolves_per_method = True

    def __init__(self, book: QuotaBook) -> None:
        self.book = book
        self._cache = HandlerCache()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_SESSION_SERVICES):
            return cast(Handler, handler)
        if method == APPEND_EVENTS:
            return self._cache.get(method, handler, lambda inner: self._guarded(inner, True))
        if handler.response_streaming:
            return self._cache.get(method, handler, lambda inner: self._guarded(inner, False))
        return handler

    def _guarded(self, handler: Handler, append: bool) -> Handler:
        if append:  # AppendEvents is unary: a check, nothing to clean up
            return rewrapped(handler, lambda behavior: checked(behavior, self._admit_append))
        return rewrapped(handler, self._counted)

    def _counted(self, behavior: Behavior) -> Behavior:
        """A stream counted against the tenant's quota while it runs; a coroutine handler is
        awaited directly, with no context manager per call."""
        if not inspect.iscoroutinefunction(behavior):
            return guarded(behavior, self._stream_guard)

        async def call(request: Any, context: Any) -> Any:
            close = await self._open(context)
            try:
                return await behavior(request, context)
            finally:
                close()

        return call

    def _admit_append(self, request: Any, context: Any) -> Awaitable[None] | None:
        """The append's token (a ``Check``): None at once when the caller's tenant has no
        append rate to keep, else its wait for a token, or its refusal."""
        if not self.book.keeps_append_rate():
            return None
        return self._take_append(context)

    async def _take_append(self, context: Any) -> None:
        try:
            await self.book.admit_append_or_wait()
        except QuotaExceeded as error:
            await status.abort(context, error)

    @asynccontextmanager
    async def _stream_guard(self, request: Any, context: Any) -> AsyncIterator[Any]:
        close = await self._open(context)
        try:
            yield request
        finally:
            close()

    async def _open(self, context: Any) -> Callable[[], None]:
        """Open one of the tenant's streams (its closer), or abort with QUOTA_EXCEEDED."""
        try:
            return self.book.open_stream()
        except QuotaExceeded as error:
            await status.abort(context, error)
            raise  # abort raises; this keeps the type checker's view of it
