// Runs the real OpenCode headless (`opencode run`) once against the scripted endpoint,
// in a fresh throwaway git repository with its own HOME / XDG dirs (nothing leaks
// between runs), and returns what happened: the requests OpenCode sent, the session
// export, OpenCode's output and exit code.
//
// mode: "none" (no plugin), "dcp" (@tarquinen/opencode-dcp) or "compactd" (this plugin).
import { spawn, execFileSync } from "node:child_process"
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join, dirname, resolve } from "node:path"
import { fileURLToPath, pathToFileURL } from "node:url"
import { createFixture } from "./fixture.mjs"
import { startEndpoint } from "./scripted-endpoint.mjs"

const here = dirname(fileURLToPath(import.meta.url))
export const pkgDir = resolve(here, "..")
export const opencodeBin = join(pkgDir, "node_modules", ".bin", "opencode")
export const PROMPT = "The tests in this repository fail. Find and fix the bug, and make sure the build still passes."
export const MODEL_LIMITS = { context: 64000, output: 8000 }

function run(cmd, args, opts) {
  return new Promise((resolvePromise) => {
    const child = spawn(cmd, args, { ...opts, stdio: ["ignore", "pipe", "pipe"] })
    let stdout = ""
    let stderr = ""
    child.stdout.on("data", (d) => (stdout += d))
    child.stderr.on("data", (d) => (stderr += d))
    const timer = setTimeout(() => child.kill("SIGKILL"), opts.timeoutMs ?? 180000)
    child.on("close", (code, signal) => {
      clearTimeout(timer)
      resolvePromise({ code, signal, stdout, stderr })
    })
  })
}

// Prompt tokens, requests and cost of the main agent's requests. Requests without tools
// (OpenCode's title request, the same in every run, and OpenCode's own compaction
// request) are counted apart, in other_requests / other_prompt_tokens.
// Cost in fresh-token units, as compactd's replay computes it: the prefix a request
// shares with the previous one is read from cache, the rest is written.
export function summarize(requests) {
  const main = requests.filter((r) => r.main)
  const sum = (f) => main.reduce((a, r) => a + f(r), 0)
  const prompt = sum((r) => r.prompt_tokens)
  const cached = sum((r) => r.cached_tokens)
  const fresh = prompt - cached
  return {
    requests: main.length,
    other_requests: requests.length - main.length,
    other_prompt_tokens: requests.filter((r) => !r.main).reduce((a, r) => a + r.prompt_tokens, 0),
    prompt_tokens: prompt,
    cached_tokens: cached,
    last_prompt_tokens: main.length ? main[main.length - 1].prompt_tokens : 0,
    cost_anthropic: Math.round(fresh * 1.25 + cached * 0.1),
    cost_openai: Math.round(fresh * 1.0 + cached * 0.1),
    cache_breaks: main.filter((r, i) => i > 0 && r.cached_tokens < main[i - 1].prompt_tokens).length,
  }
}

export async function runSession({ mode = "none", pluginOptions = {}, env = {}, timeoutMs = 180000, root, onRequest, modelLimits = MODEL_LIMITS, recall = false } = {}) {
  root ??= mkdtempSync(join(tmpdir(), `oc-${mode}-`))
  const home = join(root, "home")
  const repo = join(root, "repo")
  mkdirSync(home, { recursive: true })
  mkdirSync(repo, { recursive: true })
  createFixture(repo)
  const log = join(root, "requests.jsonl")
  writeFileSync(log, "")
  const server = await startEndpoint({ log, workdir: repo, onRequest, recall })
  const port = server.address().port
  const plugin = []
  if (mode === "dcp") plugin.push(pathToFileURL(join(pkgDir, "node_modules", "@tarquinen", "opencode-dcp", "dist", "index.js")).href)
  if (mode === "compactd") {
    const options = { binary: process.env.COMPACTD_BIN ?? "compactd", logFile: join(root, "compactd-plugin.log"), ...pluginOptions }
    plugin.push([pathToFileURL(resolve(pkgDir, process.env.PLUGIN_ENTRY ?? "dist/index.js")).href, options])
  }
  const config = {
    $schema: "https://opencode.ai/config.json",
    provider: {
      scripted: {
        npm: "@ai-sdk/openai-compatible",
        name: "Scripted",
        options: { baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "none", includeUsage: true },
        models: { "scripted-model": { name: "Scripted", limit: modelLimits, tool_call: true } },
      },
    },
    model: "scripted/scripted-model",
    small_model: "scripted/scripted-model",
    autoupdate: false,
    share: "disabled",
    permission: { edit: "allow", bash: "allow", external_directory: "allow" },
    plugin,
  }
  const configPath = join(root, "opencode.json")
  writeFileSync(configPath, JSON.stringify(config, null, 2))
  const runEnv = {
    ...process.env,
    HOME: home,
    XDG_CONFIG_HOME: join(home, ".config"),
    XDG_DATA_HOME: join(home, ".local", "share"),
    XDG_CACHE_HOME: join(home, ".cache"),
    XDG_STATE_HOME: join(home, ".local", "state"),
    PWD: repo, // the opencode launcher starts in $PWD, not in the spawn's cwd
    OPENCODE_CONFIG: configPath,
    OPENCODE_DISABLE_AUTOUPDATE: "1",
    OPENCODE_DISABLE_MODELS_FETCH: "1",
    OPENCODE_DISABLE_LSP_DOWNLOAD: "1",
    OPENCODE_DISABLE_CLAUDE_CODE: "1",
    ...env,
  }
  // The fixture's own `node --test` must not think it runs inside this test runner.
  delete runEnv.NODE_TEST_CONTEXT
  const started = Date.now()
  const result = await run(opencodeBin, ["run", "--print-logs", "--log-level", "INFO", "--format", "json", PROMPT], { cwd: repo, env: runEnv, timeoutMs })
  const seconds = (Date.now() - started) / 1000
  server.close()
  const requests = readFileSync(log, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l))
  let sessionId = null
  for (const line of result.stdout.split("\n")) {
    try {
      const ev = JSON.parse(line)
      sessionId ??= ev.sessionID ?? ev.part?.sessionID ?? ev.properties?.sessionID ?? null
    } catch {}
  }
  let exported = null
  if (sessionId) {
    try {
      const out = execFileSync(opencodeBin, ["export", "--pure", sessionId], { cwd: repo, env: runEnv, maxBuffer: 64 << 20, stdio: ["ignore", "pipe", "pipe"] }).toString()
      exported = JSON.parse(out.slice(out.indexOf("{")))
    } catch (e) {
      exported = { error: String(e) }
    }
  }
  // OpenCode's home (its database, the packages it fetched: ~45 MB) is not needed once the
  // session is exported; the requests, the plugin log and the repository stay in root.
  if (!process.env.KEEP_OPENCODE_HOME) rmSync(home, { recursive: true, force: true })
  return { mode, root, repo, port, seconds, exitCode: result.code, signal: result.signal, stdout: result.stdout, stderr: result.stderr, requests, sessionId, exported, summary: summarize(requests) }
}

if (import.meta.url === pathToFileURL(process.argv[1]).href && !process.env.NODE_TEST_CONTEXT) {
  const mode = process.argv[2] ?? "none"
  const pluginOptions = JSON.parse(process.env.PLUGIN_OPTIONS ?? "{}")
  const r = await runSession({ mode, pluginOptions })
  console.log(JSON.stringify({ mode, root: r.root, exit: r.exitCode, seconds: r.seconds, sessionId: r.sessionId, ...r.summary }, null, 1))
  console.log(`fixture: ${readFileSync(join(r.repo, "src/parser.js"), "utf8").includes("left.value - right.value") ? "fixed" : "NOT fixed"}`)
}
