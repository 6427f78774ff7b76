// The recall tool's calls, answered through SessionService.Recall.
//
// With the session policy `recallTool` on, every rebuilt request declares the recall tool (named
// `recallToolName`, default "recall"). When the model calls it, the runtime answers with
// `client.answerRecall(sessionId, call)`: an ordinary tool/result event, to append to the log and
// send back like any tool's. A handle the log does not name, or arguments that are not
// {"handle", "query"?, "page"?}, answer an error result the model can read (isError); any other
// failure throws.

import { create } from "@bufbuild/protobuf";
import type { ContentBlock, SessionEvent, ToolCallBlock } from "./gen/compactd/v1/events_pb.js";
import { type RecallRequest, RecallRequestSchema } from "./gen/compactd/v1/session_service_pb.js";
import { toolResult } from "./events.js";

/** The most bytes of recalled events one answer carries (the model pages for more). */
export const DEFAULT_TOOL_MAX_BYTES = 16384;

/** Reasons that come back to the model as an error result rather than throw. */
const MODEL_ERRORS: ReadonlySet<string> = new Set(["RECALL_HANDLE_UNKNOWN", "INVALID_ARGUMENT"]);

/**
 * A tool call: compactd's ToolCallBlock (or the ContentBlock holding it), an OpenAI chat
 * `tool_calls` item ({id, function: {name, arguments}}) or an Anthropic `tool_use` block
 * ({id, name, input}).
 */
export type ToolCallLike =
  | ToolCallBlock
  | ContentBlock
  | { id?: string; function: { name: string; arguments?: string } }
  | { id?: string; name: string; input?: unknown };

interface Call {
  id: string;
  name: string;
  args: string;
}

function parse(call: ToolCallLike): Call {
  if ("block" in call) {
    const block = call.block.case === "toolCall" ? call.block.value : undefined;
    return { id: block?.id ?? "", name: block?.name ?? "", args: block?.argumentsJson ?? "" };
  }
  if ("argumentsJson" in call) return { id: call.id, name: call.name, args: call.argumentsJson };
  if ("function" in call) {
    return { id: call.id ?? "", name: call.function.name, args: call.function.arguments ?? "" };
  }
  const input = call.input ?? {};
  return { id: call.id ?? "", name: call.name, args: typeof input === "string" ? input : JSON.stringify(input) };
}

/** Whether `call` calls the recall tool (declared under `name`). */
export function isRecallCall(call: ToolCallLike, name = "recall"): boolean {
  return parse(call).name === name;
}

/** An error tool/result answering `call`. */
export function recallErrorResult(call: ToolCallLike, message: string): SessionEvent {
  const parsed = parse(call);
  return toolResult(parsed.id, message, { toolName: parsed.name, isError: true });
}

/** The Recall request a call asks for, or the error result of unusable arguments. */
export function recallRequest(sessionId: string, call: ToolCallLike, maxBytes: number): RecallRequest | SessionEvent {
  let args: unknown;
  try {
    args = JSON.parse(parse(call).args || "{}");
  } catch {
    args = undefined;
  }
  const fields = typeof args === "object" && args !== null ? (args as Record<string, unknown>) : {};
  if (typeof fields.handle !== "string") {
    return recallErrorResult(call, 'the arguments must be {"handle": "..."} (query, page optional)');
  }
  return create(RecallRequestSchema, {
    sessionId,
    handle: fields.handle,
    query: typeof fields.query === "string" ? fields.query : "",
    pageToken: typeof fields.page === "string" ? fields.page : "",
    maxBytes,
  });
}

/** The tool/result answering `call` with a recalled page's text. */
export function recallAnswer(call: ToolCallLike, text: string): SessionEvent {
  const parsed = parse(call);
  return toolResult(parsed.id, text, { toolName: parsed.name });
}

/** The error result of a failed Recall the model can act on; rethrows `err` otherwise. */
export function recallErrorAnswer(call: ToolCallLike, err: unknown): SessionEvent {
  const reason = (err as { reason?: unknown }).reason;
  if (typeof reason !== "string" || !MODEL_ERRORS.has(reason)) throw err;
  return recallErrorResult(call, `recall failed: ${(err as Error).message}`);
}
