// Package anthropic converts between the Anthropic Messages API and compactd: messages and tools
// to events (turns and steps added, so the log is valid), and BuildRequest answers to ready
// request bodies.
//
// The mapping is the Python client's (compactd_client.anthropic), both ways, so import then
// render gives the original messages: system text; a user message's tool_result blocks become
// tool/results, the rest one user/message (consecutive user-side messages render back as one
// user message, tool results first, also after a system message logged between a call and its
// result); each assistant message is one step of a turn with thinking
// (signed; redacted_thinking as a reasoning block holding only its data), text and tool_use
// blocks in order; base64 images inline, url images as the path. A user message or tool result
// that is one text block renders as a string. Thinking blocks are always sent back. Messages are
// JSON objects as encoding/json decodes them (map[string]interface{}).
package anthropic

import (
	"encoding/base64"
	"fmt"
	"strings"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"compactd.dev/client/internal/convert"
)

// Message is one Messages API message as a JSON object.
type Message = map[string]interface{}

// Options configure EventsFromMessages.
type Options struct {
	// System is the request's system prompt: a string or text blocks.
	System interface{}
	// Tools are the request's tools; with Model they make a request/header.
	Tools []map[string]interface{}
	// Provider is the route's provider (default "anthropic"); no header when Model is empty.
	Provider, Model string
	// FirstTurn numbers the first turn opened (default 1).
	FirstTurn int64
	// KeepTurnOpen leaves the last turn open for the runtime to continue.
	KeepTurnOpen bool
}

const join = "\n\n"

// EventsFromMessages returns the events that log an Anthropic conversation as a valid log.
func EventsFromMessages(messages []Message, opts Options) ([]*v1.SessionEvent, error) {
	timeline := convert.NewTimeline(opts.FirstTurn)
	system := ""
	switch value := opts.System.(type) {
	case nil:
	case string:
		system = value
	default:
		blocks, err := convert.Array(value, "system")
		if err != nil {
			return nil, err
		}
		var texts []string
		for _, b := range blocks {
			texts = append(texts, convert.String(b, "text"))
		}
		system = strings.Join(texts, join)
	}
	// A rebuilt request's pins are not the system prompt: compactd renders them.
	if kept := convert.WithoutPins(system); opts.System != nil && (kept != "" || kept == system) {
		timeline.Other(compactd.SystemMessage(kept))
	}
	if opts.Model != "" {
		provider := opts.Provider
		if provider == "" {
			provider = "anthropic"
		}
		tools, err := Declarations(opts.Tools)
		if err != nil {
			return nil, err
		}
		timeline.Other(compactd.RequestHeader(provider, opts.Model, tools...))
	}
	names := map[string]string{}
	for i, m := range messages {
		where := fmt.Sprintf("messages[%d]", i)
		blocks, err := blocksOf(m["content"], where)
		if err != nil {
			return nil, err
		}
		switch convert.String(m, "role") {
		case "assistant":
			reply, err := assistant(blocks, where)
			if err != nil {
				return nil, err
			}
			for _, b := range reply.GetContent() {
				if call := b.GetToolCall(); call != nil {
					names[call.GetId()] = call.GetName()
				}
			}
			timeline.Assistant(&v1.SessionEvent{Body: &v1.SessionEvent_AssistantMessage{AssistantMessage: reply}})
		case "user":
			var rest []*v1.ContentBlock
			for n, b := range blocks {
				at := fmt.Sprintf("%s.content[%d]", where, n)
				if convert.String(b, "type") == "tool_result" {
					result, err := toolResult(b, names, at)
					if err != nil {
						return nil, err
					}
					timeline.Other(result)
					continue
				}
				block, err := contentBlock(b, at)
				if err != nil {
					return nil, err
				}
				rest = append(rest, block)
			}
			if len(rest) > 0 {
				timeline.User(&v1.SessionEvent{Body: &v1.SessionEvent_UserMessage{UserMessage: &v1.UserMessage{Content: rest}}})
			}
		default:
			return nil, fmt.Errorf("%s: role %q is not carried", where, convert.String(m, "role"))
		}
	}
	return timeline.Finish(opts.KeepTurnOpen), nil
}

func blocksOf(content interface{}, where string) ([]map[string]interface{}, error) {
	if text, ok := content.(string); ok {
		return []map[string]interface{}{{"type": "text", "text": text}}, nil
	}
	return convert.Array(content, where+".content")
}

// Declarations returns request/header tool declarations of Anthropic client tools.
func Declarations(tools []map[string]interface{}) ([]*v1.ToolDeclaration, error) {
	var declared []*v1.ToolDeclaration
	for i, tool := range tools {
		declaration, err := convert.Declaration(tool, "input_schema", fmt.Sprintf("tools[%d]", i))
		if err != nil {
			return nil, err
		}
		declared = append(declared, declaration)
	}
	return declared, nil
}

// AssistantEvent returns the assistant/message of a Messages API response, with its usage.
func AssistantEvent(reply map[string]interface{}, provider string) (*v1.SessionEvent, error) {
	blocks, err := convert.Array(reply["content"], "content")
	if err != nil {
		return nil, err
	}
	message, err := assistant(blocks, "")
	if err != nil {
		return nil, err
	}
	if provider == "" {
		provider = "anthropic"
	}
	message.Provider, message.Model = provider, convert.String(reply, "model")
	message.StopReason = convert.String(reply, "stop_reason")
	if usage, ok := reply["usage"].(map[string]interface{}); ok {
		message.Usage = &v1.Usage{InputTokens: convert.Int(usage, "input_tokens"), OutputTokens: convert.Int(usage, "output_tokens"),
			CacheReadTokens: convert.Int(usage, "cache_read_input_tokens"), CacheWriteTokens: convert.Int(usage, "cache_creation_input_tokens")}
	}
	return &v1.SessionEvent{Body: &v1.SessionEvent_AssistantMessage{AssistantMessage: message}}, nil
}

func assistant(blocks []map[string]interface{}, where string) (*v1.AssistantMessage, error) {
	content := make([]*v1.ContentBlock, 0, len(blocks))
	for n, b := range blocks {
		block, err := contentBlock(b, fmt.Sprintf("%s.content[%d]", where, n))
		if err != nil {
			return nil, err
		}
		content = append(content, block)
	}
	return &v1.AssistantMessage{Content: content}, nil
}

func contentBlock(b map[string]interface{}, where string) (*v1.ContentBlock, error) {
	switch kind := convert.String(b, "type"); kind {
	case "text":
		return compactd.Text(convert.String(b, "text")), nil
	case "thinking":
		return &v1.ContentBlock{Block: &v1.ContentBlock_Reasoning{Reasoning: &v1.ReasoningBlock{
			Text: convert.String(b, "thinking"), Signature: convert.String(b, "signature")}}}, nil
	case "redacted_thinking":
		return &v1.ContentBlock{Block: &v1.ContentBlock_Reasoning{Reasoning: &v1.ReasoningBlock{
			Signature: convert.String(b, "data")}}}, nil
	case "tool_use":
		input, present := b["input"]
		if !present {
			input = map[string]interface{}{}
		}
		arguments, err := convert.Compact(input)
		if err != nil {
			return nil, fmt.Errorf("%s.input: %w", where, err)
		}
		return compactd.ToolCallBlock(convert.String(b, "id"), convert.String(b, "name"), arguments), nil
	case "image":
		source, _ := b["source"].(map[string]interface{})
		switch convert.String(source, "type") {
		case "base64":
			data, err := base64.StdEncoding.DecodeString(convert.String(source, "data"))
			if err != nil {
				return nil, fmt.Errorf("%s.source.data: %w", where, err)
			}
			return &v1.ContentBlock{Block: &v1.ContentBlock_Image{Image: &v1.ImageBlock{
				MediaType: convert.String(source, "media_type"), Data: data, SizeBytes: int64(len(data))}}}, nil
		case "url":
			return &v1.ContentBlock{Block: &v1.ContentBlock_Image{Image: &v1.ImageBlock{Path: convert.String(source, "url")}}}, nil
		}
		return nil, fmt.Errorf("%s: image source %q is not carried", where, convert.String(source, "type"))
	default:
		return nil, fmt.Errorf("%s: block type %q is not carried", where, kind)
	}
}

func toolResult(b map[string]interface{}, names map[string]string, where string) (*v1.SessionEvent, error) {
	content, present := b["content"]
	if !present {
		content = ""
	}
	parts, err := blocksOf(content, where)
	if err != nil {
		return nil, err
	}
	blocks := make([]*v1.ContentBlock, 0, len(parts))
	for n, part := range parts {
		block, err := contentBlock(part, fmt.Sprintf("%s.content[%d]", where, n))
		if err != nil {
			return nil, err
		}
		blocks = append(blocks, block)
	}
	id := convert.String(b, "tool_use_id")
	isError, _ := b["is_error"].(bool)
	return &v1.SessionEvent{Body: &v1.SessionEvent_ToolResult{ToolResult: &v1.ToolResult{
		ToolCallId: id, ToolName: names[id], Content: blocks, IsError: isError}}}, nil
}

// Rendered is a conversation as the Messages API takes it; System is "" when none was logged.
type Rendered struct {
	System   string
	Messages []Message
}

// MessagesFromEvents returns the system text and messages of an append-only log.
func MessagesFromEvents(events []*v1.SessionEvent) (Rendered, error) {
	return render(convert.Messages(events))
}

// RequestBody returns a ready Messages API body for what BuildRequest answered; maxTokens 0
// takes the header's max_output_tokens (the API requires one).
func RequestBody(request *v1.BuildRequestResponse, maxTokens int64, stream *bool) (map[string]interface{}, error) {
	config := request.GetConfig()
	if maxTokens == 0 && config != nil && config.MaxOutputTokens != nil {
		maxTokens = config.GetMaxOutputTokens()
	}
	if maxTokens == 0 {
		return nil, fmt.Errorf("max_tokens: the Messages API requires it; pass it or log a header")
	}
	rendered, err := render(request.GetMessages())
	if err != nil {
		return nil, err
	}
	body := map[string]interface{}{"model": config.GetModel(), "max_tokens": maxTokens, "messages": rendered.Messages}
	if rendered.System != "" {
		body["system"] = rendered.System
	}
	if len(request.GetTools()) > 0 {
		tools, err := Tools(request.GetTools())
		if err != nil {
			return nil, err
		}
		body["tools"] = tools
	}
	convert.AddSettings(body, config, stream)
	return body, nil
}

// Tools returns Anthropic tools of request/header tool declarations.
func Tools(declared []*v1.ToolDeclaration) ([]map[string]interface{}, error) {
	var rendered []map[string]interface{}
	for _, tool := range declared {
		entry := map[string]interface{}{"name": tool.GetName()}
		if tool.GetDescription() != "" {
			entry["description"] = tool.GetDescription()
		}
		schema, err := convert.Parse(tool.GetInputSchemaJson())
		if err != nil {
			return nil, fmt.Errorf("tool %q: input schema: %w", tool.GetName(), err)
		}
		if schema == nil {
			schema = map[string]interface{}{"type": "object"}
		}
		entry["input_schema"] = schema
		rendered = append(rendered, entry)
	}
	return rendered, nil
}

func render(messages []*v1.Message) (Rendered, error) {
	var system []string
	type pending struct {
		role    string
		content []interface{}
	}
	var rendered []*pending
	for _, m := range messages {
		role := "user"
		var blocks []interface{}
		switch m.GetRole() {
		case v1.MessageRole_MESSAGE_ROLE_SYSTEM, v1.MessageRole_MESSAGE_ROLE_DEVELOPER:
			var texts []string
			for _, b := range m.GetContent() {
				texts = append(texts, b.GetText().GetText())
			}
			if len(rendered) == 0 || m.GetPinnedState() { // pins always join the system text
				system = append(system, strings.Join(texts, join))
				continue
			}
			blocks = []interface{}{map[string]interface{}{"type": "text", "text": strings.Join(texts, join)}}
		case v1.MessageRole_MESSAGE_ROLE_ASSISTANT:
			role = "assistant"
			encoded, err := encodeBlocks(m.GetContent())
			if err != nil {
				return Rendered{}, err
			}
			blocks = encoded
		case v1.MessageRole_MESSAGE_ROLE_TOOL:
			encoded, err := encodeBlocks(m.GetContent())
			if err != nil {
				return Rendered{}, err
			}
			result := map[string]interface{}{"type": "tool_result", "tool_use_id": m.GetToolCallId(), "content": asText(encoded)}
			if m.GetIsError() {
				result["is_error"] = true
			}
			blocks = []interface{}{result}
		default:
			encoded, err := encodeBlocks(m.GetContent())
			if err != nil {
				return Rendered{}, err
			}
			blocks = encoded
		}
		if n := len(rendered); n > 0 && role == "user" && rendered[n-1].role == "user" {
			rendered[n-1].content = append(rendered[n-1].content, blocks...)
		} else {
			rendered = append(rendered, &pending{role, blocks})
		}
	}
	out := Rendered{System: strings.Join(system, join), Messages: make([]Message, 0, len(rendered))}
	for _, p := range rendered {
		var content interface{} = p.content
		if p.role == "user" {
			content = asText(toolResultsFirst(p.content))
		}
		out.Messages = append(out.Messages, Message{"role": p.role, "content": content})
	}
	return out, nil
}

// toolResultsFirst puts a user message's tool_result blocks before its other blocks, each kind in
// order: Anthropic requires the results to open the user message that follows a tool_use, and a
// system message or user text logged between the call and its result would otherwise come first.
func toolResultsFirst(blocks []interface{}) []interface{} {
	results := make([]interface{}, 0, len(blocks))
	var rest []interface{}
	for _, b := range blocks {
		if m, ok := b.(map[string]interface{}); ok && m["type"] == "tool_result" {
			results = append(results, b)
		} else {
			rest = append(rest, b)
		}
	}
	return append(results, rest...)
}

func encodeBlocks(blocks []*v1.ContentBlock) ([]interface{}, error) {
	encoded := make([]interface{}, 0, len(blocks))
	for _, b := range blocks {
		switch block := b.GetBlock().(type) {
		case *v1.ContentBlock_Text:
			encoded = append(encoded, map[string]interface{}{"type": "text", "text": block.Text.GetText()})
		case *v1.ContentBlock_Reasoning:
			r := block.Reasoning
			if r.GetText() == "" && r.GetSignature() != "" {
				encoded = append(encoded, map[string]interface{}{"type": "redacted_thinking", "data": r.GetSignature()})
			} else {
				encoded = append(encoded, map[string]interface{}{"type": "thinking", "thinking": r.GetText(), "signature": r.GetSignature()})
			}
		case *v1.ContentBlock_ToolCall:
			call := block.ToolCall
			input, err := convert.Parse(call.GetArgumentsJson())
			if err != nil {
				return nil, fmt.Errorf("tool call %q: arguments: %w", call.GetId(), err)
			}
			if input == nil {
				input = map[string]interface{}{}
			}
			encoded = append(encoded, map[string]interface{}{"type": "tool_use", "id": call.GetId(), "name": call.GetName(), "input": input})
		case *v1.ContentBlock_Image:
			image := block.Image
			var source map[string]interface{}
			switch {
			case len(image.GetData()) > 0:
				source = map[string]interface{}{"type": "base64", "media_type": image.GetMediaType(),
					"data": base64.StdEncoding.EncodeToString(image.GetData())}
			case image.GetPath() != "":
				source = map[string]interface{}{"type": "url", "url": image.GetPath()}
			default:
				return nil, fmt.Errorf("image %q has no data", image.GetAttachmentId()+image.GetName())
			}
			encoded = append(encoded, map[string]interface{}{"type": "image", "source": source})
		default:
			return nil, fmt.Errorf("an empty content block has no Anthropic form")
		}
	}
	return encoded, nil
}

func asText(blocks []interface{}) interface{} {
	if len(blocks) == 1 {
		if b, ok := blocks[0].(map[string]interface{}); ok && b["type"] == "text" {
			return b["text"]
		}
	}
	return blocks
}
