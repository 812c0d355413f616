// Starts compactd (`compactd serve` on a Unix socket only this user can reach, its sessions
// in a data directory per user) or connects to a running one.
import { spawn, type ChildProcess } from "node:child_process"
import { randomBytes } from "node:crypto"
import { chmodSync, mkdirSync, mkdtempSync, rmSync, statSync } from "node:fs"
import { homedir, tmpdir } from "node:os"
import { isAbsolute, join } from "node:path"
import { CompactdClient } from "@compactd/client"
import type { PluginSettings } from "./options.js"
import type { Log } from "./log.js"

export interface Sidecar {
  client: CompactdClient
  address: string
  /** The started process, when the plugin started one. */
  child?: ChildProcess
  stop(): void
}

/** `dataDir` for a temporary data directory, removed when OpenCode exits. */
export const TEMP_DATA_DIR = ":temp:"

/**
 * The started sidecar's data directory by default: one per user that outlives OpenCode
 * (`$XDG_DATA_HOME/opencode/compactd`, else `~/.local/share/opencode/compactd`, beside
 * OpenCode's own storage), so a session loaded again after a restart keeps compactd's
 * summaries. Before, a temporary directory removed at every exit lost them.
 */
export function defaultDataDir(): string {
  const xdg = process.env.XDG_DATA_HOME
  return join(xdg && isAbsolute(xdg) ? xdg : join(homedir(), ".local", "share"), "opencode", "compactd")
}

/** Makes `dir` (and its parents) readable by its owner only: it holds every mirrored session. */
function privateDir(dir: string) {
  mkdirSync(dir, { recursive: true, mode: 0o700 })
  if ((statSync(dir).mode & 0o077) !== 0) chmodSync(dir, 0o700)
}

const IN_USE = /in use by another compactd/

/** Restarts of a sidecar that exits: 1 s, doubling to 30 s; back to 1 s once one ran a minute. */
const RESTART_FIRST_MS = 1000
const RESTART_MAX_MS = 30_000
const RESTART_STABLE_MS = 60_000

export async function startSidecar(s: PluginSettings, log: Log): Promise<Sidecar> {
  if (s.address) {
    const client = new CompactdClient({ address: s.address, token: s.token, deadlineMs: s.timeoutMs })
    await client.waitForReady(s.timeoutMs)
    log.info(`connected to compactd at ${s.address}`)
    return { client, address: s.address, stop: () => client.close() }
  }
  return startOwn(ownSettings(s), log)
}

/**
 * `s` for a sidecar the plugin starts: it always requires a token, the user's or, without
 * one, a random one made for this process and known only to it and the sidecar. Without a
 * token any local user or process could read every mirrored session (every file the agent
 * read) and change what the model is sent, over 127.0.0.1.
 */
function ownSettings(s: PluginSettings): PluginSettings {
  return s.token?.trim() ? s : { ...s, token: randomBytes(32).toString("base64url") }
}

/**
 * A private directory (mode 0700, as mkdtemp makes it) for the sidecar's socket: in
 * $XDG_RUNTIME_DIR when there is one, else the system's temporary directory, unless its
 * path is too long for a socket address (108 bytes on Linux, 104 on macOS): then in /tmp.
 */
function socketDir(): string {
  const runtime = process.env.XDG_RUNTIME_DIR
  const fits = (dir: string | undefined): dir is string => !!dir && isAbsolute(dir) && Buffer.byteLength(dir) <= 60
  if (fits(runtime)) {
    try {
      return mkdtempSync(join(runtime, "opencode-compactd-"))
    } catch {
      // not writable: the temporary directory
    }
  }
  return mkdtempSync(join(fits(tmpdir()) ? tmpdir() : "/tmp", "opencode-compactd-"))
}

async function startOwn(s: PluginSettings, log: Log): Promise<Sidecar> {
  // The data directory: the user's, or (":temp:", or one that cannot be made) a temporary
  // one removed at exit. A directory another compactd holds (a second OpenCode of this
  // user: compactd locks its data directory) is tried again a second later (one that was
  // just closed may still be stopping its sidecar), then this OpenCode falls back to a
  // temporary one: never a sidecar that cannot start.
  let persistent: string | undefined = s.dataDir === TEMP_DATA_DIR ? undefined : s.dataDir
  if (persistent === undefined && s.dataDir !== TEMP_DATA_DIR) {
    try {
      persistent = defaultDataDir()
      privateDir(persistent)
    } catch (e) {
      log.warn(`cannot make compactd's data directory ${persistent}: ${(e as Error).message}; using a temporary one (summaries are not kept across restarts)`)
      persistent = undefined
    }
  }
  // Served on a Unix socket in a directory only this user can enter (and the socket itself
  // 0600, compactd's default), never on a loopback port: a port picked free and bound by
  // compactd later could be taken meanwhile (at start, or while a crashed sidecar waits to
  // start again) by another local process, which would then get every session and the
  // token, and could change what the model is sent. The path stays the same across
  // restarts; compactd replaces a stale socket a crashed one left.
  const sockets = socketDir()
  const address = `unix:${join(sockets, "compactd.sock")}`
  let client: CompactdClient
  try {
    // Made first: a token the client refuses fails here, before a process exists to be
    // left behind.
    client = new CompactdClient({ address, token: s.token, deadlineMs: s.timeoutMs })
  } catch (e) {
    rmSync(sockets, { recursive: true, force: true })
    throw e
  }
  let waitedForLock = false
  let lastError: unknown
  for (let attempt = 0; attempt < 3; attempt++) {
    let temp = persistent === undefined
    let dataDir = persistent ?? mkdtempSync(join(tmpdir(), "opencode-compactd-"))
    // compactd exits when its stdin (a pipe this process holds) closes: OpenCode killed
    // outright (SIGKILL, the OOM killer) runs no exit handler, and would leave it running.
    const argsFor = (dir: string) => {
      const args = ["serve", "--listen", address, "--data-dir", dir, "--exit-on-stdin-eof"]
      if (s.llmModel) args.push("--llm-model", s.llmModel)
      args.push(...s.serverArgs)
      return args
    }
    let args = argsFor(dataDir)
    let stopping = false
    let proc = launch(s, args, log)
    const cleanup = () => {
      stopping = true
      if (proc.child.exitCode === null && proc.child.signalCode === null) proc.child.kill("SIGTERM")
      // Only a temporary directory: the user's keeps the sessions for the next start.
      if (temp) rmSync(dataDir, { recursive: true, force: true })
    }
    const exit = () => {
      cleanup()
      rmSync(sockets, { recursive: true, force: true })
    }
    process.once("exit", exit)
    try {
      await ready(client, proc, s.timeoutMs)
      log.info(`started compactd (${s.binary}, pid ${proc.child.pid}) on ${address}, data in ${dataDir}${temp ? " (temporary)" : ""}`)
      // A sidecar that exits (a crash, the OOM killer) is started again on the same socket
      // and data directory: the sessions it had acknowledged are on disk (durability
      // `sync` by default), the plugin's stream and watcher reconnect, and every session
      // is loaded again before its next request. Without this, a dead sidecar would leave
      // OpenCode without pruning and, with compaction "compactd", without compaction.
      let delay = RESTART_FIRST_MS
      const supervise = (current: Launched) => {
        const since = Date.now()
        current.child.once("exit", () => {
          if (stopping) return
          if (Date.now() - since >= RESTART_STABLE_MS) delay = RESTART_FIRST_MS
          log.warn(`compactd ${current.exited() ?? "exited"}: starting it again in ${delay} ms on ${address}`)
          const timer = setTimeout(() => {
            if (stopping) return
            // Another compactd took the directory meanwhile (another OpenCode started while
            // this one's was down): a temporary one, or it would never start again.
            if (!temp && IN_USE.test(current.stderr())) {
              log.warn(`${dataDir} is in use by another compactd: compactd starts again on a temporary data directory (removed at exit)`)
              temp = true
              dataDir = mkdtempSync(join(tmpdir(), "opencode-compactd-"))
              args = argsFor(dataDir)
            }
            proc = launch(s, args, log)
            supervise(proc)
            ready(client, proc, s.timeoutMs).then(
              () => log.info(`compactd started again (pid ${proc.child.pid}) on ${address}`),
              (e) => log.warn(`compactd did not come back on ${address}: ${(e as Error).message}`),
            )
          }, delay)
          timer.unref()
          delay = Math.min(delay * 2, RESTART_MAX_MS)
        })
      }
      supervise(proc)
      const stop = () => {
        process.removeListener("exit", exit)
        client.close()
        exit()
      }
      return {
        client,
        address,
        get child() {
          return proc.child
        },
        stop,
      }
    } catch (e) {
      lastError = e
      process.removeListener("exit", exit)
      cleanup()
      log.warn(`compactd did not start on ${address}: ${(e as Error).message}`)
      const exited = proc.exited()
      if (exited && /could not start/.test(exited)) break
      // The next one binds the same socket: this one must be gone first.
      await Promise.race([proc.closed, new Promise((resolve) => setTimeout(resolve, 5000).unref())])
      if (!temp && IN_USE.test(proc.stderr())) {
        if (!waitedForLock) {
          waitedForLock = true
          await new Promise((resolve) => setTimeout(resolve, 1000))
        } else {
          log.warn(`compactd's data directory ${dataDir} is in use by another compactd (another OpenCode's): this OpenCode's uses a temporary one, removed at exit (its sessions do not keep compactd's summaries across a restart)`)
          persistent = undefined
        }
      }
    }
  }
  client.close()
  rmSync(sockets, { recursive: true, force: true })
  throw lastError
}

/**
 * The sidecar's environment: OpenCode's, with the plugin's token (so the sidecar requires
 * the token its client sends: without it any local user could read and change every
 * mirrored session) and summarizer URL. Both go through the environment, as the
 * summarizer's key inherited from OpenCode's does: only the process's owner can read it,
 * never the command line, which every local user can (`ps`).
 */
function sidecarEnv(s: PluginSettings): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env }
  // An inherited token file would win over the token given here, which the client sends.
  delete env.COMPACTD_AUTH_TOKEN_FILE
  // Always set here (`ownSettings`); blank: no token, as the client reads it.
  if (s.token?.trim()) env.COMPACTD_AUTH_TOKEN = s.token
  if (s.llmBaseUrl) env.COMPACTD_LLM_BASE_URL = s.llmBaseUrl
  return env
}

interface Launched {
  child: ChildProcess
  /** Why the process ended, once it has; its last stderr lines kept apart. */
  exited(): string | null
  stderr(): string
  /** Settles once the process ended and its stderr was read to the end. */
  closed: Promise<void>
}

function launch(s: PluginSettings, args: string[], log: Log): Launched {
  let stderr = ""
  let exited: string | null = null
  const child = spawn(s.binary, args, { stdio: ["pipe", "ignore", "pipe"], env: sidecarEnv(s) })
  // Held open, never written; nor does it keep this process alive.
  const stdin = child.stdin as unknown as { unref?: () => void } | null
  stdin?.unref?.()
  child.stdin?.on("error", () => {})
  child.stderr?.on("data", (d: Buffer) => {
    stderr = (stderr + d.toString()).slice(-4000)
    if (s.debug) log.debug(`compactd: ${d.toString().trimEnd()}`)
  })
  child.on("error", (e) => (exited = `could not start ${s.binary}: ${e.message}`))
  child.on("exit", (code, signal) => {
    exited ??= `exited with ${signal ?? code}`
  })
  const closed = new Promise<void>((resolve) => {
    child.once("close", () => resolve())
    child.once("error", () => resolve())
  })
  return { child, exited: () => exited, stderr: () => stderr, closed }
}

/** Waits until `client` answers, failing at once when the process exits. */
async function ready(client: CompactdClient, proc: Launched, timeoutMs: number) {
  const deadline = Date.now() + timeoutMs
  while (true) {
    const exited = proc.exited()
    if (exited) {
      // Its last words (why it stopped) may come after its exit.
      await Promise.race([proc.closed, new Promise((resolve) => setTimeout(resolve, 500).unref())])
      throw new Error(`compactd ${exited}: ${proc.stderr().trim().split("\n").slice(-3).join(" | ")}`)
    }
    try {
      await client.waitForReady(Math.min(500, deadline - Date.now()))
      return
    } catch (e) {
      if (Date.now() >= deadline) throw e
    }
  }
}
