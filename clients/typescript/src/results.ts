import { toCompactdError } from "./errors.js";
import type { CompactionEvent, CompactionFailed, OverflowCheck, PruneReport, ServerEvent, SessionCompacted } from "./gen/compactd/v1/sessions.js";

/** An update's outcome: the events it caused (overflow, pruned, ...) and its ack. */
export interface UpdateResult {
  /** The stream seq of the update (0 for a unary twin). */
  seq: number;
  /** The kind of update applied ("open", "upsert_message", ...). */
  kind: string;
  /** True when the update created something (session, message, part). */
  created: boolean;
  /** Every event the update caused, the ack last. */
  events: ServerEvent[];
  /** The overflow decision when the update crossed the threshold. */
  overflow?: OverflowCheck;
  /** What an automatic prune cleared, when one ran. */
  pruned?: PruneReport;
}

/** What `Compact` ended with. */
export interface CompactionResult {
  compactionId: string;
  /** The summary deltas concatenated. */
  summary: string;
  /** Set when the compaction committed. */
  compacted?: SessionCompacted;
  /** Set when it failed (nothing was committed). */
  failed?: CompactionFailed;
  /** Every event, in order. */
  events: CompactionEvent[];
}

/**
 * The outcome of a `Compact` call the caller cancelled (`cancel()`, its abort signal) before
 * `compacted` or `failed` arrived: `failed` with kind "cancelled", as a compaction cancelled
 * on a stream ends (the call itself ends without one). Not retryable, as compactd's own.
 */
export function cancelledHere(sessionId: string, compactionId = ""): CompactionEvent {
  return {
    sessionId,
    compactionId,
    failed: {
      kind: "cancelled",
      reason: "cancelled by this client; a commit that raced the cancel is not reported",
      retryable: false,
      autoCompactionPaused: false,
      usage: undefined,
      cost: 0,
    },
  } as CompactionEvent;
}

/** Summarizes an UpdateResponse (or the events of one stream update) as an UpdateResult. */
export function updateResult(seq: number, events: ServerEvent[]): UpdateResult {
  const ack = events.find((e) => e.ack !== undefined)?.ack;
  const r: UpdateResult = { seq, kind: ack?.kind ?? "", created: ack?.created ?? false, events };
  for (const e of events) {
    if (e.overflow) r.overflow = e.overflow;
    if (e.pruned) r.pruned = e.pruned;
  }
  return r;
}

/** Consumes compaction events until the end: the summary, and `compacted` or `failed`. */
export async function collectCompaction(events: AsyncIterable<CompactionEvent>): Promise<CompactionResult> {
  const r: CompactionResult = { compactionId: "", summary: "", events: [] };
  try {
    for await (const e of events) {
      r.events.push(e);
      if (e.compactionId) r.compactionId = e.compactionId;
      // A retry voids what was streamed before it.
      if (e.retrying) r.summary = "";
      if (e.delta) r.summary += e.delta.text;
      if (e.compacted) r.compacted = e.compacted;
      if (e.failed) r.failed = e.failed;
      if (e.compacted || e.failed) break;
    }
  } catch (err) {
    throw toCompactdError(err);
  }
  return r;
}
