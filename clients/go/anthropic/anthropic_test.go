package anthropic_test

import (
	"encoding/json"
	"reflect"
	"testing"

	"compactd.dev/client/anthropic"
	"compactd.dev/client/compactd"
	"compactd.dev/client/compactdv1"
	"compactd.dev/client/internal/convert"
	"compactd.dev/client/internal/transcripts"
)

func TestImportThenRenderGivesEveryTranscriptsMessages(t *testing.T) {
	records := transcripts.Load(t, "anthropic")
	if len(records) < 4 {
		t.Fatalf("only %d transcripts", len(records))
	}
	for _, r := range records {
		events, err := anthropic.EventsFromMessages(r.Messages, anthropic.Options{Model: "claude"})
		if err != nil {
			t.Fatalf("%s: %v", r.Source, err)
		}
		if problems := convert.StepRuleViolations(events); len(problems) > 0 {
			t.Fatalf("%s: %v", r.Source, problems)
		}
		rendered, err := anthropic.MessagesFromEvents(events)
		if err != nil {
			t.Fatalf("%s: %v", r.Source, err)
		}
		if rendered.System != "" {
			t.Fatalf("%s: a system prompt appeared", r.Source)
		}
		if got, want := transcripts.Normalized(t, rendered.Messages), transcripts.Normalized(t, r.Messages); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: the rendered messages differ from the transcript's", r.Source)
		}
	}
}

func TestToolResultsAndTextOfOneUserMessageRenderBackTogether(t *testing.T) {
	var messages []map[string]interface{}
	_ = json.Unmarshal([]byte(`[
	  {"role": "user", "content": "Read it."},
	  {"role": "assistant", "content": [
	    {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
	    {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}]},
	  {"role": "user", "content": [
	    {"type": "tool_result", "tool_use_id": "t1", "content": "text", "is_error": true},
	    {"type": "text", "text": "Go on."}]},
	  {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"},
	                                    {"type": "text", "text": "Done."}]}]`), &messages)
	events, err := anthropic.EventsFromMessages(messages, anthropic.Options{System: "Be brief."})
	if err != nil {
		t.Fatal(err)
	}
	rendered, err := anthropic.MessagesFromEvents(events)
	if err != nil {
		t.Fatal(err)
	}
	if rendered.System != "Be brief." || !reflect.DeepEqual(transcripts.Normalized(t, rendered.Messages), transcripts.Normalized(t, messages)) {
		t.Fatalf("got %+v", rendered)
	}
}

// Anthropic requires the tool_result blocks first in the user message after a tool_use.
func TestASystemMessageBetweenACallAndItsResultRendersAfterTheToolResult(t *testing.T) {
	var messages []map[string]interface{}
	_ = json.Unmarshal([]byte(`[
	  {"role": "user", "content": "Read it."},
	  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
	  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]`), &messages)
	events, err := anthropic.EventsFromMessages(messages, anthropic.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var logged []*compactdv1.SessionEvent
	for _, e := range events {
		if compactd.EventType(e) == "tool/result" {
			logged = append(logged, compactd.SystemMessage("Be careful."))
		}
		logged = append(logged, e)
	}
	rendered, err := anthropic.MessagesFromEvents(logged)
	if err != nil {
		t.Fatal(err)
	}
	last := rendered.Messages[len(rendered.Messages)-1]
	want := []interface{}{
		map[string]interface{}{"type": "tool_result", "tool_use_id": "t1", "content": "x"},
		map[string]interface{}{"type": "text", "text": "Be careful."},
	}
	if !reflect.DeepEqual(transcripts.Normalized(t, []anthropic.Message{{"role": "user", "content": want}}),
		transcripts.Normalized(t, []anthropic.Message{last})) {
		t.Fatalf("got %+v", last)
	}
}

func TestPinsJoinTheSystemTextAndAreDroppedOnImport(t *testing.T) {
	pins := "<pinned-state>\n[goal]\nship it\n</pinned-state>"
	request := &compactdv1.BuildRequestResponse{
		Messages: []*compactdv1.Message{
			{Role: compactdv1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: []*compactdv1.ContentBlock{compactd.Text("be brief")}},
			{Role: compactdv1.MessageRole_MESSAGE_ROLE_SYSTEM, PinnedState: true, Content: []*compactdv1.ContentBlock{compactd.Text(pins)}},
			{Role: compactdv1.MessageRole_MESSAGE_ROLE_USER, Content: []*compactdv1.ContentBlock{compactd.Text("hi")}},
		},
		Config: &compactdv1.RequestConfig{Model: "m"},
	}
	body, err := anthropic.RequestBody(request, 64, nil)
	if err != nil {
		t.Fatal(err)
	}
	if body["system"] != "be brief\n\n"+pins {
		t.Fatalf("system: %q", body["system"])
	}
	events, err := anthropic.EventsFromMessages(body["messages"].([]anthropic.Message), anthropic.Options{System: body["system"]})
	if err != nil {
		t.Fatal(err)
	}
	if events[0].GetSystemMessage().GetText() != "be brief" {
		t.Fatalf("imported system: %q", events[0].GetSystemMessage().GetText())
	}
}
