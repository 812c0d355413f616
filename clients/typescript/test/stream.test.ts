// The main Stream: seqs, acks, error events, the events updates cause, and its end.
import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { after, before, describe, test } from "node:test";
import { ClientUpdate, CompactdClient, CompactdError, type ServerEvent, type OverflowCheck, type PruneReport } from "@compactd/client";
import { assistantMsg, logOf, startCompactd, textPart, toolPart, userMsg, waitFor, type Compactd } from "./harness.js";

describe("Stream", () => {
  let server: Compactd;
  let c: CompactdClient;
  before(async () => {
    server = await startCompactd();
    c = server.client();
  });
  after(async () => server.stop());

  test("assigns seqs 1, 2, ... and resolves each update with its ack, in order, without waiting between sends", async () => {
    const s = c.stream();
    const seen: ServerEvent[] = [];
    s.on("event", (e) => seen.push(e));
    const sid = "seq-1";
    const sends = [
      s.open({ id: sid, limits: { context: 100_000, output: 10_000 } }),
      s.upsertMessage(sid, userMsg("u1")),
      s.upsertPart(sid, textPart("u1", "u1-t", "hello")),
      s.upsertMessage(sid, assistantMsg("a1", "u1")),
      s.upsertPart(sid, toolPart("a1", "a1-r", "read", "contents")),
      s.upsertMessage(sid, assistantMsg("a1", "u1", "stop")),
    ];
    assert.equal(s.inFlight, 6);
    const results = await Promise.all(sends);
    assert.deepEqual(results.map((r) => r.seq), [1, 2, 3, 4, 5, 6]);
    assert.deepEqual(results.map((r) => r.kind), ["open", "upsert_message", "upsert_part", "upsert_message", "upsert_part", "upsert_message"]);
    assert.deepEqual(results.map((r) => r.created), [true, true, true, true, true, false]);
    for (const r of results) {
      assert.ok(r.events.at(-1)?.ack, "each update's events end with its ack");
      assert.ok(r.events.every((e) => e.seq === r.seq && e.sessionId === sid));
    }
    const acks = seen.filter((e) => e.ack).map((e) => e.seq);
    assert.deepEqual(acks, [1, 2, 3, 4, 5, 6], "acks arrive in the order sent");
    assert.equal(s.inFlight, 0);
    assert.equal(await s.end(), undefined, "a clean end");
    assert.equal(s.isClosed, true);
  });

  test("an update that cannot be encoded is refused alone; the stream and the updates in flight go on", async () => {
    // grpc-js encodes a written message inside the call and cancels the whole call
    // (INTERNAL) when that fails: one bad value (a fractional token count) rejected every
    // update in flight, of every session.
    const s = c.stream();
    const sid = "unencodable-1";
    await s.open({ id: sid });
    const before = s.upsertMessage(sid, userMsg("u1"));
    const bad = s.reportUsage(sid, { tokens: { input: 1.5 } as never });
    const after = s.upsertPart(sid, textPart("u1", "t1", "still open"));
    await assert.rejects(bad, (err: unknown) => {
      assert.ok(err instanceof CompactdError);
      assert.equal(err.codeName, "INVALID_ARGUMENT");
      assert.match(err.message, /encode/);
      return true;
    });
    const [b, a] = await Promise.all([before, after]);
    assert.deepEqual([b.seq, a.seq], [2, 3], "no seq is spent on the refused update");
    assert.equal(s.isClosed, false);
    assert.equal(await s.end(), undefined, "a clean end");
  });

  test("updates left unanswered when the stream ends say their outcome is unknown", async () => {
    // Cancelled with updates in flight: their errors carry the stream's code, their own
    // seq and streamEnded, where they read as refusals of each update before.
    const s = c.stream();
    const sid = "ended-1";
    await s.open({ id: sid });
    const left = [s.upsertMessage(sid, userMsg("u1")), s.upsertPart(sid, textPart("u1", "t1", "x"))];
    s.cancel();
    for (const [i, p] of left.entries()) {
      await assert.rejects(p, (err: unknown) => {
        assert.ok(err instanceof CompactdError);
        assert.equal(err.streamEnded, true);
        assert.equal(err.seq, i + 2);
        assert.equal(err.sessionId, sid);
        assert.match(err.message, /outcome is unknown/);
        return true;
      });
    }
  });

  test("an error event rejects that update with code, field and seq; the stream stays open", async () => {
    const s = c.stream();
    const sid = "err-1";
    const errors: CompactdError[] = [];
    s.on("updateError", (e) => errors.push(e));
    await s.open({ id: sid });
    await s.upsertMessage(sid, userMsg("u1"));
    const bad = s.upsertPart(sid, toolPart("u1", "t1", "bash", "", "bogus"));
    const good = s.upsertPart(sid, textPart("u1", "t2", "still open"));
    await assert.rejects(bad, (err: unknown) => {
      assert.ok(err instanceof CompactdError);
      assert.equal(err.codeName, "INVALID_ARGUMENT");
      assert.equal(err.code, 3);
      assert.equal(err.field, "upsert_part.tool.state.status");
      assert.equal(err.seq, 3);
      assert.equal(err.sessionId, sid);
      assert.match(err.details, /unknown status "bogus"/);
      assert.ok(err.events.at(-1)?.error, "the error event is the update's last");
      return true;
    });
    assert.equal((await good).seq, 4, "the update after the rejected one is applied");
    assert.equal(errors.length, 1);

    const cases: Array<[Promise<unknown>, string, string]> = [
      [s.upsertMessage("no-such", userMsg("u1")), "NOT_FOUND", "session_id"],
      [s.upsertMessage(sid, { id: "m", role: "robot" }), "INVALID_ARGUMENT", "upsert_message.role"],
      [s.upsertPart(sid, textPart("nope", "p", "x")), "FAILED_PRECONDITION", "upsert_part.message_id"],
      [s.deletePart(sid, "u1", "nope"), "NOT_FOUND", "delete_part.part_id"],
      [s.pin(sid, { messageId: "nope" }), "NOT_FOUND", "pin.message_id"],
      [s.open({ id: sid, config: { threshold: 7 } }), "INVALID_ARGUMENT", "open.config.threshold"],
      [s.send(sid, {}), "INVALID_ARGUMENT", "update"],
      [s.cancelCompaction(sid), "NOT_FOUND", ""],
      [s.compact(sid), "FAILED_PRECONDITION", ""],
    ];
    for (const [p, code, field] of cases) {
      await assert.rejects(p, (err: unknown) => {
        assert.ok(err instanceof CompactdError, String(err));
        assert.equal(err.codeName, code, err.message);
        assert.equal(err.field, field, err.message);
        return true;
      });
    }
    const ctx = await s.getContext(sid, "native");
    assert.deepEqual(ctx.messages[0]!.parts.map((p) => p.id), ["t2"], "the rejected updates changed nothing");
    await s.end();
  });

  test("get_context, prune, check_overflow, pin, delete_part and report_usage on the stream", async () => {
    const s = c.stream();
    const sid = "ops-1";
    const overflows: OverflowCheck[] = [];
    s.on("overflow", (o) => overflows.push(o));
    await s.open({ id: sid, limits: { context: 16_000, output: 4_000 }, config: { prune: false } });
    await s.upsertMessage(sid, userMsg("u1"));
    await s.upsertPart(sid, textPart("u1", "u1-t", "read the file"));
    await s.upsertMessage(sid, assistantMsg("a1", "u1"));
    await s.upsertPart(sid, toolPart("a1", "a1-r", "read", "FILE CONTENTS"));
    await s.upsertPart(sid, textPart("a1", "a1-x", "to delete"));
    assert.equal((await s.deletePart(sid, "a1", "a1-x")).kind, "delete_part");

    const openai = await s.getContext(sid, "openai");
    assert.equal(openai.messages.length, 0);
    assert.deepEqual(openai.openaiMessages?.[0], { role: "user", content: "read the file" });
    assert.deepEqual(openai.openaiMessages?.[2], { role: "tool", tool_call_id: "call_a1-r", content: "FILE CONTENTS" });
    const json = await s.getContext(sid, "openai_json");
    assert.equal(json.openaiMessages, undefined, "openai_json carries the messages as text only");
    assert.deepEqual(JSON.parse(json.openaiMessagesJson), openai.openaiMessages);
    assert.deepEqual(await s.getOpenAIMessages(sid), openai.openaiMessages, "the same messages as the unary call's helper reads");
    const native = await s.getContext(sid, "native");
    assert.equal(native.openaiMessages, undefined);
    assert.deepEqual(native.messages.map((m) => m.parts.map((p) => p.id)), [["u1-t"], ["a1-r"]]);

    const check = await s.checkOverflow(sid);
    assert.equal(check.overflow, false);
    assert.equal(check.usable, 12_000);
    assert.equal(check.trigger, "request");

    const dry = await s.prune(sid, { dryRun: true });
    assert.equal(dry.dryRun, true);
    assert.equal(dry.committed, false);

    const pin = await s.pin(sid, { messageId: "a1", partId: "a1-r" });
    assert.equal(pin.kind, "pin");
    assert.equal((await c.recall(sid, { partId: "a1-r" })).pinned, true);

    // 12,000 tokens used is over the 11,040 threshold: the usage report causes an overflow event.
    const usage = await s.reportUsage(sid, { messageId: "a1", tokens: { input: 12_000, output: 10 } });
    assert.equal(usage.kind, "report_usage");
    assert.equal(usage.overflow?.overflow, true);
    assert.equal(usage.overflow?.crossed, "used");
    assert.equal(usage.overflow?.used, 12_010);
    assert.ok(usage.events.findIndex((e) => e.overflow) < usage.events.findIndex((e) => e.ack), "events before the ack");
    assert.equal(overflows.length, 1);
    await s.end();
  });

  test("an automatic prune after a finished assistant message arrives as a pruned event", async () => {
    const s = c.stream();
    const sid = "autoprune";
    const pruned: PruneReport[] = [];
    s.on("pruned", (p) => pruned.push(p));
    await s.open({ id: sid, limits: { context: 200_000, output: 10_000 }, config: { pruneProtect: 1_000, pruneMinimum: 100, strategyPreset: "verbose", cacheModel: "none" } });
    let last;
    for (let n = 1; n <= 4; n++) {
      await s.upsertMessage(sid, userMsg(`u${n}`));
      await s.upsertPart(sid, textPart(`u${n}`, `u${n}-t`, `turn ${n}`));
      await s.upsertMessage(sid, assistantMsg(`a${n}`, `u${n}`));
      await s.upsertPart(sid, toolPart(`a${n}`, `a${n}-r`, "read", logOf(`a${n}`, 8_000)));
      last = await s.upsertMessage(sid, assistantMsg(`a${n}`, `u${n}`, "stop"));
      if (last.pruned) break;
    }
    assert.ok(last?.pruned, "a finished assistant message ran prune");
    assert.equal(last.pruned.committed, true);
    assert.ok(last.pruned.parts.some((p) => p.callId === "call_a1-r"), JSON.stringify(last.pruned.parts));
    assert.equal(pruned.length, 1);
    const ctx = await s.getContext(sid, "openai");
    assert.equal(ctx.openaiMessages?.find((m: { tool_call_id?: string }) => m.tool_call_id === "call_a1-r")?.content, "[Old tool result content cleared]");
    await s.end();
  });

  test("cancel() rejects updates in flight; sends after the end reject; close listeners run", async () => {
    const s = c.stream();
    let closedWith: CompactdError | undefined | null = null;
    s.on("close", (e) => (closedWith = e));
    await s.open({ id: "cancel-1" });
    s.cancel();
    const err = await s.closed;
    assert.ok(err instanceof CompactdError);
    assert.equal(err.codeName, "CANCELLED");
    assert.equal(closedWith, err);
    await assert.rejects(s.upsertMessage("cancel-1", userMsg("u1")), (e: unknown) => e instanceof CompactdError && e.codeName === "CANCELLED");

    const t = c.stream();
    await t.open({ id: "cancel-2" });
    assert.equal(await t.end(), undefined);
    await assert.rejects(t.upsertMessage("cancel-2", userMsg("u1")), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAVAILABLE");
  });

  test("a send after end() is refused and leaves the updates in flight to their acks", async () => {
    const s = c.stream();
    const opened = s.open({ id: "end-1" });
    const ended = s.end();
    await assert.rejects(s.upsertMessage("end-1", userMsg("u1")), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAVAILABLE");
    assert.equal((await opened).kind, "open", "the update sent before end() gets its ack");
    assert.equal(await ended, undefined, "a clean end");
    assert.ok(s.isClosed);
  });

  test("a listener that throws is a warning, not the end of the stream or of the process", async () => {
    const warnings: Error[] = [];
    const onWarning = (w: Error) => warnings.push(w);
    process.on("warning", onWarning);
    try {
      const s = c.stream();
      s.on("event", () => {
        throw new Error("a bug in the host's listener");
      });
      assert.equal((await s.open({ id: "throws-1" })).kind, "open");
      assert.equal((await s.upsertMessage("throws-1", userMsg("u1"))).kind, "upsert_message");
      await s.end();
      await new Promise((r) => setImmediate(r));
      assert.ok(warnings.some((w) => w.name === "CompactdListenerWarning" && /host's listener/.test(w.message)), warnings.join("; "));
    } finally {
      process.off("warning", onWarning);
    }
  });

  test("calls that end leave no abort listener on a signal they share", async () => {
    const ctl = new AbortController();
    for (let i = 0; i < 20; i++) {
      const sub = c.subscribe("", { signal: ctl.signal });
      await sub.ready;
      sub.cancel();
      const s = c.stream({ signal: ctl.signal });
      await s.open({ id: `signal-${i}` });
      await s.end();
    }
    // Each call's listener goes once its end is processed: wait for that, not a fixed time.
    await waitFor(() => getEventListeners(ctl.signal, "abort").length === 0, 10_000, "the abort listeners to go").catch(() => undefined);
    assert.equal(getEventListeners(ctl.signal, "abort").length, 0);
  });

  test("a stream to an unreachable address rejects its updates with UNAVAILABLE", async () => {
    const dead = new CompactdClient({ address: "127.0.0.1:1" });
    const s = dead.stream();
    await assert.rejects(s.open({ id: "x" }), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAVAILABLE");
    await assert.rejects(dead.listSessions(), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAVAILABLE");
    await assert.rejects(dead.waitForReady(200), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAVAILABLE");
    dead.close();
  });
});

describe("Stream against a server with a small --max-update-bytes", () => {
  const CAP = 65536;
  let server: Compactd;
  before(async () => {
    server = await startCompactd(["--max-update-bytes", String(CAP)]);
  });
  after(async () => server.stop());

  /** Text that makes the part's ClientUpdate (seq `seq`) encode to exactly `size` bytes. */
  function textFor(sid: string, seq: number, partId: string, size: number): string {
    const encoded = (n: number) =>
      ClientUpdate.encode(ClientUpdate.fromPartial({ seq, sessionId: sid, upsertPart: textPart("u1", partId, "z".repeat(n)) })).finish().length;
    let n = size;
    while (encoded(n) > size) n--;
    assert.equal(encoded(n), size);
    return "z".repeat(n);
  }

  function assertRefusedAlone(err: unknown): true {
    assert.ok(err instanceof CompactdError, String(err));
    assert.equal(err.codeName, "RESOURCE_EXHAUSTED", err.message);
    assert.equal(err.streamEnded, false, err.message);
    assert.equal(err.seq, undefined, err.message);
    assert.match(err.message, /maxUpdateBytes/);
    assert.match(err.message, new RegExp(`${CAP}`));
    return true;
  }

  test("an update over maxUpdateBytes is refused alone; the stream goes on", async () => {
    // compactd refuses an update far past its --max-update-bytes at the transport, which ends
    // the whole stream (every session on it): the client checks the encoded size first.
    const options = { deadlineMs: 10_000, maxUpdateBytes: CAP };
    const c = server.client(options);
    const s = c.stream();
    const sid = "over-the-limit";
    const edge = textFor(sid, 3, "p-edge", CAP);
    await s.open({ id: sid });
    await s.upsertMessage(sid, userMsg("u1"));
    await assert.rejects(s.upsertPart(sid, textPart("u1", "p-big", "x".repeat(200_000))), assertRefusedAlone);
    await assert.rejects(s.upsertPart(sid, textPart("u1", "p-edge", edge + "z")), assertRefusedAlone); // one byte over
    const atLimit = await s.upsertPart(sid, textPart("u1", "p-edge", edge)); // exactly the limit
    assert.deepEqual([atLimit.seq, atLimit.created], [3, true]);
    const later = await s.upsertPart(sid, textPart("u1", "p-after", "small"));
    assert.deepEqual([later.seq, later.created], [4, true]);
    assert.equal(s.isClosed, false);
    const held = await c.getSession(sid);
    assert.deepEqual(held.messages[0]!.parts.map((p) => p.id), ["p-edge", "p-after"]);
    assert.equal(await s.end(), undefined, "a clean end");
  });

  test("updates sent after the stream failed reject with a new error saying so", async () => {
    // Each one rejected with the stream's own stored error: no streamEnded, no seq, so it
    // read as that update's own refusal (a host skipping RESOURCE_EXHAUSTED refusals
    // dropped every later update).
    const options = { deadlineMs: 10_000, maxUpdateBytes: null };
    const s = server.client(options).stream();
    const sid = "after-the-end";
    await s.open({ id: sid });
    await s.upsertMessage(sid, userMsg("u1"));
    let first: CompactdError | undefined;
    await assert.rejects(s.upsertPart(sid, textPart("u1", "p-big", "x".repeat(200_000))), (err: unknown) => {
      assert.ok(err instanceof CompactdError);
      assert.equal(err.streamEnded, true);
      assert.equal(err.seq, 3);
      first = err;
      return true;
    });
    const failure = await s.closed;
    assert.ok(failure instanceof CompactdError);
    assert.equal(failure.codeName, "RESOURCE_EXHAUSTED");
    const seen = new Set<unknown>([first, failure]);
    for (let i = 0; i < 20; i++) {
      for (const later of [() => s.upsertPart(sid, textPart("u1", `p${i}`, "small")), () => s.checkOverflow(sid)]) {
        await assert.rejects(later(), (err: unknown) => {
          assert.ok(err instanceof CompactdError, String(err));
          assert.ok(!seen.has(err), "a new error for each update, not the stream's own");
          seen.add(err);
          assert.equal(err.streamEnded, true, err.message);
          assert.equal(err.seq, undefined, err.message);
          assert.equal(err.codeName, "RESOURCE_EXHAUSTED", "the stream's code");
          assert.match(err.message, /the stream ended/);
          assert.match(err.message, /not sent/);
          assert.match(err.message, /max_update_bytes \(65536 bytes\)/, "the original failure");
          assert.equal(err.cause, failure);
          return true;
        });
      }
    }
  });

  test("maxUpdateBytes defaults to compactd's default, 16 MiB, and null turns the check off", async () => {
    const c = server.client();
    const s = c.stream();
    await s.open({ id: "default-limit" });
    await assert.rejects(s.send("default-limit", { upsertPart: textPart("u1", "p", "x".repeat(16 * 2 ** 20)) }), (err: unknown) => {
      assert.ok(err instanceof CompactdError);
      assert.equal(err.codeName, "RESOURCE_EXHAUSTED");
      assert.equal(err.streamEnded, false);
      assert.match(err.message, /maxUpdateBytes \(16777216 bytes\)/);
      return true;
    });
    assert.equal(s.isClosed, false);
    await s.end();
    for (const bad of [0, -1, 1.5, Number.NaN]) {
      assert.throws(() => new CompactdClient({ address: server.addr, maxUpdateBytes: bad }), RangeError);
    }
    const options = { deadlineMs: 10_000, maxUpdateBytes: null };
    const unchecked = server.client(options).stream();
    await unchecked.open({ id: "no-limit" });
    await unchecked.upsertMessage("no-limit", userMsg("u1"));
    // Unchecked, the update goes out and compactd ends the stream on it.
    await assert.rejects(unchecked.upsertPart("no-limit", textPart("u1", "p", "x".repeat(200_000))), (err: unknown) => {
      assert.ok(err instanceof CompactdError);
      assert.equal(err.codeName, "RESOURCE_EXHAUSTED");
      assert.equal(err.streamEnded, true);
      return true;
    });
  });
});
