// The wrapper against a real gRPC server on loopback: typed errors with ErrorInfo, retries of
// idempotent calls only, compaction streams, watch cancellation, deadlines.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";
import {
  AppendEventsResponseSchema,
  type BuildRequestResponse,
  BuildRequestResponseSchema,
  type CompactionProgress,
  CompactionProgressSchema,
  CompactdClient,
  CompactionBusyError,
  CompactionStep,
  CompactResponseSchema,
  DeadlineExceededError,
  DeleteSessionResponseSchema,
  errorClass,
  GetSurfaceResponseSchema,
  HeldRequests,
  IncompleteStreamError,
  InvalidArgumentError,
  MessageSchema,
  NotFoundError,
  type PrepareStepRequest,
  PrepareStepResponseSchema,
  type PrepareStepResult,
  PrepareStepResultSchema,
  type PrepareStepUnaryRequest,
  PrepareStepUnaryResponseSchema,
  SeqConflictError,
  stepRequest,
  UnavailableError,
  userMessage,
  WatchPressureResponseSchema,
} from "../src/index.js";
import { type FakeServer, richError, startFake } from "./fake-server.js";

const steps = [
  CompactionStep.START,
  CompactionStep.SUMMARIZE,
  CompactionStep.SUMMARY,
  CompactionStep.REPLACE,
  CompactionStep.END,
];

describe("errors", () => {
  test("a reason only selects its class under its own code", () => {
    assert.equal(errorClass(Code.Aborted, "SEQ_CONFLICT"), SeqConflictError);
    assert.equal(errorClass(Code.Aborted, "COMPACTION_BUSY"), CompactionBusyError);
    assert.equal(errorClass(Code.Internal, "SEQ_CONFLICT").name, "CompactdError");
  });

  let fake: FakeServer;
  before(async () => {
    fake = await startFake(
      {
        appendEvents: (req) => {
          if (req.events.length > 1) {
            throw richError(Code.InvalidArgument, "malformed event", "INVALID_ARGUMENT", {}, [
              ["events[1].seq", "must be unset"],
            ]);
          }
          throw richError(Code.Aborted, "log ends at 5", "SEQ_CONFLICT", { expected_last_seq: "3", last_seq: "5" });
        },
        getSurface: () => {
          throw new ConnectError("no such session", Code.NotFound);
        },
      },
      {
        compact: async function* () {
          throw richError(Code.Aborted, "turn 4 is open", "COMPACTION_BUSY");
        },
      },
    );
  });
  after(() => fake.close());

  test("a seq conflict carries its reason and metadata", async () => {
    const client = new CompactdClient(fake.target);
    const err = await client.appendEvents("s1", [userMessage("hi")], { expectedLastSeq: 3 }).catch((e: unknown) => e);
    assert.ok(err instanceof SeqConflictError);
    assert.equal(err.reason, "SEQ_CONFLICT");
    assert.equal(err.domain, "compactd.dev");
    assert.deepEqual(err.metadata, { expected_last_seq: "3", last_seq: "5" });
    assert.equal(err.message, "ABORTED (SEQ_CONFLICT): log ends at 5");
  });

  test("bad request violations are carried", async () => {
    const client = new CompactdClient(fake.target);
    const err = await client.appendEvents("s1", [userMessage("a"), userMessage("b")]).catch((e: unknown) => e);
    assert.ok(err instanceof InvalidArgumentError);
    assert.deepEqual(err.violations, [{ field: "events[1].seq", description: "must be unset" }]);
  });

  test("a busy compaction stream throws CompactionBusyError", async () => {
    const client = new CompactdClient(fake.target);
    await assert.rejects(client.compact("s1").result(), CompactionBusyError);
  });

  test("an error without details maps by code and names it", async () => {
    const client = new CompactdClient({ target: fake.target, retry: null });
    const err = await client.getSurface("s1").catch((e: unknown) => e);
    assert.ok(err instanceof NotFoundError);
    assert.equal(err.reason, "NOT_FOUND");
    assert.deepEqual(err.metadata, {});
  });
});

describe("retries", () => {
  test("idempotent reads are retried on UNAVAILABLE; appends are not", async () => {
    let failures = 2;
    const fake = await startFake({
      getSurface: () => {
        if (failures-- > 0) throw richError(Code.Unavailable, "store briefly down", "UNAVAILABLE");
        return create(GetSurfaceResponseSchema, { revision: 7n });
      },
      appendEvents: () => {
        throw richError(Code.Unavailable, "store briefly down", "UNAVAILABLE");
      },
    });
    try {
      const client = new CompactdClient({
        target: fake.target,
        retry: { maxAttempts: 4, initialBackoffMs: 5, maxBackoffMs: 10, backoffMultiplier: 2 },
      });
      const surface = await client.getSurface("s1");
      assert.equal(surface.revision, 7n);
      assert.equal(fake.calls.get("GetSurface"), 3);
      await assert.rejects(client.appendEvents("s1", [userMessage("x")]), UnavailableError);
      assert.equal(fake.calls.get("AppendEvents"), 1);
    } finally {
      await fake.close();
    }
  });

  test("a deadline surfaces as DeadlineExceededError", async () => {
    const fake = await startFake({
      getSurface: (_req, ctx) =>
        new Promise((resolve) => ctx.signal.addEventListener("abort", () => resolve(create(GetSurfaceResponseSchema)))),
    });
    try {
      const client = new CompactdClient({ target: fake.target, retry: null });
      await assert.rejects(client.getSurface("s1", { timeoutMs: 200 }), DeadlineExceededError);
    } finally {
      await fake.close();
    }
  });
});

describe("streams", () => {
  let fake: FakeServer;
  before(async () => {
    fake = await startFake(
      { appendEvents: () => create(AppendEventsResponseSchema) },
      {
        compact: async function* (req) {
          if (req.focus === "truncate") {
            yield create(CompactResponseSchema, {
              update: { case: "progress", value: { step: CompactionStep.START } },
            });
            return;
          }
          for (const [i, step] of steps.entries()) {
            yield create(CompactResponseSchema, {
              update: { case: "progress", value: { step, compactionId: "c1", seq: BigInt(10 + i) } },
            });
          }
          yield create(CompactResponseSchema, {
            update: { case: "result", value: { outcome: { compactionId: "c1", itemsCondensed: 6n } } },
          });
        },
        watchPressure: async function* (_req, ctx) {
          for (let revision = 1n; !ctx.signal.aborted; revision++) {
            yield create(WatchPressureResponseSchema, { report: { revision } });
            await new Promise((r) => setTimeout(r, 1));
          }
        },
      },
    );
  });
  after(() => fake.close());

  test("a compaction yields each step then its result", async () => {
    const client = new CompactdClient(fake.target);
    const stream = client.compact("s1");
    const seen: CompactionStep[] = [];
    for await (const progress of stream) {
      seen.push(progress.step);
    }
    assert.deepEqual(seen, steps);
    const result = await stream.result();
    assert.equal(result.outcome?.itemsCondensed, 6n);
    assert.deepEqual(
      stream.progress.map((p) => p.seq),
      [10n, 11n, 12n, 13n, 14n],
    );
  });

  test("a stream without result is incomplete", async () => {
    const client = new CompactdClient(fake.target);
    await assert.rejects(client.compact("s1", { focus: "truncate" }).result(), IncompleteStreamError);
  });

  test("aborting a watch ends the iteration", async () => {
    const client = new CompactdClient(fake.target);
    const controller = new AbortController();
    const revisions: bigint[] = [];
    for await (const report of client.watchPressure("s1", {}, { signal: controller.signal })) {
      revisions.push(report.revision);
      if (revisions.length === 3) controller.abort();
    }
    assert.deepEqual(revisions, [1n, 2n, 3n]);
  });

  test("an unknown session maps to NotFoundError", async () => {
    const missing = await startFake({
      getSurface: () => {
        throw richError(Code.NotFound, "no session s9", "NOT_FOUND");
      },
    });
    try {
      await assert.rejects(new CompactdClient(missing.target).getSurface("s9"), NotFoundError);
    } finally {
      await missing.close();
    }
  });
});

describe("prepareStepUnary", () => {
  test("sends the held revision only when given, returns the result, types errors, never retries", async () => {
    const seen: (bigint | undefined)[] = [];
    const fake = await startFake(
      {},
      {
        prepareStepUnary: (req) => {
          seen.push(req.heldRevision);
          if (req.sessionId === "busy") throw richError(Code.Aborted, "bracket live", "COMPACTION_BUSY");
          if (req.sessionId === "down") throw richError(Code.Unavailable, "restarting", "UNAVAILABLE");
          return create(PrepareStepUnaryResponseSchema, {
            result: create(PrepareStepResultSchema, { requestUnchanged: true, requestRevision: req.turn + 6n }),
          });
        },
      },
    );
    try {
      const client = new CompactdClient(fake.target);
      const result = await client.prepareStepUnary("s1", 3, { heldRevision: 7 });
      assert.equal(result.requestRevision, 9n);
      assert.ok(result.requestUnchanged);
      await assert.rejects(client.prepareStepUnary("busy", 3), CompactionBusyError);
      await assert.rejects(client.prepareStepUnary("down", 3), UnavailableError);
      assert.deepEqual(seen, [7n, undefined, undefined]);
      assert.equal(fake.calls.get("PrepareStepUnary"), 3);
    } finally {
      await fake.close();
    }
  });
});

describe("stepRequest", () => {
  const held = create(BuildRequestResponseSchema, { revision: 7n, messages: [create(MessageSchema, {})] });

  test("an unchanged request is the held one with the appended messages", () => {
    const appended = create(MessageSchema, { toolCallId: "t" });
    const result = create(PrepareStepResultSchema, {
      requestUnchanged: true,
      appendedMessages: [appended],
      requestRevision: 9n,
    });
    const request = stepRequest(held, result);
    assert.equal(request.messages.length, 2);
    assert.equal(request.messages[1]?.toolCallId, "t");
    assert.equal(request.revision, 9n);
    assert.equal(held.messages.length, 1);
  });

  test("a full request replaces the held one; an omitted one needs it", () => {
    const full = create(BuildRequestResponseSchema, { revision: 9n });
    assert.equal(stepRequest(held, create(PrepareStepResultSchema, { request: full })), full);
    assert.throws(() => stepRequest(undefined, create(PrepareStepResultSchema, { requestUnchanged: true })));
  });
});

/**
 * A scripted session answering steps by the held-revision contract: the full request without
 * `heldRevision` (or once `rewrite` is set, or when `heldIncarnation` is not the session's), else
 * the messages appended since (one message per revision).
 */
class Log {
  messages = [create(MessageSchema, { toolCallId: "a" })];
  rewrite = false;
  incarnation = "1";
  readonly sent: (bigint | undefined)[] = [];
  readonly sentIncarnations: string[] = [];

  result(req: PrepareStepRequest | PrepareStepUnaryRequest): PrepareStepResult {
    this.sent.push(req.heldRevision);
    this.sentIncarnations.push(req.heldIncarnation);
    const revision = BigInt(this.messages.length);
    const other = req.heldIncarnation !== "" && req.heldIncarnation !== this.incarnation;
    if (req.heldRevision === undefined || this.rewrite || other) {
      this.rewrite = false;
      const messages = [...this.messages];
      const request = create(BuildRequestResponseSchema, { revision, messages, incarnation: this.incarnation });
      return create(PrepareStepResultSchema, { request, requestRevision: revision });
    }
    const appendedMessages = this.messages.slice(Number(req.heldRevision));
    return create(PrepareStepResultSchema, { requestUnchanged: true, appendedMessages, requestRevision: revision });
  }

  build(): BuildRequestResponse {
    const revision = BigInt(this.messages.length);
    return create(BuildRequestResponseSchema, {
      revision,
      messages: [...this.messages],
      incarnation: this.incarnation,
    });
  }

  add(toolCallId: string): void {
    this.messages.push(create(MessageSchema, { toolCallId }));
  }
}

const ids = (request: BuildRequestResponse) => request.messages.map((m) => m.toolCallId);

describe("prepareStep", () => {
  test("holds the request, sends its revision and extends it with what the step added", async () => {
    const log = new Log();
    const fake = await startFake(
      {},
      { prepareStepUnary: (req) => create(PrepareStepUnaryResponseSchema, { result: log.result(req) }) },
    );
    const client = new CompactdClient(fake.target);
    try {
      const first = await client.prepareStep("s", 1);
      log.add("b");
      log.add("c");
      const second = await client.prepareStep("s", 1);
      log.rewrite = true;
      log.messages = [create(MessageSchema, { toolCallId: "summary" })];
      const third = await client.prepareStep("s", 1);
      log.add("d");
      const fourth = await client.prepareStep("s", 1);
      assert.deepEqual(log.sent, [undefined, 1n, 3n, 1n]);
      assert.equal(second.request, first.request); // the held request, extended in place
      assert.deepEqual(ids(second.request), ["a", "b", "c"]);
      assert.equal(second.request.revision, 3n);
      assert.ok(second.result.requestUnchanged);
      assert.equal(fourth.request, third.request);
      assert.deepEqual(ids(fourth.request), ["summary", "d"]);
      assert.equal(fake.calls.get("PrepareStep"), undefined); // no progress asked: unary
    } finally {
      client.close();
      await fake.close();
    }
  });

  test("sends the held incarnation: a session created again by another process answers whole", async () => {
    const log = new Log();
    const fake = await startFake(
      {},
      { prepareStepUnary: (req) => create(PrepareStepUnaryResponseSchema, { result: log.result(req) }) },
    );
    const client = new CompactdClient(fake.target);
    try {
      await client.prepareStep("s", 1);
      log.add("b");
      await client.prepareStep("s", 1);
      // Another process deletes the session and creates it again, as long as the held one.
      log.incarnation = "2";
      log.messages = [create(MessageSchema, { toolCallId: "x" }), create(MessageSchema, { toolCallId: "y" })];
      const again = await client.prepareStep("s", 1);
      assert.deepEqual(log.sent, [undefined, 1n, 2n]);
      assert.deepEqual(log.sentIncarnations, ["", "1", "1"]);
      assert.ok(!again.result.requestUnchanged);
      assert.deepEqual(ids(again.request), ["x", "y"]);
      assert.equal(again.request.incarnation, "2");
    } finally {
      client.close();
      await fake.close();
    }
  });

  test("HeldRequests extends a held request only of the incarnation sent", () => {
    const held = new HeldRequests();
    held.hold("s", create(BuildRequestResponseSchema, { revision: 3n, incarnation: "2" }));
    assert.equal(held.incarnation("s"), "2");
    assert.equal(held.incarnation("other"), undefined);
    const unchanged = create(PrepareStepResultSchema, { requestUnchanged: true, requestRevision: 4n });
    assert.equal(held.update("s", 3n, unchanged, "1"), undefined); // the session was created again
    assert.equal(held.update("s", 3n, unchanged, "2")?.revision, 4n);
  });

  test("with onProgress the step is streamed and held alike", async () => {
    const log = new Log();
    const fake = await startFake(
      {},
      {
        prepareStep: async function* (req) {
          yield create(PrepareStepResponseSchema, {
            update: { case: "progress", value: create(CompactionProgressSchema, { step: CompactionStep.START }) },
          });
          yield create(PrepareStepResponseSchema, { update: { case: "result", value: log.result(req) } });
        },
      },
    );
    const client = new CompactdClient(fake.target);
    try {
      const seen: CompactionProgress[] = [];
      await client.prepareStep("s", 1, { onProgress: (p) => seen.push(p) });
      log.add("b");
      const step = await client.prepareStep("s", 1, { onProgress: (p) => seen.push(p) });
      assert.deepEqual(log.sent, [undefined, 1n]);
      assert.deepEqual(ids(step.request), ["a", "b"]);
      assert.deepEqual(
        step.progress.map((p) => p.step),
        [CompactionStep.START],
      );
      assert.equal(seen.length, 2);
      assert.equal(fake.calls.get("PrepareStepUnary"), undefined);
    } finally {
      client.close();
      await fake.close();
    }
  });

  test("deleteSession drops the held request: the next step of the id holds nothing", async () => {
    const log = new Log();
    const fake = await startFake(
      { deleteSession: () => create(DeleteSessionResponseSchema, {}) },
      { prepareStepUnary: (req) => create(PrepareStepUnaryResponseSchema, { result: log.result(req) }) },
    );
    const client = new CompactdClient(fake.target);
    try {
      await client.prepareStep("s", 1);
      await client.prepareStep("s", 1);
      await client.deleteSession("s");
      await client.prepareStep("s", 1);
      assert.deepEqual(log.sent, [undefined, 1n, undefined]);
      assert.equal(fake.calls.get("DeleteSession"), 1);
    } finally {
      client.close();
      await fake.close();
    }
  });

  test("holds a bounded number of sessions, and rebuilds an answer to a request no longer held", async () => {
    const log = new Log();
    let client: CompactdClient | undefined;
    let concurrent = false;
    const fake = await startFake(
      { buildRequest: () => log.build() },
      {
        prepareStepUnary: (req) => {
          if (concurrent) client?.forgetHeldRequest(req.sessionId); // another step moved it on
          return create(PrepareStepUnaryResponseSchema, { result: log.result(req) });
        },
      },
    );
    client = new CompactdClient({ target: fake.target, heldSessions: 1 });
    try {
      for (const session of ["s1", "s2", "s1", "s1"]) await client.prepareStep(session, 1);
      assert.deepEqual(log.sent, [undefined, undefined, undefined, 1n]);
      log.add("b");
      concurrent = true;
      const step = await client.prepareStep("s1", 1);
      assert.ok(step.result.requestUnchanged);
      assert.deepEqual(ids(step.request), ["a", "b"]); // BuildRequest's
      concurrent = false;
      assert.equal((await client.prepareStep("s1", 1)).request, step.request); // held
      assert.equal(fake.calls.get("BuildRequest"), 1);
      client.forgetHeldRequest("s1");
      await client.prepareStep("s1", 1);
      assert.deepEqual(log.sent.slice(4), [1n, 2n, undefined]);
    } finally {
      client.close();
      await fake.close();
    }
    const none = new HeldRequests(0);
    none.hold("s", log.build());
    assert.equal(none.size, 0);
    assert.throws(() => new HeldRequests(-1), RangeError);
  });
});
