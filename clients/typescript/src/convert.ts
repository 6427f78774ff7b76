// The converters and event builders alone, without the gRPC client (no Node API inside):
// `import { openai, anthropic, userMessage } from "@compactd/client/convert"`.

export * as anthropic from "./anthropic.js";
export * from "./events.js";
export * from "./gen/compactd/v1/compaction_service_pb.js";
export * from "./gen/compactd/v1/events_pb.js";
export * from "./gen/compactd/v1/session_service_pb.js";
export * as openai from "./openai.js";
export { isPins, projectEvent, projectEvents, withoutPins } from "./project.js";
export { create, fromJson, type JsonObject, toJson } from "@bufbuild/protobuf";
