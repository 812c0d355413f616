// Every unary RPC against the real binary, with the codes and fields of bad input.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer, type AddressInfo, type Socket } from "node:net";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { CompactdClient, CompactdError, codeName, codeNumber } from "@compactd/client";
import { REPO, startCompactd, textPart, toolPart, userMsg, assistantMsg, logOf, type Compactd } from "./harness.js";

const EXAMPLE = readFileSync(join(REPO, "examples/session.json"), "utf8");

/** Asserts that `p` rejects with a CompactdError of `code` naming `field`. */
async function rejects(p: Promise<unknown>, code: string, field: string, detail?: RegExp): Promise<CompactdError> {
  try {
    await p;
  } catch (err) {
    assert.ok(err instanceof CompactdError, `expected a CompactdError, got ${String(err)}`);
    assert.equal(err.codeName, code, err.message);
    assert.equal(err.code, codeNumber(code));
    assert.equal(err.field, field, err.message);
    if (detail) assert.match(err.details, detail);
    return err;
  }
  assert.fail(`expected ${code} naming ${field}, but the call succeeded`);
}

describe("unary RPCs", () => {
  let server: Compactd;
  let c: CompactdClient;
  before(async () => {
    server = await startCompactd();
    c = server.client();
    await c.waitForReady();
  });
  after(async () => server.stop());

  test("codes map both ways", () => {
    assert.equal(codeNumber("NOT_FOUND"), 5);
    assert.equal(codeName(3), "INVALID_ARGUMENT");
    assert.equal(codeNumber("NO_SUCH_CODE"), 2);
  });

  test("OpenSession creates, then reconfigures", async () => {
    const s = await c.openSession({ id: "open-1", title: "t", limits: { context: 16_000, output: 4_000 }, model: { providerId: "openai", modelId: "gpt-4.1" } });
    assert.equal(s.id, "open-1");
    assert.equal(s.created, true);
    assert.equal(s.title, "t");
    assert.deepEqual(s.limits, { context: 16_000, input: 0, output: 4_000 });
    assert.equal(s.overflow?.usable, 12_000);
    assert.equal(s.overflow?.threshold, Math.floor(12_000 * 0.92));
    const again = await c.openSession({ id: "open-1", title: "renamed", limits: { context: 32_000, output: 4_000 }, config: { threshold: 0.5 } });
    assert.equal(again.created, false);
    assert.equal(again.title, "renamed");
    assert.equal(again.overflow?.ratio, 0.5);
    assert.equal(again.overflow?.threshold, Math.floor(28_000 * 0.5));
    const got = await c.getSession("open-1");
    assert.equal(got.info?.config?.threshold, 0.5);
    assert.equal(got.info?.model?.modelId, "gpt-4.1");
  });

  test("OpenSession rejects a missing id and a bad config value, naming the field", async () => {
    await rejects(c.openSession({ id: "" }), "INVALID_ARGUMENT", "session.id");
    await rejects(c.openSession({ id: "bad", config: { threshold: 2 } }), "INVALID_ARGUMENT", "session.config.threshold", /not in \(0, 1\]/);
    await rejects(c.openSession({ id: "bad", config: { tokenizer: "nope" } }), "INVALID_ARGUMENT", "session.config.tokenizer");
  });

  test("UpsertMessage / UpsertPart / DeletePart / ReportUsage, and the context they build", async () => {
    const sid = "build-1";
    await c.openSession({ id: sid, limits: { context: 100_000, output: 10_000 } });
    const m = await c.upsertMessage(sid, userMsg("u1"));
    assert.equal(m.seq, 0);
    assert.equal(m.kind, "upsert_message");
    assert.equal(m.created, true);
    assert.ok(m.events.at(-1)?.ack, "the ack comes last");
    const p = await c.upsertPart(sid, textPart("u1", "u1-t", "Fix the failing test"));
    assert.equal(p.kind, "upsert_part");
    assert.equal(p.created, true);
    const same = await c.upsertPart(sid, textPart("u1", "u1-t", "Fix the failing test, please"));
    assert.equal(same.created, false, "an update in place creates nothing");
    await c.upsertMessage(sid, assistantMsg("a1", "u1"));
    await c.upsertPart(sid, toolPart("a1", "a1-read", "read", "file contents here"));
    await c.upsertPart(sid, textPart("a1", "a1-scratch", "scratch"));
    const d = await c.deletePart(sid, "a1", "a1-scratch");
    assert.equal(d.kind, "delete_part");
    await c.upsertMessage(sid, assistantMsg("a1", "u1", "tool-calls"));
    const u = await c.reportUsage(sid, { messageId: "a1", tokens: { input: 1_000, output: 50, cache: { read: 10 } } });
    assert.equal(u.kind, "report_usage");
    assert.equal(u.overflow, undefined, "1,060 of 100k does not overflow");

    const openai = await c.getOpenAIMessages(sid);
    assert.deepEqual(openai[0], { role: "user", content: "Fix the failing test, please" });
    const assistant = openai[1]!;
    assert.equal(assistant.role, "assistant");
    assert.equal(assistant.tool_calls?.[0]?.id, "call_a1-read");
    assert.equal(assistant.tool_calls?.[0]?.function.name, "read");
    assert.deepEqual(JSON.parse(assistant.tool_calls![0]!.function.arguments), { id: "a1-read", path: "src/a1-read.ts" });
    assert.deepEqual(openai[2], { role: "tool", tool_call_id: "call_a1-read", content: "file contents here" });
    assert.equal(openai.length, 3, JSON.stringify(openai));

    const native = await c.getNativeMessages(sid);
    assert.deepEqual(native.map((x) => x.info?.id), ["u1", "a1"]);
    assert.deepEqual(native[1]!.parts.map((x) => x.id), ["a1-read"], "the deleted part is gone");
    assert.equal(native[1]!.parts[0]!.tool?.state?.output, "file contents here");
    assert.deepEqual(native[1]!.parts[0]!.tool?.state?.input, { id: "a1-read", path: "src/a1-read.ts" }, "Struct reads as plain JSON");

    const both = await c.getContext(sid);
    assert.equal(both.messages.length, 2);
    assert.equal(both.openaiMessages?.length, 3);
    assert.equal(both.sessionMessages, 2);
    assert.equal(both.contextMessages, 2);
    assert.ok(both.estimatedTokens > 0);
    const onlyOpenai = await c.getContext(sid, "openai");
    assert.equal(onlyOpenai.messages.length, 0, "openai format leaves out the native messages");
    const onlyNative = await c.getContext(sid, "native");
    assert.equal(onlyNative.openaiMessages, undefined, "native format leaves out the OpenAI messages");
  });

  test("a config key SessionConfig lacks is refused before anything is sent, naming it", async () => {
    const s = c.stream();
    const cases: Array<[Promise<unknown>, string, RegExp]> = [
      [c.openSession({ id: "typo-1", config: { treshold: 0.5 } as never }), "session.config.treshold", /no field "treshold"/],
      [c.openSession({ id: "typo-1", config: { protect_turns: 3 } as never }), "session.config.protect_turns", /write it protectTurns/],
      [c.importSession({ exportJson: "{}", config: { autocompact: false } as never }), "config.autocompact", /its fields are autoCompact, prune/],
      [s.open({ id: "typo-1", config: { strategie: {} } as never }), "open.config.strategie", /no field/],
    ];
    for (const [p, field, message] of cases) {
      await assert.rejects(p, (err: unknown) => {
        assert.ok(err instanceof CompactdError, String(err));
        assert.equal(err.codeName, "INVALID_ARGUMENT");
        assert.equal(err.field, field);
        assert.match(err.message, message);
        return true;
      });
    }
    await s.end();
    assert.equal((await c.listSessions()).some((x) => x.id === "typo-1"), false, "nothing was opened");
    const ok = await c.openSession({ id: "typo-2", config: { threshold: 0.5, protectTurns: 3, strategies: { truncateOldErrors: false } } });
    assert.equal(ok.id, "typo-2", "known fields pass");
  });

  test("update RPCs reject bad input with the code and the field", async () => {
    const sid = "bad-1";
    await c.openSession({ id: sid });
    await rejects(c.upsertMessage("no-such-session", userMsg("u1")), "NOT_FOUND", "session_id");
    await rejects(c.upsertMessage(sid, { id: "x", role: "robot" }), "INVALID_ARGUMENT", "message.role", /unknown role/);
    await rejects(c.upsertMessage(sid, { role: "user" }), "INVALID_ARGUMENT", "message.id");
    await rejects(c.upsertPart(sid, textPart("nope", "p", "x")), "FAILED_PRECONDITION", "part.message_id");
    await c.upsertMessage(sid, userMsg("u1"));
    await rejects(c.upsertPart(sid, toolPart("u1", "t1", "bash", "", "bogus")), "INVALID_ARGUMENT", "part.tool.state.status");
    await rejects(c.deletePart(sid, "u1", "nope"), "NOT_FOUND", "part_id");
    await c.upsertMessage(sid, assistantMsg("a1", "u1"));
    await rejects(c.upsertMessage(sid, { id: "a1", role: "user" }), "FAILED_PRECONDITION", "message.role");
    const session = await c.getSession(sid);
    assert.deepEqual(session.messages.map((m) => m.info?.id), ["u1", "a1"], "rejected updates changed nothing");
  });

  test("ListSessions pages through every session, in id order", async () => {
    const ids = ["pg-e", "pg-c", "pg-a", "pg-d", "pg-b"];
    for (const id of ids) await c.openSession({ id });
    const paged = (await c.listSessions({ pageSize: 2 })).map((s) => s.id);
    assert.deepEqual(paged, (await c.listSessions()).map((s) => s.id));
    assert.deepEqual(paged.filter((id) => id.startsWith("pg-")), [...ids].sort());
    assert.deepEqual(paged, [...paged].sort());
    for (const pageSize of [-1, 0, 1.5, NaN, 2 ** 31]) await rejects(c.listSessions({ pageSize }), "INVALID_ARGUMENT", "page_size");
    for (const id of ids) await c.deleteSession(id);
  });

  test("ImportSession, CheckOverflow, Prune (dry and real), Recall, Pin, GetSession, ListSessions, DeleteSession", async () => {
    const sum = await c.importSession({
      exportJson: EXAMPLE,
      sessionId: "demo",
      limits: { context: 16_000, output: 4_000 },
      config: { pruneProtect: 2_000, pruneMinimum: 1_000 },
    });
    assert.equal(sum.id, "demo");
    assert.equal(sum.created, true);
    assert.equal(sum.messages, 11);
    assert.equal(sum.parts, 34);

    const check = await c.checkOverflow("demo");
    assert.equal(check.overflow, true);
    assert.equal(check.crossed, "used");
    assert.equal(check.usable, 12_000);
    assert.equal(check.threshold, 11_040);
    assert.ok(check.used > check.threshold);

    const dry = await c.prune("demo", { dryRun: true });
    assert.equal(dry.dryRun, true);
    assert.equal(dry.committed, false);
    assert.ok(dry.tokensSaved > 0);
    const real = await c.prune("demo");
    assert.equal(real.committed, true);
    assert.deepEqual(real.parts.map((p) => p.callId), dry.parts.map((p) => p.callId), "the dry run told what prune clears");
    assert.ok(real.parts.some((p) => p.callId === "call_0005"));

    const openai = await c.getOpenAIMessages("demo");
    const tool5 = openai.find((m) => m.role === "tool" && m.tool_call_id === "call_0005");
    assert.equal(tool5?.content, "[Old tool result content cleared]");

    const recalled = await c.recall("demo", { callId: "call_0005" });
    assert.equal(recalled.partType, "tool");
    assert.equal(recalled.call?.tool, "read");
    assert.equal(recalled.call?.status, "completed");
    assert.match(recalled.call?.output ?? "", /BUG: rounding happens per line/);
    assert.notEqual(recalled.reduction, "", "the context shortens it");
    assert.ok(recalled.tokens > recalled.contextTokens);
    const byPart = await c.recall("demo", { partId: recalled.partId });
    assert.equal(byPart.call?.callId, "call_0005");

    // Pin the cleared read: it reads verbatim again.
    const pin = await c.pin("demo", { messageId: recalled.messageId, partId: recalled.partId });
    assert.equal(pin.kind, "pin");
    const pinned = await c.recall("demo", { callId: "call_0005" });
    assert.equal(pinned.pinned, true);
    assert.equal(pinned.reduction, "");
    const after = await c.getOpenAIMessages("demo");
    assert.match(String(after.find((m) => m.tool_call_id === "call_0005")?.content), /BUG: rounding happens per line/);
    await c.pin("demo", { messageId: recalled.messageId, partId: recalled.partId, pinned: false });
    assert.equal((await c.recall("demo", { callId: "call_0005" })).pinned, false);

    const whole = await c.getSession("demo");
    assert.equal(whole.info?.id, "demo");
    assert.equal(whole.messages.length, 11);
    assert.equal(whole.summary?.messages, 11);
    const part = whole.messages.flatMap((m) => m.parts).find((p) => p.tool?.callId === "call_0007");
    assert.ok(part?.tool?.state?.time?.compacted, "lazy deletion: time.compacted is set");
    assert.ok((part?.tool?.state?.output ?? "").length > 0, "and the output is kept");

    const list = await c.listSessions();
    assert.ok(list.some((s) => s.id === "demo" && s.messages === 11));

    await rejects(c.importSession({ exportJson: EXAMPLE, sessionId: "demo" }), "ALREADY_EXISTS", "session_id");
    const replaced = await c.importSession({ export: JSON.parse(EXAMPLE), sessionId: "demo", replace: true });
    assert.equal(replaced.messages, 11, "the export as an object, replacing");
    assert.equal(replaced.compactedParts, 0, "a fresh copy");

    assert.equal(await c.deleteSession("demo"), true);
    assert.ok(!(await c.listSessions()).some((s) => s.id === "demo"));
    await rejects(c.getSession("demo"), "NOT_FOUND", "session_id");
    await rejects(c.deleteSession("demo"), "NOT_FOUND", "session_id");
  });

  test("ImportSession, Recall and Pin reject bad input, naming the field", async () => {
    await rejects(c.importSession({ exportJson: "{", sessionId: "x" }), "INVALID_ARGUMENT", "export_json.$", /not JSON/);
    await c.importSession({ exportJson: EXAMPLE, sessionId: "demo2" });
    await rejects(c.recall("demo2", { callId: "nope" }), "NOT_FOUND", "call_id");
    await rejects(c.recall("demo2", { partId: "nope" }), "NOT_FOUND", "part_id");
    await rejects(c.recall("demo2", {} as { callId: string }), "INVALID_ARGUMENT", "call_id", /required/);
    await rejects(c.recall("nope", { callId: "call_0005" }), "NOT_FOUND", "session_id");
    await rejects(c.pin("demo2", { messageId: "nope" }), "NOT_FOUND", "message_id");
    await rejects(c.pin("demo2", { messageId: "msg_0002", partId: "nope" }), "NOT_FOUND", "part_id");
    await rejects(c.getContext("nope"), "NOT_FOUND", "session_id");
    await rejects(c.prune("nope"), "NOT_FOUND", "session_id");
    await rejects(c.checkOverflow("nope"), "NOT_FOUND", "session_id");
    await rejects(c.reportUsage("nope", { tokens: { input: 1 } }), "NOT_FOUND", "session_id");
  });

  test("GetRecallTool gives an OpenAI function definition", async () => {
    const t = await c.getRecallTool();
    assert.equal(t.name, "compactd_recall");
    assert.equal(t.tool.type, "function");
    assert.equal(t.tool.function.name, "compactd_recall");
    assert.deepEqual((t.tool.function.parameters as { required: string[] }).required, ["call_id"]);
    assert.deepEqual(JSON.parse(t.json), t.tool);
  });

  test("a session over the 4 MiB gRPC default comes back whole (receive limit raised)", async () => {
    const sid = "big";
    await c.openSession({ id: sid });
    await c.upsertMessage(sid, userMsg("u1"));
    await c.upsertMessage(sid, assistantMsg("a1", "u1"));
    const big = logOf("big", 3 * 1024 * 1024);
    await c.upsertPart(sid, toolPart("a1", "t1", "bash", big));
    await c.upsertPart(sid, toolPart("a1", "t2", "bash", big));
    const whole = await c.getSession(sid);
    const outputs = whole.messages[1]!.parts.map((p) => p.tool?.state?.output?.length);
    assert.deepEqual(outputs, [big.length, big.length]);
    await c.deleteSession(sid);
  });

  test("a client with a small receive limit gets RESOURCE_EXHAUSTED from its own library", async () => {
    const sid = "big2";
    await c.openSession({ id: sid });
    await c.upsertMessage(sid, userMsg("u1"));
    await c.upsertPart(sid, textPart("u1", "t", "x".repeat(200_000)));
    const small = server.client({ maxMessageBytes: 64 * 1024 });
    await rejects(small.getSession(sid), "RESOURCE_EXHAUSTED", "");
  });

  test("deadlineMs 0 or less is a deadline already past; null and Infinity are none", async () => {
    // A TCP server that accepts and never speaks HTTP/2: only a deadline (or a cancel)
    // ends a call to it. Before, 0 or less meant no deadline: the call waited forever.
    const sockets = new Set<Socket>();
    const silent = createServer((sock) => sockets.add(sock));
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
    const address = `127.0.0.1:${(silent.address() as AddressInfo).port}`;
    const mute = new CompactdClient({ address, deadlineMs: 300 });
    /** `p` settled within 10 s (generous: it is due at once), else a failure naming `what`. */
    const within10s = async (p: Promise<unknown>, what: string) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what}: still pending after 10 s`)), 10_000)));
      try {
        return await Promise.race([p, late]);
      } finally {
        clearTimeout(timer);
      }
    };
    /** Still pending 1 s on: no deadline ended it (the client's 300 ms would have). */
    const pendingAfter1s = async (p: Promise<unknown>, what: string) => {
      const settled = await Promise.race([p.then(() => "resolved", (e: unknown) => `rejected: ${String(e)}`), new Promise((r) => setTimeout(() => r("pending"), 1_000))]);
      assert.equal(settled, "pending", what);
    };
    try {
      await within10s(rejects(mute.listSessions({ deadlineMs: 0 }), "DEADLINE_EXCEEDED", ""), "deadlineMs 0");
      await within10s(rejects(mute.getRecallTool({ deadlineMs: -5_000 }), "DEADLINE_EXCEEDED", ""), "deadlineMs -5000");
      // Streams too: a Subscribe, a Compact, the main stream.
      const sub = mute.subscribe("", { deadlineMs: 0 });
      await within10s(rejects(sub.next(), "DEADLINE_EXCEEDED", ""), "a Subscribe with deadlineMs 0");
      await within10s(rejects(mute.compact("s", {}, { deadlineMs: -1 }).result(), "DEADLINE_EXCEEDED", ""), "a Compact with deadlineMs -1");
      const s = mute.stream({ deadlineMs: 0 });
      const ended = await within10s(s.closed, "a stream with deadlineMs 0");
      assert.equal((ended as CompactdError | undefined)?.codeName, "DEADLINE_EXCEEDED");
      // No deadline: the client's default does not apply; the signal ends the call.
      for (const none of [null, Infinity]) {
        const ac = new AbortController();
        const call = rejects(mute.listSessions({ deadlineMs: none, signal: ac.signal }), "CANCELLED", "");
        await pendingAfter1s(call, `deadlineMs ${none}`);
        ac.abort();
        await within10s(call, `deadlineMs ${none}, aborted`);
      }
      await rejects(mute.listSessions({ deadlineMs: NaN }), "INVALID_ARGUMENT", "", /deadlineMs/);
      // A client without a unary deadline: null (or Infinity); 0 or less is refused.
      const unbounded = new CompactdClient({ address, deadlineMs: null });
      const ac = new AbortController();
      const call = rejects(unbounded.listSessions({ signal: ac.signal }), "CANCELLED", "");
      await pendingAfter1s(call, "a client with deadlineMs null");
      ac.abort();
      await within10s(call, "a client with deadlineMs null, aborted");
      unbounded.close();
      for (const bad of [0, -1, NaN]) {
        assert.throws(() => new CompactdClient({ address, deadlineMs: bad }), (e: unknown) => e instanceof RangeError && /null/.test(e.message));
      }
    } finally {
      mute.close();
      for (const sock of sockets) sock.destroy();
      await new Promise((r) => silent.close(r));
    }
  });

  test("deadlines and cancellation", async () => {
    // A TCP server that accepts and never speaks HTTP/2: the call waits until its deadline.
    const sockets = new Set<Socket>();
    const silent = createServer((sock) => sockets.add(sock));
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
    const mute = new CompactdClient({ address: `127.0.0.1:${(silent.address() as AddressInfo).port}`, deadlineMs: 300 });
    const t0 = Date.now();
    await rejects(mute.listSessions(), "DEADLINE_EXCEEDED", "");
    assert.ok(Date.now() - t0 >= 250, "the client's default deadline applied");
    await rejects(mute.getRecallTool({ deadlineMs: 50 }), "DEADLINE_EXCEEDED", "");
    mute.close();
    for (const sock of sockets) sock.destroy();
    await new Promise((r) => silent.close(r));
    const ac = new AbortController();
    ac.abort();
    await rejects(c.listSessions({ signal: ac.signal }), "CANCELLED", "");
  });
});
