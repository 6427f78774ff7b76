"""The server factory: composes store, services and servicers into a ``grpc.aio`` server.

``create_server(config)`` binds (port 0 picks a free one) and returns the running parts, so tests
talk to a real in-process server; ``serve`` adds signal handling and graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider

from compactd import config as settings
from compactd import redaction, telemetry
from compactd.api import auth, interceptors, reflection_v1, replies
from compactd.api.compaction_service import CompactionServicer
from compactd.api.health import HealthServicer
from compactd.api.registration import GenericOnly
from compactd.api.session_service import SessionServicer
from compactd.api.tls import Reloader, ServerTls
from compactd.config import ServerConfig
from compactd.core.policy import PressurePolicy
from compactd.core.pruner import PrunerConfig
from compactd.effective import startup_report
from compactd.errors import ConfigError, StartupError
from compactd.metrics import Metrics
from compactd.providers.base import Summarizer
from compactd.reasons import Reason
from compactd.routes import RouteCatalog
from compactd.service.ahead import AheadService
from compactd.service.bracket import Brackets, SummaryErrorRecovery
from compactd.service.guard import CompactionGuard
from compactd.service.inspection import InspectionService
from compactd.service.offload import ImageOffloadRecovery
from compactd.service.pressure import PressureService, warm_up
from compactd.service.pruning import Pruning
from compactd.service.quotas import QuotaBook, QuotaSettings
from compactd.service.recovery import RecoveryService
from compactd.service.retention import RetentionSweeper, periods_from
from compactd.service.revert import RevertService
from compactd.service.screening import Screener
from compactd.service.sessions import SessionManager
from compactd.service.steps import StepService
from compactd.service.summarizers import SummarizerRegistry, SummarizerSettings, named_routes
from compactd.service.switch import SwitchService
from compactd.store.base import Clock, EventStore, utc_now
from compactd.store.factory import store_for
from compactd.tenancy import Tenant
from compactd.v1 import (
    compaction_service_pb2,
    compaction_service_pb2_grpc,
    session_service_pb2,
    session_service_pb2_grpc,
)

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    session_service_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
    compaction_service_pb2.DESCRIPTOR.services_by_name["CompactionService"].full_name,
)


@dataclass
class RunningServer:
    """A started server and the parts a caller may need to inspect or stop."""

    server: grpc.aio.Server
    port: int
    store: EventStore
    manager: SessionManager
    health: health_aio.HealthServicer
    config: ServerConfig
    tracer_provider: trace.TracerProvider
    owns_tracer_provider: bool = False
    meter_provider: MeterProvider | None = None  # set when the server built (and owns) it
    prometheus: telemetry.PrometheusEndpoint | None = None
    pressure: PressureService | None = None  # calibration stats for plan/inspect views, metrics
    uninstall_redaction: Callable[[], None] | None = None
    # Issue 10: TLS and authentication
    reloader: Reloader | None = None  # TLS and tokens files: SIGHUP and polling
    retention: RetentionSweeper | None = None
    health_server: grpc.aio.Server | None = None  # the plaintext health-only listener
    health_port: int = 0
    quotas: QuotaBook | None = None  # issue 10: tenant quotas
    ahead: AheadService | None = None  # issue 35: summaries prepared ahead, in the background

    async def reload(self) -> bool:
        """Re-read the TLS and tokens files now (what SIGHUP does); True if any changed."""
        return False if self.reloader is None else await self.reloader.reload_now()

    @property
    def address(self) -> str:
        """``host:port`` to dial."""
        host, _ = self.config.host_port
        return f"{host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, end the following streams (``SERVER_SHUTTING_DOWN``:
        they would last the whole grace), refuse new calls, finish in-flight ones, close the
        store."""
        await self.health.enter_graceful_shutdown()
        await self.manager.end_streams()
        for background in (self.reloader, self.retention):
            if background is not None:
                await background.stop()
        await self.server.stop(self.config.shutdown_grace_s if grace is None else grace)
        if self.ahead is not None:  # background summaries: cancelled, their candidates dropped
            await self.ahead.close()
        if self.health_server is not None:
            await self.health_server.stop(0)
        await self.manager.close()
        await self.store.close()
        if self.prometheus is not None:
            await asyncio.to_thread(self.prometheus.stop)
        if self.uninstall_redaction is not None:
            self.uninstall_redaction()
        if self.owns_tracer_provider:  # flushing may wait on a collector: not on the loop
            await asyncio.to_thread(telemetry.shutdown, self.tracer_provider)
        if self.meter_provider is not None:
            await asyncio.to_thread(telemetry.shutdown, self.meter_provider)


@dataclass(frozen=True)
class Components:
    """The validated configuration sections every service is built from."""

    routes: RouteCatalog
    policy: PressurePolicy
    pruner: PrunerConfig
    summarizer: SummarizerSettings
    quotas: QuotaSettings
    retention: Mapping[Tenant, timedelta] = field(default_factory=dict)


def components(config: ServerConfig) -> Components:
    """Validate the owned sections of ``config`` (``ConfigError`` names the bad key)."""
    settings.check_limits(config)  # a config built without ``load`` is checked here too
    settings.check_transport(config)
    return Components(
        routes=RouteCatalog.from_config(config.routes),
        policy=_service_policy(config.compaction),
        pruner=PrunerConfig.from_mapping(config.pruner, prefix="pruner"),
        summarizer=SummarizerSettings.from_mapping(config.summarizer),
        quotas=QuotaSettings.from_mapping(config.quotas),
        retention=periods_from(config.session_retention_s),
    )


def _service_policy(table: Mapping[str, Any]) -> PressurePolicy:
    """The ``[compaction]`` table's policy; a bad key is named under the table, as in every
    other table (the core names it bare: a session's overrides are reported under their field)."""
    try:
        return PressurePolicy.from_settings(table)
    except ConfigError as error:
        raise ConfigError(f"compaction.{error.message}", metadata=error.metadata) from None


def validate(config: ServerConfig) -> Components:
    """Everything ``create_server`` checks before it opens the store or binds, doing neither:
    the owned sections, the TLS files, the tokens file and the JWT key set (``check-config``).

    Raises:
        ConfigError: A setting is invalid or a file it names is unusable (the message names it).
    """
    parts = components(config)
    _trust(config)
    return parts


def _trust(config: ServerConfig) -> _Trust:
    """The listener's TLS and authentication (``ConfigError`` for a missing or bad file)."""
    tls = ServerTls.from_config(config)
    return _Trust(tls, auth.Authentication(auth.credentials_from(config)))


async def create_server(
    config: ServerConfig,
    *,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    summarizer: Summarizer | None = None,
    summary_recoveries: Sequence[SummaryErrorRecovery] = (),
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Clock = utc_now,
    tenant_binding: Sequence[interceptors.Interceptor] = (),
    extra_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]] = (),
) -> RunningServer:
    """Validate the configuration, open the store, build the services and start serving.

    ``tracer_provider`` and ``meter_provider`` default to ones built from the OTEL_* environment
    (owned and shut down by the returned server; only a server-built meter provider serves
    ``metrics_listen``); gRPC server spans join the caller's W3C trace context. ``summarizer``
    replaces every route's summarizer (a deployment's own, or a test's); ``summary_recoveries``
    run in the bracket's summary-error step (see ``SummaryErrorRecovery``), before the always-on
    ``ImageOffloadRecovery``. ``clock`` (monotonic seconds) times the failure memory's
    backoffs and the quotas' append buckets; ``wall_clock`` stamps sessions' create and
    last-append times, runs the retention sweep and reads providers' HTTP-date
    ``retry-after``. ``tenant_binding`` interceptors bind the caller's tenant
    (``compactd.tenancy``) after the configured authentication, before the limits and quotas
    count it (a test's own binding: ``testing.tenants.MetadataTenants``).
    ``extra_handlers`` serve methods of their own behind the same interceptors, after compactd's
    (a benchmark's no-op references).

    Raises:
        ConfigError: A setting is invalid (the message names it), or the store's folder is
            missing.
        StartupError: The address is in use (``ADDRESS_IN_USE``: the port is never shared,
            ``SO_REUSEPORT`` is off) or another process owns the store (``STORE_LOCKED``);
            the store is closed again.
    """
    parts = components(config)
    owns_provider = tracer_provider is None
    provider = tracer_provider or telemetry.tracer_provider_from_env()
    prometheus = (
        telemetry.PrometheusEndpoint(config.metrics_listen) if config.metrics_listen else None
    )
    owned_meter = None
    if meter_provider is None:
        readers = [prometheus.reader] if prometheus is not None else []
        meter_provider = owned_meter = telemetry.meter_provider_from_env(readers)
    metrics = Metrics(meter_provider)
    trust = _trust(config)
    store = store_for(config, clock=wall_clock)
    await store.open()
    async with contextlib.AsyncExitStack() as refused:  # a start that fails closes the store
        refused.push_async_callback(store.close)
        running = await _serve_on(
            config, parts, store, provider, owns_provider, owned_meter, prometheus, metrics,
            summarizer, summary_recoveries, clock, trust, tenant_binding,
            extra_handlers=extra_handlers, wall_clock=wall_clock,
        )  # fmt: skip
        refused.pop_all()
    await _start_trust(running, parts, trust.tls, trust.authentication, wall_clock)
    return running


@dataclass(frozen=True)
class _Trust:
    """Issue 10's parts of the listener: its TLS (None: plaintext) and the authentication."""

    tls: ServerTls | None
    authentication: auth.Authentication


async def _start_trust(
    running: RunningServer,
    parts: Components,
    tls: ServerTls | None,
    authentication: auth.Authentication,
    wall_clock: Clock,
) -> None:
    """Start the reloads and the retention sweep; say how the listener is protected."""
    config = running.config
    reloads: list[Callable[[], bool]] = [] if tls is None else [tls.reload]
    if auth.TokensFileReload.paths(config):
        reloads.append(auth.TokensFileReload(config, authentication))
    running.reloader = Reloader(reloads, config.tls_reload_interval_s)
    running.reloader.start()
    if parts.retention:
        running.retention = RetentionSweeper(running.manager, parts.retention, clock=wall_clock)
        running.retention.start()
    if config.health_listen:
        running.health_server, running.health_port = await _health_only(
            config.health_listen, running.health
        )
    _log_transport(running, tls, authentication.credentials)


def _log_transport(
    running: RunningServer, tls: ServerTls | None, credentials: auth.Credentials
) -> None:
    """Say how the listeners are protected, at the addresses they bound (port 0 picks one)."""
    config = running.config
    transport = "plaintext" if tls is None else ("mutual TLS" if tls.mutual else "TLS")
    fields: dict[str, object] = {
        "listen": running.address,
        "transport": transport,
        "authentication": "on" if credentials.enabled else "off",
        "tokens": len(credentials.token_digests),
        "identities": len(credentials.identities),
    }
    if running.health_server is not None:
        health_host = config.health_listen.rpartition(":")[0]
        fields["health_listen"] = f"{health_host}:{running.health_port}"
    host, _ = config.host_port
    if tls is None and not settings.is_loopback(host):
        log.warning(
            "serving plaintext on a non-loopback address (insecure_plaintext = true): only "
            "behind a mesh sidecar that terminates mutual TLS",
            extra=fields,
        )
    else:
        log.info("listener security", extra=fields)


async def _health_only(
    listen: str, servicer: health_aio.HealthServicer
) -> tuple[grpc.aio.Server, int]:
    """A plaintext listener serving only grpc.health.v1 (probes cannot speak TLS or tokens)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    host, _, port = listen.rpartition(":")
    bound = _bind(server, host.strip("[]"), int(port), None)
    await server.start()
    return server, bound


async def _serve_on(
    config: ServerConfig,
    parts: Components,
    store: EventStore,
    provider: trace.TracerProvider,
    owns_provider: bool,
    owned_meter: MeterProvider | None,
    prometheus: telemetry.PrometheusEndpoint | None,
    metrics: Metrics,
    summarizer: Summarizer | None,
    summary_recoveries: Sequence[SummaryErrorRecovery],
    clock: Callable[[], float],
    trust: _Trust,
    tenant_binding: Sequence[interceptors.Interceptor],
    *,
    extra_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]] = (),
    wall_clock: Clock = utc_now,
) -> RunningServer:
    quotas = QuotaBook(parts.quotas, clock=clock, metrics=metrics)
    await quotas.load(store)
    manager = SessionManager(
        store,
        policy_validator=parts.policy.with_overrides,
        limits=settings.limits(config),
        lease_s=config.bracket_lease_s,
        snapshot_interval=config.snapshot_interval_events,
        max_resident=config.max_resident_sessions,
        quotas=quotas,
    )
    manager.start()  # replicas: follow other replicas' appends (a shared store only)
    await asyncio.to_thread(warm_up, parts.routes)  # the first pressure check is not a load
    metrics.observe_sessions(lambda: manager.resident)
    metrics.observe_store(lambda: store.stats)
    pressure = PressureService(manager, parts.routes, parts.policy)
    redactor = redaction.for_routes(parts.routes)
    summarizers = SummarizerRegistry(
        parts.routes,
        parts.summarizer,
        named=named_routes(config.routes, parts.summarizer, parts.policy),
        override=summarizer,
        on_client=telemetry.instrument_http_client(provider),
    )
    tracer = metrics.timed(provider.get_tracer("compactd"))  # each compaction.<step> is timed
    guard = CompactionGuard(clock=clock, tracer=tracer, metrics=metrics)
    screener = Screener(tracer=tracer, metrics=metrics)
    brackets = Brackets(
        summarizers, guard, screener, tracer=tracer, metrics=metrics, redact=redactor,
        recoveries=(*summary_recoveries, ImageOffloadRecovery()),
    )  # fmt: skip
    pruning = Pruning(parts.pruner, tracer=tracer, metrics=metrics)
    recovery = RecoveryService(manager, pressure, brackets, pruning, wall_clock)
    switch = SwitchService(manager, pressure, brackets, pruning)
    ahead = AheadService(manager, store, pressure, brackets, tracer=tracer, metrics=metrics)
    steps = StepService(manager, pressure, brackets, pruning, switch, ahead)
    telemetry.quiet_cancelled_stream_detach()
    chain = interceptors.chain(
        provider,
        max_streams=config.max_streams,
        max_streams_per_session=config.max_streams_per_session,
        observe=[metrics.interceptor()],
        authentication=trust.authentication,
        tenant_binding=tenant_binding,
        quotas=quotas,
    )
    server = grpc.aio.server(options=_channel_options(config), interceptors=chain)
    services = GenericOnly(server)  # no registered methods: see ``api.registration``
    inspection = InspectionService(
        manager, pressure, brackets, parts.pruner, recovery, switch
    )  # plans, surface detail, bracket history
    replies.add_servicer(  # GetSurface and BuildRequest hand grpc their bytes
        session_service_pb2_grpc.add_SessionServiceServicer_to_server,
        SessionServicer(
            manager,
            max_batch_events=config.max_batch_events,
            inspection=inspection,
            after_append=ahead.after_append,
        ),
        services,
    )
    services.add(
        compaction_service_pb2_grpc.add_CompactionServiceServicer_to_server,
        CompactionServicer(
            pressure,
            steps,
            recovery,
            switch,
            inspection,
            RevertService(manager, tracer),
            ahead,
        ),
    )
    health_servicer = HealthServicer()
    services.add(health_pb2_grpc.add_HealthServicer_to_server, health_servicer)
    reflection_v1.enable((*SERVICE_NAMES, health.SERVICE_NAME), server)  # v1 and v1alpha
    server.add_generic_rpc_handlers(tuple(extra_handlers))
    host, port = config.host_port
    bound = _bind(server, host, port, trust.tls)
    await server.start()
    if prometheus is not None:
        prometheus.start()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    uninstall = redaction.install(redactor)  # every log line, from here on
    running = RunningServer(
        server, bound, store, manager, health_servicer, config, provider, owns_provider,
        owned_meter, prometheus, pressure, uninstall, quotas=quotas, ahead=ahead,
    )  # fmt: skip
    for message, fields in startup_report(running, parts, summarizers):
        log.info(message, extra=fields)
    return running


def settle_interpreter() -> None:
    """Tune CPython for calls that must not wait on other work (once the server is built).

    - Let the event loop win the GIL back within 0.2 ms: pricing, snapshots and restores run
      in worker threads, and CPython's default lets a thread keep the GIL for 5 ms, so a large
      append or restore next door would delay every other call by that much per switch (a
      call waits for the GIL a few times: 1 ms each still doubled a pressure check's p99).
    - Move everything start-up allocated (modules, routes, tokenizers, templates) out of the
      collector's sight (``gc.freeze``): a full collection otherwise walks it all again and
      again, a pause of tens of milliseconds on the loop.
    """
    sys.setswitchinterval(min(sys.getswitchinterval(), 0.0002))
    gc.collect()
    gc.freeze()


def _bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None) -> int:
    """Listen on ``host:port`` (the bound port: port 0 picks one), with ``tls`` unless None,
    or raise ``StartupError``."""
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.credentials())
    except RuntimeError:
        bound = 0  # grpcio raises where older releases answered 0
    if not bound:
        raise StartupError(
            f"cannot listen on {address}: the address is in use by another process or not "
            "available on this host (choose another --listen)",
            reason=Reason.ADDRESS_IN_USE,
            metadata={"listen": address},
        )
    return bound


def _channel_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        # grpcio turns SO_REUSEPORT on by default: a second server on the same port would start
        # silently and split the traffic (and the sessions' in-memory state) with the first.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await create_server(config)
    settle_interpreter()
    if running.reloader is not None:  # certificate and token rotation without a restart
        loop.add_signal_handler(signal.SIGHUP, running.reloader.trigger)
    print(f"compactd listening on {running.address}", flush=True)
    await stop.wait()
    log.info("shutting down", extra={"grace_s": config.shutdown_grace_s})
    await running.stop()
    log.info("stopped")
