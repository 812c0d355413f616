// Starts compactd (`compactd serve` on a free local port) or connects to a running one.
import { spawn, type ChildProcess } from "node:child_process"
import { createServer } from "node:net"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
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

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer()
    srv.unref()
    srv.on("error", reject)
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address()
      const port = typeof addr === "object" && addr ? addr.port : 0
      srv.close(() => resolve(port))
    })
  })
}

export async function startSidecar(s: PluginSettings, log: Log): Promise<Sidecar> {
  if (s.address) {
    const client = new CompactdClient({ address: s.address, token: s.token, deadlineMs: s.timeoutMs })
    await client.waitForReady(s.timeoutMs)
    log.info(`connected to compactd at ${s.address}`)
    return { client, address: s.address, stop: () => client.close() }
  }
  // A port picked now could be taken before compactd binds it: try a few.
  let lastError: unknown
  for (let attempt = 0; attempt < 3; attempt++) {
    const port = await freePort()
    const address = `127.0.0.1:${port}`
    const ownDir = !s.dataDir
    const dataDir = s.dataDir ?? mkdtempSync(join(tmpdir(), "opencode-compactd-"))
    const args = ["serve", "--listen", address, "--data-dir", dataDir]
    if (s.llmBaseUrl) args.push("--llm-base-url", s.llmBaseUrl)
    if (s.llmModel) args.push("--llm-model", s.llmModel)
    args.push(...s.serverArgs)
    let stderr = ""
    let exited: string | null = null
    const child = spawn(s.binary, args, { stdio: ["ignore", "ignore", "pipe"], env: process.env })
    child.stderr?.on("data", (d: Buffer) => {
      stderr = (stderr + d.toString()).slice(-4000)
      if (s.debug) log.debug(`compactd: ${d.toString().trimEnd()}`)
    })
    child.on("error", (e) => (exited = `could not start ${s.binary}: ${e.message}`))
    child.on("exit", (code, signal) => {
      exited ??= `exited with ${signal ?? code}`
    })
    const cleanup = () => {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGTERM")
      if (ownDir) rmSync(dataDir, { recursive: true, force: true })
    }
    process.once("exit", cleanup)
    const client = new CompactdClient({ address, token: s.token, deadlineMs: s.timeoutMs })
    try {
      const deadline = Date.now() + s.timeoutMs
      while (true) {
        if (exited) throw new Error(`compactd ${exited}: ${stderr.trim().split("\n").slice(-3).join(" | ")}`)
        try {
          await client.waitForReady(Math.min(500, deadline - Date.now()))
          break
        } catch (e) {
          if (Date.now() >= deadline) throw e
        }
      }
      log.info(`started compactd (${s.binary}, pid ${child.pid}) on ${address}`)
      const stop = () => {
        process.removeListener("exit", cleanup)
        client.close()
        cleanup()
      }
      return { client, address, child, stop }
    } catch (e) {
      lastError = e
      client.close()
      process.removeListener("exit", cleanup)
      cleanup()
      log.warn(`compactd did not start on ${address}: ${(e as Error).message}`)
      if (exited && /could not start/.test(exited)) break
    }
  }
  throw lastError
}
