package compactd_test

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// fakeSessions and fakeCompaction are real gRPC servers on loopback with scripted answers.
type fakeSessions struct {
	v1.UnimplementedSessionServiceServer
}

func (fakeSessions) AppendEvents(ctx context.Context, req *v1.AppendEventsRequest) (*v1.AppendEventsResponse, error) {
	st := status.New(codes.Aborted, "log ends at 5")
	st, _ = st.WithDetails(
		&errdetails.ErrorInfo{Reason: "SEQ_CONFLICT", Domain: "compactd.dev", Metadata: map[string]string{"last_seq": "5"}},
		&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: "expected_last_seq", Description: "stale"}}},
	)
	return nil, st.Err()
}

func (fakeSessions) GetSurface(ctx context.Context, req *v1.GetSurfaceRequest) (*v1.GetSurfaceResponse, error) {
	<-ctx.Done() // stall until the client's deadline (whichever side notices first says so)
	return nil, status.Error(codes.DeadlineExceeded, "stalled")
}

type fakeCompaction struct {
	v1.UnimplementedCompactionServiceServer
}

var bracket = []v1.CompactionStep{
	v1.CompactionStep_COMPACTION_STEP_START,
	v1.CompactionStep_COMPACTION_STEP_SUMMARIZE,
	v1.CompactionStep_COMPACTION_STEP_SUMMARY,
	v1.CompactionStep_COMPACTION_STEP_REPLACE,
	v1.CompactionStep_COMPACTION_STEP_END,
}

func (fakeCompaction) Compact(req *v1.CompactRequest, stream v1.CompactionService_CompactServer) error {
	if req.GetFocus() == "busy" {
		st, _ := status.New(codes.Aborted, "turn 4 is open").WithDetails(&errdetails.ErrorInfo{Reason: "COMPACTION_BUSY"})
		return st.Err()
	}
	for i, step := range bracket {
		p := &v1.CompactionProgress{Step: step, CompactionId: "c1", Seq: int64(10 + i)}
		if err := stream.Send(&v1.CompactResponse{Update: &v1.CompactResponse_Progress{Progress: p}}); err != nil {
			return err
		}
	}
	if req.GetFocus() == "truncate" {
		return nil
	}
	result := &v1.CompactResult{Outcome: &v1.CompactionOutcome{CompactionId: "c1", ItemsCondensed: 6}}
	return stream.Send(&v1.CompactResponse{Update: &v1.CompactResponse_Result{Result: result}})
}

func (fakeCompaction) WatchPressure(req *v1.WatchPressureRequest, stream v1.CompactionService_WatchPressureServer) error {
	for rev := int64(1); ; rev++ {
		if err := stream.Send(&v1.WatchPressureResponse{Report: &v1.PressureReport{Revision: rev}}); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-time.After(time.Millisecond):
		}
	}
}

func (fakeCompaction) PrepareStepUnary(ctx context.Context, req *v1.PrepareStepUnaryRequest) (*v1.PrepareStepUnaryResponse, error) {
	if req.GetSessionId() == "busy" {
		st, _ := status.New(codes.Aborted, "bracket live").WithDetails(&errdetails.ErrorInfo{Reason: "COMPACTION_BUSY"})
		return nil, st.Err()
	}
	result := &v1.PrepareStepResult{RequestUnchanged: req.HeldRevision != nil, RequestRevision: req.GetHeldRevision() + 2}
	return &v1.PrepareStepUnaryResponse{Result: result}, nil
}

func start(t *testing.T) *compactd.Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	server := grpc.NewServer()
	v1.RegisterSessionServiceServer(server, fakeSessions{})
	v1.RegisterCompactionServiceServer(server, fakeCompaction{})
	go func() { _ = server.Serve(lis) }()
	t.Cleanup(server.Stop)
	client, err := compactd.Dial(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

func TestSeqConflictCarriesReasonMetadataAndViolations(t *testing.T) {
	client := start(t)
	_, err := client.AppendEvents(context.Background(), "s1", []*v1.SessionEvent{compactd.UserMessage("hi")}, compactd.Seq(3))
	if !errors.Is(err, compactd.ErrSeqConflict) {
		t.Fatalf("want ErrSeqConflict, got %v", err)
	}
	var e *compactd.Error
	if !errors.As(err, &e) {
		t.Fatalf("want *compactd.Error, got %T", err)
	}
	if e.Metadata["last_seq"] != "5" || e.Domain != "compactd.dev" || len(e.Violations) != 1 {
		t.Fatalf("details lost: %+v", e)
	}
	if e.Error() != "ABORTED (SEQ_CONFLICT): log ends at 5" {
		t.Fatalf("message: %q", e.Error())
	}
}

func TestDeadlineIsTyped(t *testing.T) {
	client := start(t)
	client.Timeout = 200 * time.Millisecond
	_, err := client.GetSurface(context.Background(), "s1")
	var e *compactd.Error
	if !errors.As(err, &e) || e.Code != codes.DeadlineExceeded || e.Reason != "DEADLINE_EXCEEDED" {
		t.Fatalf("want DEADLINE_EXCEEDED, got %v", err)
	}
}

func TestCompactionYieldsEachStepThenItsResult(t *testing.T) {
	client := start(t)
	stream, err := client.Compact(context.Background(), "s1", "")
	if err != nil {
		t.Fatal(err)
	}
	var steps []v1.CompactionStep
	for {
		p, err := stream.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		steps = append(steps, p.GetStep())
	}
	result, err := stream.Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(steps) != len(bracket) || result.GetOutcome().GetItemsCondensed() != 6 {
		t.Fatalf("steps %v result %v", steps, result)
	}
}

func TestStreamWithoutResultIsIncomplete(t *testing.T) {
	client := start(t)
	stream, err := client.Compact(context.Background(), "s1", "truncate")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Result(); !errors.Is(err, compactd.ErrIncompleteStream) {
		t.Fatalf("want ErrIncompleteStream, got %v", err)
	}
}

func TestBusyCompactionIsTyped(t *testing.T) {
	client := start(t)
	stream, err := client.Compact(context.Background(), "s1", "busy")
	if err == nil {
		_, err = stream.Result()
	}
	if !errors.Is(err, compactd.ErrCompactionBusy) {
		t.Fatalf("want ErrCompactionBusy, got %v", err)
	}
}

func TestWatchEndsWhenItsContextIsCancelled(t *testing.T) {
	client := start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	watch, err := client.WatchPressure(ctx, "s1", nil)
	if err != nil {
		t.Fatal(err)
	}
	var revisions []int64
	for {
		report, err := watch.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		revisions = append(revisions, report.GetRevision())
		if len(revisions) == 3 {
			cancel()
		}
	}
	if revisions[0] != 1 || revisions[2] != 3 {
		t.Fatalf("revisions %v", revisions)
	}
}

func TestStepRequestExtendsTheHeldRequestOnlyWhenUnchanged(t *testing.T) {
	held := &v1.BuildRequestResponse{Revision: 7, Messages: []*v1.Message{{Name: "a"}}}
	unchanged := &v1.PrepareStepResult{RequestUnchanged: true, AppendedMessages: []*v1.Message{{Name: "b"}}, RequestRevision: 9}
	request, err := compactd.StepRequest(held, unchanged)
	if err != nil {
		t.Fatal(err)
	}
	if len(request.GetMessages()) != 2 || request.GetMessages()[1].GetName() != "b" || request.GetRevision() != 9 || len(held.GetMessages()) != 1 {
		t.Fatalf("request %v held %v", request, held)
	}
	full := &v1.BuildRequestResponse{Revision: 9}
	if got, err := compactd.StepRequest(held, &v1.PrepareStepResult{Request: full}); err != nil || got != full {
		t.Fatalf("full request: %v %v", got, err)
	}
	if _, err := compactd.StepRequest(nil, unchanged); err == nil {
		t.Fatal("an omitted request without the held one must fail")
	}
}

func TestPrepareStepUnarySendsTheHeldRevisionAndReturnsTheResult(t *testing.T) {
	client := start(t)
	held := int64(7)
	result, err := client.PrepareStepUnary(context.Background(), "s1", 3, nil, &held)
	if err != nil || !result.GetRequestUnchanged() || result.GetRequestRevision() != 9 {
		t.Fatalf("want an unchanged request at revision 9, got %v, %v", result, err)
	}
	full, err := client.PrepareStepUnary(context.Background(), "s1", 3, nil, nil)
	if err != nil || full.GetRequestUnchanged() {
		t.Fatalf("without a held revision the request is not unchanged: %v, %v", full, err)
	}
	if _, err := client.PrepareStepUnary(context.Background(), "busy", 3, nil, nil); !errors.Is(err, compactd.ErrCompactionBusy) {
		t.Fatalf("want ErrCompactionBusy, got %v", err)
	}
}
