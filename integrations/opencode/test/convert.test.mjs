// The OpenCode <-> compactd mapping, without OpenCode or compactd.
import { test } from "node:test"
import assert from "node:assert/strict"
import { toMessageInfo, toPart, toOpenCodeMessages, kindOf } from "../dist/convert.js"
import { leavesInput, resolveSettings, sessionConfig } from "../dist/options.js"

const user = { id: "msg_1", sessionID: "ses", role: "user", time: { created: 1 }, agent: "build", model: { providerID: "p", modelID: "m" }, summary: { diffs: [] } }
const assistant = {
  id: "msg_2", sessionID: "ses", role: "assistant", parentID: "msg_1", time: { created: 2, completed: 3 }, modelID: "m", providerID: "p",
  mode: "build", agent: "build", path: { cwd: "/r", root: "/r" }, cost: 0, finish: "tool-calls",
  tokens: { input: 100, output: 20, reasoning: 0, cache: { read: 50, write: 0 } },
}
const tool = {
  id: "prt_3", sessionID: "ses", messageID: "msg_2", type: "tool", callID: "call_1", tool: "bash",
  state: { status: "completed", input: { command: "ls" }, output: "a\nb", title: "ls", metadata: { exit: 0 }, time: { start: 5, end: 6 } },
}

test("message info: typed fields, the rest in extra", () => {
  const u = toMessageInfo(user)
  assert.deepEqual(u.model, { providerId: "p", modelId: "m" })
  assert.deepEqual(u.extra, { summary: { diffs: [] } })
  const a = toMessageInfo(assistant)
  assert.equal(a.parentId, "msg_1")
  assert.equal(a.finish, "tool-calls")
  assert.deepEqual(a.tokens, { input: 100, output: 20, reasoning: 0, cache: { read: 50, write: 0 } })
  assert.deepEqual(a.time, { created: 2, completed: 3 })
  assert.deepEqual(a.extra, { path: { cwd: "/r", root: "/r" } })
})

test("usage with reasoning: compactd's output counts it, OpenCode's does not", () => {
  // OpenCode 1.18.33's getUsage stores output = the provider's output less its reasoning,
  // reasoning apart, total as the provider gave it (reasoning within). compactd takes
  // reasoning within output, and the prompt a total reports as total - output.
  const tokens = { total: 15000, input: 4000, output: 1000, reasoning: 4000, cache: { read: 6000, write: 0 } }
  const a = toMessageInfo({ ...assistant, tokens })
  assert.deepEqual(a.tokens, { total: 15000, input: 4000, output: 5000, reasoning: 4000, cache: { read: 6000, write: 0 } })
  assert.equal(a.tokens.total - a.tokens.output, tokens.input + tokens.cache.read, "the prompt compactd reads")
  const step = toPart({ id: "prt_9", sessionID: "ses", messageID: "msg_2", type: "step-finish", reason: "stop", cost: 0, tokens })
  assert.equal(step.stepFinish.tokens.output, 5000)
  // OpenCode 1.2 kept reasoning within output (its total = input + cache + output, as in
  // tests/data/traces): taken as given, or the prompt would read short by the reasoning.
  const old = { total: 15459, input: 15338, output: 121, reasoning: 101, cache: { read: 0, write: 0 } }
  const b = toMessageInfo({ ...assistant, tokens: old })
  assert.equal(b.tokens.output, 121)
  assert.equal(b.tokens.total - b.tokens.output, old.input, "the prompt compactd reads")
})

test("parts: every OpenCode kind maps; unknown kinds are skipped", () => {
  const p = toPart(tool)
  assert.equal(p.messageId, "msg_2")
  assert.deepEqual(p.tool.state.input, { command: "ls" })
  assert.equal(p.tool.state.output, "a\nb")
  assert.equal(toPart({ id: "x", messageID: "m", type: "step-start" }).stepStart.snapshot, "")
  assert.equal(toPart({ id: "x", messageID: "m", type: "compaction", auto: true }).compaction.auto, true)
  assert.equal(toPart({ id: "x", messageID: "m", type: "something-new" }), null)
})

test("context back to OpenCode: compactd's rendering over OpenCode's own objects", () => {
  const known = new Map([
    ["msg_1", { info: user, parts: [{ id: "prt_1", sessionID: "ses", messageID: "msg_1", type: "text", text: "hi" }] }],
    ["msg_2", { info: assistant, parts: [{ id: "prt_2", sessionID: "ses", messageID: "msg_2", type: "step-start" }, { ...tool, state: { ...tool.state, time: { start: 5, end: 6, compacted: 9 } } }] }],
  ])
  const context = [
    { info: { id: "msg_1", role: "user" }, parts: [{ id: "prt_1", messageId: "msg_1", text: { text: "hi" } }] },
    {
      info: { id: "msg_2", role: "assistant" },
      parts: [{ id: "prt_3", messageId: "msg_2", tool: { callId: "call_1", tool: "bash", state: { status: "completed", input: { command: "ls" }, output: "[Old tool result content cleared]", attachments: [], time: { start: 5, end: 6, compacted: 9 } } } }],
    },
    { info: { id: "cmp_1", role: "user", time: { created: 7 } }, parts: [{ id: "cmp_1p", messageId: "cmp_1", text: { text: "summary follows" } }] },
  ]
  const out = toOpenCodeMessages(context, known, "ses")
  assert.equal(out.length, 3)
  assert.equal(out[0].info, user) // OpenCode's own info object
  assert.equal(out[1].parts.length, 1) // the step marker compactd did not send
  const t = out[1].parts[0]
  assert.equal(t.state.output, "[Old tool result content cleared]")
  assert.equal(t.state.time.compacted, undefined) // OpenCode must send compactd's text
  assert.equal(t.state.title, "ls")
  assert.equal(tool.state.output, "a\nb") // OpenCode's objects are not changed
  assert.equal(out[2].info.sessionID, "ses") // a message compactd made
  assert.equal(out[2].info.agent, "build")
  assert.equal(out[2].parts[0].type, "text")
  assert.equal(kindOf(context[1].parts[0]), "tool")
})

test("session settings: snake_case or camelCase, lists and enums by short name", () => {
  assert.deepEqual(sessionConfig({ mask_keep: 3, cacheModel: "none", protected_tools: ["skill"], preset: "opencode" }), {
    maskKeep: 3,
    cacheModel: "none",
    protectedTools: { values: ["skill"] },
    preset: "OVERFLOW_PRESET_OPENCODE",
  })
})

test("a session key compactd's SessionConfig lacks fails at start, named; snake_case and camelCase keys pass", () => {
  assert.throws(() => resolveSettings({ session: { treshold: 0.8 } }), /session setting.*no field "treshold"; its fields are autoCompact/)
  const saved = process.env.COMPACTD_OPENCODE_SESSION
  process.env.COMPACTD_OPENCODE_SESSION = JSON.stringify({ protect_turn: 2 })
  try {
    assert.throws(() => resolveSettings({}), /COMPACTD_OPENCODE_SESSION.*no field "protectTurn"/)
  } finally {
    if (saved === undefined) delete process.env.COMPACTD_OPENCODE_SESSION
    else process.env.COMPACTD_OPENCODE_SESSION = saved
  }
  const ok = resolveSettings({ session: { protect_turns: 2, maskKeep: 5, preset: "opencode" } })
  assert.deepEqual(ok.session, { protect_turns: 2, maskKeep: 5, preset: "opencode" })
})

test("limits that leave compactd no input are told apart (and refused as the plugin's own limits)", () => {
  assert.equal(leavesInput({ context: 8192, output: 8192 }), false)
  assert.equal(leavesInput({ context: 16384 }), false, "32000 reserved when output is 0")
  assert.equal(leavesInput({ context: 8192, output: 1024 }), true)
  assert.equal(leavesInput({ context: 8192, input: 6000, output: 8192 }), true)
  assert.equal(leavesInput({ context: 0, output: 4096 }), true, "no window")
  assert.equal(leavesInput({ context: 200000, output: 64000 }), true)
  assert.throws(() => resolveSettings({ limits: { context: 8192, output: 8192 } }), /limits .* leave no input/)
  assert.deepEqual(resolveSettings({ limits: { context: 8192, output: 1024 } }).limits, { context: 8192, output: 1024 })
  assert.equal(resolveSettings({}).limits, undefined)
})

test("maxSessions and timeoutMs: defaults, a positive integer or a clear error", () => {
  assert.equal(resolveSettings({}).maxSessions, 256)
  assert.equal(resolveSettings({}).timeoutMs, 15000)
  // NaN would make every ack wait time out at once.
  assert.throws(() => resolveSettings({ timeoutMs: "15s" }), /timeoutMs must be a positive integer, not "15s"/)
  assert.equal(resolveSettings({ maxSessions: "8" }).maxSessions, 8)
  for (const bad of [0, -1, 1.5, "many"]) {
    assert.throws(() => resolveSettings({ maxSessions: bad }), /maxSessions must be a positive integer/)
  }
})

test("COMPACTD_OPENCODE_SERVER_ARGS that is not JSON is named, its value (which may hold a key) not shown", () => {
  const saved = process.env.COMPACTD_OPENCODE_SERVER_ARGS
  // Written as a shell line, not JSON: JSON.parse's own message quotes the text.
  process.env.COMPACTD_OPENCODE_SERVER_ARGS = "--llm-api-key sk-plugin-test-SECRET"
  try {
    assert.throws(
      () => resolveSettings({}),
      (e) => /COMPACTD_OPENCODE_SERVER_ARGS is not JSON/.test(e.message) && !e.message.includes("sk-plugin") && !String(e.stack).includes("sk-plugin"),
    )
  } finally {
    if (saved === undefined) delete process.env.COMPACTD_OPENCODE_SERVER_ARGS
    else process.env.COMPACTD_OPENCODE_SERVER_ARGS = saved
  }
})
