package openai_test

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"testing"

	"compactd.dev/client/internal/convert"
	"compactd.dev/client/openai"
)

type record struct {
	Source   string                   `json:"source"`
	Messages []map[string]interface{} `json:"messages"`
}

// testdata returns the shared transcripts: TESTDATA, or testdata/transcripts of the repository
// this package sits in (clients/go/openai).
func transcripts(t *testing.T, name string) []record {
	dir := os.Getenv("COMPACTD_TESTDATA")
	if dir == "" {
		_, file, _, _ := runtime.Caller(0)
		dir = filepath.Join(filepath.Dir(file), "..", "..", "..", "testdata", "transcripts")
	}
	f, err := os.Open(filepath.Join(dir, name+".jsonl"))
	if err != nil {
		t.Fatalf("the shared transcripts: %v (set COMPACTD_TESTDATA)", err)
	}
	defer f.Close()
	var records []record
	scanner := bufio.NewScanner(f)
	scanner.Buffer(make([]byte, 1<<20), 64<<20)
	for scanner.Scan() {
		var r record
		if err := json.Unmarshal(scanner.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		records = append(records, r)
	}
	return records
}

// normalized is v as encoding/json would decode its JSON text (so nil slices and typed maps
// compare equal to what the transcripts decode to).
func normalized(t *testing.T, v interface{}) interface{} {
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out interface{}
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestImportThenRenderGivesEveryTranscriptsMessages(t *testing.T) {
	records := transcripts(t, "openai")
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
		if got, want := normalized(t, rendered), normalized(t, r.Messages); !reflect.DeepEqual(got, want) {
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
	if !reflect.DeepEqual(normalized(t, with), normalized(t, messages)) {
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
