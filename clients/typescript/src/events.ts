// Builders for the SessionEvents an agent runtime appends. Each returns a complete event with
// seq unset (the server assigns it); `eventId` is an optional idempotency key that makes a
// retried append return the original seqs instead of appending twice.

import { create } from "@bufbuild/protobuf";
import {
  AssistantMessageSchema,
  type ContentBlock,
  ContentBlockSchema,
  HeaderReason,
  RequestHeaderSchema,
  StepEndSchema,
  StatePinSchema,
  StepStartSchema,
  SubagentEndSchema,
  SubagentStartSchema,
  SubagentStatus,
  SystemMessageSchema,
  ToolCallSchema,
  ToolResultSchema,
  TurnEndSchema,
  TurnStartSchema,
  UserMessageSchema,
  type Route,
  RouteSchema,
  type SessionEvent,
  SessionEventSchema,
  type ToolDeclaration,
  ToolDeclarationSchema,
  type Usage,
} from "./gen/compactd/v1/events_pb.js";

/** Per-event options. */
export interface EventOptions {
  /** Client-chosen idempotency key, unique within the session. */
  eventId?: string;
}

/** Message content: plain text or content blocks in order. */
export type Content = string | ContentBlock[];

type Body = SessionEvent["body"];

function event(body: Body, opts: EventOptions = {}): SessionEvent {
  return create(SessionEventSchema, { eventId: opts.eventId ?? "", body });
}

function blocks(content: Content): ContentBlock[] {
  return typeof content === "string" ? [textBlock(content)] : content;
}

function json(value: string | object): string {
  return typeof value === "string" ? value : JSON.stringify(value);
}

/** A text content block. */
export function textBlock(text: string): ContentBlock {
  return create(ContentBlockSchema, { block: { case: "text", value: { text } } });
}

/** An assistant tool-call block; object arguments are serialized as JSON. */
export function toolCallBlock(id: string, name: string, args: string | object): ContentBlock {
  return create(ContentBlockSchema, {
    block: { case: "toolCall", value: { id, name, argumentsJson: json(args) } },
  });
}

/** A system/message (the system prompt, normally surface position 0). */
export function systemMessage(text: string, opts?: EventOptions): SessionEvent {
  return event({ case: "systemMessage", value: create(SystemMessageSchema, { text }) }, opts);
}

/** A user/message of user input. */
export function userMessage(content: Content, opts?: EventOptions): SessionEvent {
  return event({ case: "userMessage", value: create(UserMessageSchema, { content: blocks(content) }) }, opts);
}

/** Fields of an assistant/message. */
export interface AssistantInit extends EventOptions {
  text?: string;
  toolCalls?: ContentBlock[];
  reasoning?: string;
  /** The provider's usage for the request this message answers (anchors pressure). */
  usage?: Usage;
  provider?: string;
  model?: string;
  stopReason?: string;
}

/** An assistant/message: reasoning, then text, then tool calls. */
export function assistantMessage(init: AssistantInit): SessionEvent {
  const content: ContentBlock[] = [];
  if (init.reasoning) {
    content.push(create(ContentBlockSchema, { block: { case: "reasoning", value: { text: init.reasoning } } }));
  }
  if (init.text) {
    content.push(textBlock(init.text));
  }
  content.push(...(init.toolCalls ?? []));
  const value = create(AssistantMessageSchema, {
    content,
    usage: init.usage,
    provider: init.provider ?? "",
    model: init.model ?? "",
    stopReason: init.stopReason ?? "",
  });
  return event({ case: "assistantMessage", value }, init);
}

/** A tool/result answering the tool-call block `toolCallId`. */
export function toolResult(
  toolCallId: string,
  content: Content,
  opts: EventOptions & { toolName?: string; isError?: boolean } = {},
): SessionEvent {
  const value = create(ToolResultSchema, {
    toolCallId,
    toolName: opts.toolName ?? "",
    content: blocks(content),
    isError: opts.isError ?? false,
  });
  return event({ case: "toolResult", value }, opts);
}

/** A log-only tool/call: the runtime dispatched a call. */
export function toolCall(toolCallId: string, name: string, args: string | object, opts?: EventOptions): SessionEvent {
  const value = create(ToolCallSchema, { toolCallId, name, argumentsJson: json(args) });
  return event({ case: "toolCall", value }, opts);
}

/** A turn/start: opens a turn (compaction is busy while it is open). */
export function turnStart(turn: number | bigint, opts?: EventOptions): SessionEvent {
  return event({ case: "turnStart", value: create(TurnStartSchema, { turn: BigInt(turn) }) }, opts);
}

/** A turn/end closing a turn. */
export function turnEnd(turn: number | bigint, reason = "", opts?: EventOptions): SessionEvent {
  const value = create(TurnEndSchema, { turn: BigInt(turn), reason });
  return event({ case: "turnEnd", value }, opts);
}

/** A step/start. */
export function stepStart(turn: number | bigint, step: number | bigint, opts?: EventOptions): SessionEvent {
  const value = create(StepStartSchema, { turn: BigInt(turn), step: BigInt(step) });
  return event({ case: "stepStart", value }, opts);
}

/** A step/end. */
export function stepEnd(turn: number | bigint, step: number | bigint, opts?: EventOptions): SessionEvent {
  const value = create(StepEndSchema, { turn: BigInt(turn), step: BigInt(step) });
  return event({ case: "stepEnd", value }, opts);
}

/** A tool declaration; an object schema is serialized as JSON. */
export function toolDeclaration(name: string, description: string, inputSchema: string | object): ToolDeclaration {
  return create(ToolDeclarationSchema, { name, description, inputSchemaJson: json(inputSchema) });
}

/** Options of a request/header. */
export interface HeaderInit extends EventOptions {
  tools?: ToolDeclaration[];
  maxOutputTokens?: number | bigint;
  temperature?: number;
  reason?: HeaderReason;
  startsSeries?: boolean;
}

/** A request/header: the route, sampling settings and tools of later requests. */
export function requestHeader(provider: string, model: string, init: HeaderInit = {}): SessionEvent {
  const value = create(RequestHeaderSchema, {
    config: {
      provider,
      model,
      maxOutputTokens: init.maxOutputTokens === undefined ? undefined : BigInt(init.maxOutputTokens),
      temperature: init.temperature,
    },
    tools: init.tools ?? [],
    reason: init.reason ?? HeaderReason.INITIAL,
    startsSeries: init.startsSeries ?? false,
  });
  return event({ case: "requestHeader", value }, init);
}

/**
 * A state/pin: `text` is in force under `key` (replacing the key's earlier pin) and is never
 * summarized; every rebuilt request shows the pins in force right after the system head. `key`:
 * 1-64 characters of [A-Za-z0-9._:/-] ("goal", "plan", ...).
 */
export function pin(key: string, text: string, opts?: EventOptions): SessionEvent {
  return event({ case: "statePin", value: create(StatePinSchema, { key, text }) }, opts);
}

/** A state/pin that removes `key` from the pins in force. */
export function clearPin(key: string, opts?: EventOptions): SessionEvent {
  return event({ case: "statePin", value: create(StatePinSchema, { key, clear: true }) }, opts);
}

/** Options of a subagent/start. */
export interface SubagentStartInit extends EventOptions {
  /** The tool call of this session that spawned the sub-agent. */
  toolCallId?: string;
  /** One line saying what the sub-agent was asked to do. */
  task?: string;
}

/**
 * A subagent/start (in the parent's log): a sub-agent runs in session `childSessionId`. Until
 * its subagent/end, every checkpoint of the parent lists it as an open handle.
 */
export function subagentStart(childSessionId: string, init: SubagentStartInit = {}): SessionEvent {
  const value = create(SubagentStartSchema, {
    childSessionId,
    toolCallId: init.toolCallId ?? "",
    task: init.task ?? "",
  });
  return event({ case: "subagentStart", value }, init);
}

/** Options of a subagent/end. */
export interface SubagentEndInit extends EventOptions {
  /** How it ended (default COMPLETED). */
  status?: SubagentStatus;
}

/** A subagent/end (in the parent's log): the sub-agent of `childSessionId` ended; `result` summarizes it. */
export function subagentEnd(childSessionId: string, result = "", init: SubagentEndInit = {}): SessionEvent {
  const value = create(SubagentEndSchema, {
    childSessionId,
    result,
    status: init.status ?? SubagentStatus.COMPLETED,
  });
  return event({ case: "subagentEnd", value }, init);
}

/** A provider/model route. */
export function route(provider: string, model: string): Route {
  return create(RouteSchema, { provider, model });
}

const eventTypes: Record<NonNullable<Body["case"]>, string> = {
  systemMessage: "system/message",
  developerMessage: "developer/message",
  userMessage: "user/message",
  assistantMessage: "assistant/message",
  toolResult: "tool/result",
  turnStart: "turn/start",
  turnEnd: "turn/end",
  stepStart: "step/start",
  stepEnd: "step/end",
  toolCall: "tool/call",
  assistantAttempt: "assistant/attempt",
  requestHeader: "request/header",
  compactionStart: "compaction/start",
  compactionPrune: "compaction/prune",
  compactionSummary: "compaction/summary",
  compactionEnd: "compaction/end",
  imageOffload: "image/offload",
  sessionEndSeed: "session/end-seed",
  llmRetry: "llm/retry",
  compactionSummaryError: "compaction/summary-error",
  statePin: "state/pin",
  subagentStart: "subagent/start",
  subagentEnd: "subagent/end",
  sessionFork: "session/fork",
};

/** The spec's type string of an event ("user/message", "compaction/start", ...). */
export function eventType(e: SessionEvent): string {
  if (e.body.case === undefined) {
    throw new Error("event has no body");
  }
  return eventTypes[e.body.case];
}
