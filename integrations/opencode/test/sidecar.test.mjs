// The sidecar the plugin starts (no `address`): the real binary, killed as a crash or the
// OOM killer would. Needs COMPACTD_BIN. Run through ../test.sh.
import { test } from "node:test"
import assert from "node:assert/strict"
import { existsSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { startSidecar } from "../dist/sidecar.js"
import { resolveSettings } from "../dist/options.js"

const BIN = process.env.COMPACTD_BIN
assert.ok(BIN && existsSync(BIN), `COMPACTD_BIN must name the compactd binary (got ${BIN})`)

async function until(what, check, ms) {
  const deadline = Date.now() + ms
  for (;;) {
    if (await check().catch(() => false)) return
    assert.ok(Date.now() < deadline, `${what} within ${ms} ms`)
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
}

test("a sidecar that dies is started again, with the sessions it acknowledged", async () => {
  const dataDir = mkdtempSync(join(tmpdir(), "compactd-sidecar-"))
  const warnings = []
  const log = { debug() {}, info() {}, warn: (m) => warnings.push(m), error: (m) => warnings.push(m) }
  const sidecar = await startSidecar(resolveSettings({ binary: BIN, dataDir, timeoutMs: 15000 }), log)
  try {
    const c = sidecar.client
    await c.openSession({ id: "ses_kept" })
    await c.upsertMessage("ses_kept", { id: "msg_1", role: "user", time: { created: 1 } })
    await c.upsertPart("ses_kept", { id: "prt_1", messageId: "msg_1", text: { text: "keep me" } })
    const first = sidecar.child.pid
    sidecar.child.kill("SIGKILL")
    await until("a new compactd holding the session", async () => {
      if (sidecar.child.pid === first) return false
      const held = await c.getSession("ses_kept")
      return held.messages.length === 1 && held.messages[0].parts[0].text.text === "keep me"
    }, 15000)
    assert.ok(warnings.some((w) => /starting it again/.test(w)), warnings.join("\n"))
  } finally {
    sidecar.stop()
  }
  // Stopped on purpose: not started again.
  const last = sidecar.child
  await until("the sidecar stopped", async () => last.exitCode !== null || last.signalCode !== null, 5000)
  await new Promise((resolve) => setTimeout(resolve, 1500))
  assert.equal(sidecar.child, last, "no restart after stop()")
  rmSync(dataDir, { recursive: true, force: true })
})
