// OpenAI chat completions <-> compactd: messages and tools to events, BuildRequest to a body.
//
// The mapping is the Python client's (compactd_client.openai), both ways, so import then render
// gives the original messages: system/developer text; user text and image_url parts (data: URLs
// inline, other URLs as the image's path); each assistant message one step of a turn, with
// reasoning_content, text ("" kept) and tool calls exactly as sent; tool messages as tool/results;
// function tools as request/header declarations. Rendering follows compactd's wire encoding (the
// one its summary requests use), so a body built here is a byte-identical prefix of the summary
// request and the provider's prompt cache is reused.

import { create, type JsonObject } from "@bufbuild/protobuf";
import { base64Decode, base64Encode } from "@bufbuild/protobuf/wire";
import {
  AssistantMessageSchema,
  type ContentBlock,
  ContentBlockSchema,
  DeveloperMessageSchema,
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
import { addSettings, isPins, projectEvents } from "./project.js";
import { Timeline } from "./timeline.js";

/** A chat-completions content part. */
export interface ChatPart {
  type: string;
  text?: string;
  image_url?: { url: string; detail?: string };
  [key: string]: unknown;
}

/** A chat-completions tool call. */
export interface ChatToolCall {
  id: string;
  type: string;
  function: { name: string; arguments: string };
}

/** A chat-completions message. */
export interface ChatMessage {
  role: string;
  content?: string | ChatPart[] | null;
  tool_calls?: ChatToolCall[];
  tool_call_id?: string;
  reasoning_content?: string;
  [key: string]: unknown;
}

/** A chat-completions function tool. */
export interface ChatTool {
  type: string;
  function: { name: string; description?: string; parameters?: unknown; [key: string]: unknown };
}

/** Options of eventsFromMessages. */
export interface ImportOptions {
  /** The request's tools; with provider/model they make a request/header. */
  tools?: ChatTool[];
  provider?: string;
  /** The route's model (empty: no request/header). */
  model?: string;
  /** Number of the first turn opened (default 1). */
  firstTurn?: number;
  /** Close the last turn with turn/end "imported" (default true). */
  closeTurn?: boolean;
}

const JOIN = "\n\n";
const DATA_URL = /^data:([^;,]+);base64,(.*)$/s;

/** The events that log OpenAI chat `messages` as a valid compactd log (turns and steps added). */
export function eventsFromMessages(messages: ChatMessage[], opts: ImportOptions = {}): SessionEvent[] {
  const timeline = new Timeline(opts.firstTurn ?? 1);
  const names = new Map<string, string>();
  let header: SessionEvent | undefined = opts.model
    ? requestHeader(opts.provider ?? "", opts.model, { tools: declarations(opts.tools ?? []) })
    : undefined;
  messages.forEach((message, index) => {
    const where = `messages[${index}]`;
    if (header && message.role !== "system" && message.role !== "developer") {
      timeline.other(header);
      header = undefined;
    }
    switch (message.role) {
      case "system":
        if (isPins(text(message))) {
          break; // the pinned-state message of a rebuilt request: compactd renders it
        }
        timeline.other(event({ case: "systemMessage", value: create(SystemMessageSchema, { text: text(message) }) }));
        break;
      case "developer":
        timeline.other(
          event({ case: "developerMessage", value: create(DeveloperMessageSchema, { text: text(message) }) }),
        );
        break;
      case "user":
        timeline.user(
          event({ case: "userMessage", value: create(UserMessageSchema, { content: parts(message.content, where) }) }),
        );
        break;
      case "assistant": {
        const reply = assistant(message, where);
        for (const block of reply.content) {
          if (block.block.case === "toolCall") {
            names.set(block.block.value.id, block.block.value.name);
          }
        }
        timeline.assistant(event({ case: "assistantMessage", value: reply }));
        break;
      }
      case "tool": {
        const toolCallId = message.tool_call_id ?? "";
        const value = create(ToolResultSchema, {
          toolCallId,
          toolName: names.get(toolCallId) ?? "",
          content: parts(message.content, where),
        });
        timeline.other(event({ case: "toolResult", value }));
        break;
      }
      default:
        throw new Error(`${where}: role ${JSON.stringify(message.role)} is not carried`);
    }
  });
  if (header) {
    timeline.other(header);
  }
  return timeline.finish(opts.closeTurn ?? true);
}

/** request/header tool declarations of OpenAI function tools. */
export function declarations(tools: ChatTool[]): ToolDeclaration[] {
  return tools.map((tool, index) => {
    if (tool.type !== "function" || typeof tool.function !== "object") {
      throw new Error(`tools[${index}]: only function tools are carried`);
    }
    const schema = tool.function.parameters;
    return create(ToolDeclarationSchema, {
      name: tool.function.name,
      description: tool.function.description ?? "",
      inputSchemaJson: schema === undefined ? "" : JSON.stringify(schema),
    });
  });
}

/** The assistant/message of a chat completion (its first choice), with its usage. */
export function assistantEvent(completion: JsonObject, opts: { provider?: string } = {}): SessionEvent {
  const choices = completion["choices"] as JsonObject[];
  const choice = choices[0] as JsonObject;
  const reply = assistant(choice["message"] as unknown as ChatMessage, "choices[0].message");
  reply.provider = opts.provider ?? "";
  reply.model = String(completion["model"] ?? "");
  reply.stopReason = String(choice["finish_reason"] ?? "");
  const usage = completion["usage"] as JsonObject | undefined;
  if (usage) {
    const details = (usage["prompt_tokens_details"] ?? {}) as JsonObject;
    const completionDetails = (usage["completion_tokens_details"] ?? {}) as JsonObject;
    const cached = Number(details["cached_tokens"] ?? 0);
    reply.usage = create(UsageSchema, {
      inputTokens: BigInt(Number(usage["prompt_tokens"] ?? 0) - cached),
      cacheReadTokens: BigInt(cached),
      outputTokens: BigInt(Number(usage["completion_tokens"] ?? 0)),
      reasoningTokens: BigInt(Number(completionDetails["reasoning_tokens"] ?? 0)),
    });
  }
  return event({ case: "assistantMessage", value: reply });
}

function event(body: SessionEvent["body"]): SessionEvent {
  return create(SessionEventSchema, { body });
}

function text(message: ChatMessage): string {
  const content = message.content;
  if (Array.isArray(content)) {
    return content.map((part) => part.text ?? "").join(JOIN);
  }
  return content ?? "";
}

function parts(content: ChatMessage["content"], where: string): ContentBlock[] {
  if (content === null || content === undefined) {
    return [];
  }
  if (typeof content === "string") {
    return [textBlock(content)];
  }
  return content.map((part, index) => {
    if (part.type === "text") {
      return textBlock(part.text ?? "");
    }
    if (part.type === "image_url" && part.image_url) {
      return create(ContentBlockSchema, { block: { case: "image", value: image(part.image_url.url) } });
    }
    throw new Error(`${where}.content[${index}]: part type ${JSON.stringify(part.type)} is not carried`);
  });
}

function image(url: string): ImageBlock {
  const inline = DATA_URL.exec(url);
  if (!inline) {
    return create(ImageBlockSchema, { path: url });
  }
  const data = base64Decode(inline[2] ?? "");
  return create(ImageBlockSchema, { mediaType: inline[1] ?? "", data, sizeBytes: BigInt(data.length) });
}

function assistant(message: ChatMessage, where: string) {
  const content: ContentBlock[] = [];
  if (typeof message.reasoning_content === "string" && message.reasoning_content) {
    content.push(
      create(ContentBlockSchema, { block: { case: "reasoning", value: { text: message.reasoning_content } } }),
    );
  }
  if (Array.isArray(message.content)) {
    content.push(
      ...parts(
        message.content.filter((part) => part.type !== "refusal"),
        where,
      ),
    );
  } else if (message.content !== null && message.content !== undefined) {
    content.push(textBlock(message.content));
  }
  (message.tool_calls ?? []).forEach((call, index) => {
    if ((call.type ?? "function") !== "function" || typeof call.function !== "object") {
      throw new Error(`${where}.tool_calls[${index}]: not a function call`);
    }
    const value = { id: call.id, name: call.function.name, argumentsJson: call.function.arguments ?? "" };
    content.push(create(ContentBlockSchema, { block: { case: "toolCall", value } }));
  });
  return create(AssistantMessageSchema, { content });
}

/** The chat messages of an append-only log's surface events. */
export function messagesFromEvents(
  events: Iterable<SessionEvent>,
  opts: { includeReasoning?: boolean } = {},
): ChatMessage[] {
  return projectEvents(events).map((message) => encodeMessage(message, opts));
}

/** Options of requestBody. */
export interface BodyOptions {
  /** Send assistant reasoning back as reasoning_content (DeepSeek thinking with tools). */
  includeReasoning?: boolean;
  /** Wire role of developer messages (default "developer"). */
  developerRole?: string;
  stream?: boolean;
}

/** A ready chat-completions body for what BuildRequest answered. */
export function requestBody(request: BuildRequestResponse, opts: BodyOptions = {}): JsonObject {
  const config = request.config;
  const body: JsonObject = {
    model: config?.model ?? "",
    messages: request.messages.map((message) => encodeMessage(message, opts)) as unknown as JsonObject[],
  };
  if (request.tools.length > 0) {
    body["tools"] = tools(request.tools) as unknown as JsonObject[];
  }
  if (config?.maxOutputTokens !== undefined) {
    body["max_tokens"] = Number(config.maxOutputTokens);
  }
  addSettings(body, config, opts.stream);
  return body;
}

/** OpenAI tools of request/header tool declarations. */
export function tools(declared: ToolDeclaration[]): ChatTool[] {
  return declared.map((tool) => {
    const fn: ChatTool["function"] = { name: tool.name };
    if (tool.description) {
      fn.description = tool.description;
    }
    const schema: unknown = tool.inputSchemaJson ? JSON.parse(tool.inputSchemaJson) : null;
    fn.parameters = schema ?? { type: "object", properties: {} };
    return { type: "function", function: fn };
  });
}

/** One compactd Message as a chat message (compactd's wire encoding). */
export function encodeMessage(message: Message, opts: BodyOptions = {}): ChatMessage {
  switch (message.role) {
    case MessageRole.SYSTEM:
    case MessageRole.DEVELOPER: {
      const role = message.role === MessageRole.SYSTEM ? "system" : (opts.developerRole ?? "developer");
      return { role, content: texts(message.content).join(JOIN) };
    }
    case MessageRole.USER:
      return { role: "user", content: content(message.content, false) };
    case MessageRole.ASSISTANT:
      return encodeAssistant(message, opts.includeReasoning ?? false);
    case MessageRole.TOOL:
      return { role: "tool", tool_call_id: message.toolCallId, content: content(message.content, true) };
    default:
      throw new Error(`message role ${message.role} has no chat role`);
  }
}

function texts(blocks: ContentBlock[]): string[] {
  return blocks.map((block) => (block.block.case === "text" ? block.block.value.text : ""));
}

function content(blocks: ContentBlock[], allowEmpty: boolean): string | ChatPart[] {
  if (blocks.every((block) => block.block.case === "text") && (blocks.length > 0 || allowEmpty)) {
    return texts(blocks).join(JOIN);
  }
  return blocks.map((block): ChatPart => {
    if (block.block.case === "text") {
      return { type: "text", text: block.block.value.text };
    }
    if (block.block.case === "image") {
      return { type: "image_url", image_url: { url: imageUrl(block.block.value) } };
    }
    throw new Error(`a user or tool message cannot carry ${block.block.case ?? "an empty block"}`);
  });
}

/** A data: URL of an inline image, else its path (a URL the provider can fetch). */
export function imageUrl(image: ImageBlock): string {
  if (image.data.length > 0) {
    return `data:${image.mediaType};base64,${base64Encode(image.data)}`;
  }
  if (image.path) {
    return image.path;
  }
  throw new Error(`image ${JSON.stringify(image.attachmentId || image.name || "?")} has no data and no URL`);
}

function encodeAssistant(message: Message, includeReasoning: boolean): ChatMessage {
  const text: string[] = [];
  const reasoning: string[] = [];
  const calls: ChatToolCall[] = [];
  for (const block of message.content) {
    if (block.block.case === "text") {
      text.push(block.block.value.text);
    } else if (block.block.case === "reasoning") {
      reasoning.push(block.block.value.text);
    } else if (block.block.case === "toolCall") {
      const call = block.block.value;
      calls.push({ id: call.id, type: "function", function: { name: call.name, arguments: call.argumentsJson } });
    }
  }
  const encoded: ChatMessage = {
    role: "assistant",
    content: text.length > 0 ? text.join(JOIN) : calls.length > 0 ? null : "",
  };
  if (includeReasoning && reasoning.length > 0) {
    encoded.reasoning_content = reasoning.join(JOIN);
  }
  if (calls.length > 0) {
    encoded.tool_calls = calls;
  }
  return encoded;
}
