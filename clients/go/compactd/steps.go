package compactd

// The request a step sends. PrepareStep with a held revision (the revision of the request the
// caller holds) answers the full request only when compactd changed what that request shows (a
// compaction, a prune, an image offload, a new header); otherwise only the messages appended
// since (RequestUnchanged), so a step costs what it adds, not the session's length. With it goes
// the held incarnation (the held request's Incarnation): a session deleted and created again
// under the same id by another process restarts its revisions, and the server then answers the
// full request. The client's PrepareStep does this by itself with heldRequests; StepRequest is the same rule for a
// runtime that calls PrepareStepUnary or PrepareStepStream and holds its requests itself.

import (
	"container/list"
	"fmt"
	"sync"

	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/protobuf/proto"
)

// DefaultHeldSessions is how many sessions' last request a client holds by default (the least
// recently stepped is dropped first).
const DefaultHeldSessions = 64

// PreparedStep is what PrepareStep answers.
type PreparedStep struct {
	// Request is the full request to send: what BuildRequest answers at Request.Revision. Later
	// steps do not change it, but it shares its messages, config and tools with the request the
	// client holds: do not modify them.
	Request *v1.BuildRequestResponse
	// Result is the step's result as the server sent it (pressure Before and After, PrunedCount,
	// Compactions, Warnings); its Request is nil when RequestUnchanged.
	Result *v1.PrepareStepResult
	// Progress holds the step updates, in order, when the step was streamed (OnProgress).
	Progress []*v1.CompactionProgress
}

// StepOptions are PrepareStep's optional arguments.
type StepOptions struct {
	// IntendedRoute is the route the step will use; nil uses the logged one.
	IntendedRoute *v1.Route
	// OnProgress, when set, streams the step (PrepareStep) and is called with each update as it
	// arrives; without it the step is one PrepareStepUnary call, the cheaper one.
	OnProgress func(*v1.CompactionProgress)
}

// heldRequests keeps the last full request of each recently stepped session, least recently
// stepped first in order; safe for concurrent use. The zero value is ready.
type heldRequests struct {
	mu       sync.Mutex
	order    list.List                // of *heldRequest, least recently stepped first
	sessions map[string]*list.Element // session id -> its element in order
}

type heldRequest struct {
	sessionID string
	request   *v1.BuildRequestResponse
}

// held is the revision and incarnation of the request held for the session, read together
// (the held revision and incarnation to send); nil and "" when none is held.
func (h *heldRequests) held(sessionID string) (*int64, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if e, ok := h.sessions[sessionID]; ok {
		request := e.Value.(*heldRequest).request
		revision := request.GetRevision()
		return &revision, request.GetIncarnation()
	}
	return nil, ""
}

// update holds the full request of result (a step sent with held revision sent and held
// incarnation sentIncarnation) and returns it: the result's request when it carries one, else
// the held request with the appended messages at RequestRevision. It returns nil when the
// result omits the request and the held one is no longer at sent of sentIncarnation (dropped,
// or moved on by a concurrent step).
func (h *heldRequests) update(sessionID string, sent *int64, sentIncarnation string, result *v1.PrepareStepResult, capacity int) *v1.BuildRequestResponse {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !result.GetRequestUnchanged() {
		if full := result.GetRequest(); full != nil {
			h.hold(sessionID, view(full), capacity)
		}
		return result.GetRequest()
	}
	e, ok := h.sessions[sessionID]
	if !ok || sent == nil {
		return nil
	}
	held := e.Value.(*heldRequest).request
	if held.GetRevision() != *sent || held.GetIncarnation() != sentIncarnation {
		return nil
	}
	// Cost follows the step: the held messages stay, the new ones are appended (amortized: the
	// slice grows by doubling, and views never share its spare capacity).
	held.Messages = append(held.Messages, result.GetAppendedMessages()...)
	held.Revision = result.GetRequestRevision()
	h.hold(sessionID, held, capacity)
	return view(held)
}

// put holds request for the session in place of the held one and returns it.
func (h *heldRequests) put(sessionID string, request *v1.BuildRequestResponse, capacity int) *v1.BuildRequestResponse {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.hold(sessionID, view(request), capacity)
	return request
}

func (h *heldRequests) hold(sessionID string, request *v1.BuildRequestResponse, capacity int) {
	if capacity <= 0 {
		h.forgetLocked(sessionID)
		return
	}
	if h.sessions == nil {
		h.sessions = map[string]*list.Element{}
	}
	if e, ok := h.sessions[sessionID]; ok {
		e.Value.(*heldRequest).request = request
		h.order.MoveToBack(e)
	} else {
		h.sessions[sessionID] = h.order.PushBack(&heldRequest{sessionID, request})
	}
	for h.order.Len() > capacity {
		h.forgetLocked(h.order.Front().Value.(*heldRequest).sessionID)
	}
}

func (h *heldRequests) forget(sessionID string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.forgetLocked(sessionID)
}

func (h *heldRequests) forgetLocked(sessionID string) {
	if e, ok := h.sessions[sessionID]; ok {
		h.order.Remove(e)
		delete(h.sessions, sessionID)
	}
}

func (h *heldRequests) clear() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.order.Init()
	h.sessions = nil
}

// view is a new request with r's fields, its Messages capped at their length: appending to
// either one's messages never writes into the other's (no copy of the messages themselves).
// It lists BuildRequestResponse's fields; TestAViewKeepsEveryFieldOfTheRequest fails when the
// message gains one.
func view(r *v1.BuildRequestResponse) *v1.BuildRequestResponse {
	n := len(r.GetMessages())
	return &v1.BuildRequestResponse{
		Revision:        r.GetRevision(),
		Messages:        r.GetMessages()[:n:n],
		Config:          r.GetConfig(),
		AdapterDefaults: r.GetAdapterDefaults(),
		Tools:           r.GetTools(),
		HeaderSeq:       r.GetHeaderSeq(),
		Pins:            r.GetPins(),
		Incarnation:     r.GetIncarnation(),
	}
}

// StepRequest is the request a step sends, leaving held as it was: the result's full request
// or, when the result says RequestUnchanged, a copy of held with the messages appended since
// (it costs the whole request; the client's PrepareStep extends its held request instead). Its
// Revision is the next step's held revision. held may be nil only when the result carries the
// full request.
func StepRequest(held *v1.BuildRequestResponse, result *v1.PrepareStepResult) (*v1.BuildRequestResponse, error) {
	if !result.GetRequestUnchanged() {
		return result.GetRequest(), nil
	}
	if held == nil {
		return nil, fmt.Errorf("the PrepareStep result omits the request: pass the request heldRevision named")
	}
	request := proto.Clone(held).(*v1.BuildRequestResponse)
	request.Messages = append(request.Messages, result.GetAppendedMessages()...)
	request.Revision = result.GetRequestRevision()
	return request, nil
}
