package compactd

// The recall tool's calls, answered through SessionService.Recall.
//
// With the session policy recallTool on, every rebuilt request declares the recall tool (named
// recallToolName, default "recall"). When the model calls it, the runtime answers with
// client.AnswerRecall(ctx, sessionID, call): an ordinary tool/result event, to append to the log
// and send back like any tool's. A handle the log does not name, or arguments that are not
// {"handle", "query"?, "page"?}, answer an error result the model can read (IsError); any other
// failure is returned.

import (
	"context"
	"encoding/json"
	"errors"

	v1 "compactd.dev/client/compactdv1"
)

// DefaultToolMaxBytes is the most bytes of recalled events one AnswerRecall carries (the model
// pages for more).
const DefaultToolMaxBytes = 16384

// recallArguments are the recall tool's arguments.
type recallArguments struct {
	Handle *string `json:"handle"`
	Query  string  `json:"query"`
	Page   string  `json:"page"`
}

// Recall returns one page of the original events behind a recall handle (or req.Seqs). An
// unknown session, or a handle its log does not name (reason RECALL_HANDLE_UNKNOWN), is a
// NOT_FOUND *Error.
func (c *Client) Recall(ctx context.Context, req *v1.RecallRequest) (*v1.RecallResponse, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.Recall(ctx, req)
	return resp, FromError(err)
}

// IsRecallCall reports whether call calls the recall tool declared under name ("recall" by
// default).
func IsRecallCall(call *v1.ToolCallBlock, name string) bool {
	return call.GetName() == name
}

// AnswerRecall answers the model's call of the recall tool: the tool/result event to append
// and send back (the recalled page as text; an error result the model can read for an unknown
// handle or unusable arguments). Other failures (an unknown session) are returned.
func (c *Client) AnswerRecall(ctx context.Context, sessionID string, call *v1.ToolCallBlock) (*v1.SessionEvent, error) {
	var args recallArguments
	raw := call.GetArgumentsJson()
	if raw == "" {
		raw = "{}"
	}
	if err := json.Unmarshal([]byte(raw), &args); err != nil || args.Handle == nil {
		return recallResult(call, `the arguments must be {"handle": "..."} (query, page optional)`, true), nil
	}
	resp, err := c.Recall(ctx, &v1.RecallRequest{
		SessionId: sessionID, Handle: *args.Handle, Query: args.Query, PageToken: args.Page,
		MaxBytes: DefaultToolMaxBytes,
	})
	var failed *Error
	if errors.As(err, &failed) && (failed.Reason == "RECALL_HANDLE_UNKNOWN" || failed.Reason == "INVALID_ARGUMENT") {
		return recallResult(call, "recall failed: "+failed.Message, true), nil
	}
	if err != nil {
		return nil, err
	}
	return recallResult(call, resp.GetText(), false), nil
}

func recallResult(call *v1.ToolCallBlock, text string, isError bool) *v1.SessionEvent {
	return &v1.SessionEvent{Body: &v1.SessionEvent_ToolResult{ToolResult: &v1.ToolResult{
		ToolCallId: call.GetId(), ToolName: call.GetName(), Content: []*v1.ContentBlock{Text(text)},
		IsError: isError,
	}}}
}
