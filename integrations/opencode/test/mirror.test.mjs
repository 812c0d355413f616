// The plugin's mirror against the real compactd binary, with OpenCode's side stubbed:
// the hooks are called as OpenCode calls them. Needs COMPACTD_BIN. Run through ../test.sh.
import { test, before, after } from "node:test"
import assert from "node:assert/strict"
import { spawn } from "node:child_process"
import { createServer as createHttpServer } from "node:http"
import { existsSync, mkdtempSync, readFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Worker } from "node:worker_threads"
import { CompactdClient } from "@compactd/client"
import { freePort, startCompactd } from "./compactd.mjs"
import plugin from "../dist/index.js"

const BIN = process.env.COMPACTD_BIN
assert.ok(BIN && existsSync(BIN), `COMPACTD_BIN must name the compactd binary (got ${BIN})`)

let server
let client
let address

before(async () => {
  ;({ server, client, address } = await startCompactd(BIN, "mirror"))
})

after(() => {
  client?.close()
  server?.kill("SIGTERM")
})

const MODEL = { providerID: "p", modelID: "m" }
const PROVIDERS = {
  data: {
    providers: [
      { id: "p", models: { m: { limit: { context: 200000, output: 32000 } }, small: { limit: { context: 8000, output: 1000 } } } },
    ],
  },
}

/** OpenCode's session `ses` of `turns` user/assistant pairs (ids msg_01, msg_02, ...). */
function history(ses, turns) {
  const out = []
  for (let t = 0; t < turns; t++) {
    const u = `msg_${String(2 * t + 1).padStart(2, "0")}`
    const a = `msg_${String(2 * t + 2).padStart(2, "0")}`
    out.push({
      info: { id: u, sessionID: ses, role: "user", time: { created: 10 * t + 1 }, agent: "build", model: MODEL },
      parts: [{ id: `prt_${u}`, sessionID: ses, messageID: u, type: "text", text: `question ${t}` }],
    })
    out.push({
      info: {
        id: a, sessionID: ses, role: "assistant", parentID: u, time: { created: 10 * t + 2, completed: 10 * t + 3 },
        modelID: MODEL.modelID, providerID: MODEL.providerID, mode: "build", agent: "build", cost: 0, finish: "stop",
        tokens: { input: 100 * (t + 1), output: 10, reasoning: 0, cache: { read: 0, write: 0 } },
      },
      parts: [{ id: `prt_${a}`, sessionID: ses, messageID: a, type: "text", text: `answer ${t}` }],
    })
  }
  return out
}

/** Session `ses` of one user turn of ~9,000 tokens on the "small" model (a window of
 * 8,000): over compactd's threshold from its first request. */
function oneLongTurn(ses) {
  const small = { providerID: "p", modelID: "small" }
  return [{
    info: { id: "msg_01", sessionID: ses, role: "user", time: { created: 1 }, agent: "build", model: small },
    parts: [{ id: "prt_01", sessionID: ses, messageID: "msg_01", type: "text", text: "word ".repeat(9000) }],
  }]
}

/** The plugin connected to the test's compactd, with OpenCode's client stubbed. */
async function hooksFor(messagesOf, more = {}, providers = async () => PROVIDERS) {
  const opencode = {
    app: { log: async () => ({}) },
    session: { messages: async ({ path }) => ({ data: messagesOf(path.id) }) },
    config: { providers },
  }
  return plugin({ client: opencode }, { address, recall: false, ...more })
}

test("a session resumed after a restart is sent in OpenCode's order", async () => {
  // OpenCode restarted: the plugin has never seen this session; its first event is the
  // new prompt, after eight messages compactd does not hold.
  const ses = "ses_resumed"
  const all = history(ses, 5).slice(0, 9)
  const hooks = await hooksFor(() => all)
  try {
    const prompt = all[8]
    await hooks.event({ event: { type: "message.updated", properties: { info: prompt.info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: prompt.parts[0] } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const ids = all.map((m) => m.info.id)
    assert.deepEqual(output.messages.map((m) => m.info.id), ids, "the context sent")
    const held = await client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), ids, "compactd's copy")
  } finally {
    await hooks.dispose()
  }
})

test("a follow-up typed while a step starts does not reorder the session in compactd", async () => {
  // OpenCode creates the step's assistant message G, then the user sends U2 before G's
  // first part: the plugin holds G back until that part, so compactd got U2 before G.
  const ses = "ses_follow_up"
  const [u1, a1] = history(ses, 1)
  const g = { info: { ...a1.info, id: "msg_02g", time: { created: 5 } }, parts: [{ ...a1.parts[0], id: "prt_g", messageID: "msg_02g" }] }
  delete g.info.finish
  const u2 = { info: { ...u1.info, id: "msg_03", time: { created: 6 } }, parts: [{ ...u1.parts[0], id: "prt_u2", messageID: "msg_03", text: "and also this" }] }
  const all = [u1, g, u2]
  const hooks = await hooksFor(() => all)
  try {
    await hooks.event({ event: { type: "message.updated", properties: { info: u1.info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: u1.parts[0] } } })
    await hooks["experimental.chat.messages.transform"]({}, { messages: [u1] })
    await hooks.event({ event: { type: "message.updated", properties: { info: g.info } } })
    await hooks.event({ event: { type: "message.updated", properties: { info: u2.info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: u2.parts[0] } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: g.parts[0] } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const ids = all.map((m) => m.info.id)
    assert.deepEqual(output.messages.map((m) => m.info.id), ids, "the context sent")
    const held = await client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), ids, "compactd's copy")
  } finally {
    await hooks.dispose()
  }
})

test('with compaction "compactd" but no summarizer in compactd, OpenCode keeps compacting on its own', async () => {
  // The test's compactd has no --llm-base-url: turning OpenCode's compaction off would
  // leave nothing to compact a session that outgrows its window (the turn would stop).
  const ses = "ses_no_summarizer"
  const all = oneLongTurn(ses)
  const logs = []
  const opencode = {
    app: { log: async ({ body }) => logs.push(`${body.level} ${body.message}`) },
    session: { messages: async () => ({ data: all }) },
    config: { providers: async () => PROVIDERS },
  }
  const hooks = await plugin({ client: opencode }, { address, recall: false, compaction: "compactd" })
  try {
    const config = { compaction: { prune: true } }
    await hooks.config(config)
    assert.notEqual(config.compaction.auto, false, JSON.stringify(config))
    assert.equal(config.compaction.prune, true)
    assert.ok(logs.some((l) => /warn .*no LLM endpoint/.test(l)), logs.join("\n"))
    // Used as with compaction "opencode": no compaction asked of compactd, none waited for.
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    assert.ok((await client.checkOverflow(ses)).overflow === false, "compactd leaves overflow to OpenCode")
    assert.ok(!logs.some((l) => /over (its|the) threshold|compaction not run/.test(l)), logs.join("\n"))
  } finally {
    await hooks.dispose()
  }
})

test("idle sessions past maxSessions are forgotten, and loaded whole when used again", async () => {
  // A long-running OpenCode meets many sessions: the plugin keeps the state (a digest per
  // part) of the most recently used ones only.
  const a = history("ses_lru_a", 2).slice(0, 3)
  const reads = []
  const hooks = await hooksFor((id) => (reads.push(id), id === "ses_lru_a" ? a : []), { maxSessions: 2 })
  try {
    const transform = async () => {
      const output = { messages: [...a] }
      await hooks["experimental.chat.messages.transform"]({}, output)
      return output.messages.map((m) => m.info.id)
    }
    assert.deepEqual(await transform(), a.map((m) => m.info.id))
    assert.deepEqual(await transform(), a.map((m) => m.info.id))
    assert.deepEqual(reads, ["ses_lru_a"], "a remembered session is not read again")
    // Two more sessions start: ses_lru_a is now the least recently used of three.
    for (const ses of ["ses_lru_b", "ses_lru_c"]) {
      await hooks.event({ event: { type: "message.updated", properties: { info: history(ses, 1)[0].info } } })
    }
    assert.deepEqual(await transform(), a.map((m) => m.info.id), "the context after it was forgotten")
    assert.deepEqual(reads, ["ses_lru_a", "ses_lru_a"], "the forgotten session was loaded whole")
    const held = await client.getSession("ses_lru_a")
    assert.deepEqual(held.messages.map((m) => m.info.id), a.map((m) => m.info.id))
  } finally {
    await hooks.dispose()
  }
})

test("a session deleted in OpenCode is deleted in compactd though its mirror state was forgotten", async () => {
  const hooks = await hooksFor(() => [], { maxSessions: 1 })
  try {
    // Each reaches compactd (and its acks the plugin) before the next comes: then
    // ses_del_a is idle, and its state is forgotten when ses_del_b comes.
    for (const ses of ["ses_del_a", "ses_del_b"]) {
      await hooks.event({ event: { type: "message.updated", properties: { info: history(ses, 1)[0].info } } })
      let held
      const heldBy = Date.now() + 15000
      while (!held?.messages?.length && Date.now() < heldBy) {
        held = await client.getSession(ses).catch(() => undefined)
        if (!held?.messages?.length) await new Promise((r) => setTimeout(r, 20))
      }
      assert.ok(held?.messages?.length, `${ses} is in compactd`)
    }
    await hooks.event({ event: { type: "session.deleted", properties: { info: { id: "ses_del_a" } } } })
    let gone
    const goneBy = Date.now() + 15000
    while (!gone && Date.now() < goneBy) {
      gone = await client.getSession("ses_del_a").then(() => undefined, (e) => e)
      if (!gone) await new Promise((r) => setTimeout(r, 20))
    }
    assert.equal(gone?.codeName, "NOT_FOUND", "deleted in compactd")
  } finally {
    await hooks.dispose()
  }
})

test("a compactd that stops answering does not hold OpenCode's request", async () => {
  const ses = "ses_stalled"
  const all = history(ses, 2).slice(0, 3)
  // A second session, deleted in OpenCode while compactd does not answer.
  const other = "ses_stalled_deleted"
  const its = history(other, 1)
  // timeoutMs bounds each wait on compactd: long enough for a debug compactd just resumed
  // on a loaded machine to answer, short against the bound on a held request below.
  const hooks = await hooksFor((id) => (id === ses ? all : id === other ? its : []), { timeoutMs: 3000, recall: true })
  try {
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...its] })
    assert.equal((await client.getSession(other)).messages.length, 2)
    // One turn mirrored and answered.
    const first = { messages: all.slice(0, 1) }
    for (const e of [
      { type: "message.updated", properties: { info: all[0].info } },
      { type: "message.part.updated", properties: { part: all[0].parts[0] } },
    ]) await hooks.event({ event: e })
    await hooks["experimental.chat.messages.transform"]({}, first)
    // compactd stops (a stuck process, a half-open connection): the next updates are
    // never acknowledged.
    server.kill("SIGSTOP")
    for (const m of all.slice(1)) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      await hooks.event({ event: { type: "message.part.updated", properties: { part: m.parts[0] } } })
    }
    const output = { messages: [...all] }
    const started = Date.now()
    const outcome = await Promise.race([
      hooks["experimental.chat.messages.transform"]({}, output).then(() => "returned"),
      new Promise((resolve) => setTimeout(() => resolve("hung"), 20000)),
    ])
    assert.equal(outcome, "returned", "the request is not held")
    assert.ok(Date.now() - started < 10000, `returned after ${Date.now() - started} ms`)
    // OpenCode's own messages go out.
    assert.deepEqual(output.messages, all)
    // While compactd still does not answer, the next requests do not wait on it again,
    // nor does the model's compactd_recall.
    const t1 = Date.now()
    const recalled = await hooks.tool.compactd_recall.execute({ call_id: "call_1" }, { sessionID: ses })
    assert.ok(Date.now() - t1 < 1000, `compactd_recall waited ${Date.now() - t1} ms on a stalled compactd`)
    assert.match(recalled, /^compactd_recall failed: compactd has not answered since /)
    await hooks.event({ event: { type: "session.deleted", properties: { info: { id: other } } } })
    for (let i = 0; i < 3; i++) {
      const again = { messages: [...all] }
      const t0 = Date.now()
      await hooks["experimental.chat.messages.transform"]({}, again)
      assert.ok(Date.now() - t0 < 1000, `request ${i} waited ${Date.now() - t0} ms on a stalled compactd`)
      assert.deepEqual(again.messages, all)
    }
    // compactd answers again: within a few probes a request is mirrored (the session
    // loaded whole on a new stream) and gets compactd's context, without waiting on the
    // lost acks (a wait on them could only end in timeoutMs passing, and OpenCode's own
    // messages sent: the last assertion).
    server.kill("SIGCONT")
    let next
    const resumed = Date.now()
    do {
      await new Promise((r) => setTimeout(r, 250))
      next = { messages: [...all] }
      await hooks["experimental.chat.messages.transform"]({}, next)
    } while (next.messages[0] === all[0] && Date.now() - resumed < 15000)
    const held = await client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), all.map((m) => m.info.id))
    assert.notEqual(next.messages[0], all[0], "compactd's context replaced OpenCode's messages")
    // The delete compactd missed is sent once it answers.
    let deleted = false
    for (let i = 0; i < 40 && !deleted; i++) {
      deleted = await client.getSession(other).then(() => false, (e) => e.codeName === "NOT_FOUND")
      if (!deleted) await new Promise((r) => setTimeout(r, 250))
    }
    assert.ok(deleted, `${other}, deleted in OpenCode while compactd was stopped, is still in compactd`)
    // Stalled again within a minute: compactd is left alone for at least 5 s, though it
    // answers probes at once (as one whose disk or sessions, not its process, are stuck).
    server.kill("SIGSTOP")
    await hooks.event({ event: { type: "message.part.updated", properties: { part: { ...all[2].parts[0], text: "answer 0, edited" } } } })
    const stalledAgain = Date.now()
    const third = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, third)
    assert.deepEqual(third.messages, all, "a stalled compactd's context was sent")
    server.kill("SIGCONT")
    let replaced
    do {
      await new Promise((r) => setTimeout(r, 250))
      replaced = { messages: [...all] }
      await hooks["experimental.chat.messages.transform"]({}, replaced)
    } while (replaced.messages[0] === all[0] && Date.now() - stalledAgain < 20000)
    assert.notEqual(replaced.messages[0], all[0], "compactd's context is sent again after the second stall")
    assert.ok(Date.now() - stalledAgain >= 5000, `asked again ${Date.now() - stalledAgain} ms after the second stall began`)
  } finally {
    server.kill("SIGCONT")
    await hooks.dispose()
  }
})

test("after a model switch the request is checked against the new model's limits", async () => {
  const ses = "ses_switch"
  const all = history(ses, 2).slice(0, 3)
  // The new prompt is for the small model; OpenCode's provider list answers slowly.
  all[2].info.model = { providerID: "p", modelID: "small" }
  const slow = () => new Promise((resolve) => setTimeout(() => resolve(PROVIDERS), 500))
  const hooks = await hooksFor(() => all, {}, slow)
  try {
    // The first turn on the large model (chat.params tells its limits).
    for (const e of [
      { type: "message.updated", properties: { info: all[0].info } },
      { type: "message.part.updated", properties: { part: all[0].parts[0] } },
    ]) await hooks.event({ event: e })
    await hooks["chat.params"]({ sessionID: ses, model: { providerID: "p", id: "m", limit: { context: 200000, output: 32000 } } })
    await hooks["experimental.chat.messages.transform"]({}, { messages: all.slice(0, 1) })
    assert.equal((await client.getSession(ses)).info.limits.context, 200000)
    for (const m of all.slice(1)) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      await hooks.event({ event: { type: "message.part.updated", properties: { part: m.parts[0] } } })
    }
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    // Right after the transform (before OpenCode's chat.params for it).
    const info = (await client.getSession(ses)).info
    assert.equal(info.model.modelId, "small")
    assert.equal(info.limits.context, 8000)
  } finally {
    await hooks.dispose()
  }
})

test("a model whose limits leave no input is mirrored without them, not refused and reloaded", async () => {
  const ses = "ses_nolimit"
  const all = history(ses, 1)
  const logFile = join(mkdtempSync(join(tmpdir(), "compactd-plugin-")), "plugin.log")
  const hooks = await hooksFor(() => all, { logFile })
  try {
    for (const m of all) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      for (const part of m.parts) await hooks.event({ event: { type: "message.part.updated", properties: { part } } })
    }
    // Groq's listing of an 8k model: all of its window may be the answer.
    await hooks["chat.params"]({ sessionID: ses, model: { providerID: "p", id: "m", limit: { context: 8192, output: 8192 } } })
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    const got = await client.getSession(ses)
    assert.equal(got.info.model.modelId, "m")
    assert.equal(got.info.limits?.context ?? 0, 0, "opened without the limits compactd refuses")
    assert.equal(got.messages.length, all.length, "the session is mirrored whole")
    // The next turn's request: nothing to reload.
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    const log = readFileSync(logFile, "utf8")
    assert.doesNotMatch(log, /rejected/, log)
    assert.equal(log.match(/leave no input once the answer is reserved/g)?.length, 1, log)
  } finally {
    await hooks.dispose()
  }
})

test("OpenCode's title request on its small model leaves the session on the user's model", async () => {
  // OpenCode names a new session with its small model, through the same chat.params hook
  // and the same session id, while the first turn runs. Before, that request set the
  // session's model and limits to the small model's: compactd judged the turn against a
  // window it is not sent to (here 8,000 tokens for a 200,000-token model).
  const ses = "ses_title"
  const all = history(ses, 1).slice(0, 1)
  const hooks = await hooksFor(() => all)
  try {
    for (const e of [
      { type: "message.updated", properties: { info: all[0].info } },
      { type: "message.part.updated", properties: { part: all[0].parts[0] } },
    ]) await hooks.event({ event: e })
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    const limit = (id) => PROVIDERS.data.providers[0].models[id].limit
    await hooks["chat.params"]({ sessionID: ses, agent: "build", model: { providerID: "p", id: "m", limit: limit("m") }, message: all[0].info })
    await hooks["chat.params"]({ sessionID: ses, agent: "title", model: { providerID: "p", id: "small", limit: limit("small") }, message: all[0].info })
    // The turn's answer streams in (compactd checks it against the session's limits).
    const answer = history(ses, 1)[1]
    await hooks.event({ event: { type: "message.updated", properties: { info: answer.info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: answer.parts[0] } } })
    let held
    const by = Date.now() + 15000
    while ((held?.messages?.length ?? 0) < 2 && Date.now() < by) {
      held = await client.getSession(ses)
      if (held.messages.length < 2) await new Promise((r) => setTimeout(r, 20))
    }
    assert.equal(held.messages.length, 2, "the answer reached compactd")
    const info = held.info
    assert.equal(info.model.modelId, "m")
    assert.equal(info.limits.context, 200000)
  } finally {
    await hooks.dispose()
  }
})

/** Session `ses`: one user turn of `calls` steps, each a bash call with a 200-line log. */
function toolTurn(ses, calls) {
  const out = [{
    info: { id: "msg_01", sessionID: ses, role: "user", time: { created: 1 }, agent: "build", model: MODEL },
    parts: [{ id: "prt_01", sessionID: ses, messageID: "msg_01", type: "text", text: "build it" }],
  }]
  for (let i = 1; i <= calls; i++) {
    const id = `msg_${String(i + 1).padStart(2, "0")}`
    out.push({
      info: {
        id, sessionID: ses, role: "assistant", parentID: "msg_01", time: { created: 10 * i, completed: 10 * i + 1 },
        modelID: MODEL.modelID, providerID: MODEL.providerID, mode: "build", agent: "build", cost: 0, finish: "tool-calls",
        tokens: { input: 1000 * i, output: 10, reasoning: 0, cache: { read: 0, write: 0 } },
      },
      parts: [{
        id: `prt_${id}`, sessionID: ses, messageID: id, type: "tool", callID: `call_${i}`, tool: "bash",
        state: { status: "completed", input: { command: `make step${i}` }, output: `step ${i}: compiling\n`.repeat(200), title: "make", metadata: {}, time: { start: 10 * i, end: 10 * i + 1 } },
      }],
    })
  }
  return out
}

const hidden = (messages) => messages.flatMap((m) => m.parts).filter((p) => /hidden to save context/.test(p.state?.output ?? ""))

test("the compaction input is left as OpenCode built it", async () => {
  // OpenCode's compaction fires experimental.session.compacting, then runs the transform
  // over a copy of the messages it summarizes, with no tools: compactd's pointers to
  // compactd_recall must not reach its summarizer.
  const ses = "ses_compaction_input"
  const all = toolTurn(ses, 4)
  const hooks = await hooksFor(() => all, { recall: true, session: { mask_keep: 1, cache_model: "none" } })
  const request = async () => {
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    return output.messages
  }
  const compacting = () => hooks["experimental.session.compacting"]?.({ sessionID: ses }, { context: [], prompt: undefined })
  try {
    // Mirrored as it happens (compactd's strategies decide on live updates).
    for (const m of all) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      for (const part of m.parts) await hooks.event({ event: { type: "message.part.updated", properties: { part } } })
    }
    assert.ok(hidden(await request()).length > 0, "a model request gets compactd's context, outputs hidden")
    await compacting()
    const head = structuredClone(all)
    const input = { messages: head }
    await hooks["experimental.chat.messages.transform"]({}, input)
    assert.deepEqual(hidden(input.messages), [], "no output hidden in the compaction's input")
    assert.equal(input.messages.length, all.length)
    input.messages.forEach((m, i) => assert.equal(m, head[i], `message ${i} is OpenCode's own`))
    assert.deepEqual(input.messages, all)
    // Once: the next model request gets compactd's context again.
    assert.ok(hidden(await request()).length > 0, "the request after the compaction")
    // A compaction whose transform never came (nothing to summarize): its end clears the mark.
    await compacting()
    await hooks["experimental.chat.messages.transform"]({}, { messages: [] })
    await hooks.event({ event: { type: "session.compacted", properties: { sessionID: ses } } })
    assert.ok(hidden(await request()).length > 0, "the request after a compaction without input")
  } finally {
    await hooks.dispose()
  }
})

// The plugin in a worker thread, its OpenCode client's providers() failing as `kind` says
// ("later": rejects after 1 ms; "at once": a rejected promise; "throwing": throws), after
// one user message: counts, in shared memory (readable while the worker's event loop is
// starved), its providers() calls and the ticks of a 10 ms timer, 500 ms long.
const LOOKUP_WORKER = `
const { workerData } = require("node:worker_threads")
const counts = new Int32Array(workerData.shared)
const providers = () => {
  Atomics.add(counts, 0, 1)
  const error = new Error("providers unavailable")
  if (workerData.kind === "throwing") throw error
  if (workerData.kind === "at once") return Promise.reject(error)
  return new Promise((_, reject) => setTimeout(() => reject(error), 1))
}
;(async () => {
  const { default: plugin } = await import(workerData.plugin)
  const opencode = { app: { log: async () => ({}) }, session: { messages: async () => ({ data: [] }) }, config: { providers } }
  const hooks = await plugin({ client: opencode }, { address: workerData.address, recall: false })
  setInterval(() => Atomics.add(counts, 1, 1), 10)
  Atomics.store(counts, 2, 1)
  await hooks.event({ event: { type: "message.updated", properties: { info: workerData.info } } })
})()
`

async function lookupsOf(kind, info) {
  const shared = new SharedArrayBuffer(12)
  const counts = new Int32Array(shared)
  const plugin = new URL("../dist/index.js", import.meta.url).href
  const worker = new Worker(LOOKUP_WORKER, { eval: true, workerData: { shared, kind, info, address, plugin } })
  worker.on("error", () => {})
  try {
    await until(`the plugin started (${kind})`, () => Atomics.load(counts, 2) === 1, 15000)
    // At least 500 ms, and until the timer ticked 10 times: a worker a loaded machine runs
    // seldom gets up to 15 s for that; one whose event loop a retry loop holds never does.
    const began = Date.now()
    const ticks = () => Atomics.load(counts, 1)
    while (Date.now() - began < 500 || (ticks() < 10 && Date.now() - began < 15000)) {
      await new Promise((resolve) => setTimeout(resolve, 50))
    }
    return { calls: Atomics.load(counts, 0), ticks: ticks(), ms: Date.now() - began }
  } finally {
    await worker.terminate()
  }
}

test("a failing lookup of the model's limits is not retried in a loop", async () => {
  // The plugin runs inside OpenCode's process: a lookup retried at once, again and again,
  // would take OpenCode's event loop.
  for (const kind of ["later", "at once", "throwing"]) {
    const { calls, ticks, ms } = await lookupsOf(kind, history(`ses_no_providers_${kind.replace(" ", "_")}`, 1)[0].info)
    assert.ok(calls <= 2, `${kind}: ${calls} lookups in ${ms} ms`)
    assert.ok(ticks >= 10, `${kind}: the event loop ran a 10 ms timer ${ticks} times in ${ms} ms`)
  }
  // Meanwhile the session is opened without limits, and its requests get compactd's context.
  const ses = "ses_no_providers"
  const all = history(ses, 1).slice(0, 1)
  let calls = 0
  const failing = () => (calls++, new Promise((_, reject) => setTimeout(() => reject(new Error("providers unavailable")), 1)))
  const hooks = await hooksFor(() => all, {}, failing)
  try {
    await hooks.event({ event: { type: "message.updated", properties: { info: all[0].info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: all[0].parts[0] } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    assert.ok(calls <= 2, `${calls} lookups`)
    assert.notEqual(output.messages[0], all[0], "compactd's context is sent")
    const held = await client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), [all[0].info.id])
    assert.ok(!held.info.limits?.context, `opened without limits: ${JSON.stringify(held.info.limits)}`)
  } finally {
    await hooks.dispose()
  }
})

/** compactd's `compactd_watchers` gauge (0 when not reported yet). */
async function watchers(metrics) {
  try {
    const text = await (await fetch(`http://${metrics}/metrics`)).text()
    const line = text.split("\n").find((l) => l.startsWith("compactd_watchers "))
    return line ? Number(line.split(" ")[1]) : 0
  } catch {
    return -1 // not up
  }
}

async function until(what, check, ms) {
  const deadline = Date.now() + ms
  for (;;) {
    if (await check()) return
    assert.ok(Date.now() < deadline, `${what} within ${ms} ms`)
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
}

test('with compaction "compactd", the watcher subscribes again after compactd restarts', async () => {
  const [port, metricsPort] = [await freePort(), await freePort()]
  const addr = `127.0.0.1:${port}`
  const metrics = `127.0.0.1:${metricsPort}`
  const start = () => {
    // With a summarizer (never called here): without one the plugin leaves compaction to
    // OpenCode and watches nothing.
    const llm = ["--llm-base-url", "http://127.0.0.1:9/v1", "--llm-model", "m"]
    const p = spawn(BIN, ["serve", "--listen", addr, "--metrics-listen", metrics, "--durability", "memory", ...llm], { stdio: ["ignore", "ignore", "pipe"] })
    p.stderr.on("data", () => {})
    return p
  }
  let own = start()
  const probe = new CompactdClient({ address: addr })
  await probe.waitForReady(15000)
  const opencode = { app: { log: async () => ({}) }, session: { messages: async () => ({ data: [] }) }, config: { providers: async () => PROVIDERS } }
  const hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd" })
  try {
    await until("the watcher subscribed", async () => (await watchers(metrics)) === 1, 10000)
    // compactd restarts on the same address (a rolling restart, a crash).
    const exited = new Promise((resolve) => own.on("exit", resolve))
    own.kill("SIGKILL")
    await exited
    own = start()
    await probe.waitForReady(15000)
    await until("the watcher subscribed again", async () => (await watchers(metrics)) === 1, 10000)
  } finally {
    await hooks.dispose()
    probe.close()
    own.kill("SIGTERM")
  }
})

/** An OpenAI-compatible endpoint that streams `summary` to every chat request (counted in
 * `requests`); everything else is 404 (compactd's window discovery). */
async function summaryEndpoint(summary, delayMs = 0) {
  const requests = []
  const port = await freePort()
  const server = createHttpServer((req, res) => {
    if (req.method !== "POST" || !req.url.endsWith("/chat/completions")) {
      res.writeHead(404).end()
      return
    }
    let body = ""
    req.on("data", (c) => (body += c))
    req.on("end", async () => {
      requests.push(body)
      if (delayMs) await new Promise((r) => setTimeout(r, delayMs))
      const chunk = (delta, finish, usage) =>
        `data: ${JSON.stringify({ id: "c", object: "chat.completion.chunk", created: 0, model: "m", choices: [{ index: 0, delta, finish_reason: finish }], ...(usage ? { usage } : {}) })}\n\n`
      res.writeHead(200, { "content-type": "text/event-stream" })
      res.write(chunk({ role: "assistant", content: summary }, null))
      res.write(chunk({}, "stop", { prompt_tokens: 900, completion_tokens: 20, total_tokens: 920 }))
      res.end("data: [DONE]\n\n")
    })
  })
  await new Promise((resolve) => server.listen(port, "127.0.0.1", resolve))
  return { url: `http://127.0.0.1:${port}/v1`, requests, close: () => (server.closeAllConnections(), server.close()) }
}

test('with compaction "compactd", a compaction that failed is not asked for again before the next user turn', async () => {
  // Every chat request is refused (a 400 is not retried): each request of the turn would
  // otherwise pay for another doomed summary, or wait for one.
  const chats = []
  const port = await freePort()
  const llm = createHttpServer((req, res) => {
    if (req.method === "POST" && req.url.endsWith("/chat/completions")) chats.push(req.url)
    const body = JSON.stringify({ error: { message: "model m is not available", type: "invalid_request_error" } })
    res.writeHead(req.url.endsWith("/chat/completions") ? 400 : 404, { "content-type": "application/json" }).end(body)
  })
  await new Promise((resolve) => llm.listen(port, "127.0.0.1", resolve))
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", `http://127.0.0.1:${port}/v1`, "--llm-model", "m", "--llm-context-tokens", "32000", "--llm-max-retries", "0"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_failing_summaries"
  const small = { providerID: "p", modelID: "small" }
  const turn = (n, text) => ({
    info: { id: `msg_${n}`, sessionID: ses, role: "user", time: { created: n }, agent: "build", model: small },
    parts: [{ id: `prt_${n}`, sessionID: ses, messageID: `msg_${n}`, type: "text", text }],
  })
  // ~9,000 tokens in a window of 8,000: over the threshold, and one turn (summarized whole).
  let all = [turn(1, "word ".repeat(9000))]
  const opencode = { app: { log: async () => ({}) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd" })
    for (let i = 0; i < 4; i++) await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    assert.equal(chats.length, 1, "one summary asked for in the turn")
    // A new user turn: compactd is asked again.
    all = [...all, turn(2, "and now?")]
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    assert.equal(chats.length, 2, "asked again in the next turn")
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.closeAllConnections()
    llm.close()
  }
})

test('with compaction "compactd", a request waits for a compaction at most compactionWaitMs', async () => {
  // The summarizer takes the request and never answers (a stuck endpoint, a network
  // partition): the request goes out without the compaction, which goes on.
  const chats = []
  const port = await freePort()
  const llm = createHttpServer((req) => {
    if (req.method === "POST" && req.url.endsWith("/chat/completions")) chats.push(req.url)
    // Never answered.
  })
  await new Promise((resolve) => llm.listen(port, "127.0.0.1", resolve))
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", `http://127.0.0.1:${port}/v1`, "--llm-model", "m", "--llm-context-tokens", "32000", "--llm-max-retries", "0", "--llm-timeout-secs", "30"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_stuck_summarizer"
  const all = oneLongTurn(ses)
  const logs = []
  const opencode = { app: { log: async ({ body }) => logs.push(body.message) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd", compactionWaitMs: 1500 })
    const began = Date.now()
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const took = Date.now() - began
    assert.ok(took < 10_000, `the request waited ${took} ms for a compaction that never ends`)
    assert.equal(output.messages[0].info.id, "msg_01", "sent without a summary")
    assert.ok(logs.some((l) => /compaction not done within 1500 ms/.test(l)), logs.join("\n"))
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.closeAllConnections()
    llm.close()
  }
})

test('with compaction "compactd", a compaction the watcher did not see start is waited for', async () => {
  // The watcher missed its start (it subscribed after it: a dropped watch, a restart of
  // the plugin): the plugin's own Compact is refused as already running.
  // Each answer comes 3 s after its request (compactd asks more than once here): the
  // compaction runs while the plugin starts, mirrors the session and asks for its own.
  const llm = await summaryEndpoint("We read the files and fixed nothing yet.", 3000)
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_unseen_compaction"
  const small = { providerID: "p", modelID: "small" }
  const all = history(ses, 3).slice(0, 5)
  for (const m of all) {
    if (m.info.role === "user") m.info.model = small
    else Object.assign(m.info, { providerID: "p", modelID: "small", tokens: undefined })
  }
  all[1].parts[0].text += " " + "long answer ".repeat(4000)
  const logs = []
  const opencode = { app: { log: async ({ body }) => logs.push(body.message) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    await probe.importSession({ sessionId: ses, export: { info: { id: ses }, messages: all }, limits: { context: 8000, output: 1000 } })
    const running = probe.compact(ses).result()
    // Running once its summary request reached the endpoint.
    await until("the summary request", () => llm.requests.length === 1, 15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd" })
    // The plugin follows the session from its first message (no reload, which would
    // replace the session and cancel the compaction).
    for (const m of all) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      for (const part of m.parts) await hooks.event({ event: { type: "message.part.updated", properties: { part } } })
    }
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const done = await running
    assert.ok(done.compacted, `compacted: ${JSON.stringify(done)}`)
    assert.equal(output.messages[0].info.id, done.compacted.userMessageId, "the request carries the summary")
    assert.ok(logs.some((l) => /already running; waiting for it/.test(l)), logs.join("\n"))
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.close()
  }
})

test('with compaction "compactd", a session loaded again keeps compactd\'s summary', async () => {
  const llm = await summaryEndpoint("We read the files and fixed nothing yet.")
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_reloaded"
  const all = history(ses, 4).slice(0, 7)
  for (const m of all) if (m.info.role === "assistant") m.parts[0].text += " " + "long answer ".repeat(400)
  const opencode = { app: { log: async () => ({}) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  const settings = { address: addr, recall: false, compaction: "compactd" }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, settings)
    const config = {}
    await hooks.config(config)
    assert.equal(config.compaction?.auto, false, "compactd summarizes: OpenCode's automatic compaction is off")
    for (const m of all.slice(0, 6)) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      await hooks.event({ event: { type: "message.part.updated", properties: { part: m.parts[0] } } })
    }
    await hooks["experimental.chat.messages.transform"]({}, { messages: all.slice(0, 6) })
    const done = await probe.compact(ses).result()
    assert.ok(done.compacted, `compacted: ${JSON.stringify(done)}`)
    const summarized = { messages: all.slice(0, 6) }
    await hooks["experimental.chat.messages.transform"]({}, summarized)
    const compactedIds = summarized.messages.map((m) => m.info.id)
    assert.equal(compactedIds[0], done.compacted.userMessageId)
    await hooks.dispose()

    // OpenCode restarts: a new plugin meets the session through its next prompt and loads
    // it whole from OpenCode's history, which holds none of compactd's messages.
    hooks = await plugin({ client: opencode }, settings)
    await hooks.event({ event: { type: "message.updated", properties: { info: all[6].info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: all[6].parts[0] } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    assert.deepEqual(output.messages.map((m) => m.info.id), [...compactedIds, all[6].info.id], "the context sent")
    assert.equal((await probe.getContext(ses, "native")).boundaryMessageId, done.compacted.userMessageId)
    assert.equal(llm.requests.length, 1, "one summary paid for")
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.close()
  }
})

test('with compaction "compactd", a context compactd cannot build is sent from its last summary', async () => {
  // OpenCode's own compaction is off: its own messages are the whole, never compacted,
  // history. Before, a request whose context could not be built (compactd gone or slow, an
  // import refused) was sent with them: refused by the provider for its length, or paid in
  // full.
  const llm = await summaryEndpoint("We read the files and fixed nothing yet.")
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_last_good"
  const all = history(ses, 5)
  for (const m of all) if (m.info.role === "assistant") m.parts[0].text += " " + "long answer ".repeat(400)
  const logs = []
  const toasts = []
  const opencode = {
    app: { log: async ({ body }) => logs.push(`${body.level} ${body.message}`) },
    session: { messages: async () => ({ data: all }) },
    config: { providers: async () => PROVIDERS },
    tui: { showToast: async ({ body }) => void toasts.push(body) },
  }
  let hooks
  const request = async (messages) => {
    const output = { messages: [...messages] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    return output.messages
  }
  const mirrored = async (messages) => {
    for (const m of messages) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      await hooks.event({ event: { type: "message.part.updated", properties: { part: m.parts[0] } } })
    }
  }
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd", timeoutMs: 3000 })
    await mirrored(all.slice(0, 6))
    await request(all.slice(0, 6))
    const done = await probe.compact(ses).result()
    assert.ok(done.compacted, `compacted: ${JSON.stringify(done)}`)
    const summarized = await request(all.slice(0, 6))
    assert.equal(summarized[0].info.id, done.compacted.userMessageId)
    const tailStart = summarized.findIndex((m) => all.some((o) => o.info.id === m.info.id))
    assert.ok(tailStart > 0, "the summary, then OpenCode's tail")
    // compactd goes away; the session goes on with a new turn.
    own.kill("SIGKILL")
    await new Promise((resolve) => own.once("exit", resolve))
    await mirrored(all.slice(6, 9))
    const sent = await request(all.slice(0, 9))
    const ids = sent.map((m) => m.info.id)
    const from = all.findIndex((m) => m.info.id === summarized[tailStart].info.id)
    assert.deepEqual(ids, [...summarized.slice(0, tailStart).map((m) => m.info.id), ...all.slice(from, 9).map((m) => m.info.id)], "compactd's last summary, then OpenCode's messages from its tail on")
    assert.equal(ids.at(-1), all[8].info.id, "the newest user message is sent")
    assert.ok(!ids.includes(all[0].info.id), "no summarized message is sent")
    assert.ok(logs.some((l) => /context not replaced \(compactd's last summary and OpenCode's messages from/.test(l)), logs.join("\n"))
    assert.equal(toasts.filter((t) => t.variant === "error").length, 1, JSON.stringify(toasts))
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGKILL")
    llm.close()
  }
})

test('with compaction "compactd", a session with nothing to compact goes out as it is, its user message unsummarized', async () => {
  // The session is over its threshold, but compactd's verbatim tail (here up to 100,000
  // tokens) is all of it: compactd has nothing to compact. Before, the plugin compacted
  // again with a tail of none: the user's newest message was summarized and, the
  // compaction being manual (no "Continue" message after it), the request ended with the
  // summary, an assistant message.
  const llm = await summaryEndpoint("The user pasted many words.")
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000", "--tail-tokens", "100000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_nothing_to_compact"
  const all = oneLongTurn(ses)
  const logs = []
  const opencode = { app: { log: async ({ body }) => logs.push(body.message) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd" })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    assert.deepEqual(output.messages.map((m) => m.info.id), ["msg_01"], "the user's message, not a summary of it")
    assert.equal(llm.requests.length, 0, "nothing summarized")
    assert.ok(logs.some((l) => /nothing to compact/.test(l)), logs.join("\n"))
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.close()
  }
})

test('with compaction "compactd", the newest user message is sent though a compaction summarized it', async () => {
  // One long agent turn: the verbatim tail (3,000 tokens here) keeps only its newest
  // steps, and the user's message is summarized with the older ones. Before, the request
  // went out without it (a compaction turned the check for the newest message off).
  const llm = await summaryEndpoint("We built steps 1 to 4.")
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000", "--tail-tokens", "3000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_split_turn"
  const all = toolTurn(ses, 6)
  const opencode = { app: { log: async () => ({}) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd", session: { cache_model: "none" } })
    for (const m of all) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      for (const part of m.parts) await hooks.event({ event: { type: "message.part.updated", properties: { part } } })
    }
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    const done = await probe.compact(ses).result()
    assert.ok(done.compacted, `compacted: ${JSON.stringify(done)}`)
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const ids = output.messages.map((m) => m.info.id)
    const kept = (await probe.getContext(ses, "native")).messages.map((m) => m.info.id).filter((id) => all.some((m) => m.info.id === id))
    assert.ok(kept.length > 0 && !kept.includes("msg_01"), `a split turn: compactd keeps ${kept.join(", ")}`)
    assert.equal(ids[0], done.compacted.userMessageId, "the summary first")
    assert.deepEqual(ids.slice(2), ["msg_01", ...kept], "the user's message, then the steps kept")
    assert.equal(output.messages[2], all[0], "OpenCode's own message")
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.close()
  }
})

test('with compaction "compactd", a session loaded again waits for the compaction compactd runs', async () => {
  // A load replaces the session in compactd, which cancels its running compaction. Before,
  // a request that had to load the session (here OpenCode removed a message) did so at
  // once: the summary being written was thrown away, and the request went without it.
  const llm = await summaryEndpoint("We read the files and fixed nothing yet.", 2000)
  const addr = `127.0.0.1:${await freePort()}`
  const own = spawn(BIN, ["serve", "--listen", addr, "--durability", "memory", "--llm-base-url", llm.url, "--llm-model", "m", "--llm-context-tokens", "32000"], { stdio: ["ignore", "ignore", "pipe"] })
  own.stderr.on("data", () => {})
  const probe = new CompactdClient({ address: addr })
  const ses = "ses_reload_waits"
  const all = history(ses, 4).slice(0, 7)
  for (const m of all) if (m.info.role === "assistant") m.parts[0].text += " " + "long answer ".repeat(400)
  const logs = []
  const opencode = { app: { log: async ({ body }) => logs.push(body.message) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  let hooks
  try {
    await probe.waitForReady(15000)
    hooks = await plugin({ client: opencode }, { address: addr, recall: false, compaction: "compactd" })
    for (const m of all) {
      await hooks.event({ event: { type: "message.updated", properties: { info: m.info } } })
      await hooks.event({ event: { type: "message.part.updated", properties: { part: m.parts[0] } } })
    }
    await hooks["experimental.chat.messages.transform"]({}, { messages: [...all] })
    const running = probe.compact(ses).result()
    await until("the plugin saw the compaction start", () => logs.some((l) => new RegExp(`compaction .* of session ${ses} started`).test(l)), 15000)
    // OpenCode removed a message (here one it then sends again): the session is loaded whole.
    await hooks.event({ event: { type: "message.removed", properties: { sessionID: ses, messageID: "msg_gone" } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const done = await running
    assert.ok(done.compacted, `the compaction was not cancelled: ${JSON.stringify(done.failed ?? done)}`)
    assert.equal(output.messages[0].info.id, done.compacted.userMessageId, "the request carries the summary")
    assert.ok(logs.some((l) => /waiting for compactd's running compaction before loading/.test(l)), logs.join("\n"))
  } finally {
    await hooks?.dispose()
    probe.close()
    own.kill("SIGTERM")
    llm.close()
  }
})

test("an import compactd aborts (a compaction committed meanwhile) is tried again at once", async () => {
  // compactd answers ABORTED when a compaction committed while the import was built:
  // imported again, it is kept. Before, the request failed (OpenCode's own messages sent).
  const ses = "ses_import_aborted"
  const all = history(ses, 2).slice(0, 3)
  const logs = []
  const opencode = { app: { log: async ({ body }) => logs.push(`${body.level} ${body.message}`) }, session: { messages: async () => ({ data: all }) }, config: { providers: async () => PROVIDERS } }
  const real = CompactdClient.prototype.importSession
  let imports = 0
  CompactdClient.prototype.importSession = function (init, opts) {
    if (init.sessionId !== ses) return real.call(this, init, opts)
    imports += 1
    if (imports > 1) return real.call(this, init, opts)
    const e = new Error(`session ${ses} was compacted while the import was built, which would lose that compaction: import again (keep_compactions keeps it)`)
    return Promise.reject(Object.assign(e, { code: 10, codeName: "ABORTED" }))
  }
  const hooks = await plugin({ client: opencode }, { address, recall: false })
  try {
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    assert.equal(imports, 2, "imported again")
    assert.notEqual(output.messages[0], all[0], "compactd's context is sent")
    assert.ok(!logs.some((l) => /context not replaced/.test(l)), logs.join("\n"))
    const held = await client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), all.map((m) => m.info.id))
  } finally {
    CompactdClient.prototype.importSession = real
    await hooks.dispose()
  }
})

test("a running tool is sent once, then its finished part", async () => {
  // OpenCode publishes a running bash tool's part at every chunk it prints (the output so
  // far, in its metadata). Each was sent: while compactd was slow or stopped they queued
  // without bound in OpenCode's process.
  const metricsPort = await freePort()
  const own = await startCompactd(BIN, "running", ["--metrics-listen", `127.0.0.1:${metricsPort}`])
  const upserts = async () => {
    const text = await (await fetch(`http://127.0.0.1:${metricsPort}/metrics`)).text()
    const line = text.split("\n").find((l) => l.startsWith("compactd_updates_total{") && l.includes('kind="upsert_part"') && l.includes('result="ok"'))
    return line ? Number(line.trim().split(/\s+/).pop()) : 0
  }
  const ses = "ses_running_tool"
  const [u1, a1] = history(ses, 1)
  const tool = (state) => ({ id: "prt_tool", sessionID: ses, messageID: a1.info.id, type: "tool", callID: "call_1", tool: "bash", state })
  const done = tool({ status: "completed", input: { command: "make" }, output: "built in 3 s\n", title: "make", metadata: {}, time: { start: 1, end: 2 } })
  const all = [u1, { info: a1.info, parts: [done] }]
  const hooks = await hooksFor(() => all, { address: own.address })
  try {
    await hooks.event({ event: { type: "message.updated", properties: { info: u1.info } } })
    await hooks.event({ event: { type: "message.part.updated", properties: { part: u1.parts[0] } } })
    await hooks["experimental.chat.messages.transform"]({}, { messages: [u1] })
    const before = await upserts()
    const working = { ...a1.info, time: { created: a1.info.time.created } }
    delete working.finish
    await hooks.event({ event: { type: "message.updated", properties: { info: working } } })
    for (let i = 1; i <= 100; i++) {
      const state = { status: "running", input: { command: "make" }, title: "make", metadata: { output: "compiling\n".repeat(i) }, time: { start: 1 } }
      await hooks.event({ event: { type: "message.part.updated", properties: { part: tool(state) } } })
    }
    await hooks.event({ event: { type: "message.part.updated", properties: { part: done } } })
    await hooks.event({ event: { type: "message.updated", properties: { info: a1.info } } })
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const sent = (await upserts()) - before
    assert.ok(sent >= 2 && sent <= 3, `${sent} part updates reached compactd`)
    const held = await own.client.getSession(ses)
    assert.match(JSON.stringify(held.messages.at(-1)), /built in 3 s/, "the finished part")
  } finally {
    await hooks.dispose()
    own.client.close()
    own.server.kill("SIGTERM")
  }
})

test("a session longer than compactd's max_update_bytes is loaded whole, in chunks", async () => {
  // A long session's history (about 6 MB) past what one request to this compactd may hold
  // (5 MiB): ImportSession alone would refuse it, and the session would go unmanaged.
  const capped = await startCompactd(BIN, "capped", ["--max-update-bytes", String(5 << 20)])
  const ses = "ses_long"
  const all = history(ses, 30)
  for (const m of all) if (m.info.role === "assistant") m.parts[0].text = "a line of build output\n".repeat(8600)
  assert.ok(Buffer.byteLength(JSON.stringify(all)) > 5.5 * 2 ** 20)
  const hooks = await hooksFor(() => all, { address: capped.address })
  try {
    const output = { messages: [...all] }
    await hooks["experimental.chat.messages.transform"]({}, output)
    const held = await capped.client.getSession(ses)
    assert.deepEqual(held.messages.map((m) => m.info.id), all.map((m) => m.info.id), "compactd's copy")
    assert.deepEqual(output.messages.map((m) => m.info.id), all.map((m) => m.info.id), "compactd's context is sent")
  } finally {
    await hooks.dispose()
    capped.client.close()
    capped.server.kill("SIGTERM")
  }
})

test("a session compactd refuses to load is not read and sent again before the next user turn", async () => {
  // This compactd holds at most 100,000 bytes per session; the session is ~400 KB. Each
  // load reads OpenCode's whole session and sends it: before, every request of the turn
  // (each step of an agent loop) paid that again, to be refused again.
  const capped = await startCompactd(BIN, "refused", ["--max-session-bytes", "100000"])
  const ses = "ses_refused"
  const all = history(ses, 4)
  for (const m of all) if (m.info.role === "assistant") m.parts[0].text = "a line of build output\n".repeat(4000)
  let reads = 0
  const hooks = await hooksFor(() => (reads++, all), { address: capped.address })
  try {
    const request = async (messages) => {
      const output = { messages: [...messages] }
      await hooks["experimental.chat.messages.transform"]({}, output)
      return output.messages
    }
    // Refused: OpenCode's own messages go out.
    assert.deepEqual(await request(all), all)
    assert.equal(reads, 1)
    // The turn's next steps: not read, not sent.
    assert.deepEqual(await request(all), all)
    assert.deepEqual(await request(all), all)
    assert.equal(reads, 1, "no load again in the same turn")
    // The next user turn tries again.
    const next = history(ses, 5).slice(8, 9)
    assert.equal(next[0].info.role, "user")
    all.push(...next)
    assert.deepEqual(await request(all), all)
    assert.equal(reads, 2, "loaded again at the next turn")
  } finally {
    await hooks.dispose()
    capped.client.close()
    capped.server.kill("SIGTERM")
  }
})

test("a session deleted right after its first message stays deleted in compactd", async () => {
  // The first message opens the session on the plugin's stream; the delete is a call of
  // its own. Before, the delete could reach compactd before the stream's updates, which
  // then made the session again: it stayed in compactd (and on its disk) for good.
  const hooks = await hooksFor(() => [])
  try {
    for (let i = 0; i < 5; i++) {
      const ses = `ses_gone_${i}`
      await hooks.event({ event: { type: "message.updated", properties: { info: history(ses, 1)[0].info } } })
      await hooks.event({ event: { type: "session.deleted", properties: { info: { id: ses } } } })
    }
    // Every update sent before is applied once a later session's update is (one stream,
    // in order).
    const marker = history("ses_gone_marker", 1)[0].info
    await hooks.event({ event: { type: "message.updated", properties: { info: marker } } })
    const by = Date.now() + 15000
    let left = []
    for (;;) {
      const listed = (await client.listSessions()).map((s) => s.id)
      left = listed.filter((id) => id.startsWith("ses_gone_") && id !== "ses_gone_marker")
      if (listed.includes("ses_gone_marker") && left.length === 0) break
      assert.ok(Date.now() < by, `still in compactd after 15 s: ${left.join(", ")}`)
      await new Promise((r) => setTimeout(r, 50))
    }
  } finally {
    await hooks.dispose()
  }
})
