// A scripted OpenAI-compatible endpoint (chat.completions, SSE streaming, tool calls).
//
// It plays one realistic tool-using coding session, whatever model OpenCode asks for:
// look around, read files, run the failing tests, read more, fix the bug, run a build
// whose log is long, run the same tests again, answer. The step to play comes from the
// newest tool result in the request (its call id names the step), so a host that
// rewrites or drops older messages (compactd, DCP) still gets the right next step.
// Requests without tools (OpenCode's title agent) get a short title; with `numberReplies`
// (a summarizer's endpoint) the title is numbered, so a summary in a later request names
// the summarizer request that wrote it.
//
// Every request is recorded (one JSON line: the body, the reply's text, prompt tokens
// counted with o200k_base, the cached prefix) and the stream ends with OpenAI usage (prompt,
// completion, cached tokens), so OpenCode records usage like with a real provider.
//
//   node scripted-endpoint.mjs --log requests.jsonl [--port 0] [--workdir DIR]
// prints "listening on PORT" once ready.
import { createServer } from "node:http"
import { appendFileSync } from "node:fs"
import { Tiktoken } from "js-tiktoken/lite"
import o200k from "js-tiktoken/ranks/o200k_base"
import { PARSER_BUG, PARSER_FIX } from "./fixture.mjs"

const enc = new Tiktoken(o200k)
export const countTokens = (text) => (text ? enc.encode(text, "all").length : 0)

// Tokens of one chat message as a provider would count it (content, tool calls, role).
export function messageTokens(m) {
  let n = 4
  if (typeof m.content === "string") n += countTokens(m.content)
  else if (Array.isArray(m.content)) for (const c of m.content) n += countTokens(c.text ?? JSON.stringify(c))
  for (const call of m.tool_calls ?? []) n += countTokens(call.function?.name) + countTokens(call.function?.arguments) + 4
  if (m.tool_call_id) n += countTokens(m.tool_call_id)
  return n
}

// Step 0's command (a summarizer that read it summarized step 0).
export const STEP0_COMMAND = "git status --short && ls -R src test"

// The session. Each step is what the model "writes" after the previous step's results.
function script(workdir, recall = false) {
  const p = (rel) => `${workdir}/${rel}`
  const steps = [
    {
      text: "I'll start by looking at the repository layout.",
      calls: [{ name: "bash", args: { command: STEP0_COMMAND, description: "Show repository layout" } }],
    },
    {
      text: "Let me read the parser and its tests.",
      calls: [
        { name: "read", args: { filePath: p("src/parser.js") } },
        { name: "read", args: { filePath: p("test/parser.test.js") } },
      ],
    },
    {
      text: "Now I'll run the test suite to see what fails.",
      calls: [{ name: "bash", args: { command: "node --test test/", description: "Run the tests" } }],
    },
    {
      text: "Subtraction fails. Let me check the lexer too before changing the parser.",
      calls: [{ name: "read", args: { filePath: p("src/lexer.js") } }],
    },
    {
      text: "The lexer is fine; the parser adds where it should subtract. Fixing it.",
      calls: [{ name: "edit", args: { filePath: p("src/parser.js"), oldString: PARSER_BUG, newString: PARSER_FIX } }],
    },
    {
      text: "Let me make sure the build still passes.",
      calls: [{ name: "bash", args: { command: "bash build.sh", description: "Build the project" } }],
    },
    {
      text: "The build passes. Running the tests again.",
      calls: [{ name: "bash", args: { command: "node --test test/", description: "Run the tests" } }],
    },
    {
      text:
        "Fixed: `expr()` in `src/parser.js` computed `left.value + right.value` for `-`; it now subtracts. " +
        "All 9 tests pass and the build succeeds (260 modules, 11 warnings, 0 errors).",
      calls: [],
    },
  ]
  // With `recall`: before answering, ask compactd for the first test run back.
  if (recall) {
    steps.splice(steps.length - 1, 0, {
      text: "Let me compare with the first test run's failures.",
      calls: [{ name: "compactd_recall", args: { call_id: "call_s02_0" } }],
    })
  }
  return steps
}

const callId = (step, k) => `call_s${String(step).padStart(2, "0")}_${k}`
const stepOfCallId = (id) => {
  const m = /^call_s(\d+)_\d+$/.exec(id ?? "")
  return m ? Number(m[1]) : -1
}

// The step to play: one after the step of the newest tool result we scripted.
function nextStep(messages) {
  for (let i = messages.length - 1; i >= 0; i--) {
    const m = messages[i]
    if (m.role === "tool") {
      const s = stepOfCallId(m.tool_call_id)
      if (s >= 0) return s + 1
    }
    if (m.role === "assistant") for (const c of m.tool_calls ?? []) {
      const s = stepOfCallId(c.id)
      if (s >= 0) return s + 1
    }
    if (m.role === "user") break
  }
  return 0
}

function workdirOf(body, fallback) {
  for (const m of body.messages ?? []) {
    if (m.role !== "system") continue
    const text = typeof m.content === "string" ? m.content : (m.content ?? []).map((c) => c.text ?? "").join("\n")
    const match = /Working directory: (\S+)/.exec(text)
    if (match) return match[1]
  }
  return fallback
}

export function startEndpoint({ port = 0, log, workdir = process.cwd(), delayMs = 0, onRequest, recall = false, numberReplies = false } = {}) {
  let previous = null // the previous main request's messages, serialized, for the cached prefix
  let requestIndex = 0
  let untooled = 0 // requests without tools so far, for numberReplies
  let lastPlayed = -1
  const server = createServer((req, res) => {
    let raw = ""
    req.on("data", (c) => (raw += c))
    req.on("end", async () => {
      if (req.method === "GET" && req.url.endsWith("/models")) {
        res.writeHead(200, { "content-type": "application/json" })
        res.end(JSON.stringify({ object: "list", data: [{ id: "scripted", object: "model" }] }))
        return
      }
      if (req.method !== "POST" || !req.url.endsWith("/chat/completions")) {
        res.writeHead(404).end()
        return
      }
      let body
      try {
        body = JSON.parse(raw)
      } catch {
        res.writeHead(400).end("bad json")
        return
      }
      const index = requestIndex++
      const main = Array.isArray(body.tools) && body.tools.length > 0
      const messages = body.messages ?? []
      const serialized = messages.map((m) => JSON.stringify(m))
      const perMessage = messages.map(messageTokens)
      const toolsTokens = main ? countTokens(JSON.stringify(body.tools)) : 0
      const promptTokens = toolsTokens + perMessage.reduce((a, b) => a + b, 0)
      // Cached: tools plus the leading messages identical to the previous main request's.
      let cached = 0
      if (main && previous) {
        cached = previous.toolsJson === JSON.stringify(body.tools) ? toolsTokens : 0
        if (cached > 0) {
          for (let i = 0; i < serialized.length && i < previous.serialized.length; i++) {
            if (serialized[i] !== previous.serialized[i]) break
            cached += perMessage[i]
          }
        }
      }
      let step = -1
      let reply
      if (main) {
        step = nextStep(messages)
        // No scripted tool result in the request: a compaction summarized them. Go on
        // from the last step played (the host kept the session going on a summary).
        if (step === 0 && lastPlayed >= 0) step = lastPlayed + 1
        lastPlayed = step
        const steps = script(workdirOf(body, workdir), recall && body.tools.some((t) => t.function?.name === "compactd_recall"))
        reply = steps[Math.min(step, steps.length - 1)]
        previous = { serialized, toolsJson: JSON.stringify(body.tools) }
      } else {
        untooled += 1
        reply = { text: numberReplies ? `Fix tinycalc subtraction (summary ${untooled})` : "Fix tinycalc subtraction", calls: [] }
      }
      const completionText = reply.text + reply.calls.map((c) => c.name + JSON.stringify(c.args)).join("")
      const usage = {
        prompt_tokens: promptTokens,
        completion_tokens: countTokens(completionText) + 4 * reply.calls.length,
        total_tokens: 0,
        prompt_tokens_details: { cached_tokens: cached },
      }
      usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
      if (log) {
        appendFileSync(
          log,
          JSON.stringify({ index, time: Date.now(), main, step, reply: reply.text, prompt_tokens: promptTokens, cached_tokens: cached, tools_tokens: toolsTokens, message_tokens: perMessage, usage, body }) + "\n",
        )
      }
      if (onRequest) await onRequest({ index, main, step })
      if (delayMs) await new Promise((r) => setTimeout(r, delayMs))
      if (!body.stream) {
        res.writeHead(200, { "content-type": "application/json" })
        res.end(
          JSON.stringify({
            id: `chatcmpl-${index}`,
            object: "chat.completion",
            created: Math.floor(Date.now() / 1000),
            model: body.model,
            choices: [
              {
                index: 0,
                message: {
                  role: "assistant",
                  content: reply.text,
                  tool_calls: reply.calls.length
                    ? reply.calls.map((c, k) => ({ id: callId(step, k), type: "function", function: { name: c.name, arguments: JSON.stringify(c.args) } }))
                    : undefined,
                },
                finish_reason: reply.calls.length ? "tool_calls" : "stop",
              },
            ],
            usage,
          }),
        )
        return
      }
      res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache", connection: "keep-alive" })
      const base = { id: `chatcmpl-${index}`, object: "chat.completion.chunk", created: Math.floor(Date.now() / 1000), model: body.model }
      const send = (choice, extra = {}) => res.write(`data: ${JSON.stringify({ ...base, choices: choice ? [choice] : [], ...extra })}\n\n`)
      send({ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null })
      // The text in a few deltas, as a model streams it.
      const words = reply.text.split(/(?<= )/)
      const chunk = Math.max(1, Math.ceil(words.length / 4))
      for (let i = 0; i < words.length; i += chunk) send({ index: 0, delta: { content: words.slice(i, i + chunk).join("") }, finish_reason: null })
      reply.calls.forEach((c, k) => {
        const args = JSON.stringify(c.args)
        send({ index: 0, delta: { tool_calls: [{ index: k, id: callId(step, k), type: "function", function: { name: c.name, arguments: "" } }] }, finish_reason: null })
        const half = Math.ceil(args.length / 2)
        send({ index: 0, delta: { tool_calls: [{ index: k, function: { arguments: args.slice(0, half) } }] }, finish_reason: null })
        send({ index: 0, delta: { tool_calls: [{ index: k, function: { arguments: args.slice(half) } }] }, finish_reason: null })
      })
      send({ index: 0, delta: {}, finish_reason: reply.calls.length ? "tool_calls" : "stop" })
      send(null, { usage })
      res.write("data: [DONE]\n\n")
      res.end()
    })
  })
  return new Promise((resolve) => server.listen(port, "127.0.0.1", () => resolve(server)))
}

if (import.meta.url === `file://${process.argv[1]}` && !process.env.NODE_TEST_CONTEXT) {
  const arg = (name, dflt) => {
    const i = process.argv.indexOf(`--${name}`)
    return i > 0 ? process.argv[i + 1] : dflt
  }
  const server = await startEndpoint({ port: Number(arg("port", 0)), log: arg("log"), workdir: arg("workdir", process.cwd()) })
  console.log(`listening on ${server.address().port}`)
}
