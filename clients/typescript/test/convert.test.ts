// The converters on the shared transcripts (testdata/transcripts): import then render gives the
// original messages, and every imported log follows the step rules.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, test } from "node:test";
import {
  anthropic,
  BuildRequestResponseSchema,
  clearPin,
  create,
  eventType,
  MessageRole,
  MessageSchema,
  openai,
  pin,
  type SessionEvent,
  SubagentStatus,
  subagentEnd,
  subagentStart,
  systemMessage,
  textBlock,
} from "../src/index.js";

const TESTDATA = new URL("../../../../testdata/transcripts/", import.meta.url);

interface Conversation<M> {
  source: string;
  messages: M[];
}

function conversations<M>(name: string): Conversation<M>[] {
  return readFileSync(new URL(`${name}.jsonl`, TESTDATA), "utf8")
    .split("\n")
    .filter((line) => line.trim())
    .map((line) => JSON.parse(line) as Conversation<M>);
}

/** Where `events` break the step rules (see AGREEMENT's protocol decision 2). */
export function stepRuleViolations(events: SessionEvent[]): string[] {
  const problems: string[] = [];
  let turn: bigint | undefined;
  let step: string | undefined;
  const calls = new Set<string>();
  events.forEach((event, index) => {
    const body = event.body;
    if (body.case === "turnStart") {
      if (turn !== undefined) problems.push(`${index}: turn/start inside a turn`);
      turn = body.value.turn;
    } else if (body.case === "turnEnd") {
      if (turn !== body.value.turn || step !== undefined) problems.push(`${index}: bad turn/end`);
      turn = undefined;
    } else if (body.case === "stepStart") {
      if (turn !== body.value.turn || step !== undefined) problems.push(`${index}: bad step/start`);
      step = `${body.value.turn}/${body.value.step}`;
    } else if (body.case === "stepEnd") {
      if (step !== `${body.value.turn}/${body.value.step}`) problems.push(`${index}: bad step/end`);
      step = undefined;
    } else if (body.case === "assistantMessage") {
      if (step === undefined) problems.push(`${index}: assistant/message outside a step`);
      for (const block of body.value.content) {
        if (block.block.case === "toolCall") calls.add(block.block.value.id);
      }
    } else if (body.case === "toolResult" && !calls.has(body.value.toolCallId)) {
      problems.push(`${index}: tool/result without an earlier call`);
    }
  });
  return problems;
}

describe("OpenAI chat messages", () => {
  const records = conversations<openai.ChatMessage>("openai");
  test("the transcripts are there", () => assert.ok(records.length >= 18));
  for (const record of records) {
    test(`import then render gives the messages: ${record.source.slice(-48)}`, () => {
      const events = openai.eventsFromMessages(record.messages, { provider: "p", model: "m" });
      assert.deepEqual(stepRuleViolations(events), []);
      assert.deepEqual(openai.messagesFromEvents(events), record.messages);
    });
  }

  test("turns and steps bracket each reply; tools become the header's", () => {
    const messages: openai.ChatMessage[] = [
      { role: "system", content: "Be brief." },
      { role: "user", content: "List files." },
      {
        role: "assistant",
        content: null,
        tool_calls: [{ id: "c1", type: "function", function: { name: "ls", arguments: "{}" } }],
      },
      { role: "tool", tool_call_id: "c1", content: "a.py" },
      { role: "assistant", content: "One file.", reasoning_content: "Easy." },
    ];
    const tools = [{ type: "function", function: { name: "ls", parameters: { type: "object" } } }];
    const events = openai.eventsFromMessages(messages, { tools, provider: "openai", model: "gpt-4o" });
    assert.deepEqual(events.map(eventType), [
      "system/message",
      "request/header",
      "turn/start",
      "user/message",
      "step/start",
      "assistant/message",
      "step/end",
      "tool/result",
      "step/start",
      "assistant/message",
      "step/end",
      "turn/end",
    ]);
    const header = events[1]?.body;
    assert.ok(header?.case === "requestHeader");
    assert.deepEqual(openai.tools(header.value.tools), tools);
    assert.deepEqual(openai.messagesFromEvents(events, { includeReasoning: true }), messages);
    assert.equal(openai.messagesFromEvents(events)[4]?.reasoning_content, undefined);
  });

  test("unknown roles are named", () => {
    assert.throws(() => openai.eventsFromMessages([{ role: "function", content: "x" }]), /messages\[0\]: role/);
  });
});

describe("Anthropic messages", () => {
  const records = conversations<anthropic.AnthropicMessage>("anthropic");
  test("the transcripts are there", () => assert.ok(records.length >= 4));
  for (const record of records) {
    test(`import then render gives the messages: ${record.source.slice(-40)}`, () => {
      const events = anthropic.eventsFromMessages(record.messages, { model: "claude" });
      assert.deepEqual(stepRuleViolations(events), []);
      assert.deepEqual(anthropic.messagesFromEvents(events), { messages: record.messages });
    });
  }

  test("tool results and text of one user message render back together", () => {
    const messages: anthropic.AnthropicMessage[] = [
      { role: "user", content: "Read it." },
      {
        role: "assistant",
        content: [
          { type: "thinking", thinking: "Use the tool.", signature: "sig" },
          { type: "tool_use", id: "t1", name: "read", input: { path: "a" } },
        ],
      },
      {
        role: "user",
        content: [
          { type: "tool_result", tool_use_id: "t1", content: "text", is_error: true },
          { type: "text", text: "Go on." },
        ],
      },
      {
        role: "assistant",
        content: [
          { type: "redacted_thinking", data: "opaque" },
          { type: "text", text: "Done." },
        ],
      },
    ];
    const events = anthropic.eventsFromMessages(messages, { system: "Be brief." });
    assert.deepEqual(stepRuleViolations(events), []);
    assert.deepEqual(anthropic.messagesFromEvents(events), { system: "Be brief.", messages });
  });

  test("a system message between a call and its result renders after the tool_result", () => {
    // Anthropic requires the tool_result blocks first in the user message after a tool_use.
    const events = anthropic.eventsFromMessages(
      [
        { role: "user", content: "Read it." },
        { role: "assistant", content: [{ type: "tool_use", id: "t1", name: "read", input: {} }] },
        { role: "user", content: [{ type: "tool_result", tool_use_id: "t1", content: "x" }] },
      ],
      { closeTurn: false },
    );
    events.splice(events.map(eventType).indexOf("tool/result"), 0, systemMessage("Be careful."));
    const rendered = anthropic.messagesFromEvents(events).messages;
    assert.deepEqual(rendered[rendered.length - 1], {
      role: "user",
      content: [
        { type: "tool_result", tool_use_id: "t1", content: "x" },
        { type: "text", text: "Be careful." },
      ],
    });
  });
});

describe("pins and sub-agents", () => {
  const pins = "<pinned-state>\nkept\n\n[goal]\nship it\n</pinned-state>";
  const text = (role: MessageRole, value: string, pinnedState = false) =>
    create(MessageSchema, { role, content: [textBlock(value)], pinnedState });
  const request = create(BuildRequestResponseSchema, {
    messages: [
      text(MessageRole.SYSTEM, "be brief"),
      text(MessageRole.SYSTEM, pins, true),
      text(MessageRole.USER, "hi"),
    ],
    config: { model: "m", maxOutputTokens: 64n },
    pins: [{ key: "goal", text: "ship it" }],
  });

  test("typed builders make the new events", () => {
    assert.equal(pin("goal", "ship").body.case, "statePin");
    assert.deepEqual(
      [pin("g", "t"), clearPin("g"), subagentStart("c", { task: "x" }), subagentEnd("c", "done")].map(eventType),
      ["state/pin", "state/pin", "subagent/start", "subagent/end"],
    );
    const cleared = clearPin("g").body;
    assert.ok(cleared.case === "statePin" && cleared.value.clear);
    const ended = subagentEnd("c", "done", { status: SubagentStatus.FAILED }).body;
    assert.ok(ended.case === "subagentEnd" && ended.value.status === SubagentStatus.FAILED);
  });

  test("OpenAI: the pins follow the head and never come back as conversation messages", () => {
    const body = openai.requestBody(request);
    const messages = body["messages"] as openai.ChatMessage[];
    assert.deepEqual(
      messages.map((m) => m.role),
      ["system", "system", "user"],
    );
    const events = openai.eventsFromMessages(messages);
    assert.deepEqual(
      openai.messagesFromEvents(events).map((m) => m.content),
      ["be brief", "hi"],
    );
  });

  test("Anthropic: the pins join the system text and are dropped on import", () => {
    const body = anthropic.requestBody(request);
    assert.equal(body["system"], `be brief\n\n${pins}`);
    assert.deepEqual(body["messages"], [{ role: "user", content: "hi" }]);
    const events = anthropic.eventsFromMessages(body["messages"] as anthropic.AnthropicMessage[], {
      system: body["system"] as string,
    });
    const first = events[0]?.body;
    assert.ok(first?.case === "systemMessage" && first.value.text === "be brief");
  });
});
