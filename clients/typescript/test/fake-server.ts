// A real gRPC server on loopback (connect-node's router over node:http2) whose handlers each
// test scripts, so the client is exercised through real HTTP/2 frames and status trailers.

import * as http2 from "node:http2";
import type { AddressInfo } from "node:net";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type ConnectRouter, type ServiceImpl } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";
import { CompactionService } from "../src/gen/compactd/v1/compaction_service_pb.js";
import { SessionService } from "../src/gen/compactd/v1/session_service_pb.js";
import { BadRequestSchema, ErrorInfoSchema } from "../src/gen/google/rpc/error_details_pb.js";

export interface FakeServer {
  target: string;
  /** Invocations per method name (retries included). */
  calls: Map<string, number>;
  close(): Promise<void>;
}

/** Starts a server implementing the given handlers; unscripted methods answer UNIMPLEMENTED. */
export async function startFake(
  sessionImpl: Partial<ServiceImpl<typeof SessionService>> = {},
  compaction: Partial<ServiceImpl<typeof CompactionService>> = {},
): Promise<FakeServer> {
  const calls = new Map<string, number>();
  const routes = (router: ConnectRouter) => {
    router.service(SessionService, counted(sessionImpl, calls));
    router.service(CompactionService, counted(compaction, calls));
  };
  const server = http2.createServer(connectNodeAdapter({ routes, grpc: true, connect: false, grpcWeb: false }));
  const sessions = new Set<http2.ServerHttp2Session>();
  server.on("session", (session) => {
    sessions.add(session);
    session.on("close", () => sessions.delete(session));
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  return {
    target: `127.0.0.1:${port}`,
    calls,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        // close() waits for open sessions; the clients keep theirs, so end them here.
        for (const session of sessions) session.destroy();
      }),
  };
}

function counted<T extends object>(impl: T, calls: Map<string, number>): T {
  const wrapped: Record<string, unknown> = {};
  for (const [name, fn] of Object.entries(impl)) {
    const method = name.charAt(0).toUpperCase() + name.slice(1);
    wrapped[name] = (...args: unknown[]) => {
      calls.set(method, (calls.get(method) ?? 0) + 1);
      return (fn as (...a: unknown[]) => unknown)(...args);
    };
  }
  return wrapped as T;
}

/** An error shaped like compactd's: one ErrorInfo, optional BadRequest violations. */
export function richError(
  code: Code,
  message: string,
  reason: string,
  metadata: Record<string, string> = {},
  violations: Array<[string, string]> = [],
): ConnectError {
  const details = [
    { desc: ErrorInfoSchema, value: create(ErrorInfoSchema, { reason, domain: "compactd.dev", metadata }) },
  ];
  if (violations.length > 0) {
    const fieldViolations = violations.map(([field, description]) => ({ field, description }));
    return new ConnectError(message, code, undefined, [
      ...details,
      { desc: BadRequestSchema, value: create(BadRequestSchema, { fieldViolations }) },
    ]);
  }
  return new ConnectError(message, code, undefined, details);
}
