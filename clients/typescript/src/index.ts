// compactd's TypeScript client: the thin wrapper, its held step requests, typed errors, event
// builders, the OpenAI and Anthropic converters, and the generated messages (re-exported so
// callers need no deep imports).

export * from "./client.js";
export * from "./convert.js";
export * from "./errors.js";
export * from "./recall.js";
export * from "./steps.js";
