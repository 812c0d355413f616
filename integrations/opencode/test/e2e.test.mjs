// End-to-end: the real OpenCode (opencode-ai from npm, headless `opencode run`) with the
// compactd plugin, against the scripted OpenAI-compatible endpoint, in a throwaway git
// repository. Then the same session with no plugin and with DCP, for the comparison.
//
// Needs COMPACTD_BIN (the compactd binary). Run through ../test.sh.
import { test, before, after } from "node:test"
import assert from "node:assert/strict"
import { spawn } from "node:child_process"
import { mkdtempSync, readFileSync, writeFileSync, rmSync, existsSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { CompactdClient } from "@compactd/client"
import { freePort, startCompactd } from "./compactd.mjs"
import { runSession, summarize, pkgDir } from "./run-session.mjs"
import { startEndpoint, STEP0_COMMAND } from "./scripted-endpoint.mjs"
import { toMessageInfo, toPart, kindOf } from "../dist/convert.js"

const BIN = process.env.COMPACTD_BIN
assert.ok(BIN && existsSync(BIN), `COMPACTD_BIN must name the compactd binary (got ${BIN})`)

// Settings under which compactd acts within this short session: outputs older than the
// newest 3 tool results are masked, and decisions apply at once (no cache to protect).
const E2E_SESSION = { mask_keep: 3, cache_model: "none" }

let server
let client
let address
const runs = {}

before(async () => {
  ;({ server, client, address } = await startCompactd(BIN, "e2e"))
})

after(() => {
  client?.close()
  server?.kill("SIGTERM")
})

// Runs each session (name -> runSession options) into `runs`, at most two at a time
// (OpenCode's runs are CPU-bound and CI has two cores).
async function inTwos(sessions) {
  const queue = Object.entries(sessions)
  const worker = async () => {
    for (let next = queue.shift(); next; next = queue.shift()) runs[next[0]] = await runSession(next[1])
  }
  await Promise.all([worker(), worker()])
}

const contentOf = (m) => (typeof m.content === "string" ? m.content : JSON.stringify(m.content ?? ""))
const toolResult = (req, callId) => req.body.messages.find((m) => m.role === "tool" && m.tool_call_id === callId)

test("OpenCode with the compactd plugin: mirror, compactd's context in the requests, normal finish", async () => {
  const r = await runSession({ mode: "compactd", pluginOptions: { address, session: E2E_SESSION } })
  runs["compactd (mask_keep 3, cache none)"] = r
  const pluginLog = existsSync(join(r.root, "compactd-plugin.log")) ? readFileSync(join(r.root, "compactd-plugin.log"), "utf8") : ""
  const diag = `\n--- plugin log ---\n${pluginLog}\n--- opencode stderr (tail) ---\n${r.stderr.slice(-3000)}`

  // OpenCode finished normally: exit 0, the final answer, the fix in the repository.
  assert.equal(r.exitCode, 0, `opencode exited with ${r.exitCode}${diag}`)
  assert.match(r.stdout, /All 9 tests pass/, `no final answer${diag}`)
  assert.match(readFileSync(join(r.repo, "src/parser.js"), "utf8"), /left\.value - right\.value/)
  const main = r.requests.filter((q) => q.main)
  assert.equal(main.length, 8, `expected the 8 scripted steps, got ${main.length}${diag}`)
  assert.deepEqual(main.map((q) => q.step), [0, 1, 2, 3, 4, 5, 6, 7])
  assert.doesNotMatch(pluginLog, / ERROR /, `plugin logged errors${diag}`)
  assert.equal((pluginLog.match(/sending compactd's context/g) ?? []).length, 8, `the context was not replaced on every request${diag}`)

  // compactd's session mirrors OpenCode's: same messages and parts, in order, with the
  // original content (compactd keeps originals; only its context shortens them).
  assert.ok(r.exported?.messages, `no export: ${JSON.stringify(r.exported)}`)
  const held = await client.getSession(r.sessionId)
  const ours = held.messages
  const theirs = r.exported.messages
  assert.deepEqual(ours.map((m) => m.info.id), theirs.map((m) => m.info.id), "message ids and order")
  for (let i = 0; i < theirs.length; i++) {
    const want = toMessageInfo(theirs[i].info)
    const got = ours[i].info
    assert.equal(got.role, want.role)
    assert.equal(got.parentId, want.parentId)
    assert.equal(got.finish, want.finish, `finish of ${want.id}`)
    assert.equal(got.time.created, want.time.created)
    if (want.role === "assistant") {
      assert.deepEqual(
        { input: got.tokens?.input, output: got.tokens?.output, read: got.tokens?.cache?.read },
        { input: want.tokens.input, output: want.tokens.output, read: want.tokens.cache.read },
        `usage of ${want.id}`,
      )
    }
    const wantParts = theirs[i].parts.map(toPart).filter(Boolean)
    assert.deepEqual(ours[i].parts.map((p) => p.id), wantParts.map((p) => p.id), `parts of ${want.id}`)
    for (let j = 0; j < wantParts.length; j++) {
      const g = ours[i].parts[j]
      const w = wantParts[j]
      assert.equal(kindOf(g), Object.keys(w).find((k) => !["id", "messageId", "extra"].includes(k)), `kind of part ${w.id}`)
      if (w.text) assert.equal(g.text.text, w.text.text)
      if (w.tool) {
        assert.equal(g.tool.callId, w.tool.callId)
        assert.equal(g.tool.tool, w.tool.tool)
        assert.equal(g.tool.state.status, w.tool.state.status)
        assert.equal(g.tool.state.output, w.tool.state.output, `output of ${w.tool.callId}`)
        assert.deepEqual(g.tool.state.input, w.tool.state.input)
      }
    }
  }
  // Usage reached compactd: it predicts from reports.
  assert.ok(held.summary.overflow.used > 0, "no usage reported to compactd")

  // compactd's decisions, and the requests OpenCode sent after them.
  const marks = Object.fromEntries(ours.flatMap((m) => m.parts).filter((p) => p.mark && p.tool).map((p) => [p.tool.callId, p.mark]))
  assert.equal(marks.call_s02_0?.strategy, "supersedeDuplicates", `first test run not superseded: ${JSON.stringify(marks)}`)
  assert.equal(marks.call_s02_0?.supersededBy, "call_s06_0")
  assert.equal(marks.call_s03_0?.strategy, "maskObservations", `lexer read not masked: ${JSON.stringify(marks)}`)
  assert.equal(marks.call_s05_0?.strategy, "capLargeOutputs", `build log not capped: ${JSON.stringify(marks)}`)

  const last = main[main.length - 1]
  // The first test run, repeated later: superseded, its failure text gone.
  const firstRun = contentOf(toolResult(last, "call_s02_0"))
  assert.equal(firstRun, "[Superseded by a newer call: call_s06_0]")
  assert.doesNotMatch(JSON.stringify(last.body.messages), /not ok 2 - subtracts/)
  // The lexer read, older than the newest 3 results: masked, its content gone.
  const lexer = contentOf(toolResult(last, "call_s03_0"))
  assert.match(lexer, /output hidden to save context/)
  assert.match(lexer, /compactd_recall/)
  assert.doesNotMatch(JSON.stringify(last.body.messages), /unexpected character/)
  // The long build log: head and tail only, from the request right after it arrived.
  const buildReq = main.find((q) => q.step === 6)
  const build = contentOf(toolResult(buildReq, "call_s05_0"))
  assert.match(build, /omitted from the middle of this output; call compactd_recall with call_id/)
  assert.doesNotMatch(build, /module_130\.js/)
  assert.match(build, /done: 260 modules/)
  // Once a placeholder went out, no later request carries that output again.
  for (const [callId, text] of [["call_s02_0", "not ok 2 - subtracts"], ["call_s03_0", "unexpected character"], ["call_s05_0", "module_130.js"]]) {
    const firstHidden = main.findIndex((q) => toolResult(q, callId) && !contentOf(toolResult(q, callId)).includes(text))
    assert.ok(firstHidden >= 0, `${callId} was never hidden`)
    for (const q of main.slice(firstHidden)) assert.ok(!contentOf(toolResult(q, callId)).includes(text), `${callId} came back in request ${q.index}`)
  }
  // The recall tool is offered to the model.
  assert.ok(last.body.tools.some((t) => t.function.name === "compactd_recall"), "compactd_recall not registered")
  // OpenCode's own storage still holds every original output.
  const stored = theirs.flatMap((m) => m.parts).find((p) => p.callID === "call_s02_0")
  assert.match(stored.state.output, /not ok 2 - subtracts/)
})

test("the model calls compactd_recall through OpenCode and gets the hidden output back", async () => {
  const r = await runSession({ mode: "compactd", recall: true, pluginOptions: { address, session: E2E_SESSION } })
  const pluginLog = readFileSync(join(r.root, "compactd-plugin.log"), "utf8")
  assert.equal(r.exitCode, 0, pluginLog)
  const main = r.requests.filter((q) => q.main)
  assert.deepEqual(main.map((q) => q.step), [0, 1, 2, 3, 4, 5, 6, 7, 8])
  // The first test run reads superseded in the context, and the recall brings it back.
  const last = main[main.length - 1]
  assert.equal(contentOf(toolResult(last, "call_s02_0")), "[Superseded by a newer call: call_s06_0]")
  const recalled = contentOf(toolResult(last, "call_s07_0"))
  assert.match(recalled, /^bash call call_s02_0 \(completed\)/)
  assert.match(recalled, /not ok 2 - subtracts/)
})

test('compaction "compactd": OpenCode\'s own is off, compactd summarizes and the requests carry its summary', async () => {
  // A small window so the session crosses it, and a summarizer endpoint for compactd (the
  // scripted endpoint answers a request without tools with a short text).
  const summarizerLog = join(mkdtempSync(join(tmpdir(), "summarizer-")), "requests.jsonl")
  writeFileSync(summarizerLog, "")
  const summarizer = await startEndpoint({ log: summarizerLog, numberReplies: true })
  const r = await runSession({
    mode: "compactd",
    pluginOptions: {
      binary: BIN,
      compaction: "compactd",
      llmBaseUrl: `http://127.0.0.1:${summarizer.address().port}/v1`,
      llmModel: "summarizer",
      limits: { context: 11000, output: 1000 },
      session: { cache_model: "none" },
    },
  })
  summarizer.close()
  const pluginLog = readFileSync(join(r.root, "compactd-plugin.log"), "utf8")
  const diag = `\n--- plugin log ---\n${pluginLog}`
  assert.equal(r.exitCode, 0, diag)
  const main = r.requests.filter((q) => q.main)
  assert.deepEqual(main.map((q) => q.step), [0, 1, 2, 3, 4, 5, 6, 7], diag)
  assert.match(pluginLog, /compactd compacted session/, diag)
  assert.doesNotMatch(pluginLog, / ERROR /, diag)
  const summarized = readFileSync(summarizerLog, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l))
  assert.ok(summarized.length >= 1, "compactd never called its summarizer")
  // The summaries that cover step 0: their summarizer read its call, or folded (as the
  // earlier conversation, or an earlier chunk) a summary that did.
  const covering = new Set()
  for (const s of summarized) {
    const read = s.body.messages.map(contentOf).join("\n")
    if (read.includes(STEP0_COMMAND) || [...covering].some((c) => read.includes(c))) covering.add(s.reply)
  }
  const summaryIn = (q) => q.body.messages.find((m) => m.role === "assistant" && /^Fix tinycalc subtraction \(summary \d+\)$/.test(contentOf(m)))
  const trace = main.map((q) => `step ${q.step}: ${q.prompt_tokens} tokens, ${summaryIn(q) ? contentOf(summaryIn(q)) : "no summary"}${toolResult(q, "call_s00_0") ? ", step 0's output" : ""}`)
  const diagAll = `\n--- main requests ---\n${trace.join("\n")}\n--- covering step 0: ${[...covering].join("; ") || "none"}${diag}`
  const i = main.findIndex(summaryIn)
  assert.ok(i > 0, `no request carries compactd's summary${diagAll}`)
  // compactd's first summary may replace little: the session is one user turn, and with
  // little outside its verbatim tail (25% of the usable input) the first compaction may
  // leave step 0 in the tail; a later one, once the tail has moved on, summarizes it. A
  // request carrying a summary of step 0 never carries step 0's output, a later compaction
  // shrinks the request, and every request fits the window (11,000 less 1,000).
  const afterStep0 = main.filter((q) => summaryIn(q) && covering.has(contentOf(summaryIn(q))))
  assert.ok(afterStep0.length >= 1, `no request carries a summary of step 0${diagAll}`)
  for (const q of afterStep0) assert.equal(toolResult(q, "call_s00_0"), undefined, `request ${q.step} carries a summary of step 0 and its output${diagAll}`)
  assert.ok(main.slice(i).some((q) => q.prompt_tokens < main[main.indexOf(q) - 1].prompt_tokens), `no request after a compaction is smaller${diagAll}`)
  for (const q of main) assert.ok(q.prompt_tokens <= 10000, `request ${q.step}: ${q.prompt_tokens} prompt tokens, past the window${diagAll}`)
  // Messages OpenCode wrote after the first compaction are sent after the summary.
  assert.ok(i + 1 < main.length, `the first compaction came before the last request${diagAll}`)
  const next = main[i + 1]
  assert.ok(toolResult(next, `call_s0${next.step - 1}_0`), `the newest tool result is missing after the compaction${diagAll}`)
  // OpenCode did not compact on its own.
  assert.ok(!r.exported.messages.some((m) => m.parts.some((p) => p.type === "compaction")), "OpenCode compacted too")
})

test("OpenCode's own compaction (the default): mirrored, and compactd's context starts at it", async () => {
  const r = await runSession({ mode: "compactd", modelLimits: { context: 10500, output: 1000 }, pluginOptions: { address } })
  const pluginLog = readFileSync(join(r.root, "compactd-plugin.log"), "utf8")
  const diag = `\n--- plugin log ---\n${pluginLog}`
  assert.equal(r.exitCode, 0, diag)
  // OpenCode may compact more than once in the small window (runs differ): the context
  // starts at the newest compaction.
  const compaction = r.exported.messages.filter((m) => m.parts.some((p) => p.type === "compaction")).at(-1)
  assert.ok(compaction, "OpenCode did not compact (the window is meant to force it)")
  assert.match(pluginLog, new RegExp(`from compaction ${compaction.info.id}`), diag)
  const held = await client.getSession(r.sessionId)
  assert.deepEqual(held.messages.map((m) => m.info.id), r.exported.messages.map((m) => m.info.id))
  const ctx = await client.getContext(r.sessionId, "native")
  assert.equal(ctx.boundaryMessageId, compaction.info.id)
  // After the compaction: OpenCode's summary, none of the summarized outputs.
  const main = r.requests.filter((q) => q.main)
  const after = main.filter((q) => q.body.messages.some((m) => contentOf(m).includes("What did we do so far?")))
  assert.ok(after.length >= 1, diag)
  for (const q of after) assert.equal(toolResult(q, "call_s00_0"), undefined)
  assert.deepEqual(main.map((q) => q.step), [0, 1, 2, 3, 4, 5, 6, 7])
  // OpenCode's summarizer (no tools) read OpenCode's own messages: the transform OpenCode
  // runs over them after experimental.session.compacting was left alone, and every model
  // request got compactd's context.
  const compactions = r.exported.messages.filter((m) => m.parts.some((p) => p.type === "compaction")).length
  assert.equal((pluginLog.match(/OpenCode is compacting; its summarizer gets OpenCode's own/g) ?? []).length, compactions, diag)
  assert.equal((pluginLog.match(/sending compactd's context/g) ?? []).length, main.length, diag)
})

test("compactd unreachable at start: the plugin stands aside, OpenCode runs as without it", async () => {
  const port = await freePort() // nothing listens there
  const r = await runSession({ mode: "compactd", pluginOptions: { address: `127.0.0.1:${port}`, timeoutMs: 2000 } })
  const pluginLog = readFileSync(join(r.root, "compactd-plugin.log"), "utf8")
  assert.equal(r.exitCode, 0, pluginLog)
  assert.equal(r.requests.filter((q) => q.main).length, 8)
  assert.match(pluginLog, /compactd plugin disabled: compactd is not available/)
})

test("compactd dies mid-session: OpenCode's own messages are sent, the session finishes", async () => {
  const port = await freePort()
  const addr = `127.0.0.1:${port}`
  const dataDir = mkdtempSync(join(tmpdir(), "compactd-e2e-dying-"))
  const dying = spawn(BIN, ["serve", "--listen", addr, "--data-dir", dataDir], { stdio: "ignore" })
  const c = new CompactdClient({ address: addr })
  await c.waitForReady(15000)
  c.close()
  let killed = false
  const r = await runSession({
    mode: "compactd",
    pluginOptions: { address: addr, session: E2E_SESSION, timeoutMs: 3000 },
    onRequest: async ({ main, step }) => {
      if (main && step === 4 && !killed) {
        killed = true
        dying.kill("SIGKILL")
        await new Promise((res) => dying.once("exit", res))
      }
    },
  })
  rmSync(dataDir, { recursive: true, force: true })
  const pluginLog = readFileSync(join(r.root, "compactd-plugin.log"), "utf8")
  assert.ok(killed)
  assert.equal(r.exitCode, 0, pluginLog)
  const main = r.requests.filter((q) => q.main)
  assert.equal(main.length, 8, pluginLog)
  assert.match(pluginLog, /context not replaced \(OpenCode's own messages are sent\)/)
  // After the fall back, the first test run goes out whole again.
  assert.match(contentOf(toolResult(main[7], "call_s02_0")), /not ok 2 - subtracts/)
})

test("comparison: no plugin, DCP, compactd, in a 64k window and in a 10.5k one", async () => {
  const tight = { context: 10500, output: 1000 }
  // Each run has its own endpoint, repository, OpenCode home and (for compactd) sidecar,
  // and what it measures is counted from its requests, not timed: two at a time.
  await inTwos({
    "none": { mode: "none" },
    "dcp": { mode: "dcp" },
    "compactd (defaults)": { mode: "compactd", pluginOptions: { binary: BIN } },
    "compactd (mask_keep 3)": { mode: "compactd", pluginOptions: { binary: BIN, session: { mask_keep: 3 } } },
    "none, 10.5k window": { mode: "none", modelLimits: tight },
    "dcp, 10.5k window": { mode: "dcp", modelLimits: tight },
    "compactd (defaults), 10.5k window": { mode: "compactd", modelLimits: tight, pluginOptions: { binary: BIN } },
  })
  const order = ["none", "dcp", "compactd (defaults)", "compactd (mask_keep 3)", "compactd (mask_keep 3, cache none)", "none, 10.5k window", "dcp, 10.5k window", "compactd (defaults), 10.5k window"]
  const compactions = (r) => (r.exported?.messages ?? []).filter((m) => m.parts.some((p) => p.type === "compaction")).length
  const rows = order
    .filter((k) => runs[k])
    .map((k) => ({ run: k, exit: runs[k].exitCode, seconds: runs[k].seconds, opencode_compactions: compactions(runs[k]), ...summarize(runs[k].requests) }))
  const pct = (a, b) => `${a >= b ? "+" : ""}${(((a - b) / b) * 100).toFixed(1)}%`
  const baseOf = (x) => rows.find((y) => y.run === (x.run.endsWith("10.5k window") ? "none, 10.5k window" : "none"))
  const lines = [
    "| run | requests | prompt tokens | vs none | last prompt | cost, anthropic | vs none | cost, openai | vs none | cache breaks | OpenCode compactions | other requests (tokens) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ...rows.map((x) => {
      const b = baseOf(x)
      return `| ${x.run} | ${x.requests} | ${x.prompt_tokens} | ${pct(x.prompt_tokens, b.prompt_tokens)} | ${x.last_prompt_tokens} | ${x.cost_anthropic} | ${pct(x.cost_anthropic, b.cost_anthropic)} | ${x.cost_openai} | ${pct(x.cost_openai, b.cost_openai)} | ${x.cache_breaks} | ${x.opencode_compactions} | ${x.other_requests} (${x.other_prompt_tokens}) |`
    }),
  ]
  console.log(`\n${lines.join("\n")}\n`)
  writeFileSync(join(pkgDir, ".tmp-comparison.json"), JSON.stringify(rows, null, 2))
  for (const x of rows) {
    assert.equal(x.exit, 0, `${x.run}: opencode exited with ${x.exit}`)
    assert.equal(x.requests, 8, `${x.run}: ${x.requests} requests`)
  }
  const aggressive = rows.find((x) => x.run.startsWith("compactd (mask"))
  assert.ok(aggressive.prompt_tokens < rows[0].prompt_tokens, "compactd sent no fewer prompt tokens than no plugin")
})
