// Command agent_loop is an agent loop on compactd, in Go: PrepareStep before every model call.
//
// For each turn of the script: open the turn, then step until the model answers without tool
// calls. Each step asks compactd to prepare it (PrepareStep prunes and compacts when the request
// is above pressure, streaming each bracket step; the client holds the request and compactd
// answers only what the step added), sends the request compactd rebuilt to the
// model (an OpenAI-compatible endpoint), logs the reply with its usage, runs the tools (scripted:
// the recorded outputs) and logs their results. Prints pressure per step, every compaction, and
// the final surface. Run through examples/run (it starts compactd and the scripted model).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"compactd.dev/client/openai"
)

type script struct {
	Source string `json:"source"`
	System string `json:"system"`
	Turns  []struct {
		User string `json:"user"`
	} `json:"turns"`
	ToolResults map[string]string `json:"tool_results"`
	Tools       []struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		InputSchema json.RawMessage `json:"input_schema"`
	} `json:"tools"`
}

func complete(baseURL string, body map[string]interface{}) (map[string]interface{}, error) {
	data, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	resp, err := http.Post(baseURL+"/chat/completions", "application/json", bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("model answered HTTP %d", resp.StatusCode)
	}
	var out map[string]interface{}
	return out, json.NewDecoder(resp.Body).Decode(&out)
}

func pressureLine(label string, r *v1.PressureReport) string {
	state := strings.TrimPrefix(r.GetState().String(), "PRESSURE_STATE_")
	method := strings.TrimPrefix(r.GetBreakdown().GetMethod().String(), "MEASUREMENT_METHOD_")
	return fmt.Sprintf("%s pressure %d/%d %s (%s)", label, r.GetMeasuredTokens(), r.GetTriggerTokens(), state, method)
}

func progressLine(p *v1.CompactionProgress) string {
	name := strings.ToLower(strings.TrimPrefix(p.GetStep().String(), "COMPACTION_STEP_"))
	return strings.TrimRight(fmt.Sprintf("    %-9s seq=%d %s", name, p.GetSeq(), p.GetDetail()), " ")
}

type agent struct {
	client                    *compactd.Client
	script                    script
	provider, model, baseURL  string
	sessionID                 string
	steps, compactions, prune int64
}

func (a *agent) append(events ...*v1.SessionEvent) {
	if _, err := a.client.AppendEvents(context.Background(), a.sessionID, events, nil); err != nil {
		log.Fatal(err)
	}
}

// openSession creates the session and logs the system prompt and the request header.
func (a *agent) openSession() {
	session, err := a.client.CreateSession(context.Background(), "", nil)
	if err != nil {
		log.Fatal(err)
	}
	a.sessionID = session.GetSessionId()
	fmt.Printf("session %s: %s\n", a.sessionID, a.script.Source)
	var tools []*v1.ToolDeclaration
	for _, t := range a.script.Tools {
		tools = append(tools, &v1.ToolDeclaration{Name: t.Name, Description: t.Description, InputSchemaJson: string(t.InputSchema)})
	}
	a.append(compactd.SystemMessage(a.script.System), compactd.RequestHeader(a.provider, a.model, tools...))
}

// runTurn opens the turn, steps until the model stops calling tools, closes the turn.
func (a *agent) runTurn(turn int64, user string) {
	a.append(compactd.TurnStart(turn), compactd.UserMessage(user))
	for step := int64(1); a.step(turn, step); step++ {
	}
	a.append(compactd.TurnEnd(turn, "completed"))
}

// step is one model call: prepare, send, log the reply and tool results. True if tools ran.
func (a *agent) step(turn, step int64) bool {
	a.steps++
	// compactd rebuilt the request; the converter makes it a chat-completions body.
	stream := false
	body, err := openai.RequestBody(a.prepare(turn, step), openai.BodyOptions{Stream: &stream})
	if err != nil {
		log.Fatal(err)
	}
	answer, err := complete(a.baseURL, body)
	if err != nil {
		log.Fatalf("model call failed: %v", err)
	}
	reply, err := openai.AssistantEvent(answer, a.provider)
	if err != nil {
		log.Fatal(err)
	}
	events := []*v1.SessionEvent{compactd.StepStart(turn, step), reply}
	calls := 0
	for _, b := range reply.GetAssistantMessage().GetContent() { // the scripted tools: the recorded outputs
		c := b.GetToolCall()
		if c == nil {
			continue
		}
		calls++
		output, ok := a.script.ToolResults[c.GetId()]
		if !ok {
			output = "(no output recorded)"
		}
		events = append(events, compactd.ToolResult(c.GetId(), c.GetName(), output))
	}
	a.append(append(events, compactd.StepEnd(turn, step))...)
	return calls > 0
}

// prepare runs PrepareStep, prints pressure and what compactd did, returns the request to send.
func (a *agent) prepare(turn, step int64) *v1.BuildRequestResponse {
	// The client holds the session's last request and sends its revision: compactd answers
	// only what this step added (or the full request after a compaction).
	var updates []string
	prepared, err := a.client.PrepareStep(context.Background(), a.sessionID, turn, &compactd.StepOptions{
		OnProgress: func(p *v1.CompactionProgress) { updates = append(updates, progressLine(p)) },
	})
	if err != nil {
		log.Fatal(err)
	}
	result := prepared.Result
	a.prune += result.GetPrunedCount()
	a.compactions += int64(len(result.GetCompactions()))
	line := pressureLine(fmt.Sprintf("turn %d step %2d", turn, step), result.GetBefore())
	if result.GetPrunedCount() > 0 || len(result.GetCompactions()) > 0 {
		line += fmt.Sprintf(" -> %d after %d pruned, %d compacted", result.GetAfter().GetMeasuredTokens(),
			result.GetPrunedCount(), len(result.GetCompactions()))
	}
	fmt.Println(line)
	for _, u := range updates {
		fmt.Println(u)
	}
	for _, o := range result.GetCompactions() {
		fmt.Printf("    compaction %s: %d items condensed, ~%d tokens freed\n", o.GetCompactionId(), o.GetItemsCondensed(), o.GetTokensFreed())
	}
	for _, w := range result.GetWarnings() {
		fmt.Printf("    warning: %s\n", w)
	}
	return prepared.Request
}

// report prints the totals, the final pressure and the final surface.
func (a *agent) report() {
	ctx := context.Background()
	final, err := a.client.CheckPressure(ctx, a.sessionID, nil)
	if err != nil {
		log.Fatal(err)
	}
	surface, err := a.client.GetSurface(ctx, a.sessionID)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("\n%d steps, %d compactions, %d tool results pruned\n", a.steps, a.compactions, a.prune)
	fmt.Println(pressureLine("final", final))
	fmt.Printf("surface at revision %d: %d nodes\n", surface.GetRevision(), len(surface.GetNodes()))
	for _, n := range surface.GetNodes() {
		chars := 0
		for _, b := range n.GetMessage().GetContent() {
			chars += len([]rune(b.GetText().GetText()))
		}
		mark := ""
		if n.GetCompactionId() != "" {
			mark = " checkpoint " + n.GetCompactionId()
		}
		fmt.Printf("  %3d seq %4d %-18s %6d chars%s\n", n.GetPosition(), n.GetSeq(), n.GetType(), chars, mark)
	}
	stream, err := a.client.Sessions.ListEvents(ctx, &v1.ListEventsRequest{SessionId: a.sessionID})
	if err != nil {
		log.Fatal(err)
	}
	events, brackets := 0, 0
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			log.Fatal(compactd.FromError(err))
		}
		events++
		if compactd.EventType(msg.GetEvent()) == "compaction/start" {
			brackets++
		}
	}
	fmt.Printf("log: %d events, %d brackets\n", events, brackets)
}

func main() {
	data, err := os.ReadFile(os.Getenv("COMPACTD_EXAMPLE_SCRIPT"))
	if err != nil {
		log.Fatal(err)
	}
	a := &agent{provider: os.Getenv("COMPACTD_PROVIDER"), model: os.Getenv("COMPACTD_MODEL"),
		baseURL: os.Getenv("COMPACTD_AGENT_BASE_URL")}
	if err := json.Unmarshal(data, &a.script); err != nil {
		log.Fatal(err)
	}
	if a.client, err = compactd.Dial(os.Getenv("COMPACTD_ADDRESS")); err != nil {
		log.Fatal(err)
	}
	defer a.client.Close()
	a.openSession()
	for i, turn := range a.script.Turns {
		a.runTurn(int64(i+1), turn.User)
	}
	a.report()
}
