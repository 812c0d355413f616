// Test harness: the real compactd binary on a free port, and a fake OpenAI-compatible
// streaming endpoint for compaction. No part of compactd is mocked.
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { CompactdClient, type ClientOptionsInit, type DeepPartial, type MessageInfo, type Part } from "@compactd/client";

const here = dirname(fileURLToPath(import.meta.url));
/** The package directory (test files run from .test-build/test/). */
export const PKG = resolve(here, "../..");
/** The repository root. */
export const REPO = resolve(PKG, "../..");

/** The compactd binary: $COMPACTD_BIN, else the repository's target/debug or target/release build. */
export function compactdBin(): string {
  const env = process.env.COMPACTD_BIN;
  if (env) return env;
  for (const p of [join(REPO, "target/debug/compactd"), join(REPO, "target/release/compactd")]) {
    if (existsSync(p)) return p;
  }
  throw new Error("no compactd binary: set COMPACTD_BIN or run `cargo build` at the repository root");
}

export interface Compactd {
  /** The gRPC address from the start log. */
  addr: string;
  /** Every log line so far (JSON). */
  log: string[];
  proc: ChildProcess;
  /** A client for this server (closed by stop()). */
  client(opts?: ClientOptionsInit): CompactdClient;
  stop(): Promise<void>;
}

/**
 * Starts `$COMPACTD_BIN serve --listen 127.0.0.1:0 --log-format json --durability memory`
 * plus `args`, and reads the bound address from the JSON start log (on stderr, field
 * `fields.listen`). Inherited COMPACTD_* variables are removed; `env` adds its own.
 */
export async function startCompactd(args: string[] = [], env: Record<string, string> = {}): Promise<Compactd> {
  const childEnv: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith("COMPACTD_") && v !== undefined) childEnv[k] = v;
  Object.assign(childEnv, env);
  const listen = args.includes("--listen") ? [] : ["--listen", "127.0.0.1:0"];
  const proc = spawn(compactdBin(), ["serve", "--log-format", "json", "--durability", "memory", ...listen, ...args], {
    env: childEnv,
    stdio: ["ignore", "ignore", "pipe"],
  });
  // Never leave a server behind, even when the test process dies.
  const killChild = () => proc.kill("SIGKILL");
  process.once("exit", killChild);
  proc.once("exit", () => process.removeListener("exit", killChild));
  const log: string[] = [];
  const lines = createInterface({ input: proc.stderr! });
  const addr = await new Promise<string>((resolveAddr, reject) => {
    const timer = setTimeout(() => reject(new Error(`compactd did not start in 20 s:\n${log.join("\n")}`)), 20_000);
    proc.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`compactd exited with ${code} before listening:\n${log.join("\n")}`));
    });
    proc.once("error", reject);
    lines.on("line", (line) => {
      log.push(line);
      try {
        const v = JSON.parse(line) as { fields?: { listen?: string } };
        if (v.fields?.listen) {
          clearTimeout(timer);
          resolveAddr(v.fields.listen);
        }
      } catch {
        // not JSON: keep reading
      }
    });
  });
  const clients: CompactdClient[] = [];
  return {
    addr,
    log,
    proc,
    client(opts = {}) {
      const c = new CompactdClient({ address: addr, ...opts });
      clients.push(c);
      return c;
    },
    async stop() {
      for (const c of clients) c.close();
      if (proc.exitCode === null && proc.signalCode === null) {
        const exited = new Promise((r) => proc.once("exit", r));
        proc.kill("SIGTERM");
        const t = setTimeout(() => proc.kill("SIGKILL"), 10_000);
        await exited;
        clearTimeout(t);
      }
    },
  };
}

/** A temporary directory removed by the returned function. */
export function tempDir(): { path: string; remove: () => void } {
  const path = mkdtempSync(join(tmpdir(), "compactd-ts-"));
  return { path, remove: () => rmSync(path, { recursive: true, force: true }) };
}

export function writeFile(path: string, text: string): string {
  writeFileSync(path, text);
  return path;
}

// ---- session builders (the shapes of tests/common/mod.rs) ----------------------------------

export function userMsg(id: string): DeepPartial<MessageInfo> {
  return { id, role: "user", time: { created: 1_700_000_000_000 }, agent: "build" };
}

export function assistantMsg(id: string, parent: string, finish = ""): DeepPartial<MessageInfo> {
  return { id, role: "assistant", parentId: parent, time: { created: 1_700_000_000_001 }, agent: "build", mode: "build", finish };
}

export function textPart(messageId: string, id: string, text: string): DeepPartial<Part> {
  return { id, messageId, text: { text } };
}

export function toolPart(messageId: string, id: string, tool: string, output: string, status = "completed"): DeepPartial<Part> {
  return {
    id,
    messageId,
    tool: { callId: `call_${id}`, tool, state: { status, output, input: { id, path: `src/${id}.ts` }, time: { start: 1, end: 2 } } },
  };
}

/** A tool output of about `chars` characters that reads like a build log. */
export function logOf(tag: string, chars: number): string {
  let s = `${tag}:\n`;
  for (let i = 0; s.length < chars; i++) {
    s += `step ${i}: compiled src/module_${i % 17}/parser.rs in ${(i * 37) % 1000}ms; warning W${String((i * 13) % 10_000).padStart(4, "0")}: unused variable \`item_${i}\`\n`;
  }
  return s.slice(0, chars);
}

/** Three user turns, each answered with a finished assistant message holding a 4,000-character read. */
export async function seedTurns(client: CompactdClient, sid: string, turns = 3): Promise<void> {
  for (let n = 1; n <= turns; n++) {
    const u = `u${n}`;
    const a = `a${n}`;
    await client.upsertMessage(sid, userMsg(u));
    await client.upsertPart(sid, textPart(u, `${u}-t`, `user turn ${n}`));
    await client.upsertMessage(sid, assistantMsg(a, u));
    await client.upsertPart(sid, toolPart(a, `${a}-read`, "read", logOf(`${a}-read`, 4_000)));
    await client.upsertMessage(sid, assistantMsg(a, u, "stop"));
  }
}

// ---- a fake OpenAI-compatible endpoint ----------------------------------------------------

export interface FakeReply {
  /** Content deltas, one SSE chunk each. */
  chunks: string[];
  /** Milliseconds before each content chunk. */
  delayMs?: number;
  /** Never answer (until the client goes away). */
  hang?: boolean;
}

export interface FakeLlm {
  /** `http://127.0.0.1:PORT/v1` */
  baseUrl: string;
  /** Parsed bodies of every chat-completions request. */
  requests: Array<{ model?: string; stream?: boolean; messages?: Array<{ role: string; content: string }>; [k: string]: unknown }>;
  /** Authorization headers seen. */
  auth: string[];
  /** Requests whose client went away before the answer ended. */
  aborted: number;
  /** The replies, in order; the last one repeats. */
  script: FakeReply[];
  stop(): Promise<void>;
}

/**
 * A streaming chat-completions endpoint (`POST /v1/chat/completions`, SSE frames like
 * OpenAI's), with `GET /v1/models` naming a 32k window so compactd learns it without guessing.
 */
export async function startFakeLlm(script: FakeReply[]): Promise<FakeLlm> {
  const fake: FakeLlm = { baseUrl: "", requests: [], auth: [], aborted: 0, script, stop: async () => undefined };
  let served = 0;
  const server: Server = createServer((req: IncomingMessage, res: ServerResponse) => {
    let body = "";
    req.on("data", (d: Buffer) => (body += d.toString("utf8")));
    req.on("end", () => {
      const url = req.url ?? "";
      if (req.method === "GET" && url.endsWith("/models")) {
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({ object: "list", data: [{ id: "fake-model", object: "model", context_length: 32_000 }] }));
        return;
      }
      if (req.method !== "POST" || !url.endsWith("/chat/completions")) {
        res.writeHead(404, { "content-type": "application/json" });
        res.end(JSON.stringify({ error: { message: "not found" } }));
        return;
      }
      const parsed = JSON.parse(body) as FakeLlm["requests"][number];
      fake.requests.push(parsed);
      fake.auth.push(String(req.headers.authorization ?? ""));
      const reply = fake.script[Math.min(served++, fake.script.length - 1)]!;
      let finished = false;
      res.on("close", () => {
        if (!finished) fake.aborted++;
      });
      const model = parsed.model ?? "fake-model";
      const created = Math.floor(Date.now() / 1000);
      const chunk = (delta: object, finish: string | null) =>
        `data: ${JSON.stringify({ id: "chatcmpl-fake", object: "chat.completion.chunk", created, model, choices: [{ index: 0, delta, finish_reason: finish }] })}\n\n`;
      if (parsed.stream === false) {
        finished = true;
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({
          id: "chatcmpl-fake", object: "chat.completion", created, model,
          choices: [{ index: 0, message: { role: "assistant", content: reply.chunks.join("") }, finish_reason: "stop" }],
          usage: { prompt_tokens: 10, completion_tokens: reply.chunks.length, total_tokens: 10 + reply.chunks.length },
        }));
        return;
      }
      res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
      res.write(chunk({ role: "assistant", content: "" }, null));
      if (reply.hang) return; // until the client goes away
      void (async () => {
        for (const c of reply.chunks) {
          if (reply.delayMs) await new Promise((r) => setTimeout(r, reply.delayMs));
          if (res.destroyed) return;
          res.write(chunk({ content: c }, null));
        }
        res.write(chunk({}, "stop"));
        const wantsUsage = (parsed.stream_options as { include_usage?: boolean } | undefined)?.include_usage;
        if (wantsUsage) {
          // What it read, as a real endpoint reports it (characters / 4).
          const messages = (parsed.messages as { content?: unknown }[] | undefined) ?? [];
          const prompt = Math.floor(messages.reduce((n, m) => n + String(m.content ?? "").length, 0) / 4);
          res.write(`data: ${JSON.stringify({ id: "chatcmpl-fake", object: "chat.completion.chunk", created, model, choices: [], usage: { prompt_tokens: prompt, completion_tokens: reply.chunks.length, total_tokens: prompt + reply.chunks.length } })}\n\n`);
        }
        res.write("data: [DONE]\n\n");
        finished = true;
        res.end();
      })();
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as AddressInfo).port;
  fake.baseUrl = `http://127.0.0.1:${port}/v1`;
  fake.stop = () =>
    new Promise<void>((r) => {
      server.closeAllConnections();
      server.close(() => r());
    });
  return fake;
}

/** Waits until `cond()` holds (polling every 10 ms), or fails after `ms` (generous: a
 * loaded machine runs a debug compactd slowly). */
export async function waitFor(cond: () => boolean, ms = 15_000, what = "condition"): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}
