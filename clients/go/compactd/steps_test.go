package compactd_test

import (
	"context"
	"net"
	"sync"
	"testing"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// heldLog is a scripted session answering steps by the held-revision contract: the full request
// without a held revision (or once rewrite is set, or when the held incarnation is not the
// session's), else the messages appended since (one message per revision). concurrent makes a
// step drop the client's held request meanwhile.
type heldLog struct {
	v1.UnimplementedSessionServiceServer
	v1.UnimplementedCompactionServiceServer
	mu         sync.Mutex
	messages   []*v1.Message
	rewrite    bool
	concurrent func(sessionID string)
	sent       []*int64
	builds     int
	// incarnation is the session's; sentIncarnations the held incarnations the steps sent.
	incarnation      string
	sentIncarnations []string
}

func (l *heldLog) add(names ...string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, name := range names {
		l.messages = append(l.messages, &v1.Message{Name: name})
	}
}

func (l *heldLog) result(sessionID string, held *int64, incarnation string) *v1.PrepareStepResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.concurrent != nil {
		l.concurrent(sessionID)
	}
	l.sent = append(l.sent, held)
	l.sentIncarnations = append(l.sentIncarnations, incarnation)
	revision := int64(len(l.messages))
	other := incarnation != "" && incarnation != l.incarnation
	if held == nil || l.rewrite || other {
		l.rewrite = false
		full := &v1.BuildRequestResponse{Revision: revision, Messages: append([]*v1.Message(nil), l.messages...), Incarnation: l.incarnation}
		return &v1.PrepareStepResult{Request: full, RequestRevision: revision}
	}
	return &v1.PrepareStepResult{RequestUnchanged: true, AppendedMessages: l.messages[*held:], RequestRevision: revision}
}

func (l *heldLog) PrepareStepUnary(ctx context.Context, req *v1.PrepareStepUnaryRequest) (*v1.PrepareStepUnaryResponse, error) {
	return &v1.PrepareStepUnaryResponse{Result: l.result(req.GetSessionId(), req.HeldRevision, req.GetHeldIncarnation())}, nil
}

func (l *heldLog) PrepareStep(req *v1.PrepareStepRequest, stream v1.CompactionService_PrepareStepServer) error {
	p := &v1.CompactionProgress{Step: v1.CompactionStep_COMPACTION_STEP_PRUNE}
	if err := stream.Send(&v1.PrepareStepResponse{Update: &v1.PrepareStepResponse_Progress{Progress: p}}); err != nil {
		return err
	}
	result := l.result(req.GetSessionId(), req.HeldRevision, req.GetHeldIncarnation())
	return stream.Send(&v1.PrepareStepResponse{Update: &v1.PrepareStepResponse_Result{Result: result}})
}

func (l *heldLog) BuildRequest(ctx context.Context, req *v1.BuildRequestRequest) (*v1.BuildRequestResponse, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.builds++
	return &v1.BuildRequestResponse{Revision: int64(len(l.messages)), Messages: append([]*v1.Message(nil), l.messages...)}, nil
}

func (l *heldLog) DeleteSession(ctx context.Context, req *v1.DeleteSessionRequest) (*v1.DeleteSessionResponse, error) {
	return &v1.DeleteSessionResponse{}, nil
}

func (l *heldLog) sentRevisions() []int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]int64, len(l.sent))
	for i, s := range l.sent {
		out[i] = -1
		if s != nil {
			out[i] = *s
		}
	}
	return out
}

func startHeld(t *testing.T) (*compactd.Client, *heldLog) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	log := &heldLog{messages: []*v1.Message{{Name: "a"}}, incarnation: "1"}
	server := grpc.NewServer()
	v1.RegisterSessionServiceServer(server, log)
	v1.RegisterCompactionServiceServer(server, log)
	go func() { _ = server.Serve(lis) }()
	t.Cleanup(server.Stop)
	client, err := compactd.Dial(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client, log
}

func names(r *v1.BuildRequestResponse) []string {
	var out []string
	for _, m := range r.GetMessages() {
		out = append(out, m.GetName())
	}
	return out
}

func equal[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func step(t *testing.T, c *compactd.Client, sessionID string, opts *compactd.StepOptions) *compactd.PreparedStep {
	t.Helper()
	prepared, err := c.PrepareStep(context.Background(), sessionID, 1, opts)
	if err != nil {
		t.Fatal(err)
	}
	return prepared
}

func TestPrepareStepHoldsTheRequestAndSendsItsRevision(t *testing.T) {
	client, log := startHeld(t)
	first := step(t, client, "s", nil)
	log.add("b", "c")
	second := step(t, client, "s", nil)
	log.mu.Lock()
	log.rewrite, log.messages = true, []*v1.Message{{Name: "summary"}}
	log.mu.Unlock()
	step(t, client, "s", nil)
	log.add("d")
	fourth := step(t, client, "s", nil)
	if got := log.sentRevisions(); !equal(got, []int64{-1, 1, 3, 1}) {
		t.Fatalf("held revisions sent %v", got)
	}
	if !equal(names(first.Request), []string{"a"}) || first.Request.GetRevision() != 1 {
		t.Fatalf("a later step changed an earlier request: %v", first.Request)
	}
	if !equal(names(second.Request), []string{"a", "b", "c"}) || second.Request.GetRevision() != 3 || !second.Result.GetRequestUnchanged() {
		t.Fatalf("second step %v %v", second.Request, second.Result)
	}
	if !equal(names(fourth.Request), []string{"summary", "d"}) {
		t.Fatalf("after a rewrite %v", fourth.Request)
	}
}

func TestPrepareStepSendsTheHeldIncarnationAndASessionCreatedAgainAnswersWhole(t *testing.T) {
	client, log := startHeld(t)
	step(t, client, "s", nil)
	log.add("b")
	step(t, client, "s", nil)
	// Another process deletes the session and creates it again, as long as the held one.
	log.mu.Lock()
	log.incarnation, log.messages = "2", []*v1.Message{{Name: "x"}, {Name: "y"}}
	log.mu.Unlock()
	again := step(t, client, "s", &compactd.StepOptions{OnProgress: func(*v1.CompactionProgress) {}})
	if got := log.sentRevisions(); !equal(got, []int64{-1, 1, 2}) {
		t.Fatalf("held revisions sent %v", got)
	}
	if got := log.sentIncarnations; !equal(got, []string{"", "1", "1"}) {
		t.Fatalf("held incarnations sent %v", got)
	}
	if again.Result.GetRequestUnchanged() || !equal(names(again.Request), []string{"x", "y"}) || again.Request.GetIncarnation() != "2" {
		t.Fatalf("after a re-creation %v %v", again.Request, again.Result)
	}
	held := &v1.BuildRequestResponse{Revision: 2, Incarnation: "2"}
	result, err := client.PrepareStepUnaryHeldRequest(context.Background(), "s", 1, nil, held)
	if err != nil || !result.GetRequestUnchanged() {
		t.Fatalf("a held request's step %v %v", result, err)
	}
	if got := log.sentIncarnations[3]; got != "2" {
		t.Fatalf("held incarnation sent %q", got)
	}
}

func TestPrepareStepWithOnProgressIsStreamedAndHeldAlike(t *testing.T) {
	client, log := startHeld(t)
	var seen []*v1.CompactionProgress
	opts := &compactd.StepOptions{OnProgress: func(p *v1.CompactionProgress) { seen = append(seen, p) }}
	step(t, client, "s", opts)
	log.add("b")
	prepared := step(t, client, "s", opts)
	if got := log.sentRevisions(); !equal(got, []int64{-1, 1}) {
		t.Fatalf("held revisions sent %v", got)
	}
	if !equal(names(prepared.Request), []string{"a", "b"}) || len(prepared.Progress) != 1 || len(seen) != 2 {
		t.Fatalf("request %v progress %v seen %v", prepared.Request, prepared.Progress, seen)
	}
}

func TestHeldRequestsAreBoundedForgottenAndRebuiltWhenMovedOn(t *testing.T) {
	client, log := startHeld(t)
	client.HeldSessions = 1
	for _, session := range []string{"s1", "s2", "s1", "s1"} { // s2 pushes s1 out of one slot
		step(t, client, session, nil)
	}
	log.add("b")
	log.mu.Lock()
	log.concurrent = client.ForgetHeldRequest // another step moved the held request on
	log.mu.Unlock()
	rebuilt := step(t, client, "s1", nil)
	log.mu.Lock()
	log.concurrent = nil
	log.mu.Unlock()
	if !rebuilt.Result.GetRequestUnchanged() || !equal(names(rebuilt.Request), []string{"a", "b"}) || log.builds != 1 {
		t.Fatalf("rebuilt %v after %d BuildRequest", rebuilt.Request, log.builds)
	}
	step(t, client, "s1", nil) // the rebuilt request is held
	client.ForgetHeldRequest("s1")
	step(t, client, "s1", nil)
	client.HeldSessions = 0 // the next step still sends what is held; none is held after it
	step(t, client, "s1", nil)
	step(t, client, "s1", nil)
	if got := log.sentRevisions(); !equal(got, []int64{-1, -1, -1, 1, 1, 2, -1, 2, -1}) {
		t.Fatalf("held revisions sent %v", got)
	}
	if !proto.Equal(rebuilt.Request, &v1.BuildRequestResponse{Revision: 2, Messages: []*v1.Message{{Name: "a"}, {Name: "b"}}}) {
		t.Fatalf("rebuilt %v", rebuilt.Request)
	}
}

func TestDeleteSessionDropsTheHeldRequest(t *testing.T) {
	client, log := startHeld(t)
	step(t, client, "s", nil)
	step(t, client, "s", nil)
	if err := client.DeleteSession(context.Background(), "s"); err != nil {
		t.Fatal(err)
	}
	step(t, client, "s", nil) // the id again: nothing held, the full request
	if got := log.sentRevisions(); !equal(got, []int64{-1, 1, -1}) {
		t.Fatalf("held revisions sent %v", got)
	}
}
