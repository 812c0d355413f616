import { status as Status, type ClientDuplexStream, type ServiceError, type StatusObject } from "@grpc/grpc-js";
import { checkSessionConfig } from "./config_keys.js";
import { contextFormat, openaiMessagesOf, type ContextFormatName } from "./context_format.js";
import { CompactdError } from "./errors.js";
import { AsyncQueue } from "./queue.js";
import { cancelledHere, collectCompaction, updateResult, type CompactionResult, type UpdateResult } from "./results.js";
import type { DeepPartial, OpenAIChatMessage } from "./types.js";
import {
  ClientUpdate,
  type CompactOptions,
  type CompactionEvent,
  type Context,
  type OverflowCheck,
  type PruneReport,
  type ServerEvent,
} from "./gen/compactd/v1/sessions.js";
import type { MessageInfo, Part, SessionInfo, TokenUsage } from "./gen/compactd/v1/session.js";

/**
 * compactd's default `--max-update-bytes`: the largest update a stream sends unless the
 * client's `maxUpdateBytes` says otherwise. compactd ends the whole stream on an update much
 * past its limit; the client refuses that update alone.
 */
export const DEFAULT_MAX_UPDATE_BYTES = 16 * 1024 * 1024;

/**
 * Updates handed to the gRPC call and not yet written out (gRPC writes them as compactd
 * reads), past which the next ones wait in the stream, in order, for room: a host that
 * outpaces a slow or stopped compactd does not fill grpc-js' write buffer without end.
 * (compactd reads at most 256 ahead of its acks; a few hundred more keep a burst flowing.)
 */
export const MAX_UNSENT = 512;

/** Options of a {@link SessionStream} (from the client's options). */
export interface SessionStreamOptions {
  /** The largest encoded update sent (default {@link DEFAULT_MAX_UPDATE_BYTES}); null: no check. */
  maxUpdateBytes?: number | null;
}

/** The body of one update: exactly one of the `ClientUpdate` oneof fields. */
export type UpdateBody = Omit<DeepPartial<ClientUpdate>, "seq" | "sessionId">;

/** Events of a {@link SessionStream}, with their listener arguments. */
export interface StreamEvents {
  /** Every server event, as it arrives (acks and errors included). */
  event: (e: ServerEvent) => void;
  /** The session crossed (or is predicted to cross) its overflow threshold. */
  overflow: (check: OverflowCheck, e: ServerEvent) => void;
  /** An automatic prune cleared old tool outputs. */
  pruned: (report: PruneReport, e: ServerEvent) => void;
  /** A compaction event (manual from this stream, or automatic after one of its updates). */
  compaction: (c: CompactionEvent, e: ServerEvent) => void;
  /** An update was rejected (its promise rejects with the same error). */
  updateError: (err: CompactdError, e: ServerEvent) => void;
  /** The stream ended: `err` is undefined for a clean end (after `end()`), else the status. */
  close: (err: CompactdError | undefined) => void;
}

/** An update numbered and encoded, waiting for room to be written. */
interface Outgoing {
  encoded: Buffer;
  /** Called once it is handed to the call (or never will be: the stream ended). */
  onHanded?: () => void;
}

/** An update handed to the stream: its seq, and its result (resolved on its ack). */
export interface SubmittedUpdate {
  seq: number;
  result: Promise<UpdateResult>;
}

interface Pending {
  seq: number;
  sessionId: string;
  events: ServerEvent[];
  resolve: (r: UpdateResult) => void;
  reject: (e: CompactdError) => void;
  /** Sent by the stream itself (a compaction's cancel): its error is no `updateError`. */
  internal?: boolean;
}

/** A compaction started on the stream, from its `compact` update until its outcome. */
interface Running {
  seq: number;
  sessionId: string;
  /** Its events, for the caller (closed once the caller stops iterating). */
  queue: AsyncQueue<CompactionEvent>;
  /** The `compact` update's ack arrived: it runs. */
  acked: boolean;
  /** A `cancel_compaction` is due: sent once it is acked. */
  cancelWanted: boolean;
  /** Its `cancel_compaction` was numbered (and handed to the call once `cancelHanded`). */
  cancelSent: boolean;
  cancelHanded: boolean;
  cancelSeq: number;
  /** The caller cancelled it (`cancel()`, a `break`): its result ends failed, kind "cancelled". */
  cancelledHere: boolean;
  compactionId: string;
}

/** How long a cancelled stream waits for compactd to answer the cancels of its compactions
 * before the call itself is cancelled. */
const CANCEL_DRAIN_MS = 10_000;

/** The update's kind as the .proto names it ("upsert_part"), from its body's one field. */
function updateKind(body: UpdateBody): string {
  const key = Object.keys(body).find((k) => (body as Record<string, unknown>)[k] !== undefined) ?? "update";
  return key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}

/** A compaction started on the stream: the ack, then its events. */
export interface StreamCompaction extends AsyncIterableIterator<CompactionEvent> {
  /** The ack of the `compact` update. */
  readonly ack: UpdateResult;
  /**
   * Consumes the remaining events and returns how the compaction ended. A compaction the
   * caller cancelled (`cancel()`, a `break`) before its outcome arrived ends with `failed`
   * of kind "cancelled" (made by the client when the iteration ended without an outcome).
   */
  result(): Promise<CompactionResult>;
  /**
   * Cancels this compaction (and its LLM request): sends `cancel_compaction` for its
   * session on the stream, only while the compaction has not ended (once its outcome
   * arrived, nothing: a `cancel_compaction` then would stop the session's next compaction).
   * The iteration goes on to compactd's `failed` (kind "cancelled"), or to an outcome
   * that raced the cancel. Breaking out of (or returning from) the iteration before the
   * outcome cancels it too.
   */
  cancel(): void;
}

/**
 * The main bidirectional stream. Sends are never blocked on earlier acks (compactd answers
 * in order); each send resolves with its events when its ack arrives. At most
 * {@link MAX_UNSENT} updates are handed to the call and not yet written out; later ones
 * wait in the stream, in order, for room (`submit()` waits with them).
 */
export class SessionStream {
  private nextSeq = 1;
  private readonly pending = new Map<number, Pending>();
  /** Compactions started on the stream and not yet ended, by the seq of their `compact`. */
  private readonly compactions = new Map<number, Running>();
  /** After `cancel()`: the compactions whose cancel (or ack) compactd has still to answer,
   * and the seqs of those cancels. The call is cancelled once none is left. */
  private draining: { compacts: Map<number, Running>; cancels: Set<number>; timer: ReturnType<typeof setTimeout> } | undefined;
  private readonly listeners = new Map<keyof StreamEvents, Set<(...args: never[]) => void>>();
  private ended: CompactdError | null | undefined = undefined; // undefined: open; null: clean end
  /** `end()` was called: no more updates (a write after it would break the call). */
  private halfClosed = false;
  /** The call was half-closed (after `end()`, once every waiting update was written). */
  private writesEnded = false;
  /** Updates numbered and waiting for room, in seq order (`waitingHead` is the next). */
  private waitingList: Array<Outgoing | undefined> = [];
  private waitingHead = 0;
  /** Updates handed to the call whose write has not completed. */
  private handed = 0;
  /** Resolves when the stream is over: undefined for a clean end, else the error it ended with. */
  readonly closed: Promise<CompactdError | undefined>;
  private closedResolve!: (e: CompactdError | undefined) => void;

  /** The underlying grpc-js call (it takes each `ClientUpdate` encoded). */
  readonly call: ClientDuplexStream<Buffer, ServerEvent>;
  /** The largest encoded update sent; null: no check. */
  readonly maxUpdateBytes: number | null;

  constructor(call: ClientDuplexStream<Buffer, ServerEvent>, options: SessionStreamOptions = {}) {
    this.call = call;
    this.maxUpdateBytes = options.maxUpdateBytes === undefined ? DEFAULT_MAX_UPDATE_BYTES : options.maxUpdateBytes;
    this.closed = new Promise((r) => (this.closedResolve = r));
    call.on("data", (e: ServerEvent) => this.onEvent(e));
    call.on("error", (err: ServiceError) => {
      this.finish(CompactdError.fromStatus(err));
      this.stopDraining();
    });
    call.on("status", (st: StatusObject) => {
      if (st.code === Status.OK) this.finish(null);
      this.stopDraining();
    });
  }

  /** Adds a listener. Returns a function that removes it. A listener that throws is reported
   * as a process warning (`CompactdListenerWarning`); the stream goes on. */
  on<K extends keyof StreamEvents>(name: K, fn: StreamEvents[K]): () => void {
    let set = this.listeners.get(name);
    if (!set) this.listeners.set(name, (set = new Set()));
    const s = set;
    s.add(fn);
    return () => void s.delete(fn);
  }

  private emit<K extends keyof StreamEvents>(name: K, ...args: Parameters<StreamEvents[K]>): void {
    const set = this.listeners.get(name) as Set<(...a: Parameters<StreamEvents[K]>) => void> | undefined;
    if (!set) return;
    for (const fn of set) {
      try {
        fn(...args);
      } catch (err) {
        // A listener's bug must not break the stream's bookkeeping, nor end the host's
        // process (an uncaught exception would): it is reported as a process warning.
        // (A string message: given an Error, Node ignores the warning type.)
        const message = err instanceof Error ? err.message : String(err);
        process.emitWarning(`a compactd stream listener threw: ${message}`, {
          type: "CompactdListenerWarning",
          detail: err instanceof Error ? err.stack : undefined,
        });
      }
    }
  }

  private onEvent(e: ServerEvent): void {
    if (this.ended !== undefined) {
      this.onDrainEvent(e);
      return;
    }
    const p = this.pending.get(e.seq);
    if (p && e.sessionId === "") e.sessionId = p.sessionId;
    this.emit("event", e);
    if (e.overflow) this.emit("overflow", e.overflow, e);
    if (e.pruned) this.emit("pruned", e.pruned, e);
    if (e.compaction) {
      this.emit("compaction", e.compaction, e);
      const r = this.compactions.get(e.seq);
      if (r) {
        if (e.compaction.compactionId) r.compactionId = e.compaction.compactionId;
        r.queue.push(e.compaction);
        if (e.compaction.compacted || e.compaction.failed) {
          r.queue.end();
          this.compactions.delete(e.seq);
        }
      }
    }
    if (!p) return;
    p.events.push(e);
    if (e.ack) {
      this.pending.delete(e.seq);
      const r = this.compactions.get(e.seq);
      if (r) {
        r.acked = true;
        if (r.cancelWanted) this.stopCompaction(r);
      }
      p.resolve(updateResult(e.seq, p.events));
      if (r && this.halfClosed) this.pump(); // end() waited for this ack to half-close
    } else if (e.error) {
      this.pending.delete(e.seq);
      const refused = this.compactions.get(e.seq);
      if (refused) {
        this.compactions.delete(e.seq); // refused: no compaction runs
        refused.queue.end();
      }
      const err = CompactdError.fromEvent(e.error, e.seq, p.sessionId, p.events);
      if (!p.internal) this.emit("updateError", err, e);
      p.reject(err);
      if (refused && this.halfClosed) this.pump();
    }
  }

  /**
   * Sends `cancel_compaction` for a compaction of this stream that has not ended: at once
   * when it runs (its `compact` acked), else once its ack arrives (compactd answers in
   * order: sent before it, the cancel would stop another client's compaction when compactd
   * refuses this one). Nothing for one that ended (its outcome arrived, or the stream is
   * over): a cancel then would stop the session's next compaction.
   */
  private stopCompaction(r: Running): void {
    if (this.compactions.get(r.seq) !== r || r.cancelSent || this.ended !== undefined || this.writesEnded) return;
    if (!r.acked) {
      r.cancelWanted = true;
      return;
    }
    r.cancelSent = true;
    const out = this.sendWithSeq(r.sessionId, { cancelCompaction: {} }, () => (r.cancelHanded = true), true);
    r.cancelSeq = out.seq;
    // NOT_FOUND: it ended meanwhile; any other failure ends the stream, which reports it.
    out.result.catch(() => undefined);
  }

  /** After `cancel()`: follows the answers to the cancels of its compactions. */
  private onDrainEvent(e: ServerEvent): void {
    const d = this.draining;
    if (!d) return;
    const r = d.compacts.get(e.seq);
    if (r && (e.compaction?.compacted || e.compaction?.failed)) d.compacts.delete(e.seq);
    else if (r && e.error) d.compacts.delete(e.seq); // refused: none runs
    else if (r && e.ack) {
      d.compacts.delete(e.seq);
      this.writeCancel(r.sessionId);
    }
    if (d.cancels.has(e.seq) && (e.ack || e.error)) d.cancels.delete(e.seq);
    if (d.compacts.size === 0 && d.cancels.size === 0) this.stopDraining();
  }

  /** Writes a `cancel_compaction` straight to the call (after `cancel()`: nothing else is written). */
  private writeCancel(sessionId: string): void {
    const d = this.draining!;
    const seq = this.nextSeq++;
    d.cancels.add(seq);
    const encoded = Buffer.from(ClientUpdate.encode(ClientUpdate.fromPartial({ seq, sessionId, cancelCompaction: {} })).finish());
    this.call.write(encoded, (err?: Error | null) => {
      if (err) this.stopDraining();
    });
  }

  private stopDraining(): void {
    const d = this.draining;
    if (!d) return;
    this.draining = undefined;
    clearTimeout(d.timer);
    this.call.cancel();
  }

  private finish(err: CompactdError | null): void {
    if (this.ended !== undefined) return;
    this.ended = err;
    const reason =
      err ??
      new CompactdError({ code: Status.UNAVAILABLE, details: "the stream ended before this update's ack" });
    for (const p of this.pending.values()) p.reject(CompactdError.streamEnded(reason, p.seq, p.sessionId, p.events));
    this.pending.clear();
    const never = this.waitingList.slice(this.waitingHead);
    this.waitingList = [];
    this.waitingHead = 0;
    for (const w of never) w?.onHanded?.(); // a waiting submit() returns: its result rejects
    for (const r of this.compactions.values()) {
      if (err) r.queue.fail(err);
      else r.queue.end();
    }
    this.compactions.clear();
    this.emit("close", err ?? undefined);
    this.closedResolve(err ?? undefined);
  }

  /** True once the stream has ended. */
  get isClosed(): boolean {
    return this.ended !== undefined || this.halfClosed;
  }

  /** Updates sent whose ack or error has not arrived yet (those waiting for room included). */
  get inFlight(): number {
    return this.pending.size;
  }

  /** Updates handed to the call and not yet written out: at most {@link MAX_UNSENT}. */
  get unsent(): number {
    return this.handed;
  }

  /** Updates numbered and waiting in the stream for room to be written (past {@link MAX_UNSENT} unsent). */
  get waiting(): number {
    return this.waitingList.length - this.waitingHead;
  }

  /**
   * Sends one update with the next seq. Resolves with its events when the ack arrives;
   * rejects with a CompactdError (code, field, seq) on its `error` event, or when the stream
   * ends first. Never waits to be numbered: past {@link MAX_UNSENT} unsent, the update waits
   * in the stream for room (a host sending faster than compactd reads holds each of those
   * updates until then: `submit()` lets it wait instead).
   */
  send(sessionId: string, body: UpdateBody): Promise<UpdateResult> {
    return this.sendWithSeq(sessionId, body).result;
  }

  /**
   * Sends one update like `send`, but resolves once it is handed to the call: at once while
   * fewer than {@link MAX_UNSENT} are unsent, else when room comes (or the stream ends: its
   * result then rejects). A host that awaits each `submit` holds at most MAX_UNSENT updates
   * in the stream, however slowly compactd reads. Rejects at once for an update refused
   * before it is numbered (one that cannot be encoded, over `maxUpdateBytes`, or sent after
   * the stream ended).
   */
  submit(sessionId: string, body: UpdateBody): Promise<SubmittedUpdate> {
    return new Promise((resolve, reject) => {
      let handed = false;
      let sent: SubmittedUpdate | undefined;
      const onHanded = () => {
        handed = true;
        if (sent) resolve(sent);
      };
      const out = this.sendWithSeq(sessionId, body, onHanded);
      if (out.refused) {
        out.result.catch(() => undefined); // the refusal is submit's own
        reject(out.refused);
        return;
      }
      sent = { seq: out.seq, result: out.result };
      if (handed) resolve(sent);
    });
  }

  private sendWithSeq(
    sessionId: string,
    body: UpdateBody,
    onHanded?: () => void,
    internal = false,
  ): { seq: number; result: Promise<UpdateResult>; refused?: CompactdError } {
    const seq = this.nextSeq;
    const refuse = (err: CompactdError) => ({ seq, result: Promise.reject(err), refused: err });
    // The stream's own cancels go out after end() too, until the call is half-closed.
    if (this.ended !== undefined || (this.halfClosed && !internal) || this.writesEnded) {
      // After end(), a write would destroy the call and reject the updates still in flight.
      // After a failure, a new error per update says the stream ended (not sent, no seq).
      return refuse(
        this.ended
          ? CompactdError.afterStreamEnd(this.ended)
          : new CompactdError({ code: Status.UNAVAILABLE, details: "the stream is closed" }),
      );
    }
    let encoded: Buffer;
    try {
      encoded = Buffer.from(ClientUpdate.encode(ClientUpdate.fromPartial({ ...body, seq, sessionId })).finish());
    } catch (e) {
      // Refused here, alone (a fractional or negative count, a wrong type): written, it
      // would have ended the call and every update in flight. No seq is spent on it.
      return refuse(
        new CompactdError({ code: Status.INVALID_ARGUMENT, details: `the update cannot be encoded: ${(e as Error).message}` }),
      );
    }
    const tooLarge = this.checkSize(encoded, body);
    if (tooLarge) return refuse(tooLarge);
    this.nextSeq++;
    const result = new Promise<UpdateResult>((resolve, reject) => {
      this.pending.set(seq, { seq, sessionId, events: [], resolve, reject, internal });
    });
    this.waitingList.push({ encoded, onHanded });
    this.pump();
    return { seq, result };
  }

  /**
   * Hands waiting updates to the call, in order, while fewer than MAX_UNSENT are unsent;
   * each write's completion makes room for the next. (grpc-js' write() asks to wait from
   * 16 buffered on: the count here is the stream's own, so a burst keeps flowing.) After
   * `end()`, half-closes the call once none waits.
   */
  private pump(): void {
    while (this.ended === undefined && this.handed < MAX_UNSENT && this.waiting > 0) {
      const out = this.takeWaiting();
      this.handed++;
      this.call.write(out.encoded, (err?: Error | null) => {
        this.handed--;
        if (!err) this.pump(); // a failed write: the call is over, its 'error' ends the stream
      });
      out.onHanded?.();
    }
    if (this.halfClosed && !this.writesEnded && this.ended === undefined && this.waiting === 0 && !this.awaitingCompactAck()) {
      this.writesEnded = true;
      this.call.end();
    }
  }

  /** A compaction of this stream waits for its ack (after `end()`, its cancel is then sent). */
  private awaitingCompactAck(): boolean {
    for (const r of this.compactions.values()) if (!r.acked) return true;
    return false;
  }

  /** The next waiting update, no longer held by the list (which is compacted as it empties). */
  private takeWaiting(): Outgoing {
    const out = this.waitingList[this.waitingHead]!;
    this.waitingList[this.waitingHead++] = undefined;
    if (this.waitingHead === this.waitingList.length) {
      this.waitingList = [];
      this.waitingHead = 0;
    } else if (this.waitingHead >= 1024 && this.waitingHead * 2 >= this.waitingList.length) {
      this.waitingList = this.waitingList.slice(this.waitingHead);
      this.waitingHead = 0;
    }
    return out;
  }

  /**
   * The refusal of an update of `encoded.length` bytes over `maxUpdateBytes` (undefined when
   * it fits): written, compactd would end the whole stream on it, every session on it; so
   * it alone is refused (no seq is spent on it) and the stream goes on.
   */
  private checkSize(encoded: Buffer, body: UpdateBody): CompactdError | undefined {
    const limit = this.maxUpdateBytes;
    if (limit === null || encoded.length <= limit) return undefined;
    return new CompactdError({
      code: Status.RESOURCE_EXHAUSTED,
      details:
        `an update of ${encoded.length} bytes (${updateKind(body)}) is over maxUpdateBytes (${limit} bytes), ` +
        "so it was not sent and the stream goes on: send large content in smaller parts, or raise " +
        "maxUpdateBytes with the server's --max-update-bytes",
    });
  }

  /** Opens or reconfigures a session (`session.id` defaults to `sessionId`). */
  async open(session: DeepPartial<SessionInfo> & { id: string }): Promise<UpdateResult> {
    checkSessionConfig(session.config, "open.config");
    return this.send(session.id, { open: session });
  }

  upsertMessage(sessionId: string, message: DeepPartial<MessageInfo>): Promise<UpdateResult> {
    return this.send(sessionId, { upsertMessage: message });
  }

  upsertPart(sessionId: string, part: DeepPartial<Part>): Promise<UpdateResult> {
    return this.send(sessionId, { upsertPart: part });
  }

  deletePart(sessionId: string, messageId: string, partId: string): Promise<UpdateResult> {
    return this.send(sessionId, { deletePart: { messageId, partId } });
  }

  reportUsage(sessionId: string, usage: { messageId?: string; tokens: DeepPartial<TokenUsage> }): Promise<UpdateResult> {
    return this.send(sessionId, { reportUsage: usage });
  }

  pin(sessionId: string, target: { messageId: string; partId?: string; pinned?: boolean }): Promise<UpdateResult> {
    return this.send(sessionId, { pin: target });
  }

  /** The context (reply event `context`), in order with the updates sent before it;
   * `format` as in CompactdClient.getContext. */
  async getContext(sessionId: string, format: ContextFormatName = "both"): Promise<Context> {
    const r = await this.send(sessionId, { getContext: { format: contextFormat(format) } });
    const ctx = r.events.find((e) => e.context)?.context;
    if (!ctx) throw new CompactdError({ code: Status.INTERNAL, details: "get_context acked without a context event", seq: r.seq, sessionId });
    return ctx;
  }

  /** The context as OpenAI chat-completions `messages` (fetched as one JSON text), in order
   * with the updates sent before it. */
  async getOpenAIMessages(sessionId: string): Promise<OpenAIChatMessage[]> {
    return openaiMessagesOf(await this.getContext(sessionId, "openai_json"));
  }

  /** Runs prune (or a dry run) and returns its report (reply event `prune_report`). */
  async prune(sessionId: string, options: { dryRun?: boolean } = {}): Promise<PruneReport> {
    const r = await this.send(sessionId, { prune: { dryRun: options.dryRun ?? false } });
    const rep = r.events.find((e) => e.pruneReport)?.pruneReport;
    if (!rep) throw new CompactdError({ code: Status.INTERNAL, details: "prune acked without a prune_report event", seq: r.seq, sessionId });
    return rep;
  }

  /** Runs the overflow check (reply event `overflow_check`). */
  async checkOverflow(sessionId: string): Promise<OverflowCheck> {
    const r = await this.send(sessionId, { checkOverflow: {} });
    const c = r.events.find((e) => e.overflowCheck)?.overflowCheck;
    if (!c) throw new CompactdError({ code: Status.INTERNAL, details: "check_overflow acked without an overflow_check event", seq: r.seq, sessionId });
    return c;
  }

  /**
   * Starts a manual compaction on this stream. Resolves after the ack with an iterator of
   * the compaction's events (they follow the ack, with the same seq), ending at `compacted`
   * or `failed`. Rejects like any update (FAILED_PRECONDITION when one is running, ...).
   * compactd does not tie the compaction to the stream: `cancel()` on it, or a `break` out
   * of its iteration before the outcome, sends `cancel_compaction` for it (nothing once it
   * ended), and the stream's `end()` and `cancel()` cancel those still running.
   */
  async compact(sessionId: string, options: DeepPartial<CompactOptions> = {}): Promise<StreamCompaction> {
    const seq = this.nextSeq; // the seq sendWithSeq will take: register before any event can arrive
    const stop = () => {
      const r = this.compactions.get(seq);
      if (r?.queue !== q) return; // over (or another compaction under a reused seq)
      r.cancelledHere = true;
      this.stopCompaction(r);
    };
    // A break (return()) before the outcome cancels the compaction: its events would go nowhere.
    const q: AsyncQueue<CompactionEvent> = new AsyncQueue<CompactionEvent>(stop);
    const running: Running = {
      seq,
      sessionId,
      queue: q,
      acked: false,
      cancelWanted: false,
      cancelSent: false,
      cancelHanded: false,
      cancelSeq: 0,
      cancelledHere: false,
      compactionId: "",
    };
    this.compactions.set(seq, running);
    let ack: UpdateResult;
    try {
      const sent = this.sendWithSeq(sessionId, { compact: options });
      ack = await sent.result;
    } catch (err) {
      // Only its own entry: an update refused before it was sent spends no seq, so a
      // compaction sent meanwhile may have registered under the same one.
      if (this.compactions.get(seq) === running) this.compactions.delete(seq);
      throw err;
    }
    const result = async (): Promise<CompactionResult> => {
      const r = await collectCompaction(q);
      if (running.cancelledHere && !r.compacted && !r.failed) {
        // The caller stopped iterating before the outcome: as client.compact() cancelled.
        const end = cancelledHere(sessionId, r.compactionId || running.compactionId);
        r.compactionId ||= end.compactionId;
        r.events.push(end);
        r.failed = end.failed;
      }
      return r;
    };
    const it = q as unknown as StreamCompaction;
    Object.defineProperty(it, "ack", { value: ack });
    Object.defineProperty(it, "result", { value: result });
    Object.defineProperty(it, "cancel", { value: stop });
    return it;
  }

  /** Stops the session's running compaction (it ends with `failed`, kind "cancelled"). NOT_FOUND when none runs. */
  cancelCompaction(sessionId: string): Promise<UpdateResult> {
    return this.send(sessionId, { cancelCompaction: {} });
  }

  /**
   * Half-closes: no more updates; the call is half-closed once the updates waiting for room
   * are written, and the stream ends once compactd has answered those sent. Compactions
   * started on the stream and still running are cancelled first (`cancel_compaction`;
   * compactd would keep the stream open until they commit): they end `failed`, kind
   * "cancelled" (or with an outcome that raced the cancel). With `timeoutMs`, a stream
   * compactd has not ended by then is cancelled (`cancel()`): a server that stopped
   * answering (hung, behind a partition that keepalive has not caught yet) would otherwise
   * hold the end for good.
   */
  end(opts?: { timeoutMs?: number }): Promise<CompactdError | undefined> {
    const ms = opts?.timeoutMs;
    if (ms !== undefined && !(typeof ms === "number" && ms >= 0)) {
      return Promise.reject(new CompactdError({ code: Status.INVALID_ARGUMENT, field: "timeoutMs", details: `timeoutMs must be a number of milliseconds >= 0, not ${String(ms)}` }));
    }
    if (this.ended === undefined && !this.halfClosed) {
      for (const r of this.compactions.values()) this.stopCompaction(r);
      this.halfClosed = true;
      this.pump();
    }
    if (ms === undefined || this.ended !== undefined) return this.closed;
    const timer = setTimeout(() => this.cancel(), ms);
    return this.closed.finally(() => clearTimeout(timer));
  }

  /**
   * Cancels the stream at once; updates in flight reject with CANCELLED, and so do the
   * iterations of its compactions. Compactions started on the stream and still running are
   * cancelled: compactd would commit them, so `cancel_compaction` is sent for each before
   * the call is cancelled (once compactd answered them, within 10 s).
   */
  cancel(): void {
    if (this.ended !== undefined) return;
    const compacts = new Map<number, Running>();
    const now: Running[] = [];
    const cancels = new Set<number>();
    for (const r of this.compactions.values()) {
      if (r.cancelHanded) cancels.add(r.cancelSeq); // its answer is awaited before the call ends
      else if (this.writesEnded) continue;
      else if (!r.acked) compacts.set(r.seq, r); // its cancel once its ack arrives
      else now.push(r); // a cancel numbered, still waiting, is dropped below
    }
    if (compacts.size === 0 && now.length === 0 && cancels.size === 0) {
      this.call.cancel();
      return;
    }
    this.draining = { compacts, cancels, timer: setTimeout(() => this.stopDraining(), CANCEL_DRAIN_MS) };
    this.draining.timer.unref?.();
    this.finish(new CompactdError({ code: Status.CANCELLED, details: "Cancelled on client" }));
    for (const r of now) this.writeCancel(r.sessionId);
    const d = this.draining as typeof this.draining | undefined;
    if (d && d.compacts.size === 0 && d.cancels.size === 0) this.stopDraining();
  }

  /**
   * Ends the stream at once with `err` (its client's `close()` uses it): updates in flight
   * and waiting reject with it (`streamEnded`), its compactions' iterations throw it, and
   * the call is cancelled. Nothing when the stream is already over.
   */
  abort(err: CompactdError): void {
    if (this.ended !== undefined) return;
    this.finish(err);
    this.call.cancel();
  }
}
