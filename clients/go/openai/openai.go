// Package openai converts between OpenAI chat completions and compactd: chat messages and tools
// to events (turns and steps added, so the log is valid), and BuildRequest answers to ready
// request bodies.
//
// The mapping is the Python client's (compactd_client.openai), both ways, so import then render
// gives the original messages: system and developer text; user text and image_url parts (data:
// URLs inline, other URLs as the image's path); each assistant message one step of a turn, with
// reasoning_content, text ("" kept) and tool calls exactly as sent; tool messages as tool/results;
// function tools as request/header declarations. Rendering follows compactd's wire encoding (the
// one its summary requests use), so a body built here is a byte-identical prefix of the summary
// request and the provider's prompt cache is reused. Messages are JSON objects as encoding/json
// decodes them (map[string]interface{}).
package openai

import (
	"encoding/base64"
	"fmt"
	"regexp"
	"strings"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"compactd.dev/client/internal/convert"
)

// Message is one chat-completions message as a JSON object.
type Message = map[string]interface{}

// Options configure EventsFromMessages.
type Options struct {
	// Tools are the request's tools; with Model they make a request/header.
	Tools []map[string]interface{}
	// Provider and Model are the route (no request/header when Model is empty).
	Provider, Model string
	// FirstTurn numbers the first turn opened (default 1).
	FirstTurn int64
	// KeepTurnOpen leaves the last turn open for the runtime to continue.
	KeepTurnOpen bool
}

const join = "\n\n"

var dataURL = regexp.MustCompile(`(?s)^data:([^;,]+);base64,(.*)$`)

// EventsFromMessages returns the events that log messages as a valid compactd log.
func EventsFromMessages(messages []Message, opts Options) ([]*v1.SessionEvent, error) {
	timeline := convert.NewTimeline(opts.FirstTurn)
	names := map[string]string{}
	var header *v1.SessionEvent
	if opts.Model != "" {
		tools, err := Declarations(opts.Tools)
		if err != nil {
			return nil, err
		}
		header = compactd.RequestHeader(opts.Provider, opts.Model, tools...)
	}
	for i, m := range messages {
		where := fmt.Sprintf("messages[%d]", i)
		role := convert.String(m, "role")
		if header != nil && role != "system" && role != "developer" {
			timeline.Other(header)
			header = nil
		}
		switch role {
		case "system":
			if convert.IsPins(text(m)) {
				continue // the pinned-state message of a rebuilt request: compactd renders it
			}
			timeline.Other(compactd.SystemMessage(text(m)))
		case "developer":
			timeline.Other(&v1.SessionEvent{Body: &v1.SessionEvent_DeveloperMessage{DeveloperMessage: &v1.DeveloperMessage{Text: text(m)}}})
		case "user":
			blocks, err := parts(m["content"], where)
			if err != nil {
				return nil, err
			}
			timeline.User(&v1.SessionEvent{Body: &v1.SessionEvent_UserMessage{UserMessage: &v1.UserMessage{Content: blocks}}})
		case "assistant":
			reply, err := assistant(m, where)
			if err != nil {
				return nil, err
			}
			for _, b := range reply.GetContent() {
				if call := b.GetToolCall(); call != nil {
					names[call.GetId()] = call.GetName()
				}
			}
			timeline.Assistant(&v1.SessionEvent{Body: &v1.SessionEvent_AssistantMessage{AssistantMessage: reply}})
		case "tool":
			blocks, err := parts(m["content"], where)
			if err != nil {
				return nil, err
			}
			id := convert.String(m, "tool_call_id")
			timeline.Other(&v1.SessionEvent{Body: &v1.SessionEvent_ToolResult{ToolResult: &v1.ToolResult{
				ToolCallId: id, ToolName: names[id], Content: blocks}}})
		default:
			return nil, fmt.Errorf("%s: role %q is not carried", where, role)
		}
	}
	if header != nil {
		timeline.Other(header)
	}
	return timeline.Finish(opts.KeepTurnOpen), nil
}

// Declarations returns request/header tool declarations of OpenAI function tools.
func Declarations(tools []map[string]interface{}) ([]*v1.ToolDeclaration, error) {
	var declared []*v1.ToolDeclaration
	for i, tool := range tools {
		function, ok := tool["function"].(map[string]interface{})
		if convert.String(tool, "type") != "function" || !ok {
			return nil, fmt.Errorf("tools[%d]: only function tools are carried", i)
		}
		declaration, err := convert.Declaration(function, "parameters", fmt.Sprintf("tools[%d].function", i))
		if err != nil {
			return nil, err
		}
		declared = append(declared, declaration)
	}
	return declared, nil
}

// AssistantEvent returns the assistant/message of a chat completion (its first choice), with
// the provider's usage (cached prompt tokens apart from the others).
func AssistantEvent(completion map[string]interface{}, provider string) (*v1.SessionEvent, error) {
	choices, err := convert.Array(completion["choices"], "choices")
	if err != nil || len(choices) == 0 {
		return nil, fmt.Errorf("choices: expected at least one choice")
	}
	message, err := convert.Object(choices[0]["message"], "choices[0].message")
	if err != nil {
		return nil, err
	}
	reply, err := assistant(message, "choices[0].message")
	if err != nil {
		return nil, err
	}
	reply.Provider, reply.Model = provider, convert.String(completion, "model")
	reply.StopReason = convert.String(choices[0], "finish_reason")
	if usage, ok := completion["usage"].(map[string]interface{}); ok {
		details, _ := usage["prompt_tokens_details"].(map[string]interface{})
		cached := convert.Int(details, "cached_tokens")
		reply.Usage = &v1.Usage{InputTokens: convert.Int(usage, "prompt_tokens") - cached, CacheReadTokens: cached,
			OutputTokens: convert.Int(usage, "completion_tokens")}
	}
	return &v1.SessionEvent{Body: &v1.SessionEvent_AssistantMessage{AssistantMessage: reply}}, nil
}

func text(m Message) string {
	switch content := m["content"].(type) {
	case string:
		return content
	case []interface{}:
		var texts []string
		for _, part := range content {
			if p, ok := part.(map[string]interface{}); ok {
				texts = append(texts, convert.String(p, "text"))
			}
		}
		return strings.Join(texts, join)
	}
	return ""
}

func parts(content interface{}, where string) ([]*v1.ContentBlock, error) {
	switch c := content.(type) {
	case nil:
		return nil, nil
	case string:
		return []*v1.ContentBlock{compactd.Text(c)}, nil
	}
	items, err := convert.Array(content, where+".content")
	if err != nil {
		return nil, err
	}
	var blocks []*v1.ContentBlock
	for i, part := range items {
		switch convert.String(part, "type") {
		case "text":
			blocks = append(blocks, compactd.Text(convert.String(part, "text")))
		case "image_url":
			image, _ := part["image_url"].(map[string]interface{})
			blocks = append(blocks, &v1.ContentBlock{Block: &v1.ContentBlock_Image{Image: imageOf(convert.String(image, "url"))}})
		default:
			return nil, fmt.Errorf("%s.content[%d]: part type %q is not carried", where, i, convert.String(part, "type"))
		}
	}
	return blocks, nil
}

func imageOf(url string) *v1.ImageBlock {
	match := dataURL.FindStringSubmatch(url)
	if match == nil {
		return &v1.ImageBlock{Path: url}
	}
	data, err := base64.StdEncoding.DecodeString(match[2])
	if err != nil {
		return &v1.ImageBlock{Path: url}
	}
	return &v1.ImageBlock{MediaType: match[1], Data: data, SizeBytes: int64(len(data))}
}

func assistant(m Message, where string) (*v1.AssistantMessage, error) {
	var blocks []*v1.ContentBlock
	if reasoning := convert.String(m, "reasoning_content"); reasoning != "" {
		blocks = append(blocks, &v1.ContentBlock{Block: &v1.ContentBlock_Reasoning{Reasoning: &v1.ReasoningBlock{Text: reasoning}}})
	}
	switch content := m["content"].(type) {
	case nil:
	case string:
		blocks = append(blocks, compactd.Text(content))
	default:
		items, err := convert.Array(content, where+".content")
		if err != nil {
			return nil, err
		}
		var kept []interface{}
		for _, part := range items {
			if convert.String(part, "type") != "refusal" {
				kept = append(kept, part)
			}
		}
		more, err := parts(kept, where)
		if err != nil {
			return nil, err
		}
		blocks = append(blocks, more...)
	}
	calls, err := convert.Array(m["tool_calls"], where+".tool_calls")
	if err != nil {
		return nil, err
	}
	for i, call := range calls {
		function, ok := call["function"].(map[string]interface{})
		kind := convert.String(call, "type")
		if !ok || (kind != "" && kind != "function") {
			return nil, fmt.Errorf("%s.tool_calls[%d]: not a function call", where, i)
		}
		blocks = append(blocks, compactd.ToolCallBlock(convert.String(call, "id"), convert.String(function, "name"),
			convert.String(function, "arguments")))
	}
	return &v1.AssistantMessage{Content: blocks}, nil
}

// MessagesFromEvents returns the chat messages of an append-only log's surface events.
func MessagesFromEvents(events []*v1.SessionEvent, includeReasoning bool) ([]Message, error) {
	return encodeAll(convert.Messages(events), BodyOptions{IncludeReasoning: includeReasoning})
}

// BodyOptions configure RequestBody and EncodeMessage.
type BodyOptions struct {
	// IncludeReasoning sends assistant reasoning back as reasoning_content (DeepSeek thinking).
	IncludeReasoning bool
	// DeveloperRole is the wire role of developer messages (default "developer").
	DeveloperRole string
	// Stream sets "stream" when not nil.
	Stream *bool
}

// RequestBody returns a ready chat-completions body for what BuildRequest answered.
func RequestBody(request *v1.BuildRequestResponse, opts BodyOptions) (map[string]interface{}, error) {
	messages, err := encodeAll(request.GetMessages(), opts)
	if err != nil {
		return nil, err
	}
	config := request.GetConfig()
	body := map[string]interface{}{"model": config.GetModel(), "messages": messages}
	if len(request.GetTools()) > 0 {
		tools, err := Tools(request.GetTools())
		if err != nil {
			return nil, err
		}
		body["tools"] = tools
	}
	if config != nil && config.MaxOutputTokens != nil {
		body["max_tokens"] = config.GetMaxOutputTokens()
	}
	convert.AddSettings(body, config, opts.Stream)
	return body, nil
}

// Tools returns OpenAI tools of request/header tool declarations.
func Tools(declared []*v1.ToolDeclaration) ([]map[string]interface{}, error) {
	var rendered []map[string]interface{}
	for _, tool := range declared {
		function := map[string]interface{}{"name": tool.GetName()}
		if tool.GetDescription() != "" {
			function["description"] = tool.GetDescription()
		}
		schema, err := convert.Parse(tool.GetInputSchemaJson())
		if err != nil {
			return nil, fmt.Errorf("tool %q: input schema: %w", tool.GetName(), err)
		}
		if schema == nil {
			schema = map[string]interface{}{"type": "object", "properties": map[string]interface{}{}}
		}
		function["parameters"] = schema
		rendered = append(rendered, map[string]interface{}{"type": "function", "function": function})
	}
	return rendered, nil
}

func encodeAll(messages []*v1.Message, opts BodyOptions) ([]Message, error) {
	encoded := make([]Message, 0, len(messages))
	for _, m := range messages {
		e, err := EncodeMessage(m, opts)
		if err != nil {
			return nil, err
		}
		encoded = append(encoded, e)
	}
	return encoded, nil
}

// EncodeMessage returns one compactd Message as a chat message (compactd's wire encoding).
func EncodeMessage(m *v1.Message, opts BodyOptions) (Message, error) {
	switch m.GetRole() {
	case v1.MessageRole_MESSAGE_ROLE_SYSTEM, v1.MessageRole_MESSAGE_ROLE_DEVELOPER:
		role := "system"
		if m.GetRole() == v1.MessageRole_MESSAGE_ROLE_DEVELOPER {
			role = opts.DeveloperRole
			if role == "" {
				role = "developer"
			}
		}
		return Message{"role": role, "content": strings.Join(texts(m.GetContent()), join)}, nil
	case v1.MessageRole_MESSAGE_ROLE_USER:
		content, err := content(m.GetContent(), false)
		return Message{"role": "user", "content": content}, err
	case v1.MessageRole_MESSAGE_ROLE_ASSISTANT:
		return encodeAssistant(m, opts.IncludeReasoning), nil
	case v1.MessageRole_MESSAGE_ROLE_TOOL:
		content, err := content(m.GetContent(), true)
		return Message{"role": "tool", "tool_call_id": m.GetToolCallId(), "content": content}, err
	}
	return nil, fmt.Errorf("message role %v has no chat role", m.GetRole())
}

func texts(blocks []*v1.ContentBlock) []string {
	out := make([]string, 0, len(blocks))
	for _, b := range blocks {
		out = append(out, b.GetText().GetText())
	}
	return out
}

func content(blocks []*v1.ContentBlock, allowEmpty bool) (interface{}, error) {
	allText := true
	for _, b := range blocks {
		if b.GetText() == nil {
			allText = false
		}
	}
	if allText && (len(blocks) > 0 || allowEmpty) {
		return strings.Join(texts(blocks), join), nil
	}
	parts := make([]interface{}, 0, len(blocks))
	for _, b := range blocks {
		switch block := b.GetBlock().(type) {
		case *v1.ContentBlock_Text:
			parts = append(parts, map[string]interface{}{"type": "text", "text": block.Text.GetText()})
		case *v1.ContentBlock_Image:
			url, err := ImageURL(block.Image)
			if err != nil {
				return nil, err
			}
			parts = append(parts, map[string]interface{}{"type": "image_url", "image_url": map[string]interface{}{"url": url}})
		default:
			return nil, fmt.Errorf("a user or tool message cannot carry %T", block)
		}
	}
	return parts, nil
}

// ImageURL returns a data: URL of an inline image, else its path (a URL the provider can fetch).
func ImageURL(image *v1.ImageBlock) (string, error) {
	if len(image.GetData()) > 0 {
		return "data:" + image.GetMediaType() + ";base64," + base64.StdEncoding.EncodeToString(image.GetData()), nil
	}
	if image.GetPath() != "" {
		return image.GetPath(), nil
	}
	return "", fmt.Errorf("image %q has no data and no URL", image.GetAttachmentId()+image.GetName())
}

func encodeAssistant(m *v1.Message, includeReasoning bool) Message {
	var text, reasoning []string
	var calls []interface{}
	for _, b := range m.GetContent() {
		switch block := b.GetBlock().(type) {
		case *v1.ContentBlock_Text:
			text = append(text, block.Text.GetText())
		case *v1.ContentBlock_Reasoning:
			reasoning = append(reasoning, block.Reasoning.GetText())
		case *v1.ContentBlock_ToolCall:
			call := block.ToolCall
			calls = append(calls, map[string]interface{}{"id": call.GetId(), "type": "function",
				"function": map[string]interface{}{"name": call.GetName(), "arguments": call.GetArgumentsJson()}})
		}
	}
	encoded := Message{"role": "assistant"}
	switch {
	case len(text) > 0:
		encoded["content"] = strings.Join(text, join)
	case len(calls) > 0:
		encoded["content"] = nil
	default:
		encoded["content"] = ""
	}
	if includeReasoning && len(reasoning) > 0 {
		encoded["reasoning_content"] = strings.Join(reasoning, join)
	}
	if len(calls) > 0 {
		encoded["tool_calls"] = calls
	}
	return encoded
}
