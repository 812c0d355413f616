// The plugin's settings: plugin options in opencode.json, then COMPACTD_OPENCODE_* /
// COMPACTD_* environment variables, then defaults.
//
//   "plugin": [["file:///path/to/integrations/opencode/dist/index.js", { "binary": "/usr/local/bin/compactd" }]]

/* eslint-disable @typescript-eslint/no-explicit-any */
import { checkSessionConfig } from "@compactd/client"

export interface PluginSettings {
  /** Off: the plugin does nothing. */
  enabled: boolean
  /** `host:port` (or `unix:/path`) of a running compactd; empty starts one. */
  address: string
  /** Bearer token for a compactd started with --auth-token-file. */
  token?: string
  /** The compactd binary to start when no address is given. */
  binary: string
  /** Extra `compactd serve` arguments for the started sidecar. */
  serverArgs: string[]
  /** Data directory of the started sidecar (default: `$XDG_DATA_HOME/opencode/compactd`,
   * kept across restarts; ":temp:": a temporary one, removed at exit). */
  dataDir?: string
  /** Whose compaction runs: "opencode" (OpenCode's own; compactd only prunes) or "compactd". */
  compaction: "opencode" | "compactd"
  /** For compaction "compactd": the summarizer endpoint and model given to the started sidecar. */
  llmBaseUrl?: string
  llmModel?: string
  /** Replace the messages OpenCode sends with compactd's context (off: mirror only). */
  replaceMessages: boolean
  /** Register compactd's `compactd_recall` tool. */
  recall: boolean
  /** Per-session compactd settings (SessionConfig: camelCase or snake_case keys). */
  session: Record<string, any>
  /** Model limits to use instead of OpenCode's model.limit. */
  limits?: { context?: number; input?: number; output?: number }
  /** Also append log lines to this file. */
  logFile?: string
  /** Log every update sent to compactd. */
  debug: boolean
  /** Milliseconds to wait for compactd at start and for each call. */
  timeoutMs: number
  /** Milliseconds a request waits for a compaction (compactd's own, or one it asked for)
   * before it goes out without it; the compaction goes on, and a later request has it. */
  compactionWaitMs: number
  /** Sessions whose mirror state (what compactd holds of each) is kept; the least recently
   * used idle one beyond it is forgotten and loaded whole again when it is next used. */
  maxSessions: number
}

function env(name: string): string | undefined {
  const v = process.env[name]
  return v === undefined || v === "" ? undefined : v
}

function bool(v: unknown, dflt: boolean): boolean {
  if (typeof v === "boolean") return v
  if (typeof v === "string") return !/^(0|false|no|off)$/i.test(v)
  return dflt
}

function jsonEnv(name: string): any {
  const v = env(name)
  if (!v) return undefined
  try {
    return JSON.parse(v)
  } catch {
    // Neither the value nor JSON.parse's message (which quotes it): server flags may hold a key.
    throw new Error(`${name} is not JSON (${v.length} characters, not shown): write it as a JSON array of strings, e.g. ["--durability","sync"]`)
  }
}

export function resolveSettings(options: Record<string, any> = {}): PluginSettings {
  const o = options ?? {}
  const compaction = String(o.compaction ?? env("COMPACTD_OPENCODE_COMPACTION") ?? "opencode")
  if (compaction !== "opencode" && compaction !== "compactd") {
    throw new Error(`compaction must be "opencode" or "compactd", not ${JSON.stringify(compaction)}`)
  }
  const serverArgs = o.serverArgs ?? jsonEnv("COMPACTD_OPENCODE_SERVER_ARGS") ?? []
  if (!Array.isArray(serverArgs)) throw new Error("serverArgs must be an array of strings")
  const session = { ...(jsonEnv("COMPACTD_OPENCODE_SESSION") ?? {}), ...(o.session ?? {}) }
  checkSession(session)
  return {
    enabled: bool(o.enabled ?? env("COMPACTD_OPENCODE_ENABLED"), true),
    address: String(o.address ?? env("COMPACTD_OPENCODE_ADDRESS") ?? ""),
    token: o.token ?? env("COMPACTD_AUTH_TOKEN"),
    binary: String(o.binary ?? env("COMPACTD_BIN") ?? "compactd"),
    serverArgs: serverArgs.map(String),
    dataDir: o.dataDir ?? env("COMPACTD_OPENCODE_DATA_DIR"),
    compaction,
    llmBaseUrl: o.llmBaseUrl ?? env("COMPACTD_LLM_BASE_URL"),
    llmModel: o.llmModel ?? env("COMPACTD_LLM_MODEL"),
    replaceMessages: bool(o.replaceMessages ?? env("COMPACTD_OPENCODE_REPLACE"), true),
    recall: bool(o.recall ?? env("COMPACTD_OPENCODE_RECALL"), true),
    session,
    limits: checkedLimits(o.limits ?? jsonEnv("COMPACTD_OPENCODE_LIMITS")),
    logFile: o.logFile ?? env("COMPACTD_OPENCODE_LOG"),
    debug: bool(o.debug ?? env("COMPACTD_OPENCODE_DEBUG"), false),
    timeoutMs: positive("timeoutMs", o.timeoutMs ?? env("COMPACTD_OPENCODE_TIMEOUT_MS") ?? 15000),
    compactionWaitMs: positive("compactionWaitMs", o.compactionWaitMs ?? env("COMPACTD_OPENCODE_COMPACTION_WAIT_MS") ?? 180_000),
    maxSessions: positive("maxSessions", o.maxSessions ?? env("COMPACTD_OPENCODE_MAX_SESSIONS") ?? 256),
  }
}

/**
 * Whether model limits leave compactd some input once the answer is reserved: compactd
 * refuses limits that do not (`context` at or under min(output, 32000), 32000 when 0, with
 * no `input`), where every count would overflow and every message ask for a compaction.
 * compactd's rule (`ModelLimits::validate`), checked here so such a model is opened without
 * limits, once, rather than refused and reloaded on every update.
 */
export function leavesInput(l: { context?: number; input?: number; output?: number }): boolean {
  const context = l.context ?? 0
  const input = l.input ?? 0
  const output = l.output ?? 0
  const reserved = output > 0 ? Math.min(output, 32_000) : 32_000
  return context === 0 || input > 0 || context > reserved
}

/** A `session` key compactd's SessionConfig lacks fails the plugin's start, named, rather than
 * every session open (the client refuses it) or, before that check, silently keeping its default. */
function checkSession(session: Record<string, any>): void {
  try {
    checkSessionConfig(sessionConfig(session), "session")
  } catch (e) {
    throw new Error(`the session setting (or COMPACTD_OPENCODE_SESSION): ${(e as { details?: string }).details ?? String(e)}`)
  }
}

function checkedLimits(l: any): PluginSettings["limits"] {
  if (l !== undefined && l !== null && !leavesInput(l)) {
    throw new Error(`limits (or COMPACTD_OPENCODE_LIMITS) ${JSON.stringify(l)} leave no input once the answer is reserved (min(output, 32000), 32000 when output is 0): give output as the most the model answers, or input`)
  }
  return l ?? undefined
}

function positive(name: string, v: unknown): number {
  const n = Number(v)
  if (!Number.isSafeInteger(n) || n < 1) throw new Error(`${name} must be a positive integer, not ${JSON.stringify(v)}`)
  return n
}

const camel = (k: string) => k.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase())
const LISTS = new Set(["protectedTools", "strategyProtectedTools", "protectedFileGlobs", "snapshotTools"])
const ENUMS: Record<string, Record<string, string>> = {
  cacheCounting: { separate: "CACHE_COUNTING_SEPARATE", included: "CACHE_COUNTING_INCLUDED" },
  preset: { compactd: "OVERFLOW_PRESET_COMPACTD", opencode: "OVERFLOW_PRESET_OPENCODE" },
}

/** SessionConfig from user keys: snake_case or camelCase, lists as arrays, enums by short name. */
export function sessionConfig(user: Record<string, any>): Record<string, any> {
  const out: Record<string, any> = {}
  for (const [k, v] of Object.entries(user)) {
    const key = camel(k)
    if (LISTS.has(key) && Array.isArray(v)) out[key] = { values: v.map(String) }
    else if (ENUMS[key] && typeof v === "string" && ENUMS[key][v.toLowerCase()]) out[key] = ENUMS[key][v.toLowerCase()]
    else out[key] = v
  }
  return out
}
