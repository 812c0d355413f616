// OpenCode's message model <-> compactd's (proto/compactd/v1/session.proto).
//
// OpenCode -> compactd follows compactd's own `opencode export` import (src/trace/import.rs)
// field by field: known fields are typed, every other field travels in `extra`, so a
// newer OpenCode's additions survive. compactd -> OpenCode overlays the context's
// rendering (placeholders, stripped inputs, breadcrumbs) onto OpenCode's own part objects,
// so everything OpenCode needs to build the provider request stays as OpenCode wrote it.
import type { DeepPartial, Message, MessageInfo, Part, TokenUsage } from "@compactd/client"

/* eslint-disable @typescript-eslint/no-explicit-any */
type Obj = { [key: string]: any }

/** A JSON-clean copy (Struct fields cannot hold undefined, functions, ...). */
export function json<T>(v: T): T {
  return v === undefined ? v : JSON.parse(JSON.stringify(v))
}

function take(o: Obj, key: string): any {
  const v = o[key]
  delete o[key]
  return v
}
const str = (v: any): string => (v === undefined || v === null ? "" : typeof v === "string" ? v : JSON.stringify(v))
const num = (v: any): number => (typeof v === "number" && Number.isFinite(v) ? v : 0)
const uint = (v: any): number => Math.max(0, Math.floor(num(v)))
const optInt = (v: any): number | undefined => (typeof v === "number" && Number.isFinite(v) ? Math.trunc(v) : undefined)
const struct = (v: any): Obj | undefined => (v && typeof v === "object" && !Array.isArray(v) ? json(v) : undefined)
const extraOf = (o: Obj): Obj | undefined => (Object.keys(o).length ? json(o) : undefined)

/**
 * OpenCode's `tokens` -> compactd's TokenUsage. compactd counts reasoning within `output`
 * (and reads a provider total less `output` as the prompt). OpenCode 1.18's getUsage
 * stores `output` less the reasoning, reported apart, with the provider's total (reasoning
 * within): its total holds input, cache, output and reasoning, and the two are added up.
 * Older versions (1.2) kept reasoning within `output` (their total holds no more than
 * input, cache and output): taken as given.
 */
export function tokenUsage(v: any): DeepPartial<TokenUsage> | undefined {
  if (!v || typeof v !== "object") return undefined
  const cache = v.cache ?? {}
  const [input, output, reasoning] = [uint(v.input), uint(v.output), uint(v.reasoning)]
  const [read, write] = [uint(cache.read), uint(cache.write)]
  const apart = reasoning > 0 && typeof v.total === "number" && uint(v.total) >= input + read + write + output + reasoning
  const t: DeepPartial<TokenUsage> = {
    input,
    output: apart ? output + reasoning : output,
    reasoning,
    cache: { read, write },
  }
  if (typeof v.total === "number") t.total = uint(v.total)
  return t
}

/** OpenCode message info -> compactd MessageInfo. */
export function toMessageInfo(info: Obj): DeepPartial<MessageInfo> {
  const o: Obj = json(info)
  const m: DeepPartial<MessageInfo> = { id: str(take(o, "id")), role: str(take(o, "role")) }
  m.parentId = str(take(o, "parentID"))
  const time = take(o, "time")
  if (time && typeof time === "object") {
    const t = { ...time }
    m.time = { created: optInt(take(t, "created")) ?? 0, completed: optInt(take(t, "completed")) }
    if (Object.keys(t).length) o.time = t
  }
  const summary = take(o, "summary")
  if (typeof summary === "boolean") m.summary = summary
  else if (summary !== undefined) o.summary = summary
  m.mode = str(take(o, "mode"))
  m.agent = str(take(o, "agent"))
  m.finish = str(take(o, "finish"))
  m.tokens = tokenUsage(take(o, "tokens"))
  m.cost = num(take(o, "cost"))
  const error = take(o, "error")
  if (error && typeof error === "object") m.error = { name: str(error.name), data: struct(error.data) }
  else if (error !== undefined && error !== null) m.error = { name: "UnknownError", data: { message: str(error) } }
  const model = take(o, "model")
  if (model && typeof model === "object") {
    m.model = { providerId: str(model.providerID), modelId: str(model.modelID) }
  } else {
    if (model !== undefined) o.model = model
    const providerId = str(take(o, "providerID"))
    const modelId = str(take(o, "modelID"))
    if (providerId || modelId) m.model = { providerId, modelId }
  }
  delete o.sessionID
  m.extra = extraOf(o)
  return m
}

function filePart(o: Obj) {
  return { mime: str(take(o, "mime")), filename: str(take(o, "filename")), url: str(take(o, "url")), source: struct(take(o, "source")), size: uint(take(o, "size")) }
}

function partTime(o: Obj) {
  const t = take(o, "time")
  if (!t || typeof t !== "object") return undefined
  return { start: optInt(t.start) ?? 0, end: optInt(t.end) }
}

/** OpenCode part -> compactd Part; `null` for a part type compactd does not model. */
export function toPart(part: Obj): DeepPartial<Part> | null {
  const o: Obj = json(part)
  const p: DeepPartial<Part> = { id: str(take(o, "id")), messageId: str(take(o, "messageID")) }
  delete o.sessionID
  const type = str(take(o, "type"))
  switch (type) {
    case "text":
      p.text = { text: str(take(o, "text")), synthetic: take(o, "synthetic") === true, ignored: take(o, "ignored") === true, time: partTime(o), metadata: struct(take(o, "metadata")) }
      break
    case "reasoning":
      p.reasoning = { text: str(take(o, "text")), time: partTime(o), metadata: struct(take(o, "metadata")) }
      break
    case "tool": {
      const st: Obj = { ...(take(o, "state") ?? {}) }
      const time = take(st, "time")
      const attachments = take(st, "attachments")
      p.tool = {
        callId: str(take(o, "callID")),
        tool: str(take(o, "tool")),
        metadata: struct(take(o, "metadata")),
        state: {
          status: str(take(st, "status")),
          input: struct(take(st, "input")) ?? {},
          output: str(take(st, "output")),
          error: str(take(st, "error")),
          title: str(take(st, "title")),
          raw: str(take(st, "raw")),
          metadata: struct(take(st, "metadata")),
          time: time && typeof time === "object" ? { start: optInt(time.start) ?? 0, end: optInt(time.end), compacted: optInt(time.compacted) } : undefined,
          attachments: Array.isArray(attachments) ? attachments.filter((a) => a && typeof a === "object").map((a) => filePart({ ...a })) : [],
        },
      }
      if (Object.keys(st).length) o.state = st
      break
    }
    case "step-start":
      p.stepStart = { snapshot: str(take(o, "snapshot")) }
      break
    case "step-finish":
      p.stepFinish = { reason: str(take(o, "reason")), snapshot: str(take(o, "snapshot")), cost: num(take(o, "cost")), tokens: tokenUsage(take(o, "tokens")) }
      break
    case "file":
      p.file = filePart(o)
      break
    case "snapshot":
      p.snapshot = { snapshot: str(take(o, "snapshot")) }
      break
    case "patch": {
      const files = take(o, "files")
      p.patch = { hash: str(take(o, "hash")), files: Array.isArray(files) ? files.filter((f) => typeof f === "string") : [] }
      break
    }
    case "agent":
      p.agent = { name: str(take(o, "name")), source: struct(take(o, "source")) }
      break
    case "subtask": {
      const model = take(o, "model")
      p.subtask = {
        prompt: str(take(o, "prompt")),
        description: str(take(o, "description")),
        agent: str(take(o, "agent")),
        command: str(take(o, "command")),
        model: model && typeof model === "object" ? { providerId: str(model.providerID), modelId: str(model.modelID) } : undefined,
      }
      break
    }
    case "retry": {
      const time = take(o, "time")
      p.retry = { attempt: uint(take(o, "attempt")), error: struct(take(o, "error")), created: optInt(time?.created) ?? 0 }
      break
    }
    case "compaction":
      p.compaction = { auto: take(o, "auto") === true, overflow: take(o, "overflow") === true, tailStartId: str(take(o, "tail_start_id")) }
      break
    default:
      return null
  }
  p.extra = extraOf(o)
  return p
}

/** The kind of a compactd part ("text", "tool", ...). */
export function kindOf(p: Part): string {
  for (const k of ["text", "reasoning", "tool", "stepStart", "stepFinish", "file", "snapshot", "patch", "agent", "subtask", "retry", "compaction"] as const) {
    if (p[k]) return k
  }
  return ""
}

type WithParts = { info: Obj; parts: Obj[] }

/**
 * compactd's context (native messages) as the `{info, parts}` list OpenCode sends to the
 * model. `known` holds OpenCode's own messages by id: their objects are reused and only
 * what the context changed is overlaid. Messages compactd made (its own compaction's
 * request and summary) are built from the native message, with the session and model
 * fields taken from `template`.
 */
export function toOpenCodeMessages(context: Message[], known: Map<string, WithParts>, sessionID: string): WithParts[] {
  const out: WithParts[] = []
  const template = [...known.values()]
  for (const m of context) {
    const info = m.info
    if (!info) continue
    const own = known.get(info.id)
    const ownParts = new Map<string, Obj>((own?.parts ?? []).map((p) => [p.id, p]))
    const parts: Obj[] = []
    for (const p of m.parts) {
      const converted = fromPart(p, ownParts.get(p.id), sessionID)
      if (converted) parts.push(converted)
    }
    if (own) {
      out.push({ info: own.info, parts })
      continue
    }
    out.push({ info: synthesizeInfo(info, sessionID, template), parts })
  }
  return out
}

function synthesizeInfo(info: MessageInfo, sessionID: string, template: WithParts[]): Obj {
  const like = [...template].reverse().find((w) => w.info.role === info.role)?.info ?? {}
  const base: Obj = { ...json(like), ...(info.extra ?? {}) }
  base.id = info.id
  base.sessionID = sessionID
  base.role = info.role
  base.time = { created: info.time?.created ?? Date.now(), ...(info.time?.completed !== undefined ? { completed: info.time.completed } : {}) }
  if (info.role === "assistant") {
    base.parentID = info.parentId || base.parentID
    base.summary = info.summary
    base.finish = info.finish || "stop"
    delete base.error
  } else {
    delete base.summary
  }
  return base
}

/** One context part in OpenCode's shape, over OpenCode's own object when there is one. */
function fromPart(p: Part, own: Obj | undefined, sessionID: string): Obj | null {
  const base: Obj = own ? { ...own } : { ...(p.extra ?? {}), id: p.id, sessionID, messageID: p.messageId }
  if (p.text) {
    // A text part, or a file the context shows as a breadcrumb (pruneFiles).
    if (base.type !== "text") {
      return { id: p.id, sessionID, messageID: p.messageId, type: "text", text: p.text.text, synthetic: p.text.synthetic }
    }
    base.text = p.text.text
    return base
  }
  if (p.reasoning) {
    base.type = "reasoning"
    base.text = p.reasoning.text
    base.time ??= p.reasoning.time ?? { start: 0 }
    return base
  }
  if (p.tool) {
    const t = p.tool
    const st = t.state
    const ownState: Obj = own?.state ?? {}
    base.type = "tool"
    base.callID = t.callId
    base.tool = t.tool
    const time: Obj = { ...(ownState.time ?? {}), start: st?.time?.start ?? ownState.time?.start ?? 0 }
    if (st?.time?.end !== undefined) time.end = st.time.end
    // The context's text is what is sent: OpenCode would render its own placeholder
    // over `time.compacted`, so it goes (a custom compactd placeholder reads as set).
    delete time.compacted
    if (st?.status === "completed") {
      base.state = { ...ownState, status: "completed", input: st.input ?? {}, output: st.output, title: ownState.title ?? st.title ?? "", metadata: ownState.metadata ?? st.metadata ?? {}, time }
      if (st.attachments.length === 0) delete base.state.attachments
    } else {
      // compactd sends interrupted calls as errors, like OpenCode.
      base.state = { status: "error", input: st?.input ?? {}, error: st?.error || "[Tool execution was interrupted]", metadata: ownState.metadata, time: { ...time, end: time.end ?? time.start } }
    }
    return base
  }
  if (own) return base // every other kind is sent as OpenCode stored it
  if (p.compaction) return { ...base, type: "compaction", auto: p.compaction.auto }
  if (p.stepStart) return { ...base, type: "step-start" }
  if (p.stepFinish) return null
  if (p.file) return { ...base, type: "file", mime: p.file.mime, filename: p.file.filename, url: p.file.url }
  return null
}
