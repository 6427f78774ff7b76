// Package convert holds what the openai and anthropic converters share: the turn and step
// brackets around imported messages, the projection of logged events to messages, and the small
// JSON helpers both wire formats need.
package convert

import (
	"encoding/json"
	"fmt"
	"strings"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
)

// PinsOpenTag and PinsCloseTag frame the pinned-state message of a rebuilt request
// (Message.PinnedState).
const (
	PinsOpenTag  = "<pinned-state>"
	PinsCloseTag = "</pinned-state>"
)

// IsPins reports whether text is exactly a pinned-state block.
func IsPins(text string) bool {
	return strings.HasPrefix(text, PinsOpenTag) && strings.HasSuffix(text, PinsCloseTag)
}

// WithoutPins returns a system text without the pinned-state block a rendered request put in
// it: pins are the runtime's task state, not the conversation's system prompt.
func WithoutPins(text string) string {
	start := strings.Index(text, PinsOpenTag)
	if start < 0 {
		return text
	}
	end := strings.Index(text[start:], PinsCloseTag)
	if end < 0 {
		return text
	}
	before := strings.TrimRight(text[:start], "\n")
	after := strings.TrimLeft(text[start+end+len(PinsCloseTag):], "\n")
	if before != "" && after != "" {
		return before + "\n\n" + after
	}
	return before + after
}

// Timeline collects imported events, adding turns and steps so the log is valid: a user message
// opens a turn (closing the previous one once the assistant answered in it), each assistant
// message is one step (step/start, the message, step/end), tool results, system and developer
// messages go where they come, and Finish closes the open turn (reason "imported") on request.
type Timeline struct {
	Events   []*v1.SessionEvent
	nextTurn int64
	turn     int64
	open     bool
	steps    int64
}

// NewTimeline starts a timeline whose first turn is firstTurn (1 when 0).
func NewTimeline(firstTurn int64) *Timeline {
	if firstTurn == 0 {
		firstTurn = 1
	}
	return &Timeline{nextTurn: firstTurn}
}

// Other appends a system, developer or tool message, or a log-only event, as is.
func (t *Timeline) Other(e *v1.SessionEvent) { t.Events = append(t.Events, e) }

// User appends user input, opening a turn first when needed.
func (t *Timeline) User(e *v1.SessionEvent) {
	if t.open && t.steps > 0 {
		t.Close("completed")
	}
	if !t.open {
		t.start()
	}
	t.Events = append(t.Events, e)
}

// Assistant appends one model reply as one step of the open turn.
func (t *Timeline) Assistant(e *v1.SessionEvent) {
	if !t.open {
		t.start()
	}
	t.steps++
	t.Events = append(t.Events, compactd.StepStart(t.turn, t.steps), e, compactd.StepEnd(t.turn, t.steps))
}

// Close closes the open turn, if any.
func (t *Timeline) Close(reason string) {
	if t.open {
		t.Events = append(t.Events, compactd.TurnEnd(t.turn, reason))
		t.open = false
	}
}

// Finish returns every event, the last turn closed unless keepOpen.
func (t *Timeline) Finish(keepOpen bool) []*v1.SessionEvent {
	if !keepOpen {
		t.Close("imported")
	}
	return t.Events
}

func (t *Timeline) start() {
	t.turn, t.steps, t.open = t.nextTurn, 0, true
	t.nextTurn++
	t.Events = append(t.Events, compactd.TurnStart(t.turn))
}

// Project returns the message a surface event shows the model, or nil for log-only events: as
// BuildRequest projects it, without the surface fold (no REPLACE, no offload, empties kept).
func Project(e *v1.SessionEvent) *v1.Message {
	switch body := e.GetBody().(type) {
	case *v1.SessionEvent_SystemMessage:
		return &v1.Message{Role: v1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: []*v1.ContentBlock{compactd.Text(body.SystemMessage.GetText())}}
	case *v1.SessionEvent_DeveloperMessage:
		return &v1.Message{Role: v1.MessageRole_MESSAGE_ROLE_DEVELOPER, Content: []*v1.ContentBlock{compactd.Text(body.DeveloperMessage.GetText())}}
	case *v1.SessionEvent_UserMessage:
		return &v1.Message{Role: v1.MessageRole_MESSAGE_ROLE_USER, Content: body.UserMessage.GetContent()}
	case *v1.SessionEvent_AssistantMessage:
		return &v1.Message{Role: v1.MessageRole_MESSAGE_ROLE_ASSISTANT, Content: body.AssistantMessage.GetContent()}
	case *v1.SessionEvent_ToolResult:
		r := body.ToolResult
		return &v1.Message{Role: v1.MessageRole_MESSAGE_ROLE_TOOL, Content: r.GetContent(),
			ToolCallId: r.GetToolCallId(), IsError: r.GetIsError(), Name: r.GetToolName()}
	}
	return nil
}

// Messages projects every surface event of events, in log order.
func Messages(events []*v1.SessionEvent) []*v1.Message {
	var messages []*v1.Message
	for _, e := range events {
		if m := Project(e); m != nil {
			messages = append(messages, m)
		}
	}
	return messages
}

// String returns m[key] as a string ("" when absent or not a string).
func String(m map[string]interface{}, key string) string {
	s, _ := m[key].(string)
	return s
}

// Object returns v as a JSON object, or an error naming where.
func Object(v interface{}, where string) (map[string]interface{}, error) {
	m, ok := v.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("%s: expected a JSON object, got %T", where, v)
	}
	return m, nil
}

// Array returns v as a JSON array of objects ([] for nil), or an error naming where.
func Array(v interface{}, where string) ([]map[string]interface{}, error) {
	if v == nil {
		return nil, nil
	}
	items, ok := v.([]interface{})
	if !ok {
		if typed, ok := v.([]map[string]interface{}); ok {
			return typed, nil
		}
		return nil, fmt.Errorf("%s: expected a JSON array, got %T", where, v)
	}
	objects := make([]map[string]interface{}, len(items))
	for i, item := range items {
		o, err := Object(item, fmt.Sprintf("%s[%d]", where, i))
		if err != nil {
			return nil, err
		}
		objects[i] = o
	}
	return objects, nil
}

// Compact returns v as compact JSON text (object keys in Go's sorted order, no HTML escaping).
func Compact(v interface{}) (string, error) {
	var out strings.Builder
	encoder := json.NewEncoder(&out)
	encoder.SetEscapeHTML(false)
	if err := encoder.Encode(v); err != nil {
		return "", err
	}
	return strings.TrimSuffix(out.String(), "\n"), nil
}

// Parse returns the JSON value of text (nil for "").
func Parse(text string) (interface{}, error) {
	if text == "" {
		return nil, nil
	}
	var v interface{}
	err := json.Unmarshal([]byte(text), &v)
	return v, err
}

// StepRuleViolations returns where events break the step rules (empty for a valid log): an
// assistant/message only inside an open step of an open turn, step/start with its turn open and
// no other step open, step/end matching the open step, turn/end with no step open, and each
// tool/result answering a call an earlier step made.
func StepRuleViolations(events []*v1.SessionEvent) []string {
	var problems []string
	var turn, step *[2]int64
	calls := map[string]bool{}
	for i, e := range events {
		switch body := e.GetBody().(type) {
		case *v1.SessionEvent_TurnStart:
			if turn != nil {
				problems = append(problems, fmt.Sprintf("%d: turn/start inside a turn", i))
			}
			turn = &[2]int64{body.TurnStart.GetTurn()}
		case *v1.SessionEvent_TurnEnd:
			if turn == nil || turn[0] != body.TurnEnd.GetTurn() || step != nil {
				problems = append(problems, fmt.Sprintf("%d: bad turn/end", i))
			}
			turn = nil
		case *v1.SessionEvent_StepStart:
			if turn == nil || turn[0] != body.StepStart.GetTurn() || step != nil {
				problems = append(problems, fmt.Sprintf("%d: bad step/start", i))
			}
			step = &[2]int64{body.StepStart.GetTurn(), body.StepStart.GetStep()}
		case *v1.SessionEvent_StepEnd:
			if step == nil || *step != [2]int64{body.StepEnd.GetTurn(), body.StepEnd.GetStep()} {
				problems = append(problems, fmt.Sprintf("%d: bad step/end", i))
			}
			step = nil
		case *v1.SessionEvent_AssistantMessage:
			if step == nil {
				problems = append(problems, fmt.Sprintf("%d: assistant/message outside a step", i))
			}
			for _, b := range body.AssistantMessage.GetContent() {
				if call := b.GetToolCall(); call != nil {
					calls[call.GetId()] = true
				}
			}
		case *v1.SessionEvent_ToolResult:
			if !calls[body.ToolResult.GetToolCallId()] {
				problems = append(problems, fmt.Sprintf("%d: tool/result without an earlier call", i))
			}
		}
	}
	return problems
}

// AddSettings sets the header's sampling settings and extra keys, and stream when not nil,
// in a request body.
func AddSettings(body map[string]interface{}, config *v1.RequestConfig, stream *bool) {
	if config != nil && config.Temperature != nil {
		body["temperature"] = config.GetTemperature()
	}
	if config != nil && config.TopP != nil {
		body["top_p"] = config.GetTopP()
	}
	if config.GetExtra() != nil {
		for key, value := range config.GetExtra().AsMap() {
			body[key] = value
		}
	}
	if stream != nil {
		body["stream"] = *stream
	}
}

// Declaration returns the tool declaration of m's name, description and m[schemaKey] (a JSON
// Schema, kept as compact JSON text); where names m in errors.
func Declaration(m map[string]interface{}, schemaKey, where string) (*v1.ToolDeclaration, error) {
	schema := ""
	if value, present := m[schemaKey]; present {
		var err error
		if schema, err = Compact(value); err != nil {
			return nil, fmt.Errorf("%s.%s: %w", where, schemaKey, err)
		}
	}
	return &v1.ToolDeclaration{Name: String(m, "name"), Description: String(m, "description"), InputSchemaJson: schema}, nil
}

// Int returns m[key] as an integer (0 when absent or not a number).
func Int(m map[string]interface{}, key string) int64 {
	switch v := m[key].(type) {
	case float64:
		return int64(v)
	case int:
		return int64(v)
	case int64:
		return v
	}
	return 0
}
