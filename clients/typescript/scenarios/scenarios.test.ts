// The cross-language scenario list, run by the TypeScript client against a running compactd
// (COMPACTD_ADDRESS; the routed model from COMPACTD_PROVIDER / COMPACTD_MODEL). Same list as
// clients/python/scenarios and clients/go/scenarios: create, append, rebuild request, pressure
// check, a watch receiving updates, a compaction with its streamed steps, a busy error with its
// reason, a SEQ_CONFLICT, held steps across a compaction, a held step of a session another client
// created again, the recall tool answered.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, describe, test } from "node:test";
import { Code } from "@connectrpc/connect";
import {
  AlreadyExistsError,
  type PrepareStepResult,
  assistantMessage,
  CompactdClient,
  CompactionBusyError,
  type CompactionProgress,
  CompactionStep,
  eventType,
  MessageRole,
  PressureState,
  requestHeader,
  SeqConflictError,
  type SessionEvent,
  stepEnd,
  stepStart,
  systemMessage,
  toolCallBlock,
  toolResult,
  turnEnd,
  turnStart,
  userMessage,
} from "../src/index.js";

const address = process.env.COMPACTD_ADDRESS ?? "";
const provider = process.env.COMPACTD_PROVIDER ?? "loopback";
const model = process.env.COMPACTD_MODEL ?? "agent-12k";

const bracket = [
  CompactionStep.START,
  CompactionStep.SUMMARIZE,
  CompactionStep.SUMMARY,
  CompactionStep.REPLACE,
  CompactionStep.END,
];

describe("scenarios", { skip: address === "" ? "COMPACTD_ADDRESS is not set" : false }, () => {
  const client = new CompactdClient({ target: address, timeoutMs: 30_000 });
  after(() => client.close());

  async function newSession(): Promise<string> {
    const sessionId = `ts-${randomUUID().slice(0, 12)}`;
    const session = await client.createSession({ sessionId });
    assert.equal(session.sessionId, sessionId);
    return sessionId;
  }

  /** A system prompt, a header and `turns` closed turns with large tool output; returns the revision. */
  async function seed(sessionId: string, turns: number): Promise<bigint> {
    const events: SessionEvent[] = [systemMessage("You are a careful coding agent."), requestHeader(provider, model)];
    for (let turn = 1; turn <= turns; turn++) {
      const callId = `call-${turn}`;
      const listing = Array.from({ length: 90 }, (_, i) => `src/module_${turn}_${i}.py: def handler_${i}(): ...`).join(
        "\n",
      );
      events.push(
        turnStart(turn),
        userMessage(`Turn ${turn}: find where the handlers are defined.`),
        stepStart(turn, 1),
        assistantMessage({ toolCalls: [toolCallBlock(callId, "grep", { pattern: "def " })] }),
        stepEnd(turn, 1),
        toolResult(callId, listing, { toolName: "grep" }),
        stepStart(turn, 2),
        assistantMessage({ text: `Turn ${turn}: the handlers live in src/module_${turn}_*.py.` }),
        stepEnd(turn, 2),
        turnEnd(turn),
      );
    }
    return (await client.appendEvents(sessionId, events)).revision;
  }

  async function types(sessionId: string): Promise<string[]> {
    const out: string[] = [];
    for await (const event of client.listEvents(sessionId)) out.push(eventType(event));
    return out;
  }

  test("create", async () => {
    const sessionId = await newSession();
    assert.equal((await client.createSession({ sessionId })).sessionId, sessionId); // a retry: idempotent
    const err = await client
      .createSession({ sessionId, compactionPolicy: { thresholdRatio: 0.5 } })
      .catch((e: unknown) => e);
    assert.ok(err instanceof AlreadyExistsError);
    assert.equal(err.code, Code.AlreadyExists);
    const chosen = await client.createSession();
    assert.ok(chosen.sessionId);
    assert.equal(chosen.revision, 0n);
  });

  test("append", async () => {
    const sessionId = await newSession();
    const response = await client.appendEvents(
      sessionId,
      [systemMessage("Be terse."), turnStart(1), userMessage("hello")],
      { expectedLastSeq: -1 },
    );
    assert.deepEqual(response.seqs, [0n, 1n, 2n]);
    assert.equal(response.revision, 3n);
    assert.deepEqual(await types(sessionId), ["system/message", "turn/start", "user/message"]);
  });

  test("rebuild request", async () => {
    const sessionId = await newSession();
    const revision = await seed(sessionId, 1);
    const request = await client.buildRequest(sessionId);
    assert.equal(request.revision, revision);
    assert.deepEqual(
      request.messages.map((m) => m.role),
      [MessageRole.SYSTEM, MessageRole.USER, MessageRole.ASSISTANT, MessageRole.TOOL, MessageRole.ASSISTANT],
    );
    assert.equal(request.config?.provider, provider);
    assert.equal(request.config?.model, model);
    assert.equal(request.headerSeq, 1n);
    assert.equal(request.messages[3]?.toolCallId, "call-1");
  });

  test("pressure check", async () => {
    const sessionId = await newSession();
    const revision = await seed(sessionId, 1);
    const report = await client.checkPressure(sessionId);
    assert.equal(report.revision, revision);
    assert.equal(report.route?.model, model);
    assert.ok(report.contextWindow > 0n);
    assert.ok(report.measuredTokens > 0n && report.measuredTokens < report.triggerTokens);
    assert.equal(report.state, PressureState.BELOW);
  });

  test("watch", async () => {
    const sessionId = await newSession();
    const revision = await seed(sessionId, 1);
    const controller = new AbortController();
    const seen: bigint[] = [];
    let firstTokens = 0n;
    let lastTokens = 0n;
    for await (const report of client.watchPressure(sessionId, {}, { signal: controller.signal, timeoutMs: 60_000 })) {
      seen.push(report.revision);
      if (seen.length === 1) {
        firstTokens = report.measuredTokens;
        await client.appendEvents(sessionId, [turnStart(2), userMessage("more")]);
      }
      lastTokens = report.measuredTokens;
      if (report.revision >= revision + 2n) controller.abort();
    }
    assert.equal(seen[0], revision);
    assert.equal(seen.at(-1), revision + 2n);
    assert.ok(lastTokens > firstTokens);
  });

  test("compaction streams its steps", async () => {
    const sessionId = await newSession();
    await seed(sessionId, 3);
    const stream = client.compact(sessionId, { focus: "keep the file names" });
    const steps: CompactionStep[] = [];
    for await (const progress of stream) steps.push(progress.step);
    const result = await stream.result();
    assert.deepEqual(
      steps.filter((s) => bracket.includes(s)),
      bracket,
    );
    const outcome = result.outcome;
    assert.ok(outcome?.compactionId);
    assert.ok(outcome.itemsCondensed > 0n);
    const surface = await client.getSurface(sessionId);
    const checkpoints = surface.nodes.filter((n) => n.compactionId === outcome.compactionId);
    assert.deepEqual(
      checkpoints.map((n) => n.seq),
      [outcome.checkpointSeq],
    );
    assert.equal(checkpoints[0]?.type, "user/message");
    const all = await types(sessionId);
    assert.equal(all.filter((t) => t === "compaction/start").length, 1);
    assert.equal(all.filter((t) => t === "compaction/end").length, 1);
  });

  test("recall tool", async () => {
    const sessionId = `ts-${randomUUID().slice(0, 12)}`;
    await client.createSession({ sessionId, compactionPolicy: { recallTool: true } });
    await seed(sessionId, 3);
    await client.compact(sessionId).result();
    const request = await client.buildRequest(sessionId);
    assert.equal(request.tools.at(-1)?.name, "recall");
    const texts = request.messages.flatMap((m) =>
      m.content.map((b) => (b.block.case === "text" ? b.block.value.text : "")),
    );
    const handle = texts.join("\n").match(/\[recall:(c\d+-[0-9a-f]{4})\]/)?.[1];
    assert.ok(handle, "the checkpoint names its recall handle");
    const callBlock = toolCallBlock("r1", "recall", { handle });
    await client.appendEvents(sessionId, [
      turnStart(9),
      userMessage("What did turn 1 find, exactly?"),
      stepStart(9, 1),
      assistantMessage({ toolCalls: [callBlock] }),
      stepEnd(9, 1),
    ]);
    const result = await client.answerRecall(sessionId, callBlock);
    await client.appendEvents(sessionId, [result, turnEnd(9)]);
    assert.equal(result.body.case, "toolResult");
    const answered = result.body.case === "toolResult" ? result.body.value : undefined;
    assert.equal(answered?.toolCallId, "r1");
    assert.equal(answered?.isError, false);
    const last = (await client.buildRequest(sessionId)).messages.at(-1);
    assert.equal(last?.toolCallId, "r1");
    const text = last?.content[0]?.block.case === "text" ? last.content[0].block.value.text : "";
    assert.ok(text.includes(`[recall:${handle}]`) && text.includes("src/module_1_0.py"), text.slice(0, 400));
    const unknown = await client.answerRecall(sessionId, { id: "r2", name: "recall", input: { handle: "c1-0000" } });
    assert.equal(unknown.body.case === "toolResult" && unknown.body.value.isError, true);
  });

  test("busy error carries its reason", async () => {
    const sessionId = await newSession();
    await seed(sessionId, 2);
    await client.appendEvents(sessionId, [turnStart(3), userMessage("still working")]);
    const err = await client
      .compact(sessionId)
      .result()
      .catch((e: unknown) => e);
    assert.ok(err instanceof CompactionBusyError, String(err));
    assert.equal(err.code, Code.Aborted);
    assert.equal(err.reason, "COMPACTION_BUSY");
  });

  test("seq conflict", async () => {
    const sessionId = await newSession();
    const revision = await seed(sessionId, 1);
    const err = await client
      .appendEvents(sessionId, [userMessage("stale")], { expectedLastSeq: revision - 2n })
      .catch((e: unknown) => e);
    assert.ok(err instanceof SeqConflictError, String(err));
    assert.equal(err.code, Code.Aborted);
    assert.equal(err.reason, "SEQ_CONFLICT");
    const next = await client.appendEvents(sessionId, [turnStart(9)], { expectedLastSeq: revision - 1n });
    assert.deepEqual(next.seqs, [revision]);
  });

  /** What one step of an open turn logs (~390 tokens): a reply calling a tool, its result. */
  function workStep(turn: number, step: number): SessionEvent[] {
    const callId = `fix-${step}`;
    const output = Array.from({ length: 40 }, (_, i) => `src/module_${step}_${i}.py: fixed handler_${i}`).join("\n");
    return [
      stepStart(turn, step),
      assistantMessage({ text: `Fixing batch ${step}.`, toolCalls: [toolCallBlock(callId, "edit", { batch: step })] }),
      stepEnd(turn, step),
      toolResult(callId, output, { toolName: "edit" }),
    ];
  }

  test("held steps across a compaction", async () => {
    const sessionId = await newSession();
    await seed(sessionId, 8); // ~8,000 tokens: five steps below the trigger (9,830)
    await client.appendEvents(sessionId, [turnStart(9), userMessage("Now fix every handler.")]);
    const answers: PrepareStepResult[] = [];
    for (let step = 1; step <= 9; step++) {
      // Even steps stream (onProgress, as the examples step), odd ones are one unary call: both
      // extend the same held request.
      const seen: CompactionProgress[] = [];
      const onProgress = step % 2 === 0 ? (p: CompactionProgress) => seen.push(p) : undefined;
      const prepared = await client.prepareStep(sessionId, 9, { onProgress });
      const built = await client.buildRequest(sessionId);
      assert.deepEqual(prepared.request, built, `step ${step}`);
      assert.deepEqual(prepared.progress, seen);
      answers.push(prepared.result);
      if (prepared.result.requestUnchanged) {
        assert.deepEqual(prepared.result.appendedMessages, built.messages.slice(-2));
      }
      await client.appendEvents(sessionId, workStep(9, step));
    }
    const compacted = answers.flatMap((a, i) => (a.compactions.length > 0 ? [i] : []));
    assert.ok(compacted.length > 0, "no step compacted");
    const first = compacted[0] ?? 0;
    assert.ok(first > 1 && first < answers.length - 1, String(compacted));
    const full = answers.flatMap((a, i) => (a.requestUnchanged ? [] : [i]));
    assert.deepEqual(full, [0, ...compacted]); // the first step held nothing; a compaction rewrites
  });

  test("a held step of a session created again answers the new request", async () => {
    // Another client deletes the session and creates it again under the same id, its log past the
    // held revision: the held incarnation tells them apart, so the step answers the new request.
    const sessionId = await newSession();
    await seed(sessionId, 1);
    await client.appendEvents(sessionId, [turnStart(2), userMessage("Fix the first handler.")]);
    const held = (await client.prepareStep(sessionId, 2)).request.revision;
    const other = new CompactdClient({ target: address, timeoutMs: 30_000 });
    try {
      await other.deleteSession(sessionId);
      await other.createSession({ sessionId });
    } finally {
      other.close();
    }
    await seed(sessionId, 2); // appends hold nothing: the client still holds the old request
    await client.appendEvents(sessionId, [turnStart(3), userMessage("Fix the second handler.")]);
    assert.ok((await client.buildRequest(sessionId)).revision > held);
    const prepared = await client.prepareStep(sessionId, 3);
    assert.ok(!prepared.result.requestUnchanged);
    assert.deepEqual(prepared.request, await client.buildRequest(sessionId));
  });
});
