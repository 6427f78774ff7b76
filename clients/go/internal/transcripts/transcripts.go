// Package transcripts loads the repository's shared agent transcripts for the converters' tests
// (testdata/transcripts, or the folder COMPACTD_TESTDATA names when the module is copied away).
package transcripts

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"testing"
)

// Record is one conversation: where it comes from and its messages as JSON objects.
type Record struct {
	Source   string                   `json:"source"`
	Messages []map[string]interface{} `json:"messages"`
}

// Load returns every record of <name>.jsonl.
func Load(t *testing.T, name string) []Record {
	t.Helper()
	dir := os.Getenv("COMPACTD_TESTDATA")
	if dir == "" {
		_, file, _, _ := runtime.Caller(0)
		dir = filepath.Join(filepath.Dir(file), "..", "..", "..", "..", "testdata", "transcripts")
	}
	f, err := os.Open(filepath.Join(dir, name+".jsonl"))
	if err != nil {
		t.Fatalf("the shared transcripts: %v (set COMPACTD_TESTDATA)", err)
	}
	defer f.Close()
	var records []Record
	scanner := bufio.NewScanner(f)
	scanner.Buffer(make([]byte, 1<<20), 64<<20)
	for scanner.Scan() {
		var r Record
		if err := json.Unmarshal(scanner.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		records = append(records, r)
	}
	return records
}

// Normalized returns v as encoding/json decodes its JSON text, so typed maps and slices compare
// equal to what the transcripts decode to.
func Normalized(t *testing.T, v interface{}) interface{} {
	t.Helper()
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
