package anthropic_test

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"testing"

	"compactd.dev/client/anthropic"
	"compactd.dev/client/internal/convert"
)

type record struct {
	Source   string                   `json:"source"`
	Messages []map[string]interface{} `json:"messages"`
}

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
	records := transcripts(t, "anthropic")
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
		if got, want := normalized(t, rendered.Messages), normalized(t, r.Messages); !reflect.DeepEqual(got, want) {
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
	if rendered.System != "Be brief." || !reflect.DeepEqual(normalized(t, rendered.Messages), normalized(t, messages)) {
		t.Fatalf("got %+v", rendered)
	}
}
