// close(): the calls a client has open end with it (grpc-js' Channel.close() fails only
// calls not yet on a connection), and a closed client's methods fail with a CompactdError.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer as createHttp2Server, type ServerHttp2Session } from "node:http2";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { after, before, describe, test } from "node:test";
import { CompactdClient, CompactdError } from "@compactd/client";
import { PKG, seedTurns, startCompactd, startFakeLlm, waitFor, type Compactd, type FakeLlm } from "./harness.js";

/** `p`, or a rejection naming `what` after `ms` (generous: a loaded machine is slow). */
async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: still pending after ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

/** The error `p` rejects with (failing when it resolves). */
async function rejection(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
  } catch (e) {
    return e;
  }
  assert.fail("resolved; a rejection was expected");
}

/** A CompactdError CANCELLED saying the client was closed. */
function isClosedError(e: unknown): boolean {
  assert.ok(e instanceof CompactdError, `a CompactdError, not ${String(e)}`);
  assert.equal(e.codeName, "CANCELLED", e.message);
  assert.match(e.details, /client (was|is) closed/);
  return true;
}

describe("close()", () => {
  let fake: FakeLlm;
  let server: Compactd;
  before(async () => {
    fake = await startFakeLlm([{ chunks: [], hang: true }]);
    server = await startCompactd(["--llm-base-url", fake.baseUrl, "--llm-model", "fake-model", "--llm-timeout-secs", "120"]);
  });
  after(async () => {
    await server.stop();
    await fake.stop();
  });

  test("a subscription open at close() ends within 10 s with CANCELLED", async () => {
    const c = server.client();
    const sub = c.subscribe();
    await sub.ready;
    const next = sub.next();
    c.close();
    isClosedError(await within(rejection(next), 10_000, "the subscription's iteration"));
  });

  test("a stream's pending work ends at close(): its compaction, later updates, closed", async () => {
    const sid = "close-stream";
    const c = server.client();
    await c.openSession({ id: sid, limits: { context: 100_000, output: 20_000 } });
    await seedTurns(c, sid);
    const sent = fake.requests.length;
    const s = c.stream();
    const run = await s.compact(sid); // the fake LLM hangs: it runs until something ends it
    await waitFor(() => fake.requests.length > sent, 15_000, "the LLM request");
    const result = run.result();
    c.close();
    const ended = await within(s.closed, 10_000, "the stream's closed");
    isClosedError(ended);
    isClosedError(await within(rejection(result), 10_000, "the stream compaction's result"));
    const late = await rejection(s.upsertMessage(sid, { id: "late", role: "user" }));
    assert.ok(late instanceof CompactdError && late.streamEnded, String(late));
    assert.equal(late.codeName, "CANCELLED");
  });

  test("a compact() run and a unary call in flight end at close()", async () => {
    const sid = "close-compact";
    const c = server.client();
    await c.openSession({ id: sid, limits: { context: 100_000, output: 20_000 } });
    await seedTurns(c, sid);
    const run = c.compact(sid);
    assert.ok((await run.next()).value?.started, "started");
    // A unary call on an HTTP/2 connection to a server that takes the request and never
    // answers: only its deadline (30 s by default) would end it.
    const h2 = createHttp2Server();
    let requests = 0;
    h2.on("stream", () => void requests++);
    const sessions = new Set<ServerHttp2Session>();
    h2.on("session", (session) => sessions.add(session));
    await new Promise<void>((r) => h2.listen(0, "127.0.0.1", r));
    const mute = new CompactdClient({ address: `127.0.0.1:${(h2.address() as AddressInfo).port}` });
    try {
      const unary = rejection(mute.listSessions());
      await waitFor(() => requests > 0, 15_000, "the request at the silent server");
      const result = rejection(run.result());
      c.close();
      mute.close();
      isClosedError(await within(result, 10_000, "the compaction's result"));
      isClosedError(await within(unary, 10_000, "the unary call"));
    } finally {
      mute.close();
      for (const session of sessions) session.destroy();
      await new Promise((r) => h2.close(r));
    }
  });

  test("a closed client's methods fail with CompactdError CANCELLED, not grpc-js' plain Error", async () => {
    const c = server.client();
    await c.listSessions();
    c.close();
    c.close(); // again: nothing
    isClosedError(await rejection(c.listSessions()));
    isClosedError(await rejection(c.openSession({ id: "x" })));
    isClosedError(await rejection(c.importSession({ exportJson: JSON.stringify({ info: { id: "x" }, messages: [] }) })));
    isClosedError(await rejection(c.waitForReady(1_000)));
    for (const start of [() => c.stream(), () => c.subscribe(), () => c.compact("x")]) {
      assert.throws(start, isClosedError);
    }
    assert.equal(c.isClosed, true);
  });

  test("a Node process that subscribes then closes its client exits by itself", async () => {
    // The client as a host imports it (the built package), in a process of its own.
    const entry = pathToFileURL(join(PKG, "dist/index.js")).href;
    const script = `
      import { CompactdClient } from ${JSON.stringify(entry)};
      const c = new CompactdClient({ address: process.env.ADDR });
      const sub = c.subscribe();
      await sub.ready;
      const ended = (async () => { try { for await (const _ of sub) {} return "ended"; } catch (e) { return e.codeName; } })();
      c.close();
      console.log("iteration:", await ended);
    `;
    const child = spawn(process.execPath, ["--input-type=module", "-e", script], {
      env: { ...process.env, ADDR: server.addr },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    child.stdout.on("data", (d: Buffer) => (out += d.toString()));
    child.stderr.on("data", (d: Buffer) => (out += d.toString()));
    const exited = new Promise<number | null>((r) => child.once("exit", (code) => r(code)));
    const killer = setTimeout(() => child.kill("SIGKILL"), 20_000);
    try {
      const code = await exited;
      assert.equal(child.signalCode, null, `the process did not exit within 20 s after close(): killed. Output:\n${out}`);
      assert.equal(code, 0, out);
      assert.match(out, /iteration: CANCELLED/);
    } finally {
      clearTimeout(killer);
      child.kill("SIGKILL");
    }
  });
});
