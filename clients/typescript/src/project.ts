// The model-visible messages of logged events, as compactd's own Messages: each surface event of
// an append-only log projected as BuildRequest would, without the surface fold (no REPLACE, no
// image offload; empty system or assistant messages are kept). For a compacted session's
// surface, render BuildRequest's messages instead.

import { create, type JsonObject } from "@bufbuild/protobuf";
import type { RequestConfig, SessionEvent } from "./gen/compactd/v1/events_pb.js";
import { type Message, MessageRole, MessageSchema } from "./gen/compactd/v1/session_service_pb.js";
import { textBlock } from "./events.js";

/** The message a surface event shows the model; undefined for log-only events. */
export function projectEvent(event: SessionEvent): Message | undefined {
  const body = event.body;
  switch (body.case) {
    case "systemMessage":
      return create(MessageSchema, { role: MessageRole.SYSTEM, content: [textBlock(body.value.text)] });
    case "developerMessage":
      return create(MessageSchema, { role: MessageRole.DEVELOPER, content: [textBlock(body.value.text)] });
    case "userMessage":
      return create(MessageSchema, { role: MessageRole.USER, content: body.value.content });
    case "assistantMessage":
      return create(MessageSchema, { role: MessageRole.ASSISTANT, content: body.value.content });
    case "toolResult":
      return create(MessageSchema, {
        role: MessageRole.TOOL,
        content: body.value.content,
        toolCallId: body.value.toolCallId,
        isError: body.value.isError,
        name: body.value.toolName,
      });
    default:
      return undefined;
  }
}

/** The messages of `events`, in log order. */
export function projectEvents(events: Iterable<SessionEvent>): Message[] {
  const messages: Message[] = [];
  for (const event of events) {
    const message = projectEvent(event);
    if (message) {
      messages.push(message);
    }
  }
  return messages;
}

/** The tags of the pinned-state message a rebuilt request holds (`Message.pinnedState`). */
export const PINS_OPEN_TAG = "<pinned-state>";
export const PINS_CLOSE_TAG = "</pinned-state>";

/** Whether `text` is exactly a pinned-state block (the text of a `Message.pinnedState`). */
export function isPins(text: string): boolean {
  return text.startsWith(PINS_OPEN_TAG) && text.endsWith(PINS_CLOSE_TAG);
}

/**
 * `text` (a system text) without a pinned-state block a rendered request put in it: pins are the
 * runtime's task state, not the conversation's system prompt, and compactd renders them itself.
 */
export function withoutPins(text: string): string {
  const start = text.indexOf(PINS_OPEN_TAG);
  const end = start < 0 ? -1 : text.indexOf(PINS_CLOSE_TAG, start);
  if (end < 0) {
    return text;
  }
  const before = text.slice(0, start).replace(/\n+$/, "");
  const after = text.slice(end + PINS_CLOSE_TAG.length).replace(/^\n+/, "");
  return before && after ? `${before}\n\n${after}` : before + after;
}

/** The header's sampling settings and extra keys, and `stream`, into a request body. */
export function addSettings(body: JsonObject, config: RequestConfig | undefined, stream: boolean | undefined): void {
  if (config?.temperature !== undefined) {
    body["temperature"] = config.temperature;
  }
  if (config?.topP !== undefined) {
    body["top_p"] = config.topP;
  }
  Object.assign(body, config?.extra ?? {});
  if (stream !== undefined) {
    body["stream"] = stream;
  }
}
