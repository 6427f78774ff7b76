package openai_test

import (
	"reflect"
	"testing"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"compactd.dev/client/internal/convert"
	"compactd.dev/client/internal/transcripts"
	"compactd.dev/client/openai"
)

func TestImportThenRenderGivesEveryTranscriptsMessages(t *testing.T) {
	records := transcripts.Load(t, "openai")
	if len(records) < 18 {
		t.Fatalf("only %d transcripts", len(records))
	}
	for _, r := range records {
		events, err := openai.EventsFromMessages(r.Messages, openai.Options{Provider: "p", Model: "m"})
		if err != nil {
			t.Fatalf("%s: %v", r.Source, err)
		}
		if problems := convert.StepRuleViolations(events); len(problems) > 0 {
			t.Fatalf("%s: %v", r.Source, problems)
		}
		rendered, err := openai.MessagesFromEvents(events, false)
		if err != nil {
			t.Fatalf("%s: %v", r.Source, err)
		}
		if got, want := transcripts.Normalized(t, rendered), transcripts.Normalized(t, r.Messages); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: the rendered messages differ from the transcript's", r.Source)
		}
	}
}

func TestReasoningGoesBackOnlyWhenAsked(t *testing.T) {
	messages := []map[string]interface{}{
		{"role": "user", "content": "2+2?"},
		{"role": "assistant", "content": "4", "reasoning_content": "2+2"},
	}
	events, err := openai.EventsFromMessages(messages, openai.Options{})
	if err != nil {
		t.Fatal(err)
	}
	with, _ := openai.MessagesFromEvents(events, true)
	if !reflect.DeepEqual(transcripts.Normalized(t, with), transcripts.Normalized(t, messages)) {
		t.Fatalf("with reasoning: %v", with)
	}
	without, _ := openai.MessagesFromEvents(events, false)
	if _, ok := without[1]["reasoning_content"]; ok {
		t.Fatal("reasoning sent back unasked")
	}
}

func TestUnknownRolesAreNamed(t *testing.T) {
	_, err := openai.EventsFromMessages([]map[string]interface{}{{"role": "function"}}, openai.Options{})
	if err == nil || err.Error() != `messages[0]: role "function" is not carried` {
		t.Fatalf("got %v", err)
	}
}

func TestPinsFollowTheHeadAndNeverComeBackAsConversationMessages(t *testing.T) {
	request := &v1.BuildRequestResponse{
		Messages: []*v1.Message{
			{Role: v1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: []*v1.ContentBlock{compactd.Text("be brief")}},
			{Role: v1.MessageRole_MESSAGE_ROLE_SYSTEM, PinnedState: true,
				Content: []*v1.ContentBlock{compactd.Text("<pinned-state>\n[goal]\nship it\n</pinned-state>")}},
			{Role: v1.MessageRole_MESSAGE_ROLE_USER, Content: []*v1.ContentBlock{compactd.Text("hi")}},
		},
		Config: &v1.RequestConfig{Model: "m"},
	}
	body, err := openai.RequestBody(request, openai.BodyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	messages := body["messages"].([]openai.Message)
	if len(messages) != 3 || messages[1]["role"] != "system" {
		t.Fatalf("the pins are not the system message after the head: %v", messages)
	}
	events, err := openai.EventsFromMessages(messages, openai.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rendered, err := openai.MessagesFromEvents(events, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(rendered) != 2 || rendered[0]["content"] != "be brief" || rendered[1]["content"] != "hi" {
		t.Fatalf("the pins came back as conversation messages: %v", rendered)
	}
}
