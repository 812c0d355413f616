// The sidecar the plugin starts (no `address`): the real binary, killed as a crash or the
// OOM killer would. Needs COMPACTD_BIN. Run through ../test.sh.
import { test, after } from "node:test"
import assert from "node:assert/strict"
import { existsSync, mkdtempSync, rmSync, statSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { startSidecar } from "../dist/sidecar.js"
import { resolveSettings } from "../dist/options.js"

const BIN = process.env.COMPACTD_BIN
assert.ok(BIN && existsSync(BIN), `COMPACTD_BIN must name the compactd binary (got ${BIN})`)

// Sidecars started without a dataDir keep their sessions in $XDG_DATA_HOME/opencode/compactd:
// this file's, not the user's (hosts it spawns inherit it).
const xdgDataHome = mkdtempSync(join(tmpdir(), "compactd-sidecar-xdg-"))
process.env.XDG_DATA_HOME = xdgDataHome
after(() => rmSync(xdgDataHome, { recursive: true, force: true }))

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

test("the default data directory is the user's, kept across restarts", async () => {
  // Before, a sidecar started without a dataDir used a temporary directory removed at
  // every exit: compactd's summaries did not survive an OpenCode restart, and a session
  // loaded again paid for them twice.
  const xdg = mkdtempSync(join(tmpdir(), "compactd-xdg-"))
  const before = process.env.XDG_DATA_HOME
  process.env.XDG_DATA_HOME = xdg
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  const dir = join(xdg, "opencode", "compactd")
  try {
    const first = await startSidecar(resolveSettings({ binary: BIN, timeoutMs: 15000 }), log)
    try {
      await first.client.openSession({ id: "ses_persisted" })
      await first.client.upsertMessage("ses_persisted", { id: "msg_1", role: "user", time: { created: 1 } })
    } finally {
      first.stop()
    }
    await until("the first sidecar stopped", async () => first.child.exitCode !== null || first.child.signalCode !== null, 5000)
    assert.ok(existsSync(join(dir, "compactd.db")), `${dir} holds compactd's database`)
    assert.equal(statSync(dir).mode & 0o777, 0o700, "readable by its owner only")
    // OpenCode starts again: its sidecar finds the session.
    const second = await startSidecar(resolveSettings({ binary: BIN, timeoutMs: 15000 }), log)
    try {
      const held = await second.client.getSession("ses_persisted")
      assert.deepEqual(held.messages.map((m) => m.info.id), ["msg_1"])
    } finally {
      second.stop()
    }
    assert.ok(existsSync(join(dir, "compactd.db")), "not removed at stop")
  } finally {
    if (before === undefined) delete process.env.XDG_DATA_HOME
    else process.env.XDG_DATA_HOME = before
    rmSync(xdg, { recursive: true, force: true })
  }
})

test("a second OpenCode on the same data directory falls back to a temporary one", async () => {
  // compactd locks its data directory: a second OpenCode of the same user must still get
  // a sidecar (on a temporary directory, said in the log), never fail to start it.
  const dataDir = mkdtempSync(join(tmpdir(), "compactd-shared-"))
  const warnings = []
  const quiet = { debug() {}, info() {}, warn() {}, error() {} }
  const log = { debug() {}, info() {}, warn: (m) => warnings.push(m), error: (m) => warnings.push(m) }
  const first = await startSidecar(resolveSettings({ binary: BIN, dataDir, timeoutMs: 15000 }), quiet)
  let second
  try {
    second = await startSidecar(resolveSettings({ binary: BIN, dataDir, timeoutMs: 15000 }), log)
    await second.client.openSession({ id: "ses_second" })
    assert.ok(warnings.some((w) => /in use by another compactd.*temporary/.test(w)), warnings.join("\n"))
    const argv = (await import("node:fs")).readFileSync(`/proc/${second.child.pid}/cmdline`, "utf8").split("\0")
    const temp = argv[argv.indexOf("--data-dir") + 1]
    assert.notEqual(temp, dataDir)
    second.stop()
    await until("the temporary directory removed", async () => !existsSync(temp), 5000)
    // The first one's directory is left alone.
    assert.ok(existsSync(join(dataDir, "compactd.db")))
  } finally {
    second?.stop()
    first.stop()
    rmSync(dataDir, { recursive: true, force: true })
  }
})

test('dataDir ":temp:" is a temporary directory, removed at stop', async () => {
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  const sidecar = await startSidecar(resolveSettings({ binary: BIN, dataDir: ":temp:", timeoutMs: 15000 }), log)
  let dir
  try {
    const argv = (await import("node:fs")).readFileSync(`/proc/${sidecar.child.pid}/cmdline`, "utf8").split("\0")
    dir = argv[argv.indexOf("--data-dir") + 1]
    assert.ok(dir && dir !== ":temp:" && existsSync(dir), dir)
  } finally {
    sidecar.stop()
  }
  await until("the directory removed", async () => !existsSync(dir), 5000)
})

test("the started sidecar is served on a Unix socket only its user can reach, not a loopback port", async () => {
  // Before, the plugin picked a free loopback port (bound, closed, then bound by compactd):
  // another local process could take it in between, at start or during a restart's
  // delay, and get every session and the token, and change what the model is sent.
  const { dirname } = await import("node:path")
  const { readFileSync } = await import("node:fs")
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  const sidecar = await startSidecar(resolveSettings({ binary: BIN, dataDir: ":temp:", timeoutMs: 15000 }), log)
  let socket
  try {
    assert.match(sidecar.address, /^unix:\//, sidecar.address)
    socket = sidecar.address.slice("unix:".length)
    const argv = readFileSync(`/proc/${sidecar.child.pid}/cmdline`, "utf8").split("\0")
    assert.equal(argv[argv.indexOf("--listen") + 1], sidecar.address, "compactd listens there, nowhere else")
    assert.ok(statSync(socket).isSocket())
    assert.equal(statSync(dirname(socket)).mode & 0o777, 0o700, "its directory is the user's alone")
    assert.equal(statSync(socket).mode & 0o077, 0, "the socket is the user's alone")
    await onlyItsClientIsServed(sidecar, "ses_unix")
    // A crash: started again on the same socket, the stale one replaced.
    const first = sidecar.child.pid
    sidecar.child.kill("SIGKILL")
    await until("compactd back on its socket", async () => {
      if (sidecar.child.pid === first) return false
      await sidecar.client.getSession("ses_unix")
      return true
    }, 15000)
  } finally {
    sidecar.stop()
  }
  await until("the socket's directory removed at stop", async () => !existsSync(dirname(socket)), 5000)
})

test("the sidecar goes with OpenCode, even when OpenCode is killed outright", async () => {
  // OpenCode killed with SIGKILL (or by the OOM killer) runs no exit handler: the sidecar
  // must notice on its own (its stdin, a pipe OpenCode held, closes).
  const { spawn } = await import("node:child_process")
  const { fileURLToPath } = await import("node:url")
  const sidecarJs = fileURLToPath(new URL("../dist/sidecar.js", import.meta.url))
  const optionsJs = fileURLToPath(new URL("../dist/options.js", import.meta.url))
  const host = spawn(process.execPath, ["--input-type=module", "-e", `
    const { startSidecar } = await import(${JSON.stringify(sidecarJs)})
    const { resolveSettings } = await import(${JSON.stringify(optionsJs)})
    const log = { debug() {}, info() {}, warn() {}, error() {} }
    const s = await startSidecar(resolveSettings({ binary: ${JSON.stringify(BIN)}, timeoutMs: 15000 }), log)
    console.log("PID " + s.child.pid)
    setInterval(() => {}, 1000)
  `], { stdio: ["ignore", "pipe", "inherit"] })
  let out = ""
  host.stdout.on("data", (d) => (out += d))
  let pid
  try {
    await until("the host started its sidecar", async () => (pid = Number(/PID (\d+)/.exec(out)?.[1])) > 0, 20000)
    process.kill(pid, 0)
  } finally {
    host.kill("SIGKILL")
  }
  const alive = () => {
    try {
      process.kill(pid, 0)
      return true
    } catch {
      return false
    }
  }
  await until("the sidecar exited after its host was killed", async () => !alive(), 15000)
})

test("a token the client refuses leaves no sidecar behind", async () => {
  const { execSync } = await import("node:child_process")
  const children = () =>
    execSync(`ps -o pid=,comm= --ppid ${process.pid}`).toString().split("\n").filter((l) => /compactd/.test(l))
  const before = children()
  await assert.rejects(
    startSidecar(resolveSettings({ binary: BIN, token: "s3cret\u0007", timeoutMs: 15000 }), { debug() {}, info() {}, warn() {}, error() {} }),
    (e) => /token/.test(e.message) && !e.message.includes("s3cret"),
  )
  await new Promise((resolve) => setTimeout(resolve, 300))
  assert.deepEqual(children().filter((p) => !before.includes(p)), [], "no compactd started")
})

/** The plugin's own client (it carries the token) opens session `ses`; any other local
 * client without the token is refused: the sidecar is not open to every user. */
async function onlyItsClientIsServed(sidecar, ses) {
  const { CompactdClient } = await import("@compactd/client")
  await sidecar.client.openSession({ id: ses })
  const stranger = new CompactdClient({ address: sidecar.address, deadlineMs: 5000 })
  try {
    await assert.rejects(stranger.getSession(ses), (e) => e.code === 16 /* UNAUTHENTICATED */)
  } finally {
    stranger.close()
  }
}

test("the sidecar started with a token requires it, and no secret is on its command line", async () => {
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  const token = "plugin-token-5f1e9c"
  // The summarizer's key reaches the sidecar from OpenCode's environment (compactd refuses
  // credentials in the URL since they would never be sent).
  const keyBefore = process.env.COMPACTD_LLM_API_KEY
  process.env.COMPACTD_LLM_API_KEY = "key-secret-77"
  let sidecar
  try {
    sidecar = await startSidecar(
      resolveSettings({ binary: BIN, token, llmBaseUrl: "http://127.0.0.1:9/v1", llmModel: "any-model", timeoutMs: 15000 }),
      log,
    )
  } finally {
    if (keyBefore === undefined) delete process.env.COMPACTD_LLM_API_KEY
    else process.env.COMPACTD_LLM_API_KEY = keyBefore
  }
  try {
    await onlyItsClientIsServed(sidecar, "ses_auth")
    // Other local users read a process's command line (`ps`); only its owner reads its
    // environment.
    const { readFileSync } = await import("node:fs")
    const argv = readFileSync(`/proc/${sidecar.child.pid}/cmdline`, "utf8")
    assert.ok(!argv.includes(token), argv)
    assert.ok(!argv.includes("key-secret-77"), argv)
    const environ = readFileSync(`/proc/${sidecar.child.pid}/environ`, "utf8")
    assert.ok(environ.includes("COMPACTD_LLM_API_KEY=key-secret-77"), "the key is in its environment")
  } finally {
    sidecar.stop()
  }
})

test("the sidecar started without a token still requires one, made for this process", async () => {
  // Before, a sidecar started without a configured token served every local user and
  // process on 127.0.0.1: any of them could read every mirrored session and change what
  // the model is sent.
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  const before = process.env.COMPACTD_AUTH_TOKEN_FILE
  // An inherited token file must not win over the token the plugin's client sends.
  process.env.COMPACTD_AUTH_TOKEN_FILE = "/nonexistent/compactd-token"
  let sidecar
  try {
    sidecar = await startSidecar(resolveSettings({ binary: BIN, timeoutMs: 15000 }), log)
  } finally {
    if (before === undefined) delete process.env.COMPACTD_AUTH_TOKEN_FILE
    else process.env.COMPACTD_AUTH_TOKEN_FILE = before
  }
  try {
    await onlyItsClientIsServed(sidecar, "ses_own_token")
  } finally {
    sidecar.stop()
  }
})

/** A sidecar that can summarize (an LLM endpoint configured; never asked here), with `token`. */
function summarizingSidecar(token) {
  const log = { debug() {}, info() {}, warn() {}, error() {} }
  return startSidecar(resolveSettings({ binary: BIN, token, llmBaseUrl: "http://127.0.0.1:9/v1", llmModel: "m", timeoutMs: 15000 }), log)
}

/** `config.compaction.auto` once a plugin with `options` (compaction "compactd") configured
 * OpenCode, and what it logged. */
async function autoCompaction(sidecar, options) {
  const { default: plugin } = await import("../dist/index.js")
  const logs = []
  const opencode = {
    app: { log: async ({ body }) => logs.push(`${body.level} ${body.message}`) },
    session: { messages: async () => ({ data: [] }) },
    config: { providers: async () => ({}) },
  }
  const hooks = await plugin({ client: opencode }, { address: sidecar.address, recall: false, compaction: "compactd", timeoutMs: 5000, ...options })
  try {
    const config = { compaction: { prune: true } }
    await hooks.config?.(config)
    return { auto: config.compaction.auto, logs }
  } finally {
    await hooks.dispose?.()
  }
}

test("OpenCode keeps its own compaction when compactd's summarizer cannot be confirmed", async () => {
  // compaction "compactd" turns OpenCode's auto compaction off only when compactd says it
  // can summarize (its probe answers NOT_FOUND). Any other answer (here UNAUTHENTICATED, a
  // wrong token) used to count as yes: then nothing compacted at all.
  const sidecar = await summarizingSidecar("right-token-1")
  try {
    const { auto, logs } = await autoCompaction(sidecar, { token: "wrong-token-2" })
    assert.notEqual(auto, false, logs.join("\n"))
  } finally {
    sidecar.stop()
  }
})

test('compaction "compactd" without replaceMessages leaves OpenCode its own compaction', async () => {
  // compactd's summary reaches the model only in the context the plugin sends. Before,
  // OpenCode's compaction was turned off all the same: nothing compacted the session.
  const sidecar = await summarizingSidecar("replace-token-1")
  try {
    // This compactd can summarize: with replaceMessages, OpenCode's compaction is off.
    const on = await autoCompaction(sidecar, { token: "replace-token-1", replaceMessages: true })
    assert.equal(on.auto, false, on.logs.join("\n"))
    const off = await autoCompaction(sidecar, { token: "replace-token-1", replaceMessages: false })
    assert.notEqual(off.auto, false, off.logs.join("\n"))
  } finally {
    sidecar.stop()
  }
})

/** OpenCode's side for session `ses`: one user turn of ~9,000 tokens on a model with a
 * window of 8,000 (over compactd's threshold from its first request), and the toasts the
 * plugin shows. */
function overflowingOpenCode(ses) {
  const model = { providerID: "p", modelID: "small" }
  const turn = [{
    info: { id: "msg_01", sessionID: ses, role: "user", time: { created: 1 }, agent: "build", model },
    parts: [{ id: "prt_01", sessionID: ses, messageID: "msg_01", type: "text", text: "word ".repeat(9000) }],
  }]
  const toasts = []
  const logs = []
  const opencode = {
    app: { log: async ({ body }) => void logs.push(`${body.level} ${body.message}`) },
    session: { messages: async () => ({ data: turn }) },
    config: { providers: async () => ({ data: { providers: [{ id: "p", models: { small: { limit: { context: 8000, output: 1000 } } } }] } }) },
    tui: { showToast: async ({ body }) => void toasts.push(body) },
  }
  return { turn, toasts, logs, opencode }
}

test("a compaction that fails is shown to the user, not only logged", async () => {
  // With compaction "compactd" OpenCode's own compaction is off: a summary compactd cannot
  // make (here its LLM endpoint refuses connections) leaves the session over its window.
  // Before, the failure was only logged, where an OpenCode user does not look.
  const token = "toast-token-1"
  const sidecar = await summarizingSidecar(token)
  const { default: plugin } = await import("../dist/index.js")
  const { turn, toasts, opencode } = overflowingOpenCode("ses_failed_toast")
  const hooks = await plugin({ client: opencode }, { address: sidecar.address, token, recall: false, compaction: "compactd", compactionWaitMs: 1000, timeoutMs: 5000 })
  try {
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...turn] })
    await until("a warning naming the failed compaction", async () =>
      toasts.some((t) => t.variant === "warning" && /could not summarize the session/.test(t.message)), 30000)
    assert.ok(!toasts.some((t) => /summarized the session/.test(t.message)), JSON.stringify(toasts))
  } finally {
    await hooks.dispose?.()
    sidecar.stop()
  }
})

test("a context compactd cannot build is shown once, not at every request", async () => {
  // The request goes out with OpenCode's own messages (uncompacted) while compactd is
  // gone: the user is told once; each further failing request is only logged.
  const token = "toast-token-2"
  const sidecar = await summarizingSidecar(token)
  const { default: plugin } = await import("../dist/index.js")
  const { turn, toasts, opencode } = overflowingOpenCode("ses_unreplaced_toast")
  const hooks = await plugin({ client: opencode }, { address: sidecar.address, token, recall: false, compaction: "opencode", timeoutMs: 3000 })
  try {
    sidecar.stop()
    for (let i = 0; i < 2; i++) await hooks["experimental.chat.messages.transform"]({}, { messages: [...turn] })
    const shown = toasts.filter((t) => t.variant === "error" && /could not build the context/.test(t.message))
    assert.equal(shown.length, 1, JSON.stringify(toasts))
  } finally {
    await hooks.dispose?.()
  }
})

test("compactions of sessions this OpenCode does not hold are not shown", async () => {
  // A compactd can serve other hosts too (a shared `address`): their compactions are not
  // this user's news. Before, each was shown here (and a state kept for it).
  const token = "toast-token-3"
  const sidecar = await summarizingSidecar(token)
  const { default: plugin } = await import("../dist/index.js")
  const { turn, toasts, logs, opencode } = overflowingOpenCode("ses_own_toast")
  const hooks = await plugin({ client: opencode }, { address: sidecar.address, token, recall: false, compaction: "compactd", compactionWaitMs: 1000, timeoutMs: 5000 })
  const failures = () => toasts.filter((t) => /could not summarize/.test(t.message)).length
  const failed = (ses) => logs.filter((l) => l.includes(`compaction of session ${ses} failed`)).length
  try {
    // This OpenCode's session fails to compact: shown (the plugin's watcher is following).
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...turn] })
    await until("the own session's failure shown", async () => failures() === 1 && failed("ses_own_toast") === 1, 30000)
    // Another host's session, compacted by that host, fails too.
    const other = sidecar.client
    await other.openSession({ id: "ses_other_host" })
    await other.upsertMessage("ses_other_host", { id: "msg_1", role: "user", time: { created: 1 } })
    await other.upsertPart("ses_other_host", { id: "prt_1", messageId: "msg_1", text: { text: "word ".repeat(2000) } })
    const result = await other.compact("ses_other_host", {}).result()
    assert.ok(result.failed, JSON.stringify(result))
    // The own session's next turn fails again. The watcher reads compactd's events in
    // order, so once this one is logged the other host's was read before it.
    turn.push({
      info: { id: "msg_02", sessionID: "ses_own_toast", role: "user", time: { created: 2 }, agent: "build", model: turn[0].info.model },
      parts: [{ id: "prt_02", sessionID: "ses_own_toast", messageID: "msg_02", type: "text", text: "go on" }],
    })
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...turn] })
    await until("the own session's second failure", async () => failed("ses_own_toast") === 2, 30000)
    assert.equal(failed("ses_other_host"), 0, logs.join("\n"))
    assert.equal(failures(), 2, JSON.stringify(toasts))
  } finally {
    await hooks.dispose?.()
    sidecar.stop()
  }
})
