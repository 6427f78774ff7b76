package openai_test

import (
	"reflect"
	"testing"

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
