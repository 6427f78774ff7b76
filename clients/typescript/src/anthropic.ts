// Anthropic Messages <-> compactd: messages and tools to events, BuildRequest to a body.
//
// The mapping is the Python client's (compactd_client.anthropic), both ways, so import then
// render gives the original messages: system text; a user message's tool_result blocks become
// tool/results, the rest one user/message (consecutive user-side messages render back as one user
// message, tool results first, also after a system message logged between a call and its result);
// each assistant message is one step of a turn with thinking (signed; redacted_thinking as a
// reasoning block holding only its data), text and tool_use blocks in order; base64 images inline, url images as the path. A user message or tool result
// that is one text block renders as a string. Thinking blocks are always sent back.

import { create, type JsonObject, type JsonValue } from "@bufbuild/protobuf";
import { base64Decode, base64Encode } from "@bufbuild/protobuf/wire";
import {
  type AssistantMessage,
  AssistantMessageSchema,
  type ContentBlock,
  ContentBlockSchema,
  type ImageBlock,
  ImageBlockSchema,
  type SessionEvent,
  SessionEventSchema,
  SystemMessageSchema,
  type ToolDeclaration,
  ToolDeclarationSchema,
  ToolResultSchema,
  UsageSchema,
  UserMessageSchema,
} from "./gen/compactd/v1/events_pb.js";
import { type BuildRequestResponse, type Message, MessageRole } from "./gen/compactd/v1/session_service_pb.js";
import { requestHeader, textBlock } from "./events.js";
import { addSettings, projectEvents, withoutPins } from "./project.js";
import { Timeline } from "./timeline.js";

/** A Messages API content block. */
export interface AnthropicBlock {
  type: string;
  [key: string]: unknown;
}

/** A Messages API message. */
export interface AnthropicMessage {
  role: string;
  content: string | AnthropicBlock[];
}

/** A Messages API client tool. */
export interface AnthropicTool {
  name: string;
  description?: string;
  input_schema?: unknown;
  [key: string]: unknown;
}

/** Options of eventsFromMessages. */
export interface ImportOptions {
  system?: string | AnthropicBlock[];
  tools?: AnthropicTool[];
  /** The route's provider (default "anthropic"). */
  provider?: string;
  /** The route's model (empty: no request/header). */
  model?: string;
  firstTurn?: number;
  closeTurn?: boolean;
}

const JOIN = "\n\n";

/** The events that log an Anthropic conversation as a valid compactd log. */
export function eventsFromMessages(messages: AnthropicMessage[], opts: ImportOptions = {}): SessionEvent[] {
  const timeline = new Timeline(opts.firstTurn ?? 1);
  if (opts.system !== undefined) {
    const text =
      typeof opts.system === "string" ? opts.system : opts.system.map((block) => String(block["text"])).join(JOIN);
    const kept = withoutPins(text); // a rebuilt request's pins are not the system prompt
    if (kept || kept === text) {
      timeline.other(event({ case: "systemMessage", value: create(SystemMessageSchema, { text: kept }) }));
    }
  }
  if (opts.model) {
    timeline.other(requestHeader(opts.provider ?? "anthropic", opts.model, { tools: declarations(opts.tools ?? []) }));
  }
  const names = new Map<string, string>();
  messages.forEach((message, index) => {
    const where = `messages[${index}]`;
    const blocks: AnthropicBlock[] =
      typeof message.content === "string" ? [{ type: "text", text: message.content }] : (message.content ?? []);
    if (message.role === "assistant") {
      const reply = assistant(blocks, where);
      for (const block of reply.content) {
        if (block.block.case === "toolCall") {
          names.set(block.block.value.id, block.block.value.name);
        }
      }
      timeline.assistant(event({ case: "assistantMessage", value: reply }));
    } else if (message.role === "user") {
      const rest: ContentBlock[] = [];
      blocks.forEach((block, number) => {
        if (block.type === "tool_result") {
          timeline.other(toolResult(block, names, `${where}.content[${number}]`));
        } else {
          rest.push(contentBlock(block, `${where}.content[${number}]`));
        }
      });
      if (rest.length > 0) {
        timeline.user(event({ case: "userMessage", value: create(UserMessageSchema, { content: rest }) }));
      }
    } else {
      throw new Error(`${where}: role ${JSON.stringify(message.role)} is not carried`);
    }
  });
  return timeline.finish(opts.closeTurn ?? true);
}

/** request/header tool declarations of Anthropic client tools. */
export function declarations(tools: AnthropicTool[]): ToolDeclaration[] {
  return tools.map((tool) =>
    create(ToolDeclarationSchema, {
      name: tool.name,
      description: tool.description ?? "",
      inputSchemaJson: tool.input_schema === undefined ? "" : JSON.stringify(tool.input_schema),
    }),
  );
}

/** The assistant/message of a Messages API response, with its usage and stop reason. */
export function assistantEvent(reply: JsonObject, opts: { provider?: string } = {}): SessionEvent {
  const message = assistant((reply["content"] ?? []) as unknown as AnthropicBlock[], "content");
  message.provider = opts.provider ?? "anthropic";
  message.model = String(reply["model"] ?? "");
  message.stopReason = String(reply["stop_reason"] ?? "");
  const usage = reply["usage"] as JsonObject | undefined;
  if (usage) {
    message.usage = create(UsageSchema, {
      inputTokens: BigInt(Number(usage["input_tokens"] ?? 0)),
      cacheReadTokens: BigInt(Number(usage["cache_read_input_tokens"] ?? 0)),
      cacheWriteTokens: BigInt(Number(usage["cache_creation_input_tokens"] ?? 0)),
      outputTokens: BigInt(Number(usage["output_tokens"] ?? 0)),
    });
  }
  return event({ case: "assistantMessage", value: message });
}

function event(body: SessionEvent["body"]): SessionEvent {
  return create(SessionEventSchema, { body });
}

function assistant(blocks: AnthropicBlock[], where: string): AssistantMessage {
  return create(AssistantMessageSchema, {
    content: blocks.map((block, number) => contentBlock(block, `${where}.content[${number}]`)),
  });
}

function contentBlock(block: AnthropicBlock, where: string): ContentBlock {
  switch (block.type) {
    case "text":
      return textBlock(String(block["text"] ?? ""));
    case "thinking":
      return create(ContentBlockSchema, {
        block: {
          case: "reasoning",
          value: { text: String(block["thinking"] ?? ""), signature: String(block["signature"] ?? "") },
        },
      });
    case "redacted_thinking":
      return create(ContentBlockSchema, {
        block: { case: "reasoning", value: { signature: String(block["data"] ?? "") } },
      });
    case "tool_use": {
      const value = {
        id: String(block["id"] ?? ""),
        name: String(block["name"] ?? ""),
        argumentsJson: JSON.stringify(block["input"] ?? {}),
      };
      return create(ContentBlockSchema, { block: { case: "toolCall", value } });
    }
    case "image":
      return create(ContentBlockSchema, {
        block: { case: "image", value: image((block["source"] ?? {}) as JsonObject, where) },
      });
    default:
      throw new Error(`${where}: block type ${JSON.stringify(block.type)} is not carried`);
  }
}

function image(source: JsonObject, where: string): ImageBlock {
  if (source["type"] === "base64") {
    const data = base64Decode(String(source["data"] ?? ""));
    return create(ImageBlockSchema, {
      mediaType: String(source["media_type"] ?? ""),
      data,
      sizeBytes: BigInt(data.length),
    });
  }
  if (source["type"] === "url") {
    return create(ImageBlockSchema, { path: String(source["url"] ?? "") });
  }
  throw new Error(`${where}: image source ${JSON.stringify(source["type"])} is not carried`);
}

function toolResult(block: AnthropicBlock, names: Map<string, string>, where: string): SessionEvent {
  const content = block["content"] ?? "";
  const parts: AnthropicBlock[] =
    typeof content === "string" ? [{ type: "text", text: content }] : (content as AnthropicBlock[]);
  const toolCallId = String(block["tool_use_id"] ?? "");
  const value = create(ToolResultSchema, {
    toolCallId,
    toolName: names.get(toolCallId) ?? "",
    content: parts.map((part, number) => contentBlock(part, `${where}.content[${number}]`)),
    isError: block["is_error"] === true,
  });
  return event({ case: "toolResult", value });
}

/** The rendered conversation: `system` only when one was logged. */
export interface Rendered {
  system?: string;
  messages: AnthropicMessage[];
}

/** The system text and messages of an append-only log. */
export function messagesFromEvents(events: Iterable<SessionEvent>): Rendered {
  return render(projectEvents(events));
}

/** A ready Messages API body for what BuildRequest answered (`maxTokens` defaults to the header's). */
export function requestBody(
  request: BuildRequestResponse,
  opts: { maxTokens?: number; stream?: boolean } = {},
): JsonObject {
  const config = request.config;
  const limit = opts.maxTokens ?? (config?.maxOutputTokens === undefined ? undefined : Number(config.maxOutputTokens));
  if (limit === undefined) {
    throw new Error("max_tokens: the Messages API requires it; pass it or log a header");
  }
  const rendered = render(request.messages);
  const body: JsonObject = { model: config?.model ?? "", max_tokens: limit };
  if (rendered.system !== undefined) {
    body["system"] = rendered.system;
  }
  body["messages"] = rendered.messages as unknown as JsonValue;
  if (request.tools.length > 0) {
    body["tools"] = tools(request.tools) as unknown as JsonValue;
  }
  addSettings(body, config, opts.stream);
  return body;
}

/** Anthropic tools of request/header tool declarations. */
export function tools(declared: ToolDeclaration[]): AnthropicTool[] {
  return declared.map((tool) => {
    const entry: AnthropicTool = { name: tool.name };
    if (tool.description) {
      entry.description = tool.description;
    }
    const schema: unknown = tool.inputSchemaJson ? JSON.parse(tool.inputSchemaJson) : null;
    entry.input_schema = schema ?? { type: "object" };
    return entry;
  });
}

function render(messages: Message[]): Rendered {
  const system: string[] = [];
  const rendered: { role: string; content: AnthropicBlock[] }[] = [];
  for (const message of messages) {
    let role = "user";
    let blocks: AnthropicBlock[];
    if (message.role === MessageRole.SYSTEM || message.role === MessageRole.DEVELOPER) {
      const text = message.content.map((b) => (b.block.case === "text" ? b.block.value.text : "")).join(JOIN);
      if (rendered.length === 0 || message.pinnedState) {
        system.push(text); // the pins always join the system text, never the messages
        continue;
      }
      blocks = [{ type: "text", text }]; // mid-conversation: user text
    } else if (message.role === MessageRole.ASSISTANT) {
      role = "assistant";
      blocks = message.content.map(encodeBlock);
    } else if (message.role === MessageRole.TOOL) {
      blocks = [toolResultBlock(message)];
    } else {
      blocks = message.content.map(encodeBlock);
    }
    const last = rendered[rendered.length - 1];
    if (last && last.role === "user" && role === "user") {
      last.content.push(...blocks);
    } else {
      rendered.push({ role, content: blocks });
    }
  }
  const result: Rendered = {
    messages: rendered.map((m) => ({
      role: m.role,
      content: m.role === "user" ? asText(toolResultsFirst(m.content)) : m.content,
    })),
  };
  if (system.length > 0) {
    result.system = system.join(JOIN);
  }
  return result;
}

// A user message's tool_result blocks before its other blocks, each kind in order: Anthropic
// requires the results to open the user message that follows a tool_use, and a system message or
// user text logged between the call and its result would otherwise come first.
function toolResultsFirst(blocks: AnthropicBlock[]): AnthropicBlock[] {
  return [...blocks.filter((b) => b.type === "tool_result"), ...blocks.filter((b) => b.type !== "tool_result")];
}

function toolResultBlock(message: Message): AnthropicBlock {
  const block: AnthropicBlock = {
    type: "tool_result",
    tool_use_id: message.toolCallId,
    content: asText(message.content.map(encodeBlock)),
  };
  if (message.isError) {
    block["is_error"] = true;
  }
  return block;
}

function encodeBlock(block: ContentBlock): AnthropicBlock {
  switch (block.block.case) {
    case "text":
      return { type: "text", text: block.block.value.text };
    case "reasoning": {
      const reasoning = block.block.value;
      if (!reasoning.text && reasoning.signature) {
        return { type: "redacted_thinking", data: reasoning.signature };
      }
      return { type: "thinking", thinking: reasoning.text, signature: reasoning.signature };
    }
    case "toolCall": {
      const call = block.block.value;
      const input: unknown = call.argumentsJson ? JSON.parse(call.argumentsJson) : {};
      return { type: "tool_use", id: call.id, name: call.name, input };
    }
    case "image": {
      const image = block.block.value;
      if (image.data.length > 0) {
        return {
          type: "image",
          source: { type: "base64", media_type: image.mediaType, data: base64Encode(image.data) },
        };
      }
      if (image.path) {
        return { type: "image", source: { type: "url", url: image.path } };
      }
      throw new Error(`image ${JSON.stringify(image.attachmentId || image.name || "?")} has no data`);
    }
    default:
      throw new Error("an empty content block has no Anthropic form");
  }
}

function asText(blocks: AnthropicBlock[]): string | AnthropicBlock[] {
  const only = blocks.length === 1 ? blocks[0] : undefined;
  return only && only.type === "text" ? String(only["text"]) : blocks;
}
