// Typed errors for failed compactd calls.
//
// compactd reports failures as gRPC statuses whose grpc-status-details-bin trailer carries one
// google.rpc.ErrorInfo (a stable UPPER_SNAKE `reason` such as SEQ_CONFLICT) and, for malformed
// input, a google.rpc.BadRequest. connect-node decodes that trailer into ConnectError.details;
// toCompactdError() turns it into the most specific class below (by reason, then by code).

import { Code, ConnectError } from "@connectrpc/connect";
import { BadRequestSchema, ErrorInfoSchema } from "./gen/google/rpc/error_details_pb.js";

/** One bad request field, from google.rpc.BadRequest. */
export interface FieldViolation {
  field: string;
  description: string;
}

/** Root of every error the client throws for a failed call. */
export class CompactdError extends Error {
  /** The gRPC status code. */
  readonly code: Code;
  /** ErrorInfo.reason (e.g. "SEQ_CONFLICT"); the code's name when the server sent none. */
  readonly reason: string;
  /** ErrorInfo.domain, empty when absent. */
  readonly domain: string;
  /** ErrorInfo.metadata. */
  readonly metadata: Readonly<Record<string, string>>;
  /** BadRequest field violations, if any. */
  readonly violations: readonly FieldViolation[];

  constructor(
    message: string,
    init: {
      code: Code;
      reason?: string;
      domain?: string;
      metadata?: Record<string, string>;
      violations?: FieldViolation[];
      cause?: unknown;
    },
  ) {
    const reason = init.reason || codeName(init.code);
    super(`${codeName(init.code)} (${reason}): ${message}`, { cause: init.cause });
    this.name = new.target.name;
    this.code = init.code;
    this.reason = reason;
    this.domain = init.domain ?? "";
    this.metadata = init.metadata ?? {};
    this.violations = init.violations ?? [];
  }
}

export class InvalidArgumentError extends CompactdError {}
export class NotFoundError extends CompactdError {}
export class AlreadyExistsError extends CompactdError {}
export class FailedPreconditionError extends CompactdError {}
/** FAILED_PRECONDITION / CAPACITY_UNKNOWN: the route declares no context window. */
export class CapacityUnknownError extends FailedPreconditionError {}
export class AbortedError extends CompactdError {}
/** ABORTED / SEQ_CONFLICT: expectedLastSeq did not match the log. */
export class SeqConflictError extends AbortedError {}
/** ABORTED / COMPACTION_BUSY: a bracket is live or a turn is open. */
export class CompactionBusyError extends AbortedError {}
export class DeadlineExceededError extends CompactdError {}
export class UnavailableError extends CompactdError {}
export class UnimplementedError extends CompactdError {}
export class ResourceExhaustedError extends CompactdError {}
/** A compaction stream ended without its final result. */
export class IncompleteStreamError extends CompactdError {}

type ErrorClass = new (message: string, init: ConstructorParameters<typeof CompactdError>[1]) => CompactdError;

const byCode = new Map<Code, ErrorClass>([
  [Code.InvalidArgument, InvalidArgumentError],
  [Code.NotFound, NotFoundError],
  [Code.AlreadyExists, AlreadyExistsError],
  [Code.FailedPrecondition, FailedPreconditionError],
  [Code.Aborted, AbortedError],
  [Code.DeadlineExceeded, DeadlineExceededError],
  [Code.Unavailable, UnavailableError],
  [Code.Unimplemented, UnimplementedError],
  [Code.ResourceExhausted, ResourceExhaustedError],
]);

const byReason = new Map<string, [Code, ErrorClass]>([
  ["SEQ_CONFLICT", [Code.Aborted, SeqConflictError]],
  ["COMPACTION_BUSY", [Code.Aborted, CompactionBusyError]],
  ["CAPACITY_UNKNOWN", [Code.FailedPrecondition, CapacityUnknownError]],
]);

/** The most specific class for a code and reason (a reason only counts under its own code). */
export function errorClass(code: Code, reason: string): ErrorClass {
  const specific = byReason.get(reason);
  if (specific !== undefined && specific[0] === code) {
    return specific[1];
  }
  return byCode.get(code) ?? CompactdError;
}

/** Converts anything a connect call threw into a typed CompactdError. */
export function toCompactdError(err: unknown): CompactdError {
  if (err instanceof CompactdError) {
    return err;
  }
  const ce = ConnectError.from(err);
  const info = ce.findDetails(ErrorInfoSchema)[0];
  const violations = ce
    .findDetails(BadRequestSchema)
    .flatMap((bad) => bad.fieldViolations.map((v) => ({ field: v.field, description: v.description })));
  const reason = info?.reason ?? "";
  const cls = errorClass(ce.code, reason);
  return new cls(ce.rawMessage, {
    code: ce.code,
    reason,
    domain: info?.domain ?? "",
    metadata: info ? { ...info.metadata } : {},
    violations,
    cause: err,
  });
}

/** The gRPC name of a code, e.g. ABORTED. */
export function codeName(code: Code): string {
  if (code === Code.Canceled) {
    return "CANCELLED"; // gRPC's spelling
  }
  return (Code[code] ?? "UNKNOWN").replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}
