// Package scenarios runs the cross-language scenario list with the Go client against a running
// compactd (COMPACTD_ADDRESS; the routed model from COMPACTD_PROVIDER / COMPACTD_MODEL). Same
// list as the Python and TypeScript suites: create, append, rebuild request, pressure check, a
// watch receiving updates, a compaction with its streamed steps, a busy error with its reason,
// a SEQ_CONFLICT, held steps across a compaction, a held step of a session another client created
// again, the recall tool answered.
package scenarios

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

var bracket = []v1.CompactionStep{
	v1.CompactionStep_COMPACTION_STEP_START,
	v1.CompactionStep_COMPACTION_STEP_SUMMARIZE,
	v1.CompactionStep_COMPACTION_STEP_SUMMARY,
	v1.CompactionStep_COMPACTION_STEP_REPLACE,
	v1.CompactionStep_COMPACTION_STEP_END,
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

var (
	provider = env("COMPACTD_PROVIDER", "loopback")
	model    = env("COMPACTD_MODEL", "agent-12k")
)

func connect(t *testing.T) *compactd.Client {
	t.Helper()
	address := os.Getenv("COMPACTD_ADDRESS")
	if address == "" {
		t.Skip("COMPACTD_ADDRESS is not set")
	}
	client, err := compactd.Dial(address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

func newSession(t *testing.T, c *compactd.Client) string {
	t.Helper()
	buf := make([]byte, 6)
	_, _ = rand.Read(buf)
	id := "go-" + hex.EncodeToString(buf)
	session, err := c.CreateSession(context.Background(), id, nil)
	if err != nil || session.GetSessionId() != id {
		t.Fatalf("create %s: %v", id, err)
	}
	return id
}

// seed appends a system prompt, a header and `turns` closed turns with large tool output.
func seed(t *testing.T, c *compactd.Client, id string, turns int) int64 {
	t.Helper()
	events := []*v1.SessionEvent{compactd.SystemMessage("You are a careful coding agent."), compactd.RequestHeader(provider, model)}
	for turn := 1; turn <= turns; turn++ {
		callID := fmt.Sprintf("call-%d", turn)
		var listing []string
		for i := 0; i < 90; i++ {
			listing = append(listing, fmt.Sprintf("src/module_%d_%d.py: def handler_%d(): ...", turn, i, i))
		}
		events = append(events,
			compactd.TurnStart(int64(turn)),
			compactd.UserMessage(fmt.Sprintf("Turn %d: find where the handlers are defined.", turn)),
			compactd.StepStart(int64(turn), 1),
			compactd.AssistantMessage("", compactd.ToolCallBlock(callID, "grep", compactd.JSON(map[string]string{"pattern": "def "}))),
			compactd.StepEnd(int64(turn), 1),
			compactd.ToolResult(callID, "grep", strings.Join(listing, "\n")),
			compactd.StepStart(int64(turn), 2),
			compactd.AssistantMessage(fmt.Sprintf("Turn %d: the handlers live in src/module_%d_*.py.", turn, turn)),
			compactd.StepEnd(int64(turn), 2),
			compactd.TurnEnd(int64(turn), ""),
		)
	}
	resp, err := c.AppendEvents(context.Background(), id, events, nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetRevision()
}

func eventTypes(t *testing.T, c *compactd.Client, id string) []string {
	t.Helper()
	stream, err := c.Sessions.ListEvents(context.Background(), &v1.ListEventsRequest{SessionId: id})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(compactd.FromError(err))
		}
		out = append(out, compactd.EventType(msg.GetEvent()))
	}
}

func TestCreate(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	again, err := c.CreateSession(context.Background(), id, nil) // a retry: idempotent
	if err != nil || again.GetSessionId() != id {
		t.Fatalf("retried create: %v %v", again, err)
	}
	_, err = c.CreateSession(context.Background(), id, map[string]interface{}{"thresholdRatio": 0.5})
	var e *compactd.Error
	if !errors.As(err, &e) || e.Code != codes.AlreadyExists {
		t.Fatalf("want ALREADY_EXISTS, got %v", err)
	}
	chosen, err := c.CreateSession(context.Background(), "", nil)
	if err != nil || chosen.GetSessionId() == "" || chosen.GetRevision() != 0 {
		t.Fatalf("server-chosen id: %v %v", chosen, err)
	}
}

func TestAppend(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	resp, err := c.AppendEvents(context.Background(), id, []*v1.SessionEvent{
		compactd.SystemMessage("Be terse."), compactd.TurnStart(1), compactd.UserMessage("hello"),
	}, compactd.Seq(-1))
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(resp.GetSeqs()) != "[0 1 2]" || resp.GetRevision() != 3 {
		t.Fatalf("seqs %v revision %d", resp.GetSeqs(), resp.GetRevision())
	}
	if got := strings.Join(eventTypes(t, c, id), ","); got != "system/message,turn/start,user/message" {
		t.Fatalf("types %s", got)
	}
}

func TestRebuildRequest(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	revision := seed(t, c, id, 1)
	req, err := c.BuildRequest(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var roles []string
	for _, m := range req.GetMessages() {
		roles = append(roles, m.GetRole().String())
	}
	want := "MESSAGE_ROLE_SYSTEM,MESSAGE_ROLE_USER,MESSAGE_ROLE_ASSISTANT,MESSAGE_ROLE_TOOL,MESSAGE_ROLE_ASSISTANT"
	if strings.Join(roles, ",") != want {
		t.Fatalf("roles %v", roles)
	}
	if req.GetRevision() != revision || req.GetConfig().GetModel() != model || req.GetHeaderSeq() != 1 {
		t.Fatalf("request %v", req)
	}
	if req.GetMessages()[3].GetToolCallId() != "call-1" {
		t.Fatalf("tool message %v", req.GetMessages()[3])
	}
}

func TestPressureCheck(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	revision := seed(t, c, id, 1)
	report, err := c.CheckPressure(context.Background(), id, nil)
	if err != nil {
		t.Fatal(err)
	}
	if report.GetRevision() != revision || report.GetRoute().GetModel() != model || report.GetContextWindow() <= 0 {
		t.Fatalf("report %v", report)
	}
	if report.GetMeasuredTokens() <= 0 || report.GetMeasuredTokens() >= report.GetTriggerTokens() ||
		report.GetState() != v1.PressureState_PRESSURE_STATE_BELOW {
		t.Fatalf("report %v", report)
	}
}

func TestWatch(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	revision := seed(t, c, id, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	watch, err := c.WatchPressure(ctx, id, nil)
	if err != nil {
		t.Fatal(err)
	}
	first, err := watch.Recv()
	if err != nil || first.GetRevision() != revision {
		t.Fatalf("first report %v %v", first, err)
	}
	if _, err := c.AppendEvents(context.Background(), id, []*v1.SessionEvent{compactd.TurnStart(2), compactd.UserMessage("more")}, nil); err != nil {
		t.Fatal(err)
	}
	for {
		report, err := watch.Recv()
		if err != nil {
			t.Fatalf("watch ended early: %v", err)
		}
		if report.GetRevision() >= revision+2 {
			if report.GetRevision() != revision+2 || report.GetMeasuredTokens() <= first.GetMeasuredTokens() {
				t.Fatalf("report %v", report)
			}
			cancel()
			return
		}
	}
}

func TestCompactionStreamsItsSteps(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	seed(t, c, id, 3)
	stream, err := c.Compact(context.Background(), id, "keep the file names")
	if err != nil {
		t.Fatal(err)
	}
	result, err := stream.Result()
	if err != nil {
		t.Fatal(err)
	}
	var steps []v1.CompactionStep
	for _, p := range stream.Progress {
		for _, b := range bracket {
			if p.GetStep() == b {
				steps = append(steps, p.GetStep())
			}
		}
	}
	if fmt.Sprint(steps) != fmt.Sprint(bracket) {
		t.Fatalf("steps %v", stream.Progress)
	}
	outcome := result.GetOutcome()
	if outcome.GetCompactionId() == "" || outcome.GetItemsCondensed() <= 0 {
		t.Fatalf("outcome %v", outcome)
	}
	surface, err := c.GetSurface(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var checkpoints []*v1.SurfaceNode
	for _, n := range surface.GetNodes() {
		if n.GetCompactionId() == outcome.GetCompactionId() {
			checkpoints = append(checkpoints, n)
		}
	}
	if len(checkpoints) != 1 || checkpoints[0].GetSeq() != outcome.GetCheckpointSeq() || checkpoints[0].GetType() != "user/message" {
		t.Fatalf("checkpoints %v", checkpoints)
	}
	all := strings.Join(eventTypes(t, c, id), ",")
	if strings.Count(all, "compaction/start") != 1 || strings.Count(all, "compaction/end") != 1 {
		t.Fatalf("log %s", all)
	}
}

var handlePattern = regexp.MustCompile(`\[recall:(c\d+-[0-9a-f]{4})\]`)

func TestRecallTool(t *testing.T) {
	c := connect(t)
	ctx := context.Background()
	buf := make([]byte, 6)
	_, _ = rand.Read(buf)
	id := "go-" + hex.EncodeToString(buf)
	if _, err := c.CreateSession(ctx, id, map[string]interface{}{"recallTool": true}); err != nil {
		t.Fatal(err)
	}
	seed(t, c, id, 3)
	stream, err := c.Compact(ctx, id, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Result(); err != nil {
		t.Fatal(err)
	}
	request, err := c.BuildRequest(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	tools := request.GetTools()
	if len(tools) == 0 || tools[len(tools)-1].GetName() != "recall" {
		t.Fatalf("tools %v", tools)
	}
	var texts []string
	for _, m := range request.GetMessages() {
		for _, b := range m.GetContent() {
			texts = append(texts, b.GetText().GetText())
		}
	}
	found := handlePattern.FindStringSubmatch(strings.Join(texts, "\n"))
	if found == nil {
		t.Fatal("the checkpoint names no recall handle")
	}
	block := compactd.ToolCallBlock("r1", "recall", compactd.JSON(map[string]string{"handle": found[1]}))
	step := []*v1.SessionEvent{
		compactd.TurnStart(9), compactd.UserMessage("What did turn 1 find, exactly?"),
		compactd.StepStart(9, 1), compactd.AssistantMessage("", block), compactd.StepEnd(9, 1),
	}
	if _, err := c.AppendEvents(ctx, id, step, nil); err != nil {
		t.Fatal(err)
	}
	result, err := c.AnswerRecall(ctx, id, block.GetToolCall())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AppendEvents(ctx, id, []*v1.SessionEvent{result, compactd.TurnEnd(9, "")}, nil); err != nil {
		t.Fatal(err)
	}
	answered := result.GetToolResult()
	text := answered.GetContent()[0].GetText().GetText()
	if answered.GetToolCallId() != "r1" || answered.GetIsError() || !strings.Contains(text, "src/module_1_0.py") {
		t.Fatalf("answer %v", answered)
	}
	request, err = c.BuildRequest(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	last := request.GetMessages()[len(request.GetMessages())-1]
	if last.GetToolCallId() != "r1" || last.GetContent()[0].GetText().GetText() != text {
		t.Fatalf("last message %v", last)
	}
	unknown, err := c.AnswerRecall(ctx, id, &v1.ToolCallBlock{Id: "r2", Name: "recall", ArgumentsJson: `{"handle":"c1-0000"}`})
	if err != nil || !unknown.GetToolResult().GetIsError() {
		t.Fatalf("unknown handle: %v %v", unknown, err)
	}
}

func TestBusyErrorCarriesItsReason(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	seed(t, c, id, 2)
	if _, err := c.AppendEvents(context.Background(), id, []*v1.SessionEvent{compactd.TurnStart(3), compactd.UserMessage("still working")}, nil); err != nil {
		t.Fatal(err)
	}
	stream, err := c.Compact(context.Background(), id, "")
	if err == nil {
		_, err = stream.Result()
	}
	var e *compactd.Error
	if !errors.Is(err, compactd.ErrCompactionBusy) || !errors.As(err, &e) || e.Code != codes.Aborted || e.Reason != "COMPACTION_BUSY" {
		t.Fatalf("want ABORTED/COMPACTION_BUSY, got %v", err)
	}
}

func TestSeqConflict(t *testing.T) {
	c := connect(t)
	id := newSession(t, c)
	revision := seed(t, c, id, 1)
	_, err := c.AppendEvents(context.Background(), id, []*v1.SessionEvent{compactd.UserMessage("stale")}, compactd.Seq(revision-2))
	var e *compactd.Error
	if !errors.Is(err, compactd.ErrSeqConflict) || !errors.As(err, &e) || e.Code != codes.Aborted || e.Reason != "SEQ_CONFLICT" {
		t.Fatalf("want ABORTED/SEQ_CONFLICT, got %v", err)
	}
	next, err := c.AppendEvents(context.Background(), id, []*v1.SessionEvent{compactd.TurnStart(9)}, compactd.Seq(revision-1))
	if err != nil || len(next.GetSeqs()) != 1 || next.GetSeqs()[0] != revision {
		t.Fatalf("append after conflict: %v %v", next, err)
	}
}

// workStep is what one step of an open turn logs (~390 tokens): a reply calling a tool, its result.
func workStep(turn, step int64) []*v1.SessionEvent {
	callID := fmt.Sprintf("fix-%d", step)
	var output []string
	for i := 0; i < 40; i++ {
		output = append(output, fmt.Sprintf("src/module_%d_%d.py: fixed handler_%d", step, i, i))
	}
	return []*v1.SessionEvent{
		compactd.StepStart(turn, step),
		compactd.AssistantMessage(fmt.Sprintf("Fixing batch %d.", step), compactd.ToolCallBlock(callID, "edit", compactd.JSON(map[string]int64{"batch": step}))),
		compactd.StepEnd(turn, step),
		compactd.ToolResult(callID, "edit", strings.Join(output, "\n")),
	}
}

// Another client deletes the session and creates it again under the same id, its log past the
// held revision: the held incarnation tells them apart, so the step answers the new request.
func TestAHeldStepOfASessionCreatedAgainAnswersTheNewRequest(t *testing.T) {
	c := connect(t)
	ctx := context.Background()
	id := newSession(t, c)
	seed(t, c, id, 1)
	if _, err := c.AppendEvents(ctx, id, []*v1.SessionEvent{compactd.TurnStart(2), compactd.UserMessage("Fix the first handler.")}, nil); err != nil {
		t.Fatal(err)
	}
	first, err := c.PrepareStep(ctx, id, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	other := connect(t)
	if err := other.DeleteSession(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := other.CreateSession(ctx, id, nil); err != nil {
		t.Fatal(err)
	}
	seed(t, other, id, 2)
	if _, err := other.AppendEvents(ctx, id, []*v1.SessionEvent{compactd.TurnStart(3), compactd.UserMessage("Fix the second handler.")}, nil); err != nil {
		t.Fatal(err)
	}
	prepared, err := c.PrepareStep(ctx, id, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	built, err := c.BuildRequest(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if built.GetRevision() <= first.Request.GetRevision() {
		t.Fatalf("the new log (revision %d) is not past the held one (%d)", built.GetRevision(), first.Request.GetRevision())
	}
	if prepared.Result.GetRequestUnchanged() || !proto.Equal(prepared.Request, built) {
		t.Fatalf("the step extended the held request of the deleted session")
	}
}

func TestHeldStepsAcrossACompaction(t *testing.T) {
	c := connect(t)
	ctx := context.Background()
	id := newSession(t, c)
	seed(t, c, id, 8) // ~8,000 tokens: five steps below the trigger (9,830)
	if _, err := c.AppendEvents(ctx, id, []*v1.SessionEvent{compactd.TurnStart(9), compactd.UserMessage("Now fix every handler.")}, nil); err != nil {
		t.Fatal(err)
	}
	var full, compacted []int
	for step := int64(1); step <= 9; step++ {
		// Even steps stream (OnProgress, as the examples step), odd ones are one unary call:
		// both extend the same held request.
		var seen []*v1.CompactionProgress
		var opts *compactd.StepOptions
		if step%2 == 0 {
			opts = &compactd.StepOptions{OnProgress: func(p *v1.CompactionProgress) { seen = append(seen, p) }}
		}
		prepared, err := c.PrepareStep(ctx, id, 9, opts)
		if err != nil {
			t.Fatal(err)
		}
		if len(prepared.Progress) != len(seen) {
			t.Fatalf("step %d: %d updates kept, %d seen", step, len(prepared.Progress), len(seen))
		}
		built, err := c.BuildRequest(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(prepared.Request, built) {
			t.Fatalf("step %d: the held request differs from BuildRequest's", step)
		}
		result := prepared.Result
		if result.GetRequestUnchanged() {
			appended, messages := result.GetAppendedMessages(), built.GetMessages()
			if len(appended) != 2 || !proto.Equal(appended[0], messages[len(messages)-2]) || !proto.Equal(appended[1], messages[len(messages)-1]) {
				t.Fatalf("step %d: appended %d messages, not the step's two", step, len(appended))
			}
		} else {
			full = append(full, int(step-1))
		}
		if len(result.GetCompactions()) > 0 {
			compacted = append(compacted, int(step-1))
		}
		if _, err := c.AppendEvents(ctx, id, workStep(9, step), nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(compacted) == 0 || compacted[0] < 2 || compacted[0] > 7 {
		t.Fatalf("compactions at steps %v", compacted)
	}
	if fmt.Sprint(full) != fmt.Sprint(append([]int{0}, compacted...)) {
		t.Fatalf("full requests at steps %v, compactions at %v", full, compacted)
	}
}
