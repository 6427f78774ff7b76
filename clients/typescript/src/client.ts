// A thin typed client over both compactd services, speaking the gRPC protocol over HTTP/2
// (connect-node's gRPC transport). Every method throws a CompactdError subclass on failure.

import type * as http2 from "node:http2";
import type { JsonObject } from "@bufbuild/protobuf";
import { type CallOptions, type Client, Code, ConnectError, createClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import {
  type CompactionProgress,
  CompactionService,
  type CompactResult,
  type PrepareStepResult,
  type PressureReport,
  type ProviderError,
  type RecoverFromErrorResult,
  type SwitchModelResult,
} from "./gen/compactd/v1/compaction_service_pb.js";
import type { Route, SessionEvent } from "./gen/compactd/v1/events_pb.js";
import {
  type AppendEventsResponse,
  type BuildRequestResponse,
  type GetSurfaceResponse,
  type ListSessionsResponse,
  type RecallResponse,
  type Session,
  SessionService,
} from "./gen/compactd/v1/session_service_pb.js";
import { IncompleteStreamError, toCompactdError } from "./errors.js";
import { DEFAULT_TOOL_MAX_BYTES, recallAnswer, recallErrorAnswer, recallRequest, type ToolCallLike } from "./recall.js";
import { DEFAULT_HELD_SESSIONS, HeldRequests, type PreparedStep } from "./steps.js";

/** Retries of idempotent unary calls on UNAVAILABLE, with jittered exponential backoff. */
export interface RetryPolicy {
  /** Attempts in total, the first included. */
  maxAttempts: number;
  initialBackoffMs: number;
  maxBackoffMs: number;
  backoffMultiplier: number;
}

export const DEFAULT_RETRY: RetryPolicy = {
  maxAttempts: 4,
  initialBackoffMs: 100,
  maxBackoffMs: 2000,
  backoffMultiplier: 2,
};

/** Unary RPCs whose retry cannot change the outcome (reads). */
export const IDEMPOTENT_METHODS: ReadonlySet<string> = new Set([
  "GetSurface",
  "BuildRequest",
  "ListSessions",
  "Recall",
  "CheckPressure",
  "ClassifyProviderError",
  "PlanCompaction",
  "ListBrackets",
]);

export interface ClientOptions {
  /** Server address: "host:port" or a URL such as "http://127.0.0.1:50051". */
  target: string;
  /** Default deadline of unary calls in ms (default 30000; 0 for none). */
  timeoutMs?: number;
  /** Default deadline of streaming calls in ms (default none: watches stay open). */
  streamTimeoutMs?: number;
  /** Headers sent with every call (e.g. authorization). */
  headers?: Record<string, string>;
  /** Bearer token naming the caller's tenant (sent as `authorization: Bearer ...`); use over TLS. */
  token?: string;
  /** TLS options of an "https://" target: `ca`, and `cert`/`key` for mutual TLS. */
  tls?: http2.SecureClientSessionOptions;
  /** Retry policy of idempotent unary calls; null disables retries. */
  retry?: RetryPolicy | null;
  /** More interceptors, run inside the retry interceptor. */
  interceptors?: Interceptor[];
  /**
   * Most sessions whose last request `prepareStep` holds (default 64; the least recently stepped
   * is dropped first; `forgetHeldRequest` and `close` drop them too). 0 holds none: every step
   * then answers the full request.
   */
  heldSessions?: number;
}

/** Per-call options. */
export interface CallOpts {
  /** Deadline in ms, overriding the client default. */
  timeoutMs?: number;
  /** Cancels the call. */
  signal?: AbortSignal;
}

/** One message of a compaction stream: a step update or, last, the result. */
export interface CompactionUpdate<R> {
  update:
    | { case: "progress"; value: CompactionProgress }
    | { case: "result"; value: R }
    | { case: undefined; value?: undefined };
}

/**
 * The progress updates of one compaction call, then its result. `for await` yields each
 * CompactionProgress; result() drains the rest and resolves to the final result.
 */
export class CompactionStream<R> implements AsyncIterable<CompactionProgress> {
  /** Every progress update seen so far. */
  readonly progress: CompactionProgress[] = [];
  private finalResult: R | undefined;
  private readonly iterator: AsyncIterator<CompactionProgress>;

  constructor(responses: AsyncIterable<CompactionUpdate<R>>) {
    this.iterator = this.run(responses);
  }

  private async *run(responses: AsyncIterable<CompactionUpdate<R>>): AsyncGenerator<CompactionProgress> {
    try {
      for await (const { update } of responses) {
        if (update.case === "progress") {
          this.progress.push(update.value);
          yield update.value;
        } else if (update.case === "result") {
          this.finalResult = update.value;
        }
      }
    } catch (err) {
      throw toCompactdError(err);
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<CompactionProgress> {
    return this.iterator;
  }

  /** Consumes the rest of the stream and returns the final result. */
  async result(): Promise<R> {
    for (;;) {
      const next = await this.iterator.next();
      if (next.done) {
        break;
      }
    }
    if (this.finalResult === undefined) {
      throw new IncompleteStreamError("the stream ended without a result", { code: Code.Unknown });
    }
    return this.finalResult;
  }
}

/** A compactd client over one HTTP/2 connection. */
export class CompactdClient {
  private readonly sessions: Client<typeof SessionService>;
  private readonly compaction: Client<typeof CompactionService>;
  private readonly timeoutMs: number;
  private readonly streamTimeoutMs: number | undefined;
  private readonly headers: Record<string, string>;
  private readonly connection: Http2SessionManager;
  private readonly held: HeldRequests;

  constructor(options: ClientOptions | string) {
    const opts = typeof options === "string" ? { target: options } : options;
    const baseUrl = /^https?:\/\//.test(opts.target) ? opts.target : `http://${opts.target}`;
    const retry = opts.retry === undefined ? DEFAULT_RETRY : opts.retry;
    const interceptors = [...(retry ? [retryInterceptor(retry)] : []), ...(opts.interceptors ?? [])];
    this.connection = new Http2SessionManager(baseUrl, undefined, opts.tls);
    const transport = createGrpcTransport({ baseUrl, interceptors, sessionManager: this.connection });
    this.sessions = createClient(SessionService, transport);
    this.compaction = createClient(CompactionService, transport);
    this.timeoutMs = opts.timeoutMs ?? 30_000;
    this.streamTimeoutMs = opts.streamTimeoutMs;
    this.headers = { ...(opts.headers ?? {}), ...(opts.token ? { authorization: `Bearer ${opts.token}` } : {}) };
    this.held = new HeldRequests(opts.heldSessions ?? DEFAULT_HELD_SESSIONS);
  }

  private unaryOptions(opts: CallOpts = {}): CallOptions {
    const timeoutMs = opts.timeoutMs ?? this.timeoutMs;
    return { headers: this.headers, signal: opts.signal, timeoutMs: timeoutMs > 0 ? timeoutMs : undefined };
  }

  private streamOptions(opts: CallOpts = {}): CallOptions {
    return { headers: this.headers, signal: opts.signal, timeoutMs: opts.timeoutMs ?? this.streamTimeoutMs };
  }

  /**
   * Closes the connection; calls still in flight fail; the held requests are dropped. (An idle
   * connection never keeps Node alive.)
   */
  close(): void {
    this.held.clear();
    this.connection.abort();
  }

  /**
   * Creates an empty session, or a sub-agent's child session with `parentSessionId` (of the same
   * tenant; NotFoundError when it does not exist); with `forkAtSeq` too, the child starts with a
   * copy of the parent's surface as it stood right after that seq. Throws AlreadyExistsError when
   * the id is taken with another policy or parent.
   */
  async createSession(
    init: {
      sessionId?: string;
      compactionPolicy?: JsonObject;
      parentSessionId?: string;
      forkAtSeq?: number | bigint;
    } = {},
    opts?: CallOpts,
  ): Promise<Session> {
    // google.protobuf.Struct fields are plain JSON objects in protobuf-es.
    const request = {
      sessionId: init.sessionId ?? "",
      compactionPolicy: init.compactionPolicy,
      parentSessionId: init.parentSessionId ?? "",
      forkAtSeq: init.forkAtSeq === undefined ? undefined : BigInt(init.forkAtSeq),
    };
    const response = await call(() => this.sessions.createSession(request, this.unaryOptions(opts)));
    if (!response.session) {
      throw new IncompleteStreamError("CreateSession answered without a session", { code: Code.Internal });
    }
    return response.session;
  }

  /**
   * One page of the caller's tenant's sessions in id order (`nextPageToken` "" at the end); with
   * `parentSessionId`, that session's children only.
   */
  async listSessions(
    init: { pageSize?: number; pageToken?: string; parentSessionId?: string } = {},
    opts?: CallOpts,
  ): Promise<ListSessionsResponse> {
    const request = {
      pageSize: init.pageSize ?? 0,
      pageToken: init.pageToken ?? "",
      parentSessionId: init.parentSessionId ?? "",
    };
    return call(() => this.sessions.listSessions(request, this.unaryOptions(opts)));
  }

  /**
   * Deletes the session and its log, durably, and drops the request the client holds for it
   * (the id may be created again, fresh: a held request would name the old log's revision).
   * Throws NotFoundError when it does not exist.
   */
  async deleteSession(sessionId: string, opts?: CallOpts): Promise<void> {
    this.held.forget(sessionId);
    await call(() => this.sessions.deleteSession({ sessionId }, this.unaryOptions(opts)));
  }

  /**
   * Appends events atomically. With `expectedLastSeq` (-1 for an empty log), a mismatch throws
   * SeqConflictError and appends nothing.
   */
  async appendEvents(
    sessionId: string,
    events: SessionEvent[],
    init: { expectedLastSeq?: number | bigint } = {},
    opts?: CallOpts,
  ): Promise<AppendEventsResponse> {
    const expectedLastSeq = init.expectedLastSeq === undefined ? undefined : BigInt(init.expectedLastSeq);
    return call(() => this.sessions.appendEvents({ sessionId, events, expectedLastSeq }, this.unaryOptions(opts)));
  }

  /** Streams the log from `fromSeq`; with `follow`, keeps streaming new events until aborted. */
  listEvents(
    sessionId: string,
    init: { fromSeq?: number | bigint; follow?: boolean } = {},
    opts?: CallOpts,
  ): AsyncIterable<SessionEvent> {
    const responses = this.sessions.listEvents(
      { sessionId, fromSeq: BigInt(init.fromSeq ?? 0), follow: init.follow ?? false },
      this.streamOptions(opts),
    );
    return project(responses, (m) => m.event, opts?.signal);
  }

  /** The current surface. */
  async getSurface(sessionId: string, opts?: CallOpts): Promise<GetSurfaceResponse> {
    return call(() => this.sessions.getSurface({ sessionId }, this.unaryOptions(opts)));
  }

  /** The reconstructed model request. */
  async buildRequest(sessionId: string, opts?: CallOpts): Promise<BuildRequestResponse> {
    return call(() => this.sessions.buildRequest({ sessionId }, this.unaryOptions(opts)));
  }

  /**
   * One page of the original events behind a recall handle (or `seqs`). Throws NotFoundError for
   * an unknown session or a handle its log does not name (reason RECALL_HANDLE_UNKNOWN).
   */
  async recall(
    sessionId: string,
    init: { handle?: string; seqs?: (number | bigint)[]; query?: string; maxBytes?: number; pageToken?: string },
    opts?: CallOpts,
  ): Promise<RecallResponse> {
    const request = {
      sessionId,
      handle: init.handle ?? "",
      seqs: (init.seqs ?? []).map((seq) => BigInt(seq)),
      query: init.query ?? "",
      maxBytes: init.maxBytes ?? 0,
      pageToken: init.pageToken ?? "",
    };
    return call(() => this.sessions.recall(request, this.unaryOptions(opts)));
  }

  /**
   * Answers the model's call of the recall tool: the tool/result event to append and send back
   * (the recalled page as text; an error result the model can read for an unknown handle or
   * unusable arguments). Throws NotFoundError for an unknown session.
   */
  async answerRecall(
    sessionId: string,
    toolCall: ToolCallLike,
    init: { maxBytes?: number } = {},
    opts?: CallOpts,
  ): Promise<SessionEvent> {
    const request = recallRequest(sessionId, toolCall, init.maxBytes ?? DEFAULT_TOOL_MAX_BYTES);
    if (request.$typeName === "compactd.v1.SessionEvent") return request;
    try {
      const response = await call(() => this.sessions.recall(request, this.unaryOptions(opts)));
      return recallAnswer(toolCall, response.text);
    } catch (err) {
      return recallErrorAnswer(toolCall, err);
    }
  }

  /** Measures the envelope against the route's policy. Throws CapacityUnknownError without a window. */
  async checkPressure(sessionId: string, init: { destination?: Route } = {}, opts?: CallOpts): Promise<PressureReport> {
    const response = await call(() =>
      this.compaction.checkPressure({ sessionId, destination: init.destination }, this.unaryOptions(opts)),
    );
    if (!response.report) {
      throw new IncompleteStreamError("CheckPressure answered without a report", { code: Code.Internal });
    }
    return response.report;
  }

  /** A report now and one per new revision, until `opts.signal` aborts (iteration then ends). */
  watchPressure(sessionId: string, init: { destination?: Route } = {}, opts?: CallOpts): AsyncIterable<PressureReport> {
    const responses = this.compaction.watchPressure(
      { sessionId, destination: init.destination },
      this.streamOptions(opts),
    );
    return project(responses, (m) => m.report, opts?.signal);
  }

  /**
   * The pre-step check (prunes and compacts when above pressure) and the full request to send.
   *
   * The client holds the session's last request (see `heldSessions`) and sends its revision as
   * `heldRevision`: while compactd changed nothing it shows, the server answers only the messages
   * appended since, which the client appends to the held request. A step that compacted, pruned
   * or switched routes answers the full request, which the client then holds instead. So a step
   * costs what it adds, never the session's length. With `onProgress` (called with each
   * CompactionProgress as it arrives) the step is streamed (PrepareStep); without, it is one
   * PrepareStepUnary call, the cheaper one. Its default deadline is `streamTimeoutMs` (a
   * compaction may run inside it). Throws CompactionBusyError while a bracket is live.
   */
  async prepareStep(
    sessionId: string,
    turn: number | bigint,
    init: { intendedRoute?: Route; onProgress?: (progress: CompactionProgress) => void } = {},
    opts?: CallOpts,
  ): Promise<PreparedStep> {
    const sent = this.held.revision(sessionId);
    const incarnation = this.held.incarnation(sessionId);
    const step = { intendedRoute: init.intendedRoute, heldRevision: sent, heldIncarnation: incarnation };
    let result: PrepareStepResult;
    let progress: CompactionProgress[] = [];
    if (init.onProgress === undefined) {
      result = await this.prepareStepUnary(sessionId, turn, step, opts);
    } else {
      const stream = this.prepareStepStream(sessionId, turn, step, opts);
      for await (const update of stream) init.onProgress(update);
      result = await stream.result();
      progress = stream.progress;
    }
    let request = this.held.update(sessionId, sent, result, incarnation);
    if (request === undefined) {
      // The held request moved on meanwhile (a concurrent step of the session): rebuild it.
      request = await this.buildRequest(sessionId, opts);
      this.held.hold(sessionId, request);
    }
    return { request, result, progress };
  }

  /**
   * The PrepareStep stream as the server sends it: `for await` the progress, `result()` for the
   * result. Nothing is held: without `heldRevision` the result carries the full request; with
   * it, `stepRequest` gives the request to send. `heldIncarnation`: the held request's
   * `incarnation`, sent with `heldRevision` so a session deleted and created again meanwhile
   * answers the full request.
   */
  prepareStepStream(
    sessionId: string,
    turn: number | bigint,
    init: { intendedRoute?: Route; heldRevision?: number | bigint; heldIncarnation?: string } = {},
    opts?: CallOpts,
  ): CompactionStream<PrepareStepResult> {
    const heldRevision = init.heldRevision === undefined ? undefined : BigInt(init.heldRevision);
    const heldIncarnation = init.heldIncarnation ?? "";
    return new CompactionStream(
      this.compaction.prepareStep(
        { sessionId, turn: BigInt(turn), intendedRoute: init.intendedRoute, heldRevision, heldIncarnation },
        this.streamOptions(opts),
      ),
    );
  }

  /**
   * Drops the request the client holds for the session (a runtime done with it); the session's
   * next `prepareStep` answers the full request.
   */
  forgetHeldRequest(sessionId: string): void {
    this.held.forget(sessionId);
  }

  /**
   * PrepareStepUnary as the server answers it: the result of `prepareStepStream`, no step updates,
   * nothing held. Cheaper than the stream for a runtime that shows no compaction progress (most
   * steps are below pressure).
   * A compaction it runs happens inside the call, so its default deadline is `streamTimeoutMs`.
   */
  async prepareStepUnary(
    sessionId: string,
    turn: number | bigint,
    init: { intendedRoute?: Route; heldRevision?: number | bigint; heldIncarnation?: string } = {},
    opts?: CallOpts,
  ): Promise<PrepareStepResult> {
    const heldRevision = init.heldRevision === undefined ? undefined : BigInt(init.heldRevision);
    const heldIncarnation = init.heldIncarnation ?? "";
    const request = { sessionId, turn: BigInt(turn), intendedRoute: init.intendedRoute, heldRevision, heldIncarnation };
    const response = await call(() => this.compaction.prepareStepUnary(request, this.streamOptions(opts)));
    if (!response.result) {
      throw new IncompleteStreamError("PrepareStepUnary answered without a result", { code: Code.Internal });
    }
    return response.result;
  }

  /** On-demand compaction. Throws CompactionBusyError while a turn is open or a bracket is live. */
  compact(sessionId: string, init: { focus?: string } = {}, opts?: CallOpts): CompactionStream<CompactResult> {
    return new CompactionStream(
      this.compaction.compact({ sessionId, focus: init.focus ?? "" }, this.streamOptions(opts)),
    );
  }

  /** Recovery after a provider error; the result says whether to retry. */
  recoverFromError(
    sessionId: string,
    turn: number | bigint,
    error: ProviderError,
    init: { retriesSoFar?: number } = {},
    opts?: CallOpts,
  ): CompactionStream<RecoverFromErrorResult> {
    return new CompactionStream(
      this.compaction.recoverFromError(
        { sessionId, turn: BigInt(turn), error, retriesSoFar: init.retriesSoFar ?? 0 },
        this.streamOptions(opts),
      ),
    );
  }

  /** Compacts history until it fits the destination route. */
  switchModel(
    sessionId: string,
    destination: Route,
    init: { turn?: number | bigint } = {},
    opts?: CallOpts,
  ): CompactionStream<SwitchModelResult> {
    const turn = init.turn === undefined ? undefined : BigInt(init.turn);
    return new CompactionStream(
      this.compaction.switchModel({ sessionId, destination, turn }, this.streamOptions(opts)),
    );
  }
}

async function call<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    throw toCompactdError(err);
  }
}

async function* project<M, T>(
  responses: AsyncIterable<M>,
  pick: (m: M) => T | undefined,
  signal: AbortSignal | undefined,
): AsyncGenerator<T> {
  try {
    for await (const message of responses) {
      if (signal?.aborted) {
        return; // a message received before the abort is not delivered after it
      }
      const value = pick(message);
      if (value !== undefined) {
        yield value;
      }
    }
  } catch (err) {
    if (signal?.aborted && ConnectError.from(err).code === Code.Canceled) {
      return; // the caller stopped the stream
    }
    throw toCompactdError(err);
  }
}

/** Retries idempotent unary calls on UNAVAILABLE (connect has no gRPC service config). */
export function retryInterceptor(policy: RetryPolicy): Interceptor {
  return (next) => async (req) => {
    if (req.stream || !IDEMPOTENT_METHODS.has(req.method.name)) {
      return next(req);
    }
    let backoff = policy.initialBackoffMs;
    for (let attempt = 1; ; attempt++) {
      try {
        return await next(req);
      } catch (err) {
        const code = ConnectError.from(err).code;
        if (code !== Code.Unavailable || attempt >= policy.maxAttempts || req.signal.aborted) {
          throw err;
        }
        await sleep(Math.random() * backoff, req.signal);
        backoff = Math.min(backoff * policy.backoffMultiplier, policy.maxBackoffMs);
      }
    }
  };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener(
      "abort",
      () => {
        clearTimeout(timer);
        resolve();
      },
      { once: true },
    );
  });
}
