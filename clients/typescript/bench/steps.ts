// The TypeScript side of bench/bench_steps.py (not a benchmark by itself: the Python bench builds
// the session, starts this driver and turns its timings into the table's rows). It times this
// client's default step, `prepareStep(sessionId, turn)` (the held request: one PrepareStepUnary
// with `heldRevision`, the answered messages appended), beside an empty unary RPC (a gRPC health
// check) sent from this same process, interleaved call by call, so the reference pays the same
// language's client costs. Also timed: the step with `onProgress` (the streamed PrepareStep,
// held alike), the call the examples make, and `prepareStepUnary` with the held request's
// revision (the RPC alone, nothing held: what the client's holding adds is the difference).
//
//   node dist/bench/steps.js ADDRESS SESSION TURN
//
// For each line read from stdin (a number of rounds, once the session has its next length) it
// steps twice (the first step of a client holds the full request), checks that the second one
// answered no request, then runs WARM_UP_ROUNDS untimed rounds and the timed ones, and writes one
// JSON line: each kind's per-call seconds, whether every timed step answered only what was
// appended, the largest step reply in bytes, and the held request's revision and message count.

import { createInterface } from "node:readline";
import { create, createFileRegistry, type DescMethodUnary, toBinary } from "@bufbuild/protobuf";
import {
  FieldDescriptorProto_Label,
  FieldDescriptorProto_Type,
  FileDescriptorProtoSchema,
} from "@bufbuild/protobuf/wkt";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import { CompactdClient } from "../src/index.js";
import { type PrepareStepResult, PrepareStepResultSchema } from "../src/gen/compactd/v1/compaction_service_pb.js";

/**
 * grpc.health.v1.Health/Check, described here: the client ships no health stubs. The response's
 * `status` enum is read as the int32 it is on the wire; nothing looks at it.
 */
function healthCheck(): DescMethodUnary {
  const field = (name: string, type: FieldDescriptorProto_Type) => ({
    name,
    jsonName: name,
    number: 1,
    type,
    label: FieldDescriptorProto_Label.OPTIONAL,
  });
  const file = create(FileDescriptorProtoSchema, {
    name: "grpc/health/v1/health.proto",
    package: "grpc.health.v1",
    syntax: "proto3",
    messageType: [
      { name: "HealthCheckRequest", field: [field("service", FieldDescriptorProto_Type.STRING)] },
      { name: "HealthCheckResponse", field: [field("status", FieldDescriptorProto_Type.INT32)] },
    ],
    service: [
      {
        name: "Health",
        method: [
          {
            name: "Check",
            inputType: ".grpc.health.v1.HealthCheckRequest",
            outputType: ".grpc.health.v1.HealthCheckResponse",
          },
        ],
      },
    ],
  });
  const service = createFileRegistry(file, () => undefined).getService("grpc.health.v1.Health");
  const check = service?.methods[0];
  if (check?.methodKind !== "unary") throw new Error("the health service descriptor has no unary Check");
  return check as DescMethodUnary; // DescMethod does not narrow on methodKind
}

/** Untimed rounds before the timed ones at each length (the JIT compiles the calls' paths). */
const WARM_UP_ROUNDS = 20;

interface Timings {
  empty: number[];
  step: number[];
  streamed: number[];
  unary: number[];
  unchanged: boolean;
  replyBytes: number;
  revision: string;
  messages: number;
}

async function main(): Promise<void> {
  const [address, sessionId, turnArg] = process.argv.slice(2);
  if (address === undefined || sessionId === undefined || turnArg === undefined) {
    throw new Error("usage: node dist/bench/steps.js ADDRESS SESSION TURN");
  }
  const turn = BigInt(turnArg);
  const client = new CompactdClient({ target: address });
  const baseUrl = `http://${address}`;
  const connection = new Http2SessionManager(baseUrl);
  const transport = createGrpcTransport({ baseUrl, sessionManager: connection });
  const check = healthCheck();
  const emptyRequest = create(check.input);

  const empty = () => transport.unary(check, undefined, undefined, undefined, emptyRequest);
  const step = () => client.prepareStep(sessionId, turn);
  const streamed = () => client.prepareStep(sessionId, turn, { onProgress: () => {} });

  const lines = createInterface({ input: process.stdin });
  for await (const line of lines) {
    const rounds = Number(line.trim());
    const first = await step();
    const second = await step();
    if (!second.result.requestUnchanged || second.request.revision !== first.request.revision) {
      throw new Error("the second step did not answer from the held request");
    }
    const timings: Timings = {
      empty: [],
      step: [],
      streamed: [],
      unary: [],
      unchanged: true,
      replyBytes: 0,
      revision: second.request.revision.toString(),
      messages: second.request.messages.length,
    };
    const heldRevision = second.request.revision;
    const results: PrepareStepResult[] = [];
    const kinds: Array<[number[], () => Promise<unknown>]> = [
      [timings.empty, empty],
      [timings.step, async () => results.push((await step()).result)],
      [timings.streamed, async () => results.push((await streamed()).result)],
      [timings.unary, () => client.prepareStepUnary(sessionId, turn, { heldRevision })],
    ];
    for (let round = -WARM_UP_ROUNDS; round < rounds; round++) {
      const order = round % 2 === 0 ? kinds : [...kinds].reverse();
      for (const [samples, call] of order) {
        const start = process.hrtime.bigint();
        await call();
        if (round >= 0) samples.push(Number(process.hrtime.bigint() - start) / 1e9);
      }
    }
    for (const result of results) {
      timings.unchanged &&= result.requestUnchanged;
      timings.replyBytes = Math.max(timings.replyBytes, toBinary(PrepareStepResultSchema, result).length);
    }
    process.stdout.write(JSON.stringify(timings) + "\n");
  }
  client.close();
  connection.abort();
}

main().catch((error: unknown) => {
  console.error(error);
  process.exit(1);
});
