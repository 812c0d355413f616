// compactd for OpenCode.
//
// - mirrors every OpenCode session into compactd: the `event` hook streams message and
//   part updates (assistant usage included) as they happen, and before each model request
//   the messages OpenCode is about to send are reconciled with what compactd holds;
// - replaces those messages with compactd's context (`experimental.chat.messages.transform`):
//   cleared, superseded, masked and capped outputs as compactd renders them;
// - compaction: OpenCode's own (default; compactd only prunes) or compactd's (OpenCode's
//   automatic compaction is turned off and compactd's summaries are relayed);
// - registers compactd's `compactd_recall` tool, so the model can get a hidden output back;
// - starts the sidecar (`compactd serve` on a private Unix socket) or connects to a given address.
//
// A compactd error never breaks OpenCode: the request goes out with OpenCode's own
// messages and the error is logged.
import { createHash, randomUUID } from "node:crypto"
import type { Plugin, Hooks, ToolDefinition } from "@opencode-ai/plugin"
import { z } from "zod"
import type { CompactdClient, SessionStream, Recalled } from "@compactd/client"
import { leavesInput, resolveSettings, sessionConfig, type PluginSettings } from "./options.js"
import { startSidecar, type Sidecar } from "./sidecar.js"
import { createLog, type Log } from "./log.js"
import { toMessageInfo, toPart, toOpenCodeMessages } from "./convert.js"

/* eslint-disable @typescript-eslint/no-explicit-any */
type Obj = { [key: string]: any }
type WithParts = { info: Obj; parts: Obj[] }

interface SessionState {
  id: string
  /** "new": open on the first update; "import": load OpenCode's whole session first. */
  status: "new" | "import" | "ready"
  /** Digest of what compactd holds, by "m:<id>" / "p:<id>". */
  sent: Map<string, string>
  /** Part ids compactd holds, by message id. */
  parts: Map<string, Set<string>>
  /** Updates sent whose ack has not arrived. */
  pending: Set<Promise<unknown>>
  /** The model and limits the session was opened with (JSON), to reopen on change. */
  opened: string
  model?: { providerID: string; modelID: string }
  /** Assistant messages held back until their first part, by id. */
  deferred: Map<string, Obj>
  /** A compaction compactd is running for the session. */
  compaction?: Promise<void>
  /** The user turn (its message id) in which a compaction the plugin asked for failed: not
   *  asked for again before the next turn. */
  failedIn?: string
  /** The user turn in which compactd refused to load the session whole, and why: not
   *  loaded again before the next turn. */
  refused?: { turn?: string; reason: string }
  /** OpenCode deleted the session: nothing more is sent for this state (a reopen that
   *  waited for the model's limits would make the session again in compactd). */
  deleted?: boolean
  /** With compaction "compactd", the last context sent that started with compactd's
   *  summary: its messages before OpenCode's own (`head`), the first of OpenCode's that
   *  followed (`tailStart`; none when it summarized them all) and the newest message of
   *  that request (`after`). A request whose context cannot be built is sent from it. */
  lastGood?: { head: WithParts[]; tailStart?: string; after: string }
}

/** Codes of failures a retry may not meet again (compactd down or slow, a call cut): any
 * other is a refusal of the request itself, which the same request would meet again. */
const TRANSIENT = new Set(["UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED", "UNKNOWN", "INTERNAL"])

/** The id of the last user message: the user turn `messages` belong to. */
function userTurn(messages: WithParts[]): string | undefined {
  return [...messages].reverse().find((m) => m.info?.role === "user")?.info?.id
}

const digest = (v: unknown) => createHash("sha1").update(JSON.stringify(v)).digest("base64")

const RECALL_DESCRIPTION =
  "Returns the original content of a tool output that the context shows cleared, superseded, masked or truncated. Pass the tool call's call_id."

/**
 * Whether compactd has a summarizer: it refuses a compaction without one before it looks
 * for the session, so one of a session no one holds answers FAILED_PRECONDITION naming the
 * missing endpoint, or NOT_FOUND when there is one. Only NOT_FOUND is a yes: any other
 * answer (a wrong token, compactd unavailable, a timeout) leaves OpenCode's own
 * compaction on, or nothing would compact. `why` is what the probe got instead.
 */
async function canSummarize(client: CompactdClient): Promise<{ yes: boolean; why: string }> {
  try {
    await client.compact(`compactd-opencode-probe-${randomUUID()}`).result()
    return { yes: true, why: "" }
  } catch (e: any) {
    if (e?.codeName === "NOT_FOUND") return { yes: true, why: "" }
    return { yes: false, why: `${e?.codeName ?? "error"}: ${String(e?.message ?? e)}` }
  }
}

const CompactdPlugin: Plugin = async (input, options) => {
  let settings: PluginSettings
  const early = createLog(input.client, process.env.COMPACTD_OPENCODE_LOG, false)
  try {
    settings = resolveSettings(options as Obj)
  } catch (e) {
    early.error(`compactd plugin disabled: bad settings: ${(e as Error).message}`)
    return {}
  }
  if (!settings.enabled) return {}
  const log = createLog(input.client, settings.logFile, settings.debug)
  let sidecar: Sidecar
  try {
    sidecar = await startSidecar(settings, log)
  } catch (e) {
    log.error(`compactd plugin disabled: compactd is not available: ${(e as Error).message}`)
    return {}
  }
  // compactd's summary reaches the model only in the context the plugin sends: without
  // replaceMessages, OpenCode's compaction turned off would leave nothing to compact the
  // session (OpenCode's history grows until the provider refuses it).
  if (settings.compaction === "compactd" && !settings.replaceMessages) {
    log.warn(`compaction "compactd" needs replaceMessages (compactd's summary reaches the model only in its context): OpenCode keeps compacting, as with compaction "opencode"`)
    settings = { ...settings, compaction: "opencode" }
  }
  // OpenCode's own compaction is turned off only when compactd can summarize: without a
  // summarizer, a session that outgrows its window would stop the turn. Such a compactd is
  // used as with compaction "opencode" (it follows OpenCode's compactions).
  if (settings.compaction === "compactd") {
    const probe = await canSummarize(sidecar.client)
    if (!probe.yes) {
      const missing = /no LLM endpoint is configured/.test(probe.why)
        ? "compactd has no LLM endpoint (--llm-base-url, or llmBaseUrl)"
        : `compactd could not confirm it can summarize (${probe.why})`
      log.warn(`compaction "compactd", but ${missing}: OpenCode keeps compacting, as with compaction "opencode"`)
      settings = { ...settings, compaction: "opencode" }
    }
  }
  const mirror = new Mirror(sidecar.client, settings, log, input.client)
  let recallDescription = RECALL_DESCRIPTION
  if (settings.recall) {
    try {
      const t = await sidecar.client.getRecallTool()
      recallDescription = t.tool.function.description ?? recallDescription
    } catch (e) {
      log.warn(`GetRecallTool failed, using the built-in description: ${(e as Error).message}`)
    }
  }
  if (settings.compaction === "compactd") mirror.watchCompactions()

  const hooks: Hooks = {
    dispose: async () => {
      mirror.close()
      sidecar.stop()
    },
    config: async (config: Obj) => {
      if (settings.compaction === "compactd") {
        // compactd decides when to compact; OpenCode must not summarize on its own too.
        config.compaction = { ...(config.compaction ?? {}), auto: false }
      }
    },
    event: async ({ event }) => {
      try {
        mirror.onEvent(event as Obj)
      } catch (e) {
        log.warn(`mirroring ${(event as Obj)?.type}: ${(e as Error).message}`)
      }
    },
    "chat.params": async (inp: Obj) => {
      try {
        mirror.onModel(inp.sessionID, inp.model, inp.message)
      } catch (e) {
        log.warn(`chat.params: ${(e as Error).message}`)
      }
    },
    "experimental.session.compacting": async (inp: Obj) => {
      mirror.onCompacting(inp?.sessionID)
    },
    "experimental.chat.messages.transform": async (_inp, output: Obj) => {
      if (!Array.isArray(output?.messages) || output.messages.length === 0) return
      // OpenCode's own compaction runs this hook too, over the messages it summarizes (its
      // summarizer has no tools: compactd's pointers to compactd_recall would mislead it).
      if (mirror.isCompactionInput(output.messages as WithParts[])) return
      try {
        const replaced = await mirror.transform(output.messages as WithParts[])
        if (replaced && settings.replaceMessages) output.messages.splice(0, output.messages.length, ...replaced)
        mirror.contextReplaced()
      } catch (e) {
        // With compaction "compactd" OpenCode's own messages are the whole history (its
        // compaction is off): the last summary compactd gave, and OpenCode's messages
        // from where its tail began, keep the request compacted.
        const kept = mirror.lastGood(output.messages as WithParts[])
        if (kept) output.messages.splice(0, output.messages.length, ...kept.messages)
        mirror.contextNotReplaced(e as Error, kept?.from)
      }
    },
  }
  if (settings.recall) {
    hooks.tool = {
      // What @opencode-ai/plugin's tool() builds (it returns its input; the schema is zod's),
      // written out so the plugin needs zod at run time, not the whole plugin package.
      compactd_recall: {
        description: recallDescription,
        args: { call_id: z.string().describe("The call_id of the tool call whose original output you need") },
        async execute(args: { call_id: string }, ctx: { sessionID: string }) {
          // A stalled compactd would hold the model's tool call for timeoutMs.
          const stalled = mirror.stalledSince()
          if (stalled !== null) return `compactd_recall failed: compactd has not answered since ${new Date(stalled).toISOString()}; try again later`
          try {
            return formatRecalled(await sidecar.client.recall(ctx.sessionID, { callId: args.call_id }))
          } catch (e) {
            return `compactd_recall failed: ${(e as Error).message}`
          }
        },
      } as unknown as ToolDefinition,
    }
  }
  log.info(`compactd plugin ready (compaction: ${settings.compaction}, replace messages: ${settings.replaceMessages}, recall tool: ${settings.recall})`)
  return hooks
}

function formatRecalled(r: Recalled): string {
  if (r.call) {
    const c = r.call
    const head = `${c.tool} call ${c.callId} (${c.status}), input: ${JSON.stringify(c.input ?? {})}`
    return `${head}\n\n${c.status === "error" ? c.error : c.output}`
  }
  if (r.text !== undefined) return r.text
  if (r.file) return `[File: ${r.file.filename} (${r.file.mime})] ${r.file.url}`
  return `(part ${r.partId} of type ${r.partType} has no content)`
}

class Mirror {
  private stream: SessionStream | null = null
  private readonly sessions = new Map<string, SessionState>()
  private readonly limitsCache = new Map<string, Promise<Obj | undefined>>()
  private watcher: { cancel(): void } | null = null
  private closing = false
  /** Whether the last context compactd was asked for failed (its toast was shown). */
  private unreplaced = false
  /** Set while compactd is not answering (`stall`): since when (ms since the epoch). */
  private stalled: { since: number } | null = null
  /** When the last stall ended, and the floor it had (a stall soon after doubles it). */
  private lastStall = { ended: 0, floorMs: 0 }
  /** Sessions deleted in OpenCode whose delete compactd did not get (it was stalled or
   * unreachable): sent again once it answers. */
  private readonly undeleted = new Set<string>()

  constructor(
    private readonly client: CompactdClient,
    private readonly settings: PluginSettings,
    private readonly log: Log,
    private readonly opencode: any,
  ) {}

  /** Sessions OpenCode is compacting: the next transform of each is its compaction's input. */
  private readonly compacting = new Set<string>()

  close() {
    this.closing = true
    this.watcher?.cancel()
    this.stream?.cancel()
  }

  /**
   * OpenCode fires `experimental.session.compacting` right before it runs the transform
   * over a copy of the messages it summarizes: the session's next transform is that one.
   * The mark also goes when the compaction ends (its transform may not come: nothing to
   * summarize), so it never holds back a model request's context.
   */
  onCompacting(sessionID: unknown) {
    if (typeof sessionID === "string" && sessionID) this.compacting.add(sessionID)
  }

  /** Whether `messages` are the input of OpenCode's compaction (once per compaction). */
  isCompactionInput(messages: WithParts[]): boolean {
    const sessionID = messages[0]?.info?.sessionID
    if (!sessionID || !this.compacting.delete(sessionID)) return false
    this.log.info(`session ${sessionID}: OpenCode is compacting; its summarizer gets OpenCode's own ${messages.length} messages`)
    return true
  }

  /** The session's state, created when first met; it becomes the most recently used. */
  private session(id: string): SessionState {
    let s = this.known(id)
    if (!s) {
      s = { id, status: "new", sent: new Map(), parts: new Map(), pending: new Set(), opened: "", deferred: new Map() }
      this.sessions.set(id, s)
      this.forgetIdle(id)
    }
    return s
  }

  /** The session's state if there is one, made the most recently used (the map's order). */
  private known(id: string): SessionState | undefined {
    const s = this.sessions.get(id)
    if (s) {
      this.sessions.delete(id)
      this.sessions.set(id, s)
    }
    return s
  }

  /**
   * Past `maxSessions`, forgets the least recently used sessions that wait on nothing (no
   * ack, no compaction): a long-running OpenCode meets many sessions, and each state holds
   * a digest per part. A forgotten session is loaded whole when it is used again, as after
   * a restart (compactd keeps its summaries).
   */
  private forgetIdle(keep: string) {
    let over = this.sessions.size - this.settings.maxSessions
    for (const [id, s] of this.sessions) {
      if (over <= 0) return
      if (id === keep || s.pending.size || s.compaction) continue
      this.sessions.delete(id)
      over -= 1
      if (this.settings.debug) this.log.debug(`forgetting the mirror state of idle session ${id}`)
    }
  }

  private getStream(): SessionStream {
    if (!this.stream || this.stream.isClosed) {
      this.stream = this.client.stream()
      this.stream.on("close", (err) => {
        if (this.closing) return
        if (err) this.log.warn(`compactd stream closed: ${err.message}; sessions will be reloaded`)
        for (const s of this.sessions.values()) s.status = "import"
      })
      this.stream.on("pruned", (r, e) => {
        const strategies = r.strategies.map((x) => `${x.strategy} ${x.parts} parts/${x.tokens} tokens`).join(", ")
        this.log.info(`compactd pruned session ${e.sessionId}: opencode prune ${r.committed ? `${r.tokensSaved} tokens` : "no"}${strategies ? `; ${strategies}` : ""}`)
      })
    }
    return this.stream
  }

  /** Sends one update; failures are logged and make the session reload before its next request. */
  private send(s: SessionState, body: Obj, what: string): Promise<unknown> {
    if (s.deleted) return Promise.resolve()
    if (this.stalled) {
      // Not sent to a compactd that does not answer: the session is loaded whole later.
      s.status = "import"
      return Promise.resolve()
    }
    if (this.settings.debug) this.log.debug(`-> ${s.id} ${what}`)
    const p: Promise<unknown> = this.getStream()
      .send(s.id, body)
      .catch((e: any) => {
        if (this.closing) return
        this.log.warn(`compactd rejected ${what} of session ${s.id} (${e.codeName ?? e.code ?? ""} ${e.field ?? ""}): ${e.message}; reloading the session`)
        s.status = "import"
      })
      .finally(() => s.pending.delete(p))
    s.pending.add(p)
    return p
  }

  private sessionInfo(s: SessionState, limits: Obj | undefined): Obj {
    const config = sessionConfig({ ...(this.settings.compaction === "opencode" ? { autoCompact: false } : {}), ...this.settings.session })
    const info: Obj = { id: s.id, config }
    if (s.model) info.model = { providerId: s.model.providerID, modelId: s.model.modelID }
    const l = this.settings.limits ?? limits
    if (l) info.limits = { context: l.context ?? 0, input: l.input ?? 0, output: l.output ?? 0 }
    return info
  }

  /** (Re)opens the session when its model or limits changed. Sends at once (updates after it
   * must follow it on the stream); limits not known yet are looked up and sent by a reopen
   * (a lookup that fails is not: the session stays open without them until one succeeds). */
  private open(s: SessionState) {
    let limits: Obj | undefined
    if (s.model) {
      const key = `${s.model.providerID}/${s.model.modelID}`
      if (this.limitsKnown.has(key)) limits = this.limitsKnown.get(key)
      else {
        void this.limitsOf(s.model).then(() => {
          if (this.limitsKnown.has(key)) this.open(s)
        })
      }
    }
    const info = this.sessionInfo(s, limits)
    const key = JSON.stringify(info)
    if (key === s.opened) return
    s.opened = key
    this.send(s, { open: info }, "open")
  }

  private readonly limitsKnown = new Map<string, Obj | undefined>()
  /** Lookups of a model's limits that failed: when the next may start, and the wait before it. */
  private readonly limitsRetry = new Map<string, { at: number; wait: number }>()

  /**
   * The model's limits from OpenCode's provider list (one lookup at a time per model). A
   * failed lookup is tried again on a later call once its wait is over (1 s, doubling to
   * 30 s while it keeps failing); until then the answer is "unknown" at once.
   */
  private limitsOf(model: { providerID: string; modelID: string }): Promise<Obj | undefined> {
    const key = `${model.providerID}/${model.modelID}`
    let p = this.limitsCache.get(key)
    if (p) return p
    if (Date.now() < (this.limitsRetry.get(key)?.at ?? 0)) return Promise.resolve(undefined)
    // Dropped once it settles unless it found the limits (never before it is cached: a
    // providers() that throws at once fails the lookup before this line returns).
    p = this.lookUpLimits(model, key).finally(() => {
      if (!this.limitsKnown.has(key)) this.limitsCache.delete(key)
    })
    this.limitsCache.set(key, p)
    return p
  }

  private async lookUpLimits(model: { providerID: string; modelID: string }, key: string): Promise<Obj | undefined> {
    try {
      const res = await this.opencode.config.providers()
      const data = res?.data ?? res
      const provider = (data?.providers ?? []).find((x: Obj) => x.id === model.providerID)
      const limit = this.usableLimits(key, provider?.models?.[model.modelID]?.limit)
      if (!limit) this.log.warn(`no limits known for ${key}: compactd will not detect overflow`)
      this.limitsKnown.set(key, limit)
      this.limitsRetry.delete(key)
      return limit
    } catch (e) {
      const wait = Math.min(2 * (this.limitsRetry.get(key)?.wait ?? 500), 30_000)
      this.limitsRetry.set(key, { at: Date.now() + wait, wait })
      this.log.warn(`reading OpenCode's providers failed (${key} has no limits until a lookup succeeds; next one in ${wait / 1000} s at the earliest): ${(e as Error).message}`)
      return undefined
    }
  }

  /** A model's limits as compactd takes them: limits that leave no input once the answer is
   * reserved (`leavesInput`) are left out, with a warning once per model, rather than have
   * every open and reload of its sessions refused. */
  private usableLimits(key: string, limit: Obj | undefined): Obj | undefined {
    if (!limit || leavesInput(limit)) return limit
    if (!this.unusableLimits.has(key)) {
      this.unusableLimits.add(key)
      this.log.warn(`${key}'s limits ${JSON.stringify(limit)} leave no input once the answer is reserved: compactd will not detect overflow for it (set the plugin's limits, or the model's limit.input)`)
    }
    return undefined
  }

  private readonly unusableLimits = new Set<string>()

  onModel(sessionID: string, model: Obj, message?: Obj) {
    if (!sessionID || !model) return
    const ref = { providerID: String(model.providerID ?? ""), modelID: String(model.id ?? model.modelID ?? "") }
    if (model.limit) {
      const key = `${ref.providerID}/${ref.modelID}`
      const limit = this.usableLimits(key, model.limit)
      this.limitsCache.set(key, Promise.resolve(limit))
      this.limitsKnown.set(key, limit)
    }
    // OpenCode's turns go to their user message's model. A request on another model is a
    // side request of the same session (its title, its summary, on OpenCode's small
    // model): the session's model and limits stay the turn's.
    const turn = message?.model
    if (turn && (String(turn.providerID) !== ref.providerID || String(turn.modelID) !== ref.modelID)) return
    const s = this.session(sessionID)
    s.model = ref
    if (s.status === "ready") this.open(s)
  }

  private noteModel(s: SessionState, info: Obj) {
    if (info.role === "user" && info.model) s.model = { providerID: info.model.providerID, modelID: info.model.modelID }
    else if (info.role === "assistant" && info.providerID) s.model = { providerID: info.providerID, modelID: info.modelID }
  }

  private messageUpdate(s: SessionState, info: Obj, force = false) {
    this.noteModel(s, info)
    // OpenCode creates a step's assistant message before it builds the request: held back
    // until its first part, it lands after a compaction that request triggers (in the
    // context) rather than before it (summarized while still empty).
    if (!force && info.role === "assistant" && !info.time?.completed && !s.parts.has(info.id)) {
      s.deferred.set(info.id, info)
      return
    }
    s.deferred.delete(info.id)
    const m = toMessageInfo(info)
    const key = `m:${m.id}`
    const d = digest(m)
    if (s.sent.get(key) === d) return
    s.sent.set(key, d)
    if (!s.parts.has(m.id!)) s.parts.set(m.id!, new Set())
    this.send(s, { upsertMessage: m }, `message ${m.id}`)
  }

  private partUpdate(s: SessionState, part: Obj) {
    const p = toPart(part)
    if (!p) return
    const waiting = s.deferred.get(p.messageId!)
    if (waiting) this.messageUpdate(s, waiting, true)
    const key = `p:${p.id}`
    const d = digest(p)
    if (s.sent.get(key) === d) return
    s.sent.set(key, d)
    s.parts.get(p.messageId!)?.add(p.id!)
    this.send(s, { upsertPart: p }, `part ${p.id}`)
  }

  private partRemoved(s: SessionState, messageID: string, partID: string) {
    if (!s.sent.delete(`p:${partID}`)) return
    s.parts.get(messageID)?.delete(partID)
    this.send(s, { deletePart: { messageId: messageID, partId: partID } }, `delete part ${partID}`)
  }

  onEvent(event: Obj) {
    const props = event?.properties ?? {}
    switch (event?.type) {
      case "message.updated": {
        const info = props.info
        if (!info?.sessionID) return
        const s = this.session(info.sessionID)
        if (s.status === "new") {
          // A session seen from its first user message is mirrored update by update;
          // one met mid-way is loaded whole before its next request.
          if (info.role !== "user") {
            s.status = "import"
            return
          }
          s.status = "ready"
          this.noteModel(s, info)
          this.open(s)
          this.messageUpdate(s, info)
          return
        }
        if (s.status === "ready") this.messageUpdate(s, info)
        return
      }
      case "message.part.updated": {
        const part = props.part
        if (!part?.sessionID) return
        const s = this.known(part.sessionID)
        if (s?.status !== "ready") return
        // Text still streaming is sent when it appears (compactd keeps parts in arrival
        // order) and once it is whole, not at every delta. So is a tool still running:
        // OpenCode publishes a running command's part at every chunk it prints (the output
        // so far, in its metadata); sent each time, they queued without bound in OpenCode's
        // process while compactd was slow or stopped. Its finished part comes before the
        // next request.
        const streaming = (part.type === "text" || part.type === "reasoning") && part.time && part.time.end === undefined
        const running = part.type === "tool" && (part.state?.status === "pending" || part.state?.status === "running")
        if ((streaming || running) && s.sent.has(`p:${part.id}`)) return
        this.partUpdate(s, part)
        return
      }
      case "message.part.removed": {
        const s = this.known(props.sessionID)
        if (s?.status === "ready") this.partRemoved(s, props.messageID, props.partID)
        return
      }
      case "message.removed": {
        // compactd has no message delete: reload the session from OpenCode.
        const s = this.sessions.get(props.sessionID)
        if (s) s.status = "import"
        return
      }
      case "session.deleted": {
        const id = props.info?.id
        if (!id) return
        // Forwarded whether or not the plugin still holds the session's state (an idle
        // one past maxSessions was forgotten, but compactd still holds the session).
        // After the updates sent on the stream are answered: the delete is a call of its
        // own, and one that came first would be undone by them (the session made again).
        const gone = this.sessions.get(id)
        const sent = Promise.allSettled([...(gone?.pending ?? [])])
        if (gone) gone.deleted = true
        this.sessions.delete(id)
        this.compacting.delete(id)
        void sent.then(() => this.deleteInCompactd(id))
        return
      }
      case "session.compacted":
        this.compacting.delete(props.sessionID)
        this.log.info(`OpenCode compacted session ${props.sessionID}`)
        return
      case "session.idle":
      case "session.error":
        // A compaction that failed or was stopped before its transform.
        this.compacting.delete(props.sessionID)
        return
    }
  }

  /**
   * Waits for the acks of the updates sent, at most `timeoutMs` (stream updates carry no
   * deadline): a compactd that stopped answering must not hold OpenCode's request, which
   * then goes out with OpenCode's own messages. The stream is dropped (a half-open one
   * would never answer; every session is loaded whole on the next), and so are the acks
   * waited for, so later requests do not wait on them again.
   */
  private async acked(s: SessionState) {
    if (s.pending.size === 0) return
    let timer: ReturnType<typeof setTimeout> | undefined
    const late = new Promise<"late">((resolve) => {
      timer = setTimeout(() => resolve("late"), this.settings.timeoutMs)
    })
    try {
      const waiting = s.pending.size
      if ((await Promise.race([Promise.allSettled([...s.pending]), late])) === "late") {
        s.status = "import"
        s.pending.clear()
        this.stream?.cancel()
        throw Object.assign(new Error(`compactd did not answer updates of session ${s.id} within ${this.settings.timeoutMs} ms (${waiting} waiting)`), { stalled: true })
      }
    } finally {
      clearTimeout(timer)
    }
  }

  /**
   * `importSession`, tried at most once per user turn once compactd refused it (the
   * session past its limits, a message it rejects, a wrong token): the same history would
   * be refused again, and each try reads the whole session from OpenCode and sends it.
   * Before, every request of the turn (every step) paid that in full. A failure to reach
   * compactd is tried again at the next request, as before.
   */
  private async load(s: SessionState, messages: WithParts[], until: number) {
    const turn = userTurn(messages)
    if (s.refused && s.refused.turn === turn) {
      throw new Error(`compactd refused to load session ${s.id} in this user turn (${s.refused.reason}); it is tried again at the next turn`)
    }
    // An import replaces the session, which cancels the compaction compactd runs for it
    // (its summary paid for and lost): with compaction "compactd", wait for it first (until
    // `until`, the request's compaction deadline), then load the session with it.
    if (s.compaction) {
      this.log.info(`session ${s.id}: waiting for compactd's running compaction before loading the session`)
      if ((await within(s.compaction, until - Date.now())) === "late") {
        this.log.warn(`session ${s.id}: compaction not done within ${this.settings.compactionWaitMs} ms; loading the session cancels it`)
      }
    }
    try {
      try {
        await this.importSession(s, messages)
      } catch (e) {
        if ((e as Obj)?.codeName !== "ABORTED") throw e
        // A compaction committed while compactd built the import: loaded again, it is kept.
        this.log.info(`session ${s.id}: compactd compacted it while loading it (${(e as Error).message}); loading it again`)
        await this.importSession(s, messages)
      }
      s.refused = undefined
    } catch (e) {
      const code = (e as Obj)?.codeName
      if (typeof code === "string" && !TRANSIENT.has(code)) s.refused = { turn, reason: (e as Error).message }
      if (e && typeof e === "object") Object.assign(e, { loading: true })
      throw e
    }
  }

  /**
   * Loads OpenCode's whole session into compactd (replacing what it held). With compaction
   * "compactd", the compactions compactd committed stay: OpenCode's history lacks their
   * messages, and without them the summarized head would be sent (and summarized) again.
   */
  private async importSession(s: SessionState, fallback: WithParts[]) {
    let all: WithParts[] = fallback
    try {
      const res = await this.opencode.session.messages({ path: { id: s.id } })
      const data = res?.data ?? res
      if (Array.isArray(data) && data.length) all = data
    } catch (e) {
      this.log.warn(`reading session ${s.id} from OpenCode failed, loading the messages at hand: ${(e as Error).message}`)
    }
    const last = [...all].reverse().find((m) => m.info?.role === "user")?.info
    if (last?.model) s.model = { providerID: last.model.providerID, modelID: last.model.modelID }
    const limits = s.model ? await this.limitsOf(s.model) : undefined
    const info = this.sessionInfo(s, limits)
    await this.acked(s)
    s.pending.clear()
    await this.client.importSession({
      sessionId: s.id,
      replace: true,
      keepCompactions: this.settings.compaction === "compactd",
      export: { info: { id: s.id }, messages: all as any },
      limits: info.limits,
      config: info.config,
    })
    s.sent.clear()
    s.parts.clear()
    s.deferred.clear()
    s.opened = ""
    s.status = "ready"
    for (const m of all) {
      s.sent.set(`m:${m.info.id}`, digest(toMessageInfo(m.info)))
      const ids = new Set<string>()
      for (const part of m.parts) {
        const p = toPart(part)
        if (!p) continue
        ids.add(p.id!)
        s.sent.set(`p:${p.id}`, digest(p))
      }
      s.parts.set(m.info.id, ids)
    }
    this.open(s)
    this.log.info(`loaded session ${s.id} into compactd (${all.length} messages)`)
  }

  /**
   * Brings compactd up to date with what OpenCode is about to send, then returns compactd's
   * context. While compactd is stalled (see `stall`) it throws at once: the request goes
   * out as without compactd instead of waiting `timeoutMs` again.
   */
  async transform(messages: WithParts[]): Promise<WithParts[] | null> {
    if (this.stalled) {
      throw new Error(
        `compactd has not answered since ${new Date(this.stalled.since).toISOString()} (nothing within ${this.settings.timeoutMs} ms); it is asked again once it answers a probe`,
      )
    }
    try {
      return await this.build(messages)
    } catch (e) {
      // A load past its deadline is not a stall: a long session may take longer to send.
      const late = (e as Obj)?.codeName === "DEADLINE_EXCEEDED" && !(e as Obj)?.loading
      if ((e as Obj)?.stalled === true || late) this.stall()
      throw e
    }
  }

  /** Since when compactd has not answered (`stall`), or null while it answers. */
  stalledSince(): number | null {
    return this.stalled?.since ?? null
  }

  /** Deletes session `id` in compactd; kept for later when compactd is stalled or unreachable. */
  private async deleteInCompactd(id: string) {
    if (this.stalled) {
      this.undeleted.add(id)
      return
    }
    try {
      await this.client.deleteSession(id)
      this.undeleted.delete(id)
    } catch (e: any) {
      if (e?.codeName === "NOT_FOUND") {
        this.undeleted.delete(id)
        return
      }
      this.log.warn(`DeleteSession ${id}: ${e?.message}`)
      if (TRANSIENT.has(e?.codeName)) this.undeleted.add(id)
    }
  }

  /**
   * compactd did not answer within `timeoutMs` (a stuck process, a half-open connection):
   * until it answers a probe (one every 2 s), requests go out without asking it and
   * updates are not sent (each session is loaded whole once it answers). Before, every
   * request of every session waited `timeoutMs` on it, and the updates it never
   * acknowledged piled up in memory. The probe answers past a stuck disk or session too:
   * a stall within a minute of the last one lasts at least twice as long as that one did
   * (5 s to 2 min), so a compactd that answers probes but not updates costs one
   * `timeoutMs` wait per such period, not one per request.
   */
  private stall() {
    if (this.stalled || this.closing) return
    const soon = Date.now() - this.lastStall.ended < 60_000
    const floorMs = soon ? Math.min(Math.max(2 * this.lastStall.floorMs, 5000), 120_000) : 0
    this.stalled = { since: Date.now() }
    this.log.warn(
      `compactd did not answer within ${this.settings.timeoutMs} ms: requests go out with OpenCode's own messages until it answers again${floorMs ? ` (for at least ${floorMs} ms: it stalled again soon after the last time)` : ""}`,
    )
    const probe = async () => {
      while (this.stalled && !this.closing) {
        const { since } = this.stalled
        try {
          await this.client.getRecallTool({ deadlineMs: this.settings.timeoutMs })
          const left = since + floorMs - Date.now()
          if (left > 0) await new Promise((resolve) => setTimeout(resolve, left).unref())
          if (this.closing) return
          this.stalled = null
          this.lastStall = { ended: Date.now(), floorMs }
          this.log.info(`compactd answers again (after ${Date.now() - since} ms); its sessions are loaded whole at their next request`)
          for (const id of [...this.undeleted]) await this.deleteInCompactd(id)
          return
        } catch {
          await new Promise((resolve) => setTimeout(resolve, 2000).unref())
        }
      }
    }
    void probe()
  }

  private async build(messages: WithParts[]): Promise<WithParts[] | null> {
    const sessionID = messages[0]?.info?.sessionID
    if (!sessionID) return null
    const s = this.session(sessionID)
    // How long this request may wait for compactions (compaction "compactd").
    const until = Date.now() + this.settings.compactionWaitMs
    if (s.status !== "ready") await this.load(s, messages, until)
    // compactd keeps parts in arrival order: if events came out of OpenCode's order, load
    // the session whole rather than send a context in another order.
    for (const m of messages) {
      const held = [...(s.parts.get(m.info.id) ?? [])]
      const order = m.parts.map((p) => p.id).filter((id) => held.includes(id))
      if (held.length && order.join() !== held.filter((id) => order.includes(id)).join()) {
        this.log.warn(`session ${sessionID}: parts of ${m.info.id} arrived out of order; reloading the session`)
        s.status = "import"
        break
      }
    }
    // compactd keeps messages in the order they were sent: an assistant message held back
    // until its first part lands after a user message that came meanwhile (a follow-up
    // typed while the step starts). Held messages out of OpenCode's order: load it whole.
    if (s.status === "ready") {
      const rank = new Map([...s.parts.keys()].map((id, i) => [id, i]))
      let before = -1
      for (const m of messages) {
        const r = rank.get(m.info.id)
        if (r === undefined) continue
        if (r < before) {
          this.log.info(`session ${sessionID}: ${m.info.id} reached compactd out of OpenCode's order; loading the session`)
          s.status = "import"
          break
        }
        before = r
      }
    }
    // compactd keeps messages in arrival order too: a message it has not seen before one it
    // holds (a session resumed after a restart, whose first event was its new prompt, or
    // events missed) would land after it, so load the session whole instead.
    if (s.status === "ready") {
      let missing = ""
      for (const m of messages) {
        if (!s.parts.has(m.info.id)) missing ||= m.info.id
        else if (missing) {
          this.log.info(`session ${sessionID}: ${missing} is not in compactd but comes before ${m.info.id}; loading the session`)
          s.status = "import"
          break
        }
      }
    }
    if (s.status !== "ready") await this.load(s, messages, until)
    // Reconcile: anything the events missed (or that changed since) is sent now.
    for (const m of messages) {
      this.messageUpdate(s, m.info, true)
      const held = s.parts.get(m.info.id)
      const now = new Set<string>()
      for (const part of m.parts) {
        now.add(part.id)
        this.partUpdate(s, part)
      }
      for (const id of held ?? []) if (!now.has(id)) this.partRemoved(s, m.info.id, id)
    }
    // A model met for the first time (the user switched): its limits are looked up before
    // this request's overflow check, not after it (OpenCode's chat.params comes later).
    if (s.model) await this.limitsOf(s.model)
    this.open(s)
    await this.acked(s)
    if (s.status !== "ready") {
      // An update was rejected: load the whole session once more, then go on.
      await this.load(s, messages, until)
    }
    if (this.settings.compaction === "compactd") await this.compactIfNeeded(s, userTurn(messages), until)
    const ctx = await this.client.getContext(sessionID, "native")
    const known = new Map(messages.map((m) => [m.info.id, m]))
    // OpenCode messages not in this request (one OpenCode created after building it, such
    // as its own compaction's request) stay out; messages compactd made go in.
    const context = ctx.messages.filter((m) => known.has(m.info!.id) || !s.sent.has(`m:${m.info!.id}`))
    const out = toOpenCodeMessages(context, known, sessionID)
    const lastId = messages[messages.length - 1].info.id
    // The newest message is missing only when compactd's newest compaction summarized it,
    // which then kept no verbatim tail (one it kept is followed by every newer message):
    // otherwise compactd lacks it, and its context would drop it. Before, any compaction
    // ever made turned this check off for the rest of the session.
    const boundary = ctx.boundaryMessageId ? ctx.messages.find((m) => m.info?.id === ctx.boundaryMessageId) : undefined
    const tailStart = boundary?.parts.find((p) => p.compaction)?.compaction?.tailStartId
    if (!out.some((m) => m.info.id === lastId) && (!ctx.boundaryMessageId || tailStart)) {
      throw new Error(`compactd's context lacks the newest message ${lastId}; mirror out of sync`)
    }
    // The newest user message is always sent. A compaction may have summarized it (a turn
    // longer than the verbatim tail keeps only its newest steps; a tail of none keeps
    // nothing): the request would carry the user's request only as the summary tells it,
    // or end with the summary, an assistant message (refused by Anthropic with extended
    // thinking). It goes back right after the summary, before the steps that followed it.
    const turn = userTurn(messages)
    if (turn !== undefined && !out.some((m) => m.info.id === turn)) {
      if (!ctx.boundaryMessageId) throw new Error(`compactd's context lacks the newest user message ${turn}; mirror out of sync`)
      const order = new Map(messages.map((m, i) => [m.info.id, i]))
      const at = order.get(turn)!
      const before = out.findIndex((m) => (order.get(m.info.id) ?? -1) > at)
      out.splice(before < 0 ? out.length : before, 0, known.get(turn)!)
      this.log.info(`session ${sessionID}: compactd's compaction summarized the newest user message ${turn}; it is sent after the summary`)
    }
    if (this.settings.compaction === "compactd") {
      const first = out.findIndex((m) => known.has(m.info.id))
      s.lastGood = ctx.boundaryMessageId && first !== 0
        ? { head: structuredClone(first < 0 ? out : out.slice(0, first)), tailStart: first < 0 ? undefined : out[first].info.id, after: lastId }
        : undefined
    }
    const reduced = ctx.messages.reduce((n, m) => n + m.parts.filter((p) => p.mark || p.tool?.state?.time?.compacted).length, 0)
    this.log.info(
      `session ${sessionID}: sending compactd's context: ${out.length} messages (OpenCode: ${messages.length}), ~${ctx.estimatedTokens} tokens, ${reduced} parts reduced${ctx.boundaryMessageId ? `, from compaction ${ctx.boundaryMessageId}` : ""}`,
    )
    return out
  }

  // ---- compaction "compactd" -----------------------------------------------------------

  /**
   * Follows compactd's compactions (automatic ones included) to wait for them and log them.
   * A watch that ends (compactd restarted, the connection dropped) is opened again a
   * second later: without it no compaction compactd runs would be waited for again.
   */
  watchCompactions() {
    const run = async () => {
      let quiet = false
      while (!this.closing) {
        const watched = await this.watchOnce(quiet)
        if (this.closing) return
        // Warned once per outage: a compactd that stays down is retried quietly.
        quiet = !watched
        await new Promise((resolve) => setTimeout(resolve, 1000).unref())
      }
    }
    void run()
  }

  /** One Subscribe; true when it lasted (more than 2 s) before it ended. */
  private async watchOnce(quiet: boolean): Promise<boolean> {
    const sub = this.client.subscribe("")
    this.watcher = sub
    const running = new Map<string, () => void>()
    const since = Date.now()
    try {
      for await (const ev of sub) {
        const c = ev.compaction
        if (!c) continue
        // Only this OpenCode's sessions: a compactd can serve other hosts too, whose
        // compactions are not this user's news (nor states to keep). A session forgotten
        // since is no longer waited on; a request finds its compaction by asking.
        const s = this.sessions.get(ev.sessionId)
        if (!s) continue
        if (c.started) {
          this.log.info(`compactd compaction ${c.compactionId} of session ${ev.sessionId} started (${c.started.auto ? "automatic" : "manual"}, ~${c.started.tokensBefore} tokens)`)
          s.compaction = new Promise<void>((resolve) => running.set(ev.sessionId, resolve))
        } else if (c.compacted || c.failed) {
          if (c.compacted) {
            this.log.info(`compactd compacted session ${ev.sessionId}: ${c.compacted.tokensBefore} -> ${c.compacted.tokensAfter} tokens`)
            this.toast(`compactd summarized the session (${c.compacted.tokensBefore} -> ${c.compacted.tokensAfter} tokens)`, "info")
          } else {
            const { kind, reason } = c.failed!
            this.log.warn(`compactd compaction of session ${ev.sessionId} failed (${kind}): ${reason}`)
            // Shown, not only logged: with compaction "compactd" nothing else summarizes the
            // session. A cancelled one was ended on purpose (a reload, a shutdown).
            if (kind !== "cancelled") this.toast(`compactd could not summarize the session (${kind}): ${brief(reason)}`, "warning")
          }
          running.get(ev.sessionId)?.()
          running.delete(ev.sessionId)
          s.compaction = undefined
        }
      }
    } catch (e) {
      if (!this.closing && !quiet) this.log.warn(`compactd watch ended: ${(e as Error).message}; watching again`)
    } finally {
      for (const [id, resolve] of running) {
        resolve()
        const s = this.sessions.get(id)
        if (s) s.compaction = undefined
      }
    }
    return Date.now() - since > 2000
  }

  /** A compaction not done within `compactionWaitMs`: the request goes out without it. */
  private late(s: SessionState) {
    this.log.warn(`session ${s.id}: compaction not done within ${this.settings.compactionWaitMs} ms; the request goes out without it (the compaction goes on)`)
  }

  /**
   * A request whose context compactd could not build goes out with compactd's last
   * summary and OpenCode's messages from `from` on or, without one, with OpenCode's own
   * messages: shown once (each failing request logs it), again only after a success.
   */
  contextNotReplaced(e: Error, from?: string) {
    let sent: string
    if (from) sent = `compactd's last summary and OpenCode's messages from ${from} on are sent`
    else if (this.settings.compaction === "compactd") {
      sent = `OpenCode's own messages are sent, the whole history uncompacted (OpenCode's compaction is off with compaction "compactd", and there is no summary of compactd's to send instead)`
    } else sent = "OpenCode's own messages are sent"
    this.log.error(`context not replaced (${sent}): ${e.message}`)
    if (this.unreplaced) return
    this.unreplaced = true
    this.toast(`compactd could not build the context; ${sent}: ${brief(e.message)}`, "error")
  }

  /**
   * With compaction "compactd", the request `messages` from the session's last context
   * that carried compactd's summary: that summary, then OpenCode's messages from where
   * its verbatim tail began (the newest user message always among them). Null without
   * one, or when OpenCode's messages no longer hold where it began (OpenCode compacted,
   * or messages were reverted).
   */
  lastGood(messages: WithParts[]): { messages: WithParts[]; from: string } | null {
    if (this.settings.compaction !== "compactd") return null
    const sessionID = messages[0]?.info?.sessionID
    const kept = sessionID ? this.sessions.get(sessionID)?.lastGood : undefined
    if (!kept) return null
    const ids = messages.map((m) => m.info?.id)
    let from = kept.tailStart ? ids.indexOf(kept.tailStart) : ids.indexOf(kept.after)
    if (from < 0) return null
    if (!kept.tailStart) from += 1
    const newestUser = ids.lastIndexOf(userTurn(messages))
    if (newestUser >= 0) from = Math.min(from, newestUser)
    if (from >= messages.length) return null
    return { messages: [...structuredClone(kept.head), ...messages.slice(from)], from: ids[from] }
  }

  /** The context was built again: the next failure is shown. */
  contextReplaced() {
    this.unreplaced = false
  }

  private toast(message: string, variant: "info" | "warning" | "error") {
    try {
      const p = this.opencode?.tui?.showToast?.({ body: { message, variant } })
      if (p?.catch) p.catch(() => undefined)
    } catch {
      // no TUI (opencode run)
    }
  }

  /**
   * Waits (until `until`, the request's compaction deadline) for a compaction that runs
   * unseen by the watcher: until the session is no longer over its threshold, or no
   * compaction runs (a Compact is no longer refused as already running; it then compacts,
   * as this request needs).
   */
  private async waitUnseen(s: SessionState, until: number) {
    while (Date.now() < until && !this.closing) {
      await new Promise((r) => setTimeout(r, 250))
      const check = await within(this.client.checkOverflow(s.id), until - Date.now())
      if (check === "late") return this.late(s)
      if (!check.overflow) return
      try {
        const result = await within(this.client.compact(s.id, {}).result(), until - Date.now())
        if (result === "late") return this.late(s)
        if (result.failed) this.log.warn(`compactd compaction failed (${result.failed.kind}): ${result.failed.reason}`)
        return
      } catch (e: any) {
        if (e?.codeName === "FAILED_PRECONDITION" && /already running/.test(e.message)) continue
        this.log.warn(`compactd compaction not run: ${e?.message}`)
        return
      }
    }
  }

  /**
   * Over the threshold, compactd compacts on its own (automatic compaction) right after
   * the update that crossed it: wait for that compaction (seen through Subscribe) so the
   * request goes out with its summary. Nothing starts when compactd has no summarizer or
   * nothing to summarize; the request then goes out with the context as it is.
   */
  private async compactIfNeeded(s: SessionState, turn: string | undefined, until: number) {
    // At most `compactionWaitMs` in all (`until`, a load's wait included): a compaction
    // that takes longer (a slow endpoint, a compactd gone without closing the connection)
    // must not hold OpenCode's request.
    // False once the deadline has passed (said once): the request goes out as it is.
    const wait = async (p: Promise<void> | undefined) => {
      if (p && (await within(p, until - Date.now())) === "late") {
        this.late(s)
        return false
      }
      return true
    }
    if (!(await wait(s.compaction))) return
    const check = await within(this.client.checkOverflow(s.id), until - Date.now())
    if (check === "late") return this.late(s)
    if (!check.overflow) return
    const numbers = `${check.crossed} ${check.crossed === "used" ? check.used : check.predicted}/${check.threshold}`
    const started = Date.now() + 300
    while (!s.compaction && Date.now() < started) await new Promise((r) => setTimeout(r, 25))
    if (s.compaction) {
      this.log.info(`session ${s.id} is over its threshold (${numbers}): waiting for compactd's compaction`)
      await wait(s.compaction)
      return
    }
    // A compaction asked for in this turn failed (an endpoint refusing, a summary not
    // smaller): every request of the turn would pay for, or wait on, another. compactd's
    // own automatic compaction still runs (its pause after failures governs it).
    if (turn !== undefined && s.failedIn === turn) {
      this.log.debug(`session ${s.id} is over its threshold (${numbers}); compactd's compaction failed in this turn, not asked for again`)
      return
    }
    // The next request would cross the threshold but no finished message or usage report
    // triggered compactd's own compaction yet: compact now, keeping the verbatim tail
    // (the last 2 user turns, or the newest steps of a long one). When that tail is the
    // whole context, compactd has nothing to compact: the request goes out as it is.
    // (Before, the plugin then compacted with a tail of none, summarizing the user's
    // newest message too: the request ended with the summary, no user message after it.)
    this.log.info(`session ${s.id}: the next request is over the threshold (${numbers}): compacting`)
    try {
      const result = await within(this.client.compact(s.id, {}).result(), until - Date.now())
      if (result === "late") return this.late(s)
      if (result.failed) this.log.warn(`compactd compaction failed (${result.failed.kind}): ${result.failed.reason}`)
      s.failedIn = result.failed ? turn : undefined
    } catch (e: any) {
      if (s.compaction) {
        await wait(s.compaction) // an automatic one started meanwhile
        return
      }
      if (e?.codeName === "FAILED_PRECONDITION" && /already running/.test(e.message)) {
        // One the watcher did not see start (it subscribed after, or was dropped).
        this.log.info(`session ${s.id}: a compaction is already running; waiting for it`)
        return this.waitUnseen(s, until)
      }
      if (e?.codeName === "FAILED_PRECONDITION" && /nothing to compact/.test(e.message)) {
        this.log.info(`session ${s.id}: nothing to compact (the verbatim tail is the whole context); the request goes out as it is`)
        return
      }
      this.log.warn(`compactd compaction not run: ${e?.message}`)
      s.failedIn = turn
    }
  }
}

/**
 * `p`, or "late" once `ms` have passed. The timer goes with the wait (it would keep a
 * process that is done, `opencode run`, alive until it fires); a late `p` that rejects
 * later is not left unhandled.
 */
async function within<T>(p: Promise<T>, ms: number): Promise<T | "late"> {
  let timer: ReturnType<typeof setTimeout> | undefined
  p.catch(() => undefined)
  try {
    return await Promise.race([p, new Promise<"late">((r) => (timer = setTimeout(() => r("late"), Math.max(0, ms))))])
  } finally {
    clearTimeout(timer)
  }
}

/** `text` short enough for a toast (a reason can quote a long provider error). */
function brief(text: string, max = 200): string {
  return text.length <= max ? text : `${text.slice(0, max - 1)}…`
}

export default CompactdPlugin
