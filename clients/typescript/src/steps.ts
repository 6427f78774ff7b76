// The request a step sends: the held request, the step's answer, and how one becomes the other.
//
// PrepareStep with `heldRevision` (the revision of the request the caller holds) answers the full
// request only when compactd changed what that request shows (a compaction, a prune, an image
// offload, a new header); otherwise only the messages appended since (`requestUnchanged`), so a
// step costs what it adds, not the session's length. With it goes `heldIncarnation` (the held
// request's `incarnation`): a session deleted and created again under the same id by another
// process restarts its revisions, and the server then answers the full request. The client's
// `prepareStep` does this by
// itself with a HeldRequests; `stepRequest` is the same rule for a runtime that calls
// `prepareStepUnary` or `prepareStepStream` and holds its requests itself.

import { clone } from "@bufbuild/protobuf";
import type { CompactionProgress, PrepareStepResult } from "./gen/compactd/v1/compaction_service_pb.js";
import { type BuildRequestResponse, BuildRequestResponseSchema } from "./gen/compactd/v1/session_service_pb.js";

/** Sessions whose last request a client holds by default (the least recently stepped is dropped). */
export const DEFAULT_HELD_SESSIONS = 64;

/** What the default `prepareStep` answers. */
export interface PreparedStep {
  /**
   * The full request to send: what BuildRequest answers at `request.revision`. It is the request
   * the client holds for the session: the session's next `prepareStep` on this client extends it
   * in place, so clone it (`clone(BuildRequestResponseSchema, request)`) to keep this step's.
   */
  request: BuildRequestResponse;
  /**
   * The step's result as the server sent it (pressure `before` and `after`, `prunedCount`,
   * `compactions`, `warnings`); its `request` is absent when `requestUnchanged`.
   */
  result: PrepareStepResult;
  /** The step updates, in order, when the step was streamed (`onProgress`); empty otherwise. */
  progress: CompactionProgress[];
}

/**
 * The last full request of each recently stepped session, for `heldRevision`. Holds at most
 * `capacity` sessions, the least recently stepped dropped first (0 holds none: every step then
 * answers the full request). The held requests are the ones `PreparedStep.request` hands out:
 * `update` extends them in place.
 */
export class HeldRequests {
  private readonly requests = new Map<string, BuildRequestResponse>();

  constructor(readonly capacity: number = DEFAULT_HELD_SESSIONS) {
    if (!Number.isInteger(capacity) || capacity < 0) {
      throw new RangeError(`capacity must be an integer >= 0, got ${capacity}`);
    }
  }

  /** Sessions held. */
  get size(): number {
    return this.requests.size;
  }

  /** The revision of the request held for the session (the `heldRevision` to send), if any. */
  revision(sessionId: string): bigint | undefined {
    return this.requests.get(sessionId)?.revision;
  }

  /** The incarnation of the request held for the session (the `heldIncarnation` to send), if any. */
  incarnation(sessionId: string): string | undefined {
    return this.requests.get(sessionId)?.incarnation;
  }

  /**
   * The full request of `result` (a step sent with `heldRevision` `sent`), now held: the
   * result's request when it carries one, else the held request extended in place with
   * `appendedMessages` at `requestRevision`. Undefined when the result omits the request and
   * the held one is no longer at `sent` (dropped, or moved on by a concurrent step, or of another
   * incarnation than `sentIncarnation`, when given): the caller then needs the full request
   * another way.
   */
  update(
    sessionId: string,
    sent: bigint | undefined,
    result: PrepareStepResult,
    sentIncarnation?: string,
  ): BuildRequestResponse | undefined {
    if (!result.requestUnchanged) {
      if (result.request !== undefined) this.hold(sessionId, result.request);
      return result.request;
    }
    const held = this.requests.get(sessionId);
    if (held === undefined || sent === undefined || held.revision !== sent) return undefined;
    if (sentIncarnation !== undefined && held.incarnation !== sentIncarnation) return undefined;
    // Cost follows the step: the held messages stay, the new ones are appended (one by one: a
    // spread of a long array would overflow the call stack).
    for (const message of result.appendedMessages) held.messages.push(message);
    held.revision = result.requestRevision;
    this.hold(sessionId, held);
    return held;
  }

  /** Holds `request` (a full request of the session) in place of the held one. */
  hold(sessionId: string, request: BuildRequestResponse): void {
    if (this.capacity === 0) return;
    this.requests.delete(sessionId); // a Map iterates in insertion order: re-insert as newest
    this.requests.set(sessionId, request);
    for (const oldest of this.requests.keys()) {
      if (this.requests.size <= this.capacity) break;
      this.requests.delete(oldest);
    }
  }

  /** Drops the request held for the session, if any. */
  forget(sessionId: string): void {
    this.requests.delete(sessionId);
  }

  /** Drops every held request. */
  clear(): void {
    this.requests.clear();
  }
}

/**
 * The request a step sends, leaving `held` as it was: the result's full request, or
 * (`requestUnchanged`) a copy of the held request with the messages appended since (it costs
 * the whole request; the client's `prepareStep` extends its held request in place instead). Its
 * `revision` is the next step's `heldRevision`. Throws when the result omits the request and no
 * held request is given.
 */
export function stepRequest(held: BuildRequestResponse | undefined, result: PrepareStepResult): BuildRequestResponse {
  if (!result.requestUnchanged) {
    if (result.request === undefined) throw new Error("the PrepareStep result carries no request");
    return result.request;
  }
  if (held === undefined) throw new Error("the result omits the request: pass the request heldRevision named");
  const request = clone(BuildRequestResponseSchema, held);
  request.messages.push(...result.appendedMessages);
  request.revision = result.requestRevision;
  return request;
}
