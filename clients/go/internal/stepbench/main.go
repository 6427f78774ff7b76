// Command stepbench is the Go side of bench/bench_steps.py (not a benchmark by itself: the Python
// bench builds the session, starts this driver and turns its timings into the table's rows). It
// times this client's default step, PrepareStep(ctx, session, turn, nil) (the held request: one
// PrepareStepUnary with the held revision, the answered messages appended), beside an empty unary
// RPC (a gRPC health check) sent from this same process, interleaved call by call, so the
// reference pays the same language's client costs. Also timed: the step with OnProgress (the
// streamed PrepareStep, held alike), the call the examples make, and PrepareStepUnary with the
// held request's revision (the RPC alone, nothing held: what the client's holding adds is the
// difference).
//
//	stepbench ADDRESS SESSION TURN
//
// For each line read from stdin (a number of rounds, once the session has its next length) it
// steps twice (the first step of a client holds the full request), checks that the second one
// answered no request, then runs warmUpRounds untimed rounds and the timed ones, and writes one
// JSON line: each kind's per-call seconds, whether every timed step answered only what was
// appended, the largest step reply in bytes, and the held request's revision and message count.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"compactd.dev/client/compactd"
	v1 "compactd.dev/client/compactdv1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"
)

// warmUpRounds are untimed rounds before the timed ones at each length (as the TypeScript
// driver's, whose JIT needs them; here they settle the connections and the allocator).
const warmUpRounds = 20

type timings struct {
	Empty      []float64 `json:"empty"`
	Step       []float64 `json:"step"`
	Streamed   []float64 `json:"streamed"`
	Unary      []float64 `json:"unary"`
	Unchanged  bool      `json:"unchanged"`
	ReplyBytes int       `json:"replyBytes"`
	Revision   string    `json:"revision"`
	Messages   int       `json:"messages"`
}

func main() {
	if len(os.Args) != 4 {
		log.Fatal("usage: stepbench ADDRESS SESSION TURN")
	}
	address, sessionID := os.Args[1], os.Args[2]
	turn, err := strconv.ParseInt(os.Args[3], 10, 64)
	if err != nil {
		log.Fatal(err)
	}
	// A client's first step receives the full request: 68.9 MB at 100,000 events, over the
	// client's 64 MiB default; the bench lifts it as the Python bench lifts its clients'.
	client, err := compactd.Dial(address, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32)))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	conn, err := grpc.Dial(address, grpc.WithInsecure())
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	health := grpc_health_v1.NewHealthClient(conn)
	ctx := context.Background()
	lines := bufio.NewScanner(os.Stdin)
	out := json.NewEncoder(os.Stdout)
	for lines.Scan() {
		rounds, err := strconv.Atoi(strings.TrimSpace(lines.Text()))
		if err != nil {
			log.Fatal(err)
		}
		t, err := measure(ctx, client, health, sessionID, turn, rounds)
		if err != nil {
			log.Fatal(err)
		}
		if err := out.Encode(t); err != nil {
			log.Fatal(err)
		}
	}
	if err := lines.Err(); err != nil {
		log.Fatal(err)
	}
}

func measure(ctx context.Context, client *compactd.Client, health grpc_health_v1.HealthClient, sessionID string, turn int64, rounds int) (*timings, error) {
	first, err := client.PrepareStep(ctx, sessionID, turn, nil)
	if err != nil {
		return nil, err
	}
	second, err := client.PrepareStep(ctx, sessionID, turn, nil)
	if err != nil {
		return nil, err
	}
	if !second.Result.GetRequestUnchanged() || second.Request.GetRevision() != first.Request.GetRevision() {
		return nil, fmt.Errorf("the second step did not answer from the held request")
	}
	t := &timings{
		Unchanged: true,
		Revision:  strconv.FormatInt(second.Request.GetRevision(), 10),
		Messages:  len(second.Request.GetMessages()),
	}
	var results []*v1.PrepareStepResult
	streamed := &compactd.StepOptions{OnProgress: func(*v1.CompactionProgress) {}}
	step := func(opts *compactd.StepOptions) func() error {
		return func() error {
			prepared, err := client.PrepareStep(ctx, sessionID, turn, opts)
			if err == nil {
				results = append(results, prepared.Result)
			}
			return err
		}
	}
	kinds := []struct {
		samples *[]float64
		call    func() error
	}{
		{&t.Empty, func() error {
			_, err := health.Check(ctx, &grpc_health_v1.HealthCheckRequest{})
			return err
		}},
		{&t.Step, step(nil)},
		{&t.Streamed, step(streamed)},
		{&t.Unary, func() error {
			revision := second.Request.GetRevision()
			_, err := client.PrepareStepUnary(ctx, sessionID, turn, nil, &revision)
			return err
		}},
	}
	for round := -warmUpRounds; round < rounds; round++ {
		for i := range kinds {
			kind := kinds[i]
			if round%2 != 0 {
				kind = kinds[len(kinds)-1-i]
			}
			start := time.Now()
			if err := kind.call(); err != nil {
				return nil, err
			}
			if round >= 0 {
				*kind.samples = append(*kind.samples, time.Since(start).Seconds())
			}
		}
	}
	for _, result := range results {
		t.Unchanged = t.Unchanged && result.GetRequestUnchanged()
		if size := proto.Size(result); size > t.ReplyBytes {
			t.ReplyBytes = size
		}
	}
	return t, nil
}
