// compactd's TypeScript client: the thin wrapper, typed errors, event builders, and the
// generated messages (re-exported so callers need no deep imports).

export * from "./client.js";
export * from "./errors.js";
export * from "./events.js";
export * from "./gen/compactd/v1/compaction_service_pb.js";
export * from "./gen/compactd/v1/events_pb.js";
export * from "./gen/compactd/v1/session_service_pb.js";
export { create, toJson, fromJson } from "@bufbuild/protobuf";
