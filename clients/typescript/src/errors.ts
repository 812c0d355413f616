import { status as Status, type ServiceError } from "@grpc/grpc-js";
import type { Error as ErrorEvent, ServerEvent } from "./gen/compactd/v1/sessions.js";

/** gRPC status code names, as compactd writes them in a stream `error` event. */
export type CodeName =
  | "OK"
  | "CANCELLED"
  | "UNKNOWN"
  | "INVALID_ARGUMENT"
  | "DEADLINE_EXCEEDED"
  | "NOT_FOUND"
  | "ALREADY_EXISTS"
  | "PERMISSION_DENIED"
  | "RESOURCE_EXHAUSTED"
  | "FAILED_PRECONDITION"
  | "ABORTED"
  | "OUT_OF_RANGE"
  | "UNIMPLEMENTED"
  | "INTERNAL"
  | "UNAVAILABLE"
  | "DATA_LOSS"
  | "UNAUTHENTICATED";

const NAMES: Record<number, CodeName> = {};
for (const [name, value] of Object.entries(Status)) {
  if (typeof value === "number") NAMES[value] = name as CodeName;
}

/** The gRPC status number of a code name (`"NOT_FOUND"` → 5); UNKNOWN (2) for a name it does not know. */
export function codeNumber(name: string): number {
  const n = (Status as unknown as Record<string, number>)[name];
  return typeof n === "number" ? n : Status.UNKNOWN;
}

/** The name of a gRPC status number (5 → `"NOT_FOUND"`). */
export function codeName(code: number): CodeName {
  return NAMES[code] ?? "UNKNOWN";
}

// A unary rejection reads "<field>: <message>" when a field is to blame (src/server/status.rs).
// A field is a dotted path without spaces or colons: "session.id", "upsert_part.tool.state.status",
// "export_json.$.messages[2]" (an import's JSON path).
const FIELD_PREFIX = /^([A-Za-z_][^\s:]*): ([\s\S]*)$/;

/**
 * Any failure reported by compactd: a gRPC status of a unary call or of a stream, or the
 * `error` event the main stream sends in place of an update's ack.
 */
export class CompactdError extends Error {
  /** gRPC status number (3 for INVALID_ARGUMENT, 5 for NOT_FOUND, ...). */
  readonly code: number;
  /** gRPC status name ("INVALID_ARGUMENT", "NOT_FOUND", ...). */
  readonly codeName: CodeName;
  /** The offending field, dotted and snake_case as in the .proto ("upsert_part.tool.state.status"), or "". */
  readonly field: string;
  /** The server's message without the field prefix. */
  readonly details: string;
  /** For a stream update's rejection: its seq. */
  readonly seq?: number;
  /** For a stream update's rejection: its session. */
  readonly sessionId?: string;
  /** For a stream update's rejection: the events it caused before the error. */
  readonly events: ServerEvent[];
  /** Trailing metadata of the failed call, when it came from a gRPC status. */
  readonly metadata?: Record<string, unknown>;
  /**
   * True for a stream update left unanswered when the stream ended: the code is the
   * stream's, not a refusal of this update, and whether it was applied is unknown
   * (`getSession` shows the session). Also for one sent after its stream ended (then
   * without a seq: it was not sent).
   */
  readonly streamEnded: boolean;

  constructor(init: {
    code: number;
    details: string;
    field?: string;
    seq?: number;
    sessionId?: string;
    events?: ServerEvent[];
    metadata?: Record<string, unknown>;
    cause?: unknown;
    streamEnded?: boolean;
  }) {
    const name = codeName(init.code);
    const field = init.field ?? "";
    super(`${name}: ${field ? `${field}: ` : ""}${init.details}`, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = "CompactdError";
    this.code = init.code;
    this.codeName = name;
    this.field = field;
    this.details = init.details;
    this.seq = init.seq;
    this.sessionId = init.sessionId;
    this.events = init.events ?? [];
    this.metadata = init.metadata;
    this.streamEnded = init.streamEnded ?? false;
  }

  /** The error of stream update `seq` (of `sessionId`) left unanswered when its stream ended with `ended`. */
  static streamEnded(ended: CompactdError, seq: number, sessionId: string, events: ServerEvent[]): CompactdError {
    return new CompactdError({
      code: ended.code,
      details: `the stream ended before this update's ack, so its outcome is unknown (getSession shows the session): ${ended.details}`,
      field: ended.field,
      seq,
      sessionId,
      events,
      metadata: ended.metadata,
      cause: ended,
      streamEnded: true,
    });
  }

  /**
   * The error of a stream update sent after its stream ended with `ended`: a new one per
   * update (the stream's own error again would read as this update's refusal), with the
   * stream's code, `streamEnded` set, no seq (the update was not sent) and the failure named.
   */
  static afterStreamEnd(ended: CompactdError): CompactdError {
    const where = ended.field ? ` [${ended.field}]` : "";
    return new CompactdError({
      code: ended.code,
      details: `the stream ended earlier, so this update was not sent (open a new stream); it ended with ${ended.codeName}${where}: ${ended.details}`,
      metadata: ended.metadata,
      cause: ended,
      streamEnded: true,
    });
  }

  /** From a gRPC status (a unary call, or the end of a stream). */
  static fromStatus(err: Partial<ServiceError> & { code?: number; details?: string }): CompactdError {
    const code = typeof err.code === "number" ? err.code : Status.UNKNOWN;
    const raw = err.details ?? err.message ?? "";
    const m = FIELD_PREFIX.exec(raw);
    return new CompactdError({
      code,
      details: m ? m[2]! : raw,
      field: m ? m[1]! : "",
      metadata: err.metadata?.getMap?.() as Record<string, unknown> | undefined,
      cause: err,
    });
  }

  /** From the stream's `error` event for one update. */
  static fromEvent(e: ErrorEvent, seq: number, sessionId: string, events: ServerEvent[] = []): CompactdError {
    return new CompactdError({
      code: codeNumber(e.code),
      details: e.message,
      field: e.field,
      seq,
      sessionId,
      events,
    });
  }
}

/** Whatever was thrown, as a CompactdError (gRPC errors keep their code; anything else is UNKNOWN). */
export function toCompactdError(err: unknown): CompactdError {
  if (err instanceof CompactdError) return err;
  if (err && typeof err === "object" && "code" in err && typeof (err as { code: unknown }).code === "number") {
    return CompactdError.fromStatus(err as ServiceError);
  }
  return new CompactdError({ code: Status.UNKNOWN, details: String((err as Error)?.message ?? err), cause: err });
}
