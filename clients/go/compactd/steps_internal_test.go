package compactd

import (
	"testing"

	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func TestAViewKeepsEveryFieldOfTheRequest(t *testing.T) {
	fields := (&v1.BuildRequestResponse{}).ProtoReflect().Descriptor().Fields()
	if fields.Len() != 8 {
		t.Fatalf("BuildRequestResponse has %d fields: copy the new ones in view", fields.Len())
	}
	defaults, _ := structpb.NewStruct(map[string]interface{}{"top_p": 0.9})
	full := &v1.BuildRequestResponse{
		Revision: 7, Messages: []*v1.Message{{Name: "a"}}, Config: &v1.RequestConfig{Model: "m"},
		AdapterDefaults: defaults, Tools: []*v1.ToolDeclaration{{Name: "run"}}, HeaderSeq: 1,
		Pins:        []*v1.StatePin{{Key: "goal", Text: "ship"}},
		Incarnation: "1",
	}
	v := view(full)
	if !proto.Equal(v, full) {
		t.Fatalf("view %v of %v", v, full)
	}
	v.Messages = append(v.Messages, &v1.Message{Name: "b"})
	if len(full.Messages) != 1 || cap(full.Messages) < 1 {
		t.Fatalf("an append to a view reached the original: %v", full.Messages)
	}
}
