import {
  connectivityState,
  credentials as grpcCredentials,
  Metadata,
  status as Status,
  type CallOptions as GrpcCallOptions,
  type ChannelCredentials,
  type ClientOptions,
  type ServiceError,
} from "@grpc/grpc-js";
import { checkSessionConfig } from "./config_keys.js";
import { contextFormat, openaiMessagesOf, type ContextFormatName } from "./context_format.js";
import { CompactdError, toCompactdError } from "./errors.js";
import { cancelledHere, collectCompaction, updateResult, type CompactionResult, type UpdateResult } from "./results.js";
export { collectCompaction, updateResult, type CompactionResult, type UpdateResult };
import { AsyncQueue } from "./queue.js";
import { DEFAULT_MAX_UPDATE_BYTES, SessionStream } from "./stream.js";
import type { CallOptions, DeepPartial, JsonValue, OpenAIChatMessage, OpenAITool } from "./types.js";
import {
  CompactOptions,
  CompactRequest,
  DeletePartRequest,
  DeleteSessionRequest,
  GetContextRequest,
  GetRecallToolRequest,
  GetSessionRequest,
  ImportSessionRequest,
  ListSessionsRequest,
  OpenSessionRequest,
  PinRequest,
  PruneRequest,
  RecallRequest,
  ReportUsageRequest,
  SessionsClient,
  SessionsService,
  SubscribeRequest,
  UpsertMessageRequest,
  UpsertPartRequest,
  CheckOverflowRequest,
  type CompactionEvent,
  type Context,
  type GetSessionResponse,
  type OverflowCheck,
  type PruneReport,
  type Recalled,
  type ServerEvent,
  type SessionCompacted,
  type CompactionFailed,
  type SessionEvent,
  type SessionSummary,
  type UpdateResponse,
} from "./gen/compactd/v1/sessions.js";
import type { Message, MessageInfo, ModelLimits, Part, SessionConfig, SessionInfo, TokenUsage } from "./gen/compactd/v1/session.js";

/** How to reach compactd. */
export interface ClientOptionsInit {
  /**
   * `host:port` or `unix:/path/to.sock` (also `unix:///abs/path`). Default: `$COMPACTD_ADDR`,
   * else `127.0.0.1:50051` (compactd's default `--listen`).
   */
  address?: string;
  /** Bearer token sent as `authorization: Bearer <token>` (compactd `--auth-token-file`), surrounding whitespace trimmed. Default: `$COMPACTD_AUTH_TOKEN`. */
  token?: string;
  /**
   * TLS: `true` for the system roots, or PEM buffers (a CA, and a client key + chain for
   * mutual TLS). Plaintext by default, as compactd serves without `--tls-cert`.
   */
  tls?: boolean | { rootCerts?: Buffer; privateKey?: Buffer; certChain?: Buffer };
  /**
   * Deadline of each unary call in milliseconds (default 30000): more than 0, or `null` (or
   * `Infinity`) for none. Streams have none unless given per call. 0 or less throws a
   * RangeError (per call it is an already expired deadline: a client whose every call
   * failed at once is a mistake).
   */
  deadlineMs?: number | null;
  /**
   * Largest message sent or received, in bytes (default 512 MiB). gRPC libraries default to a
   * 4 MiB receive limit, which a large `GetSession` or `GetContext` exceeds.
   */
  maxMessageBytes?: number;
  /**
   * An `importSession` document longer than this many bytes goes in chunks of this size
   * (`ImportSessionChunked`; whole to a compactd without it): one request may be at most
   * compactd's `max_update_bytes` (16 MiB by default), and a chunk under 1 MiB decodes
   * outside the server's few slots for large requests. Default 960 KiB; 0 never chunks.
   */
  importChunkBytes?: number;
  /**
   * The largest update a `stream()` sends, measured encoded (default 16 MiB, compactd's
   * default `--max-update-bytes`: set it to the server's). A larger one is refused alone
   * (RESOURCE_EXHAUSTED, naming maxUpdateBytes) and the stream goes on, where compactd would
   * end the whole stream, every session on it. `null`: no check.
   */
  maxUpdateBytes?: number | null;
  /**
   * Extra grpc-js channel options, applied last (over the defaults: the message limits, and
   * keepalive pings every 20 s while calls are open, 10 s to answer: `grpc.keepalive_time_ms`
   * 20000, `grpc.keepalive_timeout_ms` 10000; `grpc.keepalive_time_ms: -1` turns them off).
   */
  channelOptions?: Partial<ClientOptions>;
  /** Ready-made channel credentials (wins over `tls`). */
  credentials?: ChannelCredentials;
}


/** The recall tool, parsed. */
export interface RecallToolDefinition {
  /** "compactd_recall". */
  name: string;
  /** The definition as JSON text, as the server sent it. */
  json: string;
  /** The same definition parsed: add it to a chat-completions request's `tools`. */
  tool: OpenAITool;
}


/**
 * Events a `Subscribe` or `Compact` call reads ahead of the host's iteration, past which it
 * reads no more until the host takes one: a host that stops iterating leaves them with
 * compactd, whose slow-reader protection then ends the call (RESOURCE_EXHAUSTED).
 */
export const MAX_UNREAD_EVENTS = 256;

/** A server stream as an async iterator; `cancel()` (or `break`) ends the call. */
export interface ServerStream<T> extends AsyncIterableIterator<T> {
  /** Resolves when the server has accepted the call (its response headers arrived). */
  readonly ready: Promise<void>;
  /** Events read and not yet taken by the iteration: at most {@link MAX_UNREAD_EVENTS}. */
  readonly buffered: number;
  /**
   * Ends the call: the iterator ends without an error once the call's end is in, after
   * the events that arrived before it (a Compact's then ends with `failed`, kind
   * "cancelled", unless its outcome was among them).
   */
  cancel(): void;
}

/** A manual compaction's events; also `result()` to wait for the end. */
export interface CompactionRun extends ServerStream<CompactionEvent> {
  /** Consumes the remaining events and returns how the compaction ended. */
  result(): Promise<CompactionResult>;
}

export type SessionInit = DeepPartial<SessionInfo> & { id: string };

/** `ImportSession` input: the export as text or as an object. */
export interface ImportInit {
  /** The `opencode export` document as JSON text. */
  exportJson?: string;
  /** The same document as an object. */
  export?: { [key: string]: JsonValue | unknown };
  /** Session id to use instead of the document's `info.id`. */
  sessionId?: string;
  limits?: DeepPartial<ModelLimits>;
  config?: DeepPartial<SessionConfig>;
  /** Replace a session with the same id instead of failing with ALREADY_EXISTS. */
  replace?: boolean;
  /**
   * With `replace`: keep the compactions compactd committed on the replaced session, which
   * a host's own history lacks (a reload of a session compactd compacts for the host). One
   * committed while the document was built fails the call with ABORTED: import again, and
   * it is kept then.
   */
  keepCompactions?: boolean;
}

const DEFAULT_ADDRESS = "127.0.0.1:50051";
const DEFAULT_DEADLINE_MS = 30_000;
const DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024;
const DEFAULT_IMPORT_CHUNK_BYTES = 960 * 1024;
/**
 * While calls are open, the channel pings compactd every KEEPALIVE_MS and gives it
 * KEEPALIVE_TIMEOUT_MS to answer: a call with no deadline (a subscribe(), a compact(), a
 * stream()) to a compactd that stopped answering without closing the connection (hung,
 * stopped, across a network partition) fails UNAVAILABLE within ~30 s instead of waiting
 * for TCP to give up (never, for a call that sends nothing). No pings without calls
 * (grpc-js' `grpc.keepalive_permit_without_calls` stays off): an idle client costs
 * compactd nothing. The Python client's defaults too.
 */
const KEEPALIVE_MS = 20_000;
const KEEPALIVE_TIMEOUT_MS = 10_000;
/** The details of the CANCELLED error of calls `close()` ended, and of calls made after it. */
const CLOSED_IN_FLIGHT = "the client was closed (close()) while this call was open";
const CLOSED_BEFORE = "the client is closed (close() was called): no call can be made on it; make a new CompactdClient";

type Service = typeof SessionsService;
type UnaryName = {
  [K in keyof Service]: Service[K]["requestStream"] extends false
    ? Service[K]["responseStream"] extends false
      ? K
      : never
    : never;
}[keyof Service];
type ReqOf<K extends keyof Service> = Parameters<Service[K]["requestSerialize"]>[0];
type ResOf<K extends keyof Service> = ReturnType<Service[K]["responseDeserialize"]>;

/** A call this client started and has not seen end: `close()` aborts it with its error. */
interface OpenCall {
  abort(err: CompactdError): void;
}

function envVar(name: string): string | undefined {
  const p = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  const v = p?.env?.[name];
  return v === undefined || v === "" ? undefined : v;
}


/**
 * The token as the server reads its file: without surrounding whitespace (a file's or a
 * secret's newline). One an HTTP/2 header cannot carry (control or non-ASCII characters) is
 * refused here, naming the option but not the value, where grpc-js would put the whole
 * header in every call's error.
 */
function bearerToken(raw: string | undefined): string | undefined {
  const token = raw?.trim();
  if (!token) return undefined;
  if (!/^[\x20-\x7e]+$/.test(token)) {
    throw new TypeError("token (or COMPACTD_AUTH_TOKEN) holds characters an HTTP header cannot carry (control or non-ASCII); its value is not shown");
  }
  return token;
}

/**
 * A compactd client. One instance holds one HTTP/2 channel; share it. Every method rejects
 * with a {@link CompactdError} carrying the gRPC code and, when the server names one, the field.
 */
export class CompactdClient {
  /** The generated grpc-js client, for anything this wrapper does not cover. */
  readonly raw: SessionsClient;
  readonly address: string;
  /** Private at run time too (`#`): printing or inspecting the client never shows it. */
  readonly #token?: string;
  /** The unary calls' deadline in ms; null: none. */
  private readonly deadlineMs: number | null;
  private readonly importChunkBytes: number;
  private readonly maxUpdateBytes: number | null;
  /** Calls started and not yet over: `close()` cancels them (the channel's own close does not). */
  readonly #open = new Set<OpenCall>();
  #closed = false;

  constructor(options: ClientOptionsInit = {}) {
    this.address = options.address ?? envVar("COMPACTD_ADDR") ?? DEFAULT_ADDRESS;
    this.#token = bearerToken(options.token ?? envVar("COMPACTD_AUTH_TOKEN"));
    const deadlineMs = options.deadlineMs === undefined ? DEFAULT_DEADLINE_MS : options.deadlineMs;
    if (deadlineMs !== null && !(typeof deadlineMs === "number" && deadlineMs > 0)) {
      throw new RangeError(`deadlineMs must be a number of milliseconds > 0, or null (or Infinity) for no deadline, not ${String(options.deadlineMs)}`);
    }
    this.deadlineMs = deadlineMs === Infinity ? null : deadlineMs;
    this.importChunkBytes = options.importChunkBytes ?? DEFAULT_IMPORT_CHUNK_BYTES;
    if (!Number.isSafeInteger(this.importChunkBytes) || this.importChunkBytes < 0) {
      throw new RangeError(`importChunkBytes must be a whole number of bytes >= 0, not ${String(options.importChunkBytes)}`);
    }
    this.maxUpdateBytes = options.maxUpdateBytes === undefined ? DEFAULT_MAX_UPDATE_BYTES : options.maxUpdateBytes;
    if (this.maxUpdateBytes !== null && (!Number.isSafeInteger(this.maxUpdateBytes) || this.maxUpdateBytes <= 0)) {
      throw new RangeError(`maxUpdateBytes must be a whole number of bytes > 0, or null, not ${String(options.maxUpdateBytes)}`);
    }
    const max = options.maxMessageBytes ?? DEFAULT_MAX_MESSAGE_BYTES;
    let creds = options.credentials;
    if (!creds) {
      const tls = options.tls;
      if (!tls) creds = grpcCredentials.createInsecure();
      else if (tls === true) creds = grpcCredentials.createSsl();
      else creds = grpcCredentials.createSsl(tls.rootCerts ?? null, tls.privateKey ?? null, tls.certChain ?? null);
    }
    this.raw = new SessionsClient(this.address, creds, {
      "grpc.max_receive_message_length": max,
      "grpc.max_send_message_length": max,
      "grpc.keepalive_time_ms": KEEPALIVE_MS,
      "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
      ...options.channelOptions,
    });
  }

  /**
   * Waits until the channel is connected; it waits through failed attempts, as gRPC's
   * wait-for-ready does. At `timeoutMs` it rejects with UNAVAILABLE when the channel's
   * attempts were failing (TRANSIENT_FAILURE: refused, unreachable; the same code its calls
   * get), else DEADLINE_EXCEEDED (an attempt still under way: a server that accepts and
   * never speaks HTTP/2, a slow network); the details name the channel's state. CANCELLED
   * once the client is closed.
   */
  waitForReady(timeoutMs = 10_000): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.#closed) {
        reject(this.closedError());
        return;
      }
      this.raw.waitForReady(Date.now() + timeoutMs, (err) => {
        if (!err) resolve();
        else if (this.#closed) reject(this.closedError(err));
        else {
          let state = "unknown";
          try {
            state = connectivityState[this.raw.getChannel().getConnectivityState(false)] ?? state;
          } catch {
            // closed meanwhile: the state is unknown
          }
          const failing = state === "TRANSIENT_FAILURE";
          reject(
            new CompactdError({
              code: failing ? Status.UNAVAILABLE : Status.DEADLINE_EXCEEDED,
              details:
                `compactd at ${this.address} not ready within ${timeoutMs} ms ` +
                `(channel ${state}${failing ? ": its connection attempts are failing" : ""}): ${err.message}`,
              cause: err,
            }),
          );
        }
      });
    });
  }

  /**
   * Closes the client: every call it has open ends at once with a {@link CompactdError}
   * CANCELLED ("the client was closed"): a unary call rejects, a `subscribe()` or
   * `compact()` iteration throws (and `result()` rejects), a `stream()` ends (its updates
   * in flight reject, `closed` resolves with the error). Then the channel closes, and a
   * process holds nothing open for it. (grpc-js' own `Channel.close()` fails only calls
   * not yet on a connection: a subscription went on, and kept the process alive.) For a
   * graceful end, `await stream.end()` first. After `close()`, unary methods reject, and
   * `stream()`, `subscribe()` and `compact()` throw, the same CANCELLED error: make a new
   * client. Calling it again does nothing.
   */
  close(): void {
    if (!this.#closed) {
      this.#closed = true;
      const open = [...this.#open];
      this.#open.clear();
      const err = new CompactdError({ code: Status.CANCELLED, details: CLOSED_IN_FLIGHT });
      for (const call of open) call.abort(err);
    }
    this.raw.close();
  }

  /** True once `close()` was called. */
  get isClosed(): boolean {
    return this.#closed;
  }

  /** The error of a call made after `close()`. */
  private closedError(cause?: unknown): CompactdError {
    return new CompactdError({ code: Status.CANCELLED, details: CLOSED_BEFORE, cause });
  }

  /**
   * Starts a grpc-js call: after `close()` (or a `raw.close()`) it throws the client's
   * CANCELLED error, and whatever else it throws as a CompactdError (grpc-js throws plain
   * Errors, "Channel has been shut down").
   */
  private startCall<C>(start: () => C): C {
    if (this.#closed) throw this.closedError();
    try {
      return start();
    } catch (e) {
      if (e instanceof CompactdError) throw e;
      if (e instanceof Error && /shut ?down|closed/i.test(e.message)) throw this.closedError(e);
      throw toCompactdError(e);
    }
  }

  /** Tracks an open call (close() aborts it); returns the function that stops tracking it, for its end. */
  private track(call: OpenCall): () => void {
    this.#open.add(call);
    return () => void this.#open.delete(call);
  }

  /** Metadata carrying the bearer token (exposed for calls made through `raw`). */
  metadata(): Metadata {
    const md = new Metadata();
    if (this.#token) md.set("authorization", `Bearer ${this.#token}`);
    return md;
  }

  /**
   * grpc-js call options for a call: the deadline. `deadlineMs` 0 or less is a deadline
   * already past (the call fails DEADLINE_EXCEEDED at once: a caller's budget that ran out
   * must not become a call without one); `null` or `Infinity` is none; absent, a unary
   * call takes the client's. Throws a CompactdError INVALID_ARGUMENT for anything else (NaN).
   */
  private callOptions(opts: CallOptions | undefined, unary: boolean): Partial<GrpcCallOptions> {
    const given = opts?.deadlineMs;
    const ms = given === undefined ? (unary ? this.deadlineMs : null) : given;
    if (ms === null || ms === Infinity) return {};
    if (typeof ms !== "number" || Number.isNaN(ms)) {
      throw new CompactdError({
        code: Status.INVALID_ARGUMENT,
        details: `deadlineMs must be a number of milliseconds (0 or less: already expired), or null (or Infinity) for none, not ${String(given)}`,
      });
    }
    return { deadline: Date.now() + ms };
  }

  private unary<K extends UnaryName>(name: K, request: ReqOf<K>, opts?: CallOptions): Promise<ResOf<K>> {
    const def = SessionsService[name];
    return new Promise<ResOf<K>>((resolve, reject) => {
      if (this.#closed) {
        reject(this.closedError());
        return;
      }
      if (opts?.signal?.aborted) {
        reject(new CompactdError({ code: Status.CANCELLED, details: "aborted before the call" }));
        return;
      }
      let over = false;
      let abortedWith: CompactdError | undefined;
      let untrack = () => undefined as void;
      const call = this.startCall(() =>
        this.raw.makeUnaryRequest(
          def.path,
          def.requestSerialize as (v: ReqOf<K>) => Buffer,
          def.responseDeserialize as (b: Buffer) => ResOf<K>,
          request,
          this.metadata(),
          this.callOptions(opts, true),
          (err: ServiceError | null, res?: ResOf<K>) => {
            over = true;
            untrack();
            opts?.signal?.removeEventListener("abort", onAbort);
            if (err) reject(abortedWith ?? CompactdError.fromStatus(err));
            else resolve(res as ResOf<K>);
          },
        ),
      );
      if (over) return;
      untrack = this.track({
        abort: (e) => {
          abortedWith = e;
          call.cancel();
        },
      });
      const onAbort = () => call.cancel();
      opts?.signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /**
   * A server-streaming call as a {@link ServerStream}. `hooks.observe` sees every item as
   * it arrives; `hooks.cancelledEnd` gives the item that ends a call the caller cancelled
   * (`cancel()`, the signal), if any, pushed after every item that arrived before it.
   */
  private serverStream<K extends "compact" | "subscribe", T>(
    name: K,
    request: ReqOf<K>,
    opts?: CallOptions,
    hooks?: { observe?(item: T): void; cancelledEnd?(): T | undefined },
  ): ServerStream<T> {
    const def = SessionsService[name];
    const call = this.startCall(() =>
      this.raw.makeServerStreamRequest(
        def.path,
        def.requestSerialize as (v: ReqOf<K>) => Buffer,
        def.responseDeserialize as (b: Buffer) => T,
        request,
        this.metadata(),
        this.callOptions(opts, false),
      ),
    );
    let cancelled = false;
    // close() ends the call with its own error (a cancel() by the host ends it cleanly).
    let abortedWith: CompactdError | undefined;
    const untrack = this.track({
      abort: (e) => {
        if (cancelled || abortedWith) return;
        abortedWith = e;
        call.cancel();
      },
    });
    const cancel = () => {
      if (cancelled) return;
      cancelled = true;
      call.cancel();
    };
    // Past MAX_UNREAD_EVENTS untaken the call is paused (grpc-js then reads no further,
    // and HTTP/2 flow control holds the rest at compactd); a take resumes it.
    let paused = false;
    const queue: AsyncQueue<T> = new AsyncQueue<T>(cancel, () => {
      if (paused && queue.size < MAX_UNREAD_EVENTS) {
        paused = false;
        call.resume();
      }
    });
    let readyResolve!: () => void;
    let readyReject!: (e: unknown) => void;
    const ready = new Promise<void>((res, rej) => {
      readyResolve = res;
      readyReject = rej;
    });
    ready.catch(() => undefined); // no unhandled rejection when nobody waits for it
    call.on("metadata", () => readyResolve());
    call.on("data", (item: T) => {
      hooks?.observe?.(item);
      queue.push(item);
      if (!paused && queue.size >= MAX_UNREAD_EVENTS) {
        paused = true;
        call.pause();
      }
    });
    // How the call ended, delivered once every event it received was: a paused call still
    // holds events in its own buffer when its status comes (they flow once a take resumes
    // it, then 'end'), and ending the queue first would drop them (a Compact's last ones:
    // its outcome).
    let outcome: { error?: CompactdError } | undefined;
    let drained = false;
    let settled = false;
    const settle = () => {
      if (settled || !outcome || !(drained || (!paused && call.readableLength === 0))) return;
      settled = true;
      if (outcome.error) {
        queue.fail(outcome.error);
        return;
      }
      const last = cancelled ? hooks?.cancelledEnd?.() : undefined;
      if (last !== undefined) queue.push(last);
      queue.end();
    };
    call.on("error", (err: ServiceError) => {
      const e = abortedWith ?? CompactdError.fromStatus(err);
      readyReject(e);
      outcome ??= cancelled && err.code === Status.CANCELLED ? {} : { error: e };
      settle();
    });
    call.on("end", () => {
      // 'end' comes before 'error' for a failed call: the status settles it then.
      drained = true;
      settle();
    });
    call.on("close", () => {
      drained = true;
      settle();
    });
    const onAbort = () => cancel();
    call.on("status", (st) => {
      // The call is over: a signal shared by many calls keeps no listener of this one.
      opts?.signal?.removeEventListener("abort", onAbort);
      untrack();
      if (st.code === Status.OK) {
        readyResolve();
        outcome ??= {};
        settle();
      }
    });
    if (opts?.signal) {
      if (opts.signal.aborted) cancel();
      else opts.signal.addEventListener("abort", onAbort, { once: true });
    }
    const it = queue as unknown as ServerStream<T>;
    Object.defineProperty(it, "ready", { value: ready });
    Object.defineProperty(it, "buffered", { get: () => queue.size });
    // The iteration ends once the call's end is in: after what arrived before the cancel
    // (a Compact's outcome among it, which ending the queue here dropped).
    Object.defineProperty(it, "cancel", { value: cancel });
    return it;
  }

  // ---- the main stream ----------------------------------------------------------------

  /**
   * Opens the main `Stream`. Updates sent on it get seqs 1, 2, ...; each resolves with its
   * events when its ack arrives, or rejects with a CompactdError on its `error` event (the
   * stream stays open).
   */
  stream(opts?: CallOptions): SessionStream {
    const def = SessionsService.stream;
    // Updates are encoded by the stream before they are written (`SessionStream.send`):
    // grpc-js would encode inside the call and cancel the whole call on a value that does
    // not encode.
    const call = this.startCall(() =>
      this.raw.makeBidiStreamRequest(
        def.path,
        (encoded: Buffer) => encoded,
        def.responseDeserialize,
        this.metadata(),
        this.callOptions(opts, false),
      ),
    );
    const s = new SessionStream(call, { maxUpdateBytes: this.maxUpdateBytes });
    const untrack = this.track({ abort: (e) => s.abort(e) });
    void s.closed.then(untrack);
    if (opts?.signal) {
      const signal = opts.signal;
      const onAbort = () => s.cancel();
      if (signal.aborted) s.cancel();
      else {
        signal.addEventListener("abort", onAbort, { once: true });
        // The stream is over: a signal shared by many streams keeps no listener of this one.
        void s.closed.then(() => signal.removeEventListener("abort", onAbort));
      }
    }
    return s;
  }

  // ---- sessions ------------------------------------------------------------------------

  /** Opens a session, or reconfigures it (title, model, limits, config, todos) when it exists. */
  async openSession(session: SessionInit, opts?: CallOptions): Promise<SessionSummary> {
    checkSessionConfig(session.config, "session.config");
    return this.unary("openSession", OpenSessionRequest.fromPartial({ session }), opts);
  }

  /** The whole session: info, every message and part (pruned outputs included), summary. */
  getSession(sessionId: string, opts?: CallOptions): Promise<GetSessionResponse> {
    return this.unary("getSession", GetSessionRequest.fromPartial({ sessionId }), opts);
  }

  /**
   * One summary per session held, in id order (cold sessions give their id and `cold`),
   * fetched `pageSize` (an integer from 1 to 2^31 - 1; 1000) at a time so no reply
   * outgrows the receive limit. `deadlineMs` applies to each page.
   */
  async listSessions(opts?: CallOptions & { pageSize?: number }): Promise<SessionSummary[]> {
    const pageSize = opts?.pageSize ?? 1000;
    if (!Number.isInteger(pageSize) || pageSize < 1 || pageSize > 0x7fffffff) {
      throw new CompactdError({ code: Status.INVALID_ARGUMENT, field: "page_size", details: `pageSize must be an integer from 1 to 2^31 - 1, not ${String(pageSize)}` });
    }
    const sessions: SessionSummary[] = [];
    let pageToken = "";
    for (;;) {
      const reply = await this.unary("listSessions", ListSessionsRequest.fromPartial({ pageSize, pageToken }), opts);
      sessions.push(...reply.sessions);
      if (!reply.nextPageToken) return sessions;
      // Ids compare as UTF-8 bytes on the server; a token that does not move on would loop.
      if (Buffer.compare(Buffer.from(reply.nextPageToken), Buffer.from(pageToken)) <= 0) {
        throw new CompactdError({ code: Status.INTERNAL, details: `ListSessions page token did not advance (${reply.nextPageToken})` });
      }
      pageToken = reply.nextPageToken;
    }
  }

  /** Forgets a session; true when it existed. */
  async deleteSession(sessionId: string, opts?: CallOptions): Promise<boolean> {
    return (await this.unary("deleteSession", DeleteSessionRequest.fromPartial({ sessionId }), opts)).deleted;
  }

  /** Loads an `opencode export` document (text or object) as a session. */
  async importSession(init: ImportInit, opts?: CallOptions): Promise<SessionSummary> {
    checkSessionConfig(init.config);
    const request = ImportSessionRequest.fromPartial({
      exportJson: init.exportJson ?? "",
      export: init.export as { [key: string]: unknown } | undefined,
      sessionId: init.sessionId ?? "",
      limits: init.limits,
      config: init.config,
      replace: init.replace ?? false,
      keepCompactions: init.keepCompactions ?? false,
    });
    const size = this.importChunkBytes;
    const both = Boolean(init.exportJson) && init.export !== undefined; // refused by compactd as it is
    if (size === 0 || both) return this.unary("importSession", request, opts);
    // The document's JSON text measures it (an object goes as a Struct of about that size).
    const text = init.exportJson || (init.export === undefined ? "" : JSON.stringify(init.export));
    if (Buffer.byteLength(text, "utf8") <= size) return this.unary("importSession", request, opts);
    const head = { ...request, exportJson: "", export: undefined };
    return this.importChunked(head, Buffer.from(text, "utf8"), size, opts).catch((e: unknown) => {
      // A compactd without ImportSessionChunked: the document whole, as before it.
      if (e instanceof CompactdError && e.codeName === "UNIMPLEMENTED") return this.unary("importSession", request, opts);
      throw e;
    });
  }

  /**
   * `ImportSessionChunked`: `request` rides on the first chunk, `doc` is cut every `size`
   * bytes, and each chunk waits for the call to drain (grpc-js' backpressure) before the next.
   */
  private importChunked(request: ImportSessionRequest, doc: Buffer, size: number, opts?: CallOptions): Promise<SessionSummary> {
    const def = SessionsService.importSessionChunked;
    return new Promise<SessionSummary>((resolve, reject) => {
      if (this.#closed) {
        reject(this.closedError());
        return;
      }
      if (opts?.signal?.aborted) {
        reject(new CompactdError({ code: Status.CANCELLED, details: "aborted before the call" }));
        return;
      }
      let ended = false;
      let abortedWith: CompactdError | undefined;
      let untrack = () => undefined as void;
      const call = this.startCall(() =>
        this.raw.makeClientStreamRequest(
          def.path,
          def.requestSerialize,
          def.responseDeserialize,
          this.metadata(),
          this.callOptions(opts, true),
          (err: ServiceError | null, res?: SessionSummary) => {
            ended = true;
            untrack();
            opts?.signal?.removeEventListener("abort", onAbort);
            if (err) reject(abortedWith ?? CompactdError.fromStatus(err));
            else resolve(res as SessionSummary);
          },
        ),
      );
      if (ended) return;
      untrack = this.track({
        abort: (e) => {
          abortedWith = e;
          call.cancel();
        },
      });
      const onAbort = () => call.cancel();
      opts?.signal?.addEventListener("abort", onAbort, { once: true });
      let at = 0;
      const send = () => {
        while (!ended && at < doc.length) {
          const chunk = { request: at === 0 ? request : undefined, exportJson: doc.subarray(at, at + size) };
          at += size;
          if (!call.write(chunk)) {
            call.once("drain", send);
            return;
          }
        }
        if (!ended) call.end();
      };
      send();
    });
  }

  // ---- unary twins of the stream updates --------------------------------------------------

  /** Inserts a message or updates it in place. */
  async upsertMessage(sessionId: string, message: DeepPartial<MessageInfo>, opts?: CallOptions): Promise<UpdateResult> {
    return this.twin(this.unary("upsertMessage", UpsertMessageRequest.fromPartial({ sessionId, message }), opts));
  }

  /** Inserts a part or updates it in place (its message must exist). */
  async upsertPart(sessionId: string, part: DeepPartial<Part>, opts?: CallOptions): Promise<UpdateResult> {
    return this.twin(this.unary("upsertPart", UpsertPartRequest.fromPartial({ sessionId, part }), opts));
  }

  /** Removes a part. */
  async deletePart(sessionId: string, messageId: string, partId: string, opts?: CallOptions): Promise<UpdateResult> {
    return this.twin(this.unary("deletePart", DeletePartRequest.fromPartial({ sessionId, messageId, partId }), opts));
  }

  /** Records provider token usage (optionally on an assistant message) and checks overflow. */
  async reportUsage(
    sessionId: string,
    usage: { messageId?: string; tokens: DeepPartial<TokenUsage> },
    opts?: CallOptions,
  ): Promise<UpdateResult> {
    return this.twin(this.unary("reportUsage", ReportUsageRequest.fromPartial({ sessionId, usage }), opts));
  }

  /** Pins (or with `pinned: false` unpins) a part, or a whole message when `partId` is empty. */
  async pin(
    sessionId: string,
    target: { messageId: string; partId?: string; pinned?: boolean },
    opts?: CallOptions,
  ): Promise<UpdateResult> {
    return this.twin(this.unary("pin", PinRequest.fromPartial({ sessionId, ...target }), opts));
  }

  private async twin(p: Promise<UpdateResponse>): Promise<UpdateResult> {
    return updateResult(0, (await p).events);
  }

  // ---- context and decisions ------------------------------------------------------------

  /**
   * The ready-to-send context. `format`: "both" (default), "openai" (only `openaiMessages`),
   * "openai_json" (only `openaiMessagesJson`, the same messages as one JSON text) or
   * "native" (only `messages`).
   */
  getContext(sessionId: string, format: ContextFormatName = "both", opts?: CallOptions): Promise<Context> {
    return this.unary("getContext", GetContextRequest.fromPartial({ sessionId, format: contextFormat(format) }), opts);
  }

  /** The context as OpenAI chat-completions `messages`, ready to send (fetched as one JSON
   * text, the cheapest shape to build and read). */
  async getOpenAIMessages(sessionId: string, opts?: CallOptions): Promise<OpenAIChatMessage[]> {
    return openaiMessagesOf(await this.getContext(sessionId, "openai_json", opts));
  }

  /** The context as native (OpenCode-shaped) messages with their parts. */
  async getNativeMessages(sessionId: string, opts?: CallOptions): Promise<Message[]> {
    return (await this.getContext(sessionId, "native", opts)).messages;
  }

  /** Runs OpenCode's prune now (or, with `dryRun`, reports what it would do). */
  prune(sessionId: string, options: { dryRun?: boolean } = {}, opts?: CallOptions): Promise<PruneReport> {
    return this.unary("prune", PruneRequest.fromPartial({ sessionId, dryRun: options.dryRun ?? false }), opts);
  }

  /** Runs the overflow check now; every number behind the decision. */
  checkOverflow(sessionId: string, opts?: CallOptions): Promise<OverflowCheck> {
    return this.unary("checkOverflow", CheckOverflowRequest.fromPartial({ sessionId }), opts);
  }

  // ---- pins and recall ---------------------------------------------------------------------

  /** A part's original content, by the tool call id the model passes, or by part id. */
  recall(sessionId: string, key: { callId: string } | { partId: string }, opts?: CallOptions): Promise<Recalled> {
    return this.unary("recall", RecallRequest.fromPartial({ sessionId, ...key }), opts);
  }

  /** The `compactd_recall` tool definition (OpenAI function calling), parsed. */
  async getRecallTool(opts?: CallOptions): Promise<RecallToolDefinition> {
    const t = await this.unary("getRecallTool", GetRecallToolRequest.fromPartial({}), opts);
    return { name: t.name, json: t.json, tool: JSON.parse(t.json) as OpenAITool };
  }

  // ---- compaction and watching -------------------------------------------------------------

  /**
   * Summarizes the session now. Iterate the run for `started`, `delta`, `retrying` and the
   * final `compacted` or `failed`; or `await run.result()`. `cancel()` (or `break`, or the
   * signal) cancels the compaction and its LLM request. A run cancelled by `cancel()` or
   * the signal ends with `failed` of kind "cancelled" (not retryable; made by the client,
   * as the call ends without an outcome), so `result().failed.kind` is "cancelled"; an
   * outcome that arrived before the cancel is kept instead. (A `break` just ends.)
   */
  compact(sessionId: string, options: DeepPartial<CompactOptions> = {}, opts?: CallOptions): CompactionRun {
    let compactionId = "";
    let ended = false;
    const s = this.serverStream<"compact", CompactionEvent>(
      "compact",
      CompactRequest.fromPartial({ sessionId, options: CompactOptions.fromPartial(options) }),
      opts,
      {
        observe: (e) => {
          compactionId ||= e.compactionId;
          if (e.compacted || e.failed) ended = true;
        },
        cancelledEnd: () => (ended ? undefined : cancelledHere(sessionId, compactionId)),
      },
    );
    Object.defineProperty(s, "result", { value: () => collectCompaction(s) });
    return s as CompactionRun;
  }

  /**
   * Watches one session (or every session with no id): overflow, pruned, compaction and
   * evicted events. A watcher that falls behind ends with RESOURCE_EXHAUSTED.
   */
  subscribe(sessionId = "", opts?: CallOptions): ServerStream<SessionEvent> {
    return this.serverStream<"subscribe", SessionEvent>("subscribe", SubscribeRequest.fromPartial({ sessionId }), opts);
  }
}

