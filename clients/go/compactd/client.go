// Package compactd is a thin typed client for the compactd gRPC services.
//
// Every method returns an *Error (see errors.go) for a failed call. Unary calls get the
// client's default deadline when the context has none; streams run until their context ends.
package compactd

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

// ServiceConfig retries the idempotent RPCs (reads) on UNAVAILABLE. grpc-go applies retry
// policies by default from v1.40; older releases (Debian bookworm ships v1.33) need the
// environment variable GRPC_GO_RETRY=on.
const ServiceConfig = `{"methodConfig": [{
  "name": [
    {"service": "compactd.v1.SessionService", "method": "ListEvents"},
    {"service": "compactd.v1.SessionService", "method": "GetSurface"},
    {"service": "compactd.v1.SessionService", "method": "BuildRequest"},
    {"service": "compactd.v1.SessionService", "method": "ListSessions"},
    {"service": "compactd.v1.SessionService", "method": "Recall"},
    {"service": "compactd.v1.CompactionService", "method": "CheckPressure"},
    {"service": "compactd.v1.CompactionService", "method": "WatchPressure"},
    {"service": "compactd.v1.CompactionService", "method": "ClassifyProviderError"},
    {"service": "compactd.v1.CompactionService", "method": "PlanCompaction"},
    {"service": "compactd.v1.CompactionService", "method": "ListBrackets"}
  ],
  "retryPolicy": {
    "maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "2s",
    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
  }
}]}`

// Client talks to both compactd services over one connection.
type Client struct {
	conn *grpc.ClientConn
	// Sessions and Compaction are the raw generated stubs, for calls the wrapper lacks.
	Sessions   v1.SessionServiceClient
	Compaction v1.CompactionServiceClient
	// Timeout is the default deadline of unary calls (0: none).
	Timeout time.Duration
	// HeldSessions is how many sessions' last request PrepareStep holds (Dial sets
	// DefaultHeldSessions; the least recently stepped is dropped first; ForgetHeldRequest and
	// Close drop them too). 0 holds none: every step then answers the full request.
	HeldSessions int
	held         heldRequests
}

// Dial connects (plaintext, lazily) to target ("host:port") with the retrying service config.
// Extra dial options (credentials, interceptors) are applied after the defaults.
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	defaults := []grpc.DialOption{
		grpc.WithInsecure(),
		grpc.WithDefaultServiceConfig(ServiceConfig),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64 << 20)),
	}
	conn, err := grpc.Dial(target, append(defaults, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("compactd: dial %s: %w", target, err)
	}
	return &Client{
		conn:         conn,
		Sessions:     v1.NewSessionServiceClient(conn),
		Compaction:   v1.NewCompactionServiceClient(conn),
		Timeout:      30 * time.Second,
		HeldSessions: DefaultHeldSessions,
	}, nil
}

// Close closes the connection and drops the held requests.
func (c *Client) Close() error {
	c.held.clear()
	return c.conn.Close()
}

func (c *Client) unaryContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok || c.Timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.Timeout)
}

// CreateSession creates an empty session ("" lets the server choose the id). policy holds
// per-session compaction policy overrides with the spec's keys, or nil.
func (c *Client) CreateSession(ctx context.Context, sessionID string, policy map[string]interface{}) (*v1.Session, error) {
	req := &v1.CreateSessionRequest{SessionId: sessionID}
	if policy != nil {
		s, err := toStruct(policy)
		if err != nil {
			return nil, err
		}
		req.CompactionPolicy = s
	}
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.CreateSession(ctx, req)
	if err != nil {
		return nil, FromError(err)
	}
	return resp.GetSession(), nil
}

// AppendEvents appends events atomically. With expectedLastSeq (-1 for an empty log) a
// mismatch fails with ErrSeqConflict and appends nothing; nil skips the check.
func (c *Client) AppendEvents(ctx context.Context, sessionID string, events []*v1.SessionEvent, expectedLastSeq *int64) (*v1.AppendEventsResponse, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.AppendEvents(ctx, &v1.AppendEventsRequest{
		SessionId: sessionID, Events: events, ExpectedLastSeq: expectedLastSeq,
	})
	return resp, FromError(err)
}

// Seq returns a pointer to n, for AppendEvents' expectedLastSeq.
func Seq(n int64) *int64 { return &n }

// GetSurface returns the current surface.
func (c *Client) GetSurface(ctx context.Context, sessionID string) (*v1.GetSurfaceResponse, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.GetSurface(ctx, &v1.GetSurfaceRequest{SessionId: sessionID})
	return resp, FromError(err)
}

// CreateChildSession creates a sub-agent's session: a child of parentSessionID (of the same
// tenant; ErrNotFound when it does not exist). With forkAtSeq (nil: none) the child starts with
// a copy of the parent's surface as it stood right after that seq.
func (c *Client) CreateChildSession(ctx context.Context, sessionID, parentSessionID string, forkAtSeq *int64) (*v1.Session, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.CreateSession(ctx, &v1.CreateSessionRequest{
		SessionId: sessionID, ParentSessionId: parentSessionID, ForkAtSeq: forkAtSeq,
	})
	if err != nil {
		return nil, FromError(err)
	}
	return resp.GetSession(), nil
}

// ListSessions returns one page of the caller's tenant's sessions in id order (NextPageToken ""
// at the end); with parentSessionID, that session's children only.
func (c *Client) ListSessions(ctx context.Context, pageSize int32, pageToken, parentSessionID string) (*v1.ListSessionsResponse, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.ListSessions(ctx, &v1.ListSessionsRequest{
		PageSize: pageSize, PageToken: pageToken, ParentSessionId: parentSessionID,
	})
	return resp, FromError(err)
}

// DeleteSession deletes the session and its log, durably, and drops the request the client holds
// for it (the id may be created again, fresh: a held request would name the old log's
// revision). NOT_FOUND when it does not exist.
func (c *Client) DeleteSession(ctx context.Context, sessionID string) error {
	c.held.forget(sessionID)
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	_, err := c.Sessions.DeleteSession(ctx, &v1.DeleteSessionRequest{SessionId: sessionID})
	return FromError(err)
}

// BuildRequest returns the reconstructed model request.
func (c *Client) BuildRequest(ctx context.Context, sessionID string) (*v1.BuildRequestResponse, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Sessions.BuildRequest(ctx, &v1.BuildRequestRequest{SessionId: sessionID})
	return resp, FromError(err)
}

// CheckPressure measures the envelope against the route's policy (destination may be nil).
func (c *Client) CheckPressure(ctx context.Context, sessionID string, destination *v1.Route) (*v1.PressureReport, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	resp, err := c.Compaction.CheckPressure(ctx, &v1.CheckPressureRequest{SessionId: sessionID, Destination: destination})
	if err != nil {
		return nil, FromError(err)
	}
	return resp.GetReport(), nil
}

// Watch is a stream of pressure reports; Recv returns io.EOF once the context is cancelled.
type Watch struct {
	ctx    context.Context
	stream v1.CompactionService_WatchPressureClient
}

// WatchPressure streams a report now and one per new revision until ctx is cancelled.
func (c *Client) WatchPressure(ctx context.Context, sessionID string, destination *v1.Route) (*Watch, error) {
	stream, err := c.Compaction.WatchPressure(ctx, &v1.WatchPressureRequest{SessionId: sessionID, Destination: destination})
	if err != nil {
		return nil, FromError(err)
	}
	return &Watch{ctx: ctx, stream: stream}, nil
}

// Recv returns the next report.
func (w *Watch) Recv() (*v1.PressureReport, error) {
	msg, err := w.stream.Recv()
	if err != nil {
		if err == io.EOF || w.ctx.Err() != nil {
			return nil, io.EOF
		}
		return nil, FromError(err)
	}
	return msg.GetReport(), nil
}

// update is what every compaction stream message offers: a progress update or the result.
type update[R any] interface {
	GetProgress() *v1.CompactionProgress
	GetResult() R
}

// CompactionStream yields the progress of one compaction call, then its result.
type CompactionStream[M update[R], R comparable] struct {
	recv     func() (M, error)
	result   R
	Progress []*v1.CompactionProgress
}

// Next returns the next progress update, or io.EOF when the stream has ended.
func (s *CompactionStream[M, R]) Next() (*v1.CompactionProgress, error) {
	var zero R
	for {
		msg, err := s.recv()
		if err == io.EOF {
			return nil, io.EOF
		}
		if err != nil {
			return nil, FromError(err)
		}
		if p := msg.GetProgress(); p != nil {
			s.Progress = append(s.Progress, p)
			return p, nil
		}
		if r := msg.GetResult(); r != zero {
			s.result = r
		}
	}
}

// Result drains the stream and returns the final result (ErrIncompleteStream without one).
func (s *CompactionStream[M, R]) Result() (R, error) {
	var zero R
	for {
		_, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return zero, err
		}
	}
	if s.result == zero {
		return zero, ErrIncompleteStream
	}
	return s.result, nil
}

func newStream[M update[R], R comparable](recv func() (M, error), err error) (*CompactionStream[M, R], error) {
	if err != nil {
		return nil, FromError(err)
	}
	return &CompactionStream[M, R]{recv: recv}, nil
}

// PrepareStep runs the pre-step check for an open turn (prunes and compacts when above
// pressure) and answers the full request to send. opts may be nil.
//
// The client holds the session's last request (see HeldSessions) and sends its revision as the
// held revision: while compactd changed nothing it shows, the server answers only the messages
// appended since, which the client appends to the held request. A step that compacted, pruned
// or switched routes answers the full request, which the client then holds instead. So a step
// costs what it adds, never the session's length. Without opts.OnProgress the step is one
// PrepareStepUnary call; give ctx a deadline a compaction fits in. Errors as PrepareStepStream
// (ErrCompactionBusy while a bracket is live).
func (c *Client) PrepareStep(ctx context.Context, sessionID string, turn int64, opts *StepOptions) (*PreparedStep, error) {
	var o StepOptions
	if opts != nil {
		o = *opts
	}
	sent, incarnation := c.held.held(sessionID)
	var result *v1.PrepareStepResult
	var progress []*v1.CompactionProgress
	var err error
	if o.OnProgress == nil {
		result, err = c.prepareStepUnary(ctx, &v1.PrepareStepUnaryRequest{SessionId: sessionID, Turn: turn, IntendedRoute: o.IntendedRoute, HeldRevision: sent, HeldIncarnation: incarnation})
	} else {
		result, progress, err = c.streamStep(ctx, &v1.PrepareStepRequest{SessionId: sessionID, Turn: turn, IntendedRoute: o.IntendedRoute, HeldRevision: sent, HeldIncarnation: incarnation}, o.OnProgress)
	}
	if err != nil {
		return nil, err
	}
	request := c.held.update(sessionID, sent, incarnation, result, c.HeldSessions)
	if request == nil { // the held request moved on meanwhile (a concurrent step): rebuild it
		full, err := c.BuildRequest(ctx, sessionID)
		if err != nil {
			return nil, err
		}
		request = c.held.put(sessionID, full, c.HeldSessions)
	}
	return &PreparedStep{Request: request, Result: result, Progress: progress}, nil
}

// streamStep runs the PrepareStep stream to its result, passing each update to onProgress.
func (c *Client) streamStep(ctx context.Context, request *v1.PrepareStepRequest, onProgress func(*v1.CompactionProgress)) (*v1.PrepareStepResult, []*v1.CompactionProgress, error) {
	ctx, cancel := context.WithCancel(ctx) // ends the call on an early return
	defer cancel()
	stream, err := c.prepareStep(ctx, request)
	if err != nil {
		return nil, nil, err
	}
	for {
		p, err := stream.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, nil, err
		}
		onProgress(p)
	}
	result, err := stream.Result()
	return result, stream.Progress, err
}

// ForgetHeldRequest drops the request the client holds for the session (a runtime done with
// it); the session's next PrepareStep answers the full request.
func (c *Client) ForgetHeldRequest(sessionID string) { c.held.forget(sessionID) }

// PrepareStepStream is the PrepareStep stream as the server sends it: Next for the progress,
// Result for the result. Nothing is held: the result carries the full request.
func (c *Client) PrepareStepStream(ctx context.Context, sessionID string, turn int64, intended *v1.Route) (*CompactionStream[*v1.PrepareStepResponse, *v1.PrepareStepResult], error) {
	return c.prepareStep(ctx, &v1.PrepareStepRequest{SessionId: sessionID, Turn: turn, IntendedRoute: intended})
}

// PrepareStepHeld is PrepareStepStream for a runtime that holds the request built at heldRevision:
// the result omits the full request while compactd changed none of it (StepRequest gives the
// request to send either way). It cannot tell a session deleted and created again under the
// same id from the one held: PrepareStepHeldRequest can.
func (c *Client) PrepareStepHeld(ctx context.Context, sessionID string, turn int64, intended *v1.Route, heldRevision int64) (*CompactionStream[*v1.PrepareStepResponse, *v1.PrepareStepResult], error) {
	return c.prepareStep(ctx, &v1.PrepareStepRequest{SessionId: sessionID, Turn: turn, IntendedRoute: intended, HeldRevision: &heldRevision})
}

// PrepareStepHeldRequest is PrepareStepHeld for the request the runtime holds: it sends held's
// revision and incarnation, so a session another process deleted and created again under the
// same id (its revisions restarted) answers the full request.
func (c *Client) PrepareStepHeldRequest(ctx context.Context, sessionID string, turn int64, intended *v1.Route, held *v1.BuildRequestResponse) (*CompactionStream[*v1.PrepareStepResponse, *v1.PrepareStepResult], error) {
	revision := held.GetRevision()
	return c.prepareStep(ctx, &v1.PrepareStepRequest{SessionId: sessionID, Turn: turn, IntendedRoute: intended, HeldRevision: &revision, HeldIncarnation: held.GetIncarnation()})
}

// PrepareStepUnaryHeldRequest is PrepareStepUnary for the request the runtime holds, sending its
// revision and incarnation (as PrepareStepHeldRequest).
func (c *Client) PrepareStepUnaryHeldRequest(ctx context.Context, sessionID string, turn int64, intended *v1.Route, held *v1.BuildRequestResponse) (*v1.PrepareStepResult, error) {
	revision := held.GetRevision()
	return c.prepareStepUnary(ctx, &v1.PrepareStepUnaryRequest{SessionId: sessionID, Turn: turn, IntendedRoute: intended, HeldRevision: &revision, HeldIncarnation: held.GetIncarnation()})
}

// PrepareStepUnary is the PrepareStepUnary RPC as the server answers it: PrepareStepStream's
// result in one call, no step updates, nothing held. It is cheaper than the stream for a runtime that shows no compaction progress
// (most steps are below pressure); a compaction it runs happens inside the call, so give ctx a
// deadline a compaction fits in. heldRevision may be nil (the result then carries the full
// request).
func (c *Client) PrepareStepUnary(ctx context.Context, sessionID string, turn int64, intended *v1.Route, heldRevision *int64) (*v1.PrepareStepResult, error) {
	return c.prepareStepUnary(ctx, &v1.PrepareStepUnaryRequest{SessionId: sessionID, Turn: turn, IntendedRoute: intended, HeldRevision: heldRevision})
}

func (c *Client) prepareStepUnary(ctx context.Context, request *v1.PrepareStepUnaryRequest) (*v1.PrepareStepResult, error) {
	response, err := c.Compaction.PrepareStepUnary(ctx, request)
	if err != nil {
		return nil, FromError(err)
	}
	if response.GetResult() == nil {
		return nil, ErrIncompleteStream
	}
	return response.GetResult(), nil
}

func (c *Client) prepareStep(ctx context.Context, request *v1.PrepareStepRequest) (*CompactionStream[*v1.PrepareStepResponse, *v1.PrepareStepResult], error) {
	s, err := c.Compaction.PrepareStep(ctx, request)
	if err != nil {
		return newStream[*v1.PrepareStepResponse, *v1.PrepareStepResult](nil, err)
	}
	return newStream[*v1.PrepareStepResponse, *v1.PrepareStepResult](s.Recv, nil)
}

// Compact compacts on demand (ErrCompactionBusy while a turn is open or a bracket is live).
func (c *Client) Compact(ctx context.Context, sessionID, focus string) (*CompactionStream[*v1.CompactResponse, *v1.CompactResult], error) {
	s, err := c.Compaction.Compact(ctx, &v1.CompactRequest{SessionId: sessionID, Focus: focus})
	if err != nil {
		return newStream[*v1.CompactResponse, *v1.CompactResult](nil, err)
	}
	return newStream[*v1.CompactResponse, *v1.CompactResult](s.Recv, nil)
}

// RecoverFromError recovers after a provider error; the result says whether to retry.
func (c *Client) RecoverFromError(ctx context.Context, sessionID string, turn int64, perr *v1.ProviderError, retriesSoFar int32) (*CompactionStream[*v1.RecoverFromErrorResponse, *v1.RecoverFromErrorResult], error) {
	s, err := c.Compaction.RecoverFromError(ctx, &v1.RecoverFromErrorRequest{
		SessionId: sessionID, Turn: turn, Error: perr, RetriesSoFar: retriesSoFar,
	})
	if err != nil {
		return newStream[*v1.RecoverFromErrorResponse, *v1.RecoverFromErrorResult](nil, err)
	}
	return newStream[*v1.RecoverFromErrorResponse, *v1.RecoverFromErrorResult](s.Recv, nil)
}

// SwitchModel compacts history until it fits the destination route (turn may be nil).
func (c *Client) SwitchModel(ctx context.Context, sessionID string, destination *v1.Route, turn *int64) (*CompactionStream[*v1.SwitchModelResponse, *v1.SwitchModelResult], error) {
	s, err := c.Compaction.SwitchModel(ctx, &v1.SwitchModelRequest{SessionId: sessionID, Destination: destination, Turn: turn})
	if err != nil {
		return newStream[*v1.SwitchModelResponse, *v1.SwitchModelResult](nil, err)
	}
	return newStream[*v1.SwitchModelResponse, *v1.SwitchModelResult](s.Recv, nil)
}

func toStruct(m map[string]interface{}) (*structpb.Struct, error) {
	// Round-trip through JSON so ints, nested maps and slices become Struct values.
	data, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("compactd: compaction policy: %w", err)
	}
	s := &structpb.Struct{}
	if err := s.UnmarshalJSON(data); err != nil {
		return nil, fmt.Errorf("compactd: compaction policy: %w", err)
	}
	return s, nil
}
