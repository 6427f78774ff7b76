package compactd

import (
	"encoding/json"

	v1 "compactd.dev/client/compactdv1"
)

// Builders for the events an agent runtime appends. Seq is left unset (the server assigns it);
// set EventId on the result for an idempotent retry.

// Text returns a text content block.
func Text(text string) *v1.ContentBlock {
	return &v1.ContentBlock{Block: &v1.ContentBlock_Text{Text: &v1.TextBlock{Text: text}}}
}

// ToolCallBlock returns an assistant tool-call block with JSON arguments.
func ToolCallBlock(id, name, argumentsJSON string) *v1.ContentBlock {
	return &v1.ContentBlock{Block: &v1.ContentBlock_ToolCall{
		ToolCall: &v1.ToolCallBlock{Id: id, Name: name, ArgumentsJson: argumentsJSON},
	}}
}

// JSON marshals tool arguments or schemas; it panics on values encoding/json cannot encode.
func JSON(v interface{}) string {
	data, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(data)
}

// SystemMessage returns a system/message.
func SystemMessage(text string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_SystemMessage{SystemMessage: &v1.SystemMessage{Text: text}}}
}

// UserMessage returns a user/message of user input.
func UserMessage(text string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_UserMessage{
		UserMessage: &v1.UserMessage{Content: []*v1.ContentBlock{Text(text)}},
	}}
}

// AssistantMessage returns an assistant/message: text (if any), then the tool calls.
func AssistantMessage(text string, toolCalls ...*v1.ContentBlock) *v1.SessionEvent {
	var content []*v1.ContentBlock
	if text != "" {
		content = append(content, Text(text))
	}
	content = append(content, toolCalls...)
	return &v1.SessionEvent{Body: &v1.SessionEvent_AssistantMessage{
		AssistantMessage: &v1.AssistantMessage{Content: content},
	}}
}

// ToolResult returns a tool/result answering the tool-call block toolCallID.
func ToolResult(toolCallID, toolName, text string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_ToolResult{ToolResult: &v1.ToolResult{
		ToolCallId: toolCallID, ToolName: toolName, Content: []*v1.ContentBlock{Text(text)},
	}}}
}

// TurnStart returns a turn/start (compaction is busy while the turn is open).
func TurnStart(turn int64) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_TurnStart{TurnStart: &v1.TurnStart{Turn: turn}}}
}

// TurnEnd returns a turn/end.
func TurnEnd(turn int64, reason string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_TurnEnd{TurnEnd: &v1.TurnEnd{Turn: turn, Reason: reason}}}
}

// StepStart returns a step/start.
func StepStart(turn, step int64) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_StepStart{StepStart: &v1.StepStart{Turn: turn, Step: step}}}
}

// StepEnd returns a step/end.
func StepEnd(turn, step int64) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_StepEnd{StepEnd: &v1.StepEnd{Turn: turn, Step: step}}}
}

// RequestHeader returns a request/header routing later requests to provider/model.
func RequestHeader(provider, model string, tools ...*v1.ToolDeclaration) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_RequestHeader{RequestHeader: &v1.RequestHeader{
		Config: &v1.RequestConfig{Provider: provider, Model: model},
		Tools:  tools,
		Reason: v1.HeaderReason_HEADER_REASON_INITIAL,
	}}}
}

// Pin returns a state/pin: text is in force under key (replacing the key's earlier pin) and is
// never summarized; every rebuilt request shows the pins in force right after the system head.
// key: 1-64 characters of [A-Za-z0-9._:/-] ("goal", "plan", ...).
func Pin(key, text string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_StatePin{StatePin: &v1.StatePin{Key: key, Text: text}}}
}

// ClearPin returns a state/pin that removes key from the pins in force.
func ClearPin(key string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_StatePin{StatePin: &v1.StatePin{Key: key, Clear: true}}}
}

// SubagentStart returns a subagent/start (in the parent's log): a sub-agent runs in session
// childSessionID, spawned by tool call toolCallID ("" if none), to do task (one line). Until its
// subagent/end, every checkpoint of the parent lists it as an open handle.
func SubagentStart(childSessionID, toolCallID, task string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_SubagentStart{SubagentStart: &v1.SubagentStart{
		ChildSessionId: childSessionID, ToolCallId: toolCallID, Task: task,
	}}}
}

// SubagentEnd returns a subagent/end (in the parent's log): the sub-agent of childSessionID
// ended with status; result summarizes it.
func SubagentEnd(childSessionID string, status v1.SubagentStatus, result string) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_SubagentEnd{SubagentEnd: &v1.SubagentEnd{
		ChildSessionId: childSessionID, Status: status, Result: result,
	}}}
}

// Route returns a provider/model route.
func Route(provider, model string) *v1.Route { return &v1.Route{Provider: provider, Model: model} }

// EventType returns the spec's type string of an event ("user/message", "compaction/start", ...).
func EventType(e *v1.SessionEvent) string {
	switch e.GetBody().(type) {
	case *v1.SessionEvent_SystemMessage:
		return "system/message"
	case *v1.SessionEvent_DeveloperMessage:
		return "developer/message"
	case *v1.SessionEvent_UserMessage:
		return "user/message"
	case *v1.SessionEvent_AssistantMessage:
		return "assistant/message"
	case *v1.SessionEvent_ToolResult:
		return "tool/result"
	case *v1.SessionEvent_TurnStart:
		return "turn/start"
	case *v1.SessionEvent_TurnEnd:
		return "turn/end"
	case *v1.SessionEvent_StepStart:
		return "step/start"
	case *v1.SessionEvent_StepEnd:
		return "step/end"
	case *v1.SessionEvent_ToolCall:
		return "tool/call"
	case *v1.SessionEvent_AssistantAttempt:
		return "assistant/attempt"
	case *v1.SessionEvent_RequestHeader:
		return "request/header"
	case *v1.SessionEvent_CompactionStart:
		return "compaction/start"
	case *v1.SessionEvent_CompactionPrune:
		return "compaction/prune"
	case *v1.SessionEvent_CompactionSummary:
		return "compaction/summary"
	case *v1.SessionEvent_CompactionEnd:
		return "compaction/end"
	case *v1.SessionEvent_ImageOffload:
		return "image/offload"
	case *v1.SessionEvent_SessionEndSeed:
		return "session/end-seed"
	case *v1.SessionEvent_LlmRetry:
		return "llm/retry"
	case *v1.SessionEvent_CompactionSummaryError:
		return "compaction/summary-error"
	case *v1.SessionEvent_StatePin:
		return "state/pin"
	case *v1.SessionEvent_SubagentStart:
		return "subagent/start"
	case *v1.SessionEvent_SubagentEnd:
		return "subagent/end"
	case *v1.SessionEvent_SessionFork:
		return "session/fork"
	}
	return ""
}
