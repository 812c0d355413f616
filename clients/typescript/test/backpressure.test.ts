// Backpressure: what a host sends faster than compactd reads waits in bounded room, and
// what compactd sends faster than a host reads is read no further ahead than a bound.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { CompactdError, MAX_UNREAD_EVENTS, MAX_UNSENT, type CompactdClient, type SessionEvent, type UpdateResult } from "@compactd/client";
import { textPart, userMsg, startCompactd, waitFor, type Compactd } from "./harness.js";

/** Resumes a stopped server whatever the test did. */
function resume(server: Compactd): void {
  if (server.proc.exitCode === null && server.proc.signalCode === null) server.proc.kill("SIGCONT");
}

describe("stream writes wait for room", () => {
  let server: Compactd;
  let c: CompactdClient;
  before(async () => {
    server = await startCompactd();
    c = server.client({ deadlineMs: 30_000 });
  });
  after(async () => {
    resume(server);
    await server.stop();
  });

  // compactd counts the tokens of each new text it is sent (once per text: it caches the
  // counts), which a debug build does slowly on a loaded machine: each of these tests has
  // room for that, and the package's --test-timeout (on Node 20 a limit for the whole file)
  // too.
  test("with the server stopped, at most MAX_UNSENT updates wait in the call; all are acked in order after", { timeout: 180_000 }, async () => {
    // write()'s return value was ignored: with the server stopped, every update sent went
    // into grpc-js' write buffer, without bound.
    const s = c.stream();
    const sid = "backpressure";
    await s.open({ id: sid });
    await s.upsertMessage(sid, userMsg("m1"));
    // 300 past what the call may hold: a stopped server takes about 60 of them (1 MiB into
    // the socket and its windows) and the rest wait in the stream.
    const total = MAX_UNSENT + 300;
    server.proc.kill("SIGSTOP");
    const results: Promise<UpdateResult>[] = [];
    let ended: Promise<CompactdError | undefined> | undefined;
    try {
      for (let i = 0; i < total; i++) {
        // 16 KiB each fills HTTP/2's windows after a few (and costs compactd a quarter of
        // what 64 KiB did to count); 16 parts updated in place keep the session small.
        const text = `${String(i).padStart(6, "0")}${"x".repeat(16 << 10)}`;
        const p = s.upsertPart(sid, textPart("m1", `p${i % 16}`, text));
        p.catch(() => undefined); // awaited below; a failed assertion leaves them unawaited
        results.push(p);
      }
      ended = s.end(); // half-closes once the updates waiting are written
      let most = s.call.writableLength;
      for (let t = 0; t < 50; t++) {
        await new Promise((r) => setTimeout(r, 10));
        most = Math.max(most, s.call.writableLength);
      }
      assert.ok(most <= MAX_UNSENT, `${most} updates waited in the call's write buffer`);
      assert.equal(s.inFlight, total, "every update is numbered and waits for its ack");
      assert.equal(s.unsent, MAX_UNSENT, "the call holds as many as it may");
      assert.ok(s.waiting > 0, "the rest wait in the stream, in order");
    } finally {
      resume(server);
    }
    const acked = await Promise.all(results);
    assert.deepEqual(
      acked.map((r) => r.seq),
      Array.from({ length: total }, (_, i) => i + 3),
    );
    assert.deepEqual([s.call.writableLength, s.unsent, s.waiting], [0, 0, 0]);
    assert.equal(await ended, undefined, "a clean end, after the last update's ack");
  });

  test("a host awaiting submit() holds at most MAX_UNSENT updates while the server is stopped", { timeout: 180_000 }, async () => {
    const s = c.stream();
    const sid = "submit-waits";
    await s.open({ id: sid });
    await s.upsertMessage(sid, userMsg("m1"));
    const total = MAX_UNSENT + 200;
    const results: Promise<UpdateResult>[] = [];
    server.proc.kill("SIGSTOP");
    let host: Promise<void> | undefined;
    try {
      host = (async () => {
        for (let i = 0; i < total; i++) {
          const text = `${String(i).padStart(6, "0")}${"x".repeat(16 << 10)}`;
          const { seq, result } = await s.submit(sid, { upsertPart: textPart("m1", `p${i % 16}`, text) });
          assert.equal(seq, i + 3);
          result.catch(() => undefined); // awaited below
          results.push(result);
        }
      })();
      // The host waits once the call holds MAX_UNSENT: wait for the call to be full (a
      // host starved for a moment is not one that waits), then for it to stop moving.
      await waitFor(() => s.unsent === MAX_UNSENT, 20_000, "the call to hold MAX_UNSENT updates");
      let last = -1;
      for (let still = 0; still < 10; ) {
        await new Promise((r) => setTimeout(r, 50));
        still = results.length === last ? still + 1 : 0;
        last = results.length;
      }
      assert.ok(results.length < total, "submit() never waited");
      assert.equal(s.unsent, MAX_UNSENT);
      assert.ok(s.waiting <= 1, `${s.waiting} waiting`);
    } finally {
      resume(server);
    }
    await host;
    const acked = await Promise.all(results);
    assert.deepEqual(
      acked.map((r) => r.seq),
      Array.from({ length: total }, (_, i) => i + 3),
    );
    assert.equal(await s.end(), undefined);
  });

  test("end({ timeoutMs }) cancels a stream the stopped server does not end", { timeout: 60_000 }, async () => {
    const s = c.stream();
    const sid = "end-bounded";
    await s.open({ id: sid });
    server.proc.kill("SIGSTOP");
    try {
      const unanswered = s.upsertMessage(sid, userMsg("m1"));
      unanswered.catch(() => undefined);
      const began = Date.now();
      const ended = await s.end({ timeoutMs: 1000 });
      assert.ok(Date.now() - began < 10_000, `end() took ${Date.now() - began} ms`);
      assert.ok(ended instanceof CompactdError && ended.codeName === "CANCELLED", String(ended));
      await assert.rejects(unanswered, (e: unknown) => e instanceof CompactdError && e.codeName === "CANCELLED");
    } finally {
      resume(server);
    }
    // A timeout that is no number of milliseconds is refused, the stream left open.
    const t = c.stream();
    await t.open({ id: sid });
    await assert.rejects(t.end({ timeoutMs: NaN }), (e: unknown) => e instanceof CompactdError && e.codeName === "INVALID_ARGUMENT" && e.field === "timeoutMs");
    await t.upsertMessage(sid, userMsg("m2"));
    assert.equal(await t.end({ timeoutMs: 30_000 }), undefined);
  });

  test("submit() rejects an update refused before it is numbered", async () => {
    const s = server.client({ maxUpdateBytes: 1024 }).stream();
    await s.open({ id: "submit-refused" });
    await assert.rejects(s.submit("submit-refused", { upsertMessage: userMsg("x".repeat(2048)) }), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "RESOURCE_EXHAUSTED");
      return true;
    });
    const { seq, result } = await s.submit("submit-refused", { upsertMessage: userMsg("u1") });
    assert.equal(seq, 2, "no seq is spent on the refused update");
    assert.equal((await result).kind, "upsert_message");
    s.cancel();
    await s.closed;
    await assert.rejects(s.submit("submit-refused", { upsertMessage: userMsg("u2") }), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.streamEnded, true);
      return true;
    });
  });
});

describe("server streams read no further ahead than the host", () => {
  let server: Compactd;
  let c: CompactdClient;
  let impatient: Compactd;
  before(async () => {
    server = await startCompactd();
    c = server.client({ deadlineMs: 30_000 });
    impatient = await startCompactd(["--slow-reader-grace-secs", "1"]);
  });
  after(async () => {
    await server.stop();
    await impatient.stop();
  });

  test("a watcher the host stopped reading is dropped by compactd after its slow-reader grace", async () => {
    // Subscribe read every event into a queue of its own whether or not the host iterated:
    // compactd's slow-reader protection never saw a TypeScript host fall behind, and the
    // host's memory grew with every event.
    const sid = "unread-watcher";
    const c = impatient.client({ deadlineMs: 30_000 });
    await c.openSession({ id: sid, limits: { context: 16_000, output: 4_000 } });
    await c.upsertMessage(sid, userMsg("u1"));
    const sub = c.subscribe(sid);
    await sub.ready;
    const s = c.stream();
    // Over the threshold: each usage report publishes an overflow event. A few at a time,
    // so that a watcher that reads keeps up.
    const total = 2_000;
    for (let i = 0; i < total; i += 20) {
      const batch = [];
      for (let j = i; j < i + 20; j++) batch.push(s.reportUsage(sid, { tokens: { input: 15_000 + j } }));
      await Promise.all(batch);
    }
    await s.end();
    await waitFor(() => sub.buffered >= MAX_UNREAD_EVENTS, 15_000, "the call to read ahead as far as it may");
    // Then well past the 1 s grace: compactd drops the watcher before the host reads on.
    await new Promise((r) => setTimeout(r, 5_000));
    assert.equal(sub.buffered, MAX_UNREAD_EVENTS, "the call read no further ahead");
    const seen: SessionEvent[] = [];
    let idle: NodeJS.Timeout | undefined;
    // A watcher never dropped would leave the host reading on, then waiting: it gives up
    // after 10 s without an event (a dropped one ends at once after its last event).
    const stopWhenIdle = () => {
      clearTimeout(idle);
      idle = setTimeout(() => sub.cancel(), 10_000);
    };
    stopWhenIdle();
    let failure: unknown;
    try {
      for await (const e of sub) {
        seen.push(e);
        stopWhenIdle();
      }
    } catch (e) {
      failure = e;
    } finally {
      clearTimeout(idle);
    }
    assert.ok(seen.length < total, `the host read all ${seen.length} events: they were all read ahead`);
    assert.ok(failure instanceof CompactdError, `the watcher was not dropped (${String(failure)})`);
    assert.equal(failure.codeName, "RESOURCE_EXHAUSTED");
    assert.match(failure.message, /watcher is not reading its events/);
    assert.deepEqual(
      seen.map((e) => e.overflow?.used),
      Array.from({ length: seen.length }, (_, i) => 15_000 + i),
      "the events before the drop, in order",
    );
  });

  test("a host that reads late gets every event in order: the call waits for it", async () => {
    const sid = "late-reader";
    await c.openSession({ id: sid, limits: { context: 16_000, output: 4_000 } });
    await c.upsertMessage(sid, userMsg("u1"));
    const sub = c.subscribe(sid);
    await sub.ready;
    const total = 400; // more than the call reads ahead, fewer than compactd holds for it
    for (let i = 0; i < total; i++) await c.reportUsage(sid, { tokens: { input: 15_000 + i } });
    await waitFor(() => sub.buffered >= MAX_UNREAD_EVENTS, 15_000, "the call to read ahead as far as it may");
    assert.equal(sub.buffered, MAX_UNREAD_EVENTS);
    const used: number[] = [];
    for await (const e of sub) {
      assert.ok(sub.buffered <= MAX_UNREAD_EVENTS);
      used.push(e.overflow!.used);
      if (used.length === total) break;
    }
    assert.deepEqual(used, Array.from({ length: total }, (_, i) => 15_000 + i));
  });
});
