package convert_test

import (
	"testing"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"compactd.dev/client/internal/convert"
)

func TestWithoutPinsDropsThePinnedBlockOnly(t *testing.T) {
	pins := "<pinned-state>\nkept\n\n[goal]\nship it\n</pinned-state>"
	for text, want := range map[string]string{
		"be brief\n\n" + pins: "be brief",
		pins:                  "",
		"be brief":            "be brief",
		pins + "\n\nafter":    "after",
	} {
		if got := convert.WithoutPins(text); got != want {
			t.Fatalf("WithoutPins(%q) = %q, want %q", text, got, want)
		}
	}
	if !convert.IsPins(pins) || convert.IsPins("be brief\n\n"+pins) {
		t.Fatal("IsPins must match exactly a pinned-state block")
	}
}

func TestPinAndSubagentBuildersHaveTheirTypes(t *testing.T) {
	events := []*v1.SessionEvent{
		compactd.Pin("goal", "ship"),
		compactd.ClearPin("goal"),
		compactd.SubagentStart("child", "c1", "find it"),
		compactd.SubagentEnd("child", v1.SubagentStatus_SUBAGENT_STATUS_COMPLETED, "found"),
	}
	want := []string{"state/pin", "state/pin", "subagent/start", "subagent/end"}
	for i, e := range events {
		if got := compactd.EventType(e); got != want[i] {
			t.Fatalf("event %d: %q, want %q", i, got, want[i])
		}
	}
	if !events[1].GetStatePin().GetClear() || events[2].GetSubagentStart().GetTask() != "find it" {
		t.Fatal("the builders lost a field")
	}
}
