// The compactd the plugin's tests run against: the real binary on a free local port.
import { spawn } from "node:child_process"
import { mkdtempSync, rmSync } from "node:fs"
import { createServer } from "node:net"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { CompactdClient } from "@compactd/client"

/** A local TCP port nothing listens on (as of now). */
export function freePort() {
  return new Promise((resolve) => {
    const s = createServer()
    s.listen(0, "127.0.0.1", () => {
      const p = s.address().port
      s.close(() => resolve(p))
    })
  })
}

/** `bin serve` on a free port with a throwaway data directory (removed when it exits),
 * and `args`, and a client of it, ready. */
export async function startCompactd(bin, name, args = []) {
  const address = `127.0.0.1:${await freePort()}`
  const dataDir = mkdtempSync(join(tmpdir(), `compactd-${name}-`))
  const server = spawn(bin, ["serve", "--listen", address, "--data-dir", dataDir, ...args], { stdio: ["ignore", "ignore", "pipe"] })
  server.stderr.on("data", () => {})
  server.on("exit", () => rmSync(dataDir, { recursive: true, force: true }))
  const client = new CompactdClient({ address })
  await client.waitForReady(15000)
  return { server, client, address }
}
