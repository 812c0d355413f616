// Compact and Subscribe, with compactd's summarizer pointed at a fake OpenAI-compatible
// streaming endpoint (node http, SSE chat.completion chunks).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { CompactdClient, CompactdError, collectCompaction, type CompactionEvent, type SessionEvent } from "@compactd/client";
import { seedTurns, startCompactd, startFakeLlm, userMsg, textPart, waitFor, type Compactd, type FakeLlm } from "./harness.js";

const SECRET = "sk-test-SECRET-ts-client";

describe("Compact and Subscribe", () => {
  let fake: FakeLlm;
  let server: Compactd;
  let c: CompactdClient;
  before(async () => {
    fake = await startFakeLlm([{ chunks: ["## Objective\n", "Fix the ", "failing test."] }]);
    server = await startCompactd(["--llm-base-url", fake.baseUrl, "--llm-model", "fake-model", "--llm-timeout-secs", "20"], {
      COMPACTD_LLM_API_KEY: SECRET,
    });
    c = server.client();
  });
  after(async () => {
    await server.stop();
    await fake.stop();
  });

  async function seeded(sid: string): Promise<void> {
    await c.openSession({ id: sid, limits: { context: 100_000, output: 20_000 } });
    await seedTurns(c, sid);
  }

  test("a stream compaction refused before it is sent leaves one sent beside it routed", async () => {
    // A refused update spends no seq: the next compact() registers under the same one,
    // and the refused one's cleanup took its queue: its result never came.
    const sid = "cmp-seq";
    await seeded(sid);
    fake.script = [{ chunks: ["## Objective\n", "Routed."] }];
    const s = c.stream();
    const [bad, good] = await Promise.allSettled([s.compact(sid, { tailTurns: 1.5 } as never), s.compact(sid)]);
    assert.equal(bad.status, "rejected");
    assert.match(String((bad as PromiseRejectedResult).reason), /encode/);
    assert.equal(good.status, "fulfilled", String((good as PromiseRejectedResult).reason));
    const run = (good as PromiseFulfilledResult<Awaited<ReturnType<typeof s.compact>>>).value;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<"late">((r) => (timer = setTimeout(() => r("late"), 15_000)));
    const result = await Promise.race([run.result(), late]);
    clearTimeout(timer);
    assert.notEqual(result, "late", "the compaction's events reached it");
    assert.ok((result as { compacted?: unknown }).compacted, JSON.stringify(result));
    await s.end();
  });

  test("a Compact read late gets every event, its outcome last", async () => {
    // More deltas than the call reads ahead (it pauses past 256): the call ends while
    // events still wait in its paused buffer. Before, its end emptied the queue first and
    // those events, the outcome among them, were dropped.
    const sid = "cmp-late";
    await seeded(sid);
    const pieces = ["## Objective\n", ...Array.from({ length: 599 }, (_, i) => `d${i} `)];
    // A millisecond between pieces lets compactd hand each on alone, mostly: the call
    // then has far more than 256 events to pause on.
    fake.script = [{ chunks: pieces, delayMs: 1 }];
    const run = c.compact(sid);
    await new Promise((r) => setTimeout(r, 1_500));
    const events: CompactionEvent[] = [];
    for await (const e of run) {
      events.push(e);
      // Slow enough for the call to pause and resume again and again.
      if (events.length % 50 === 0) await new Promise((r) => setTimeout(r, 20));
    }
    // compactd joins pieces the call has no room for yet (it reads the answer on while the
    // caller lags), so the count may be below 600; but no delta it sent may be missing:
    // their indices run 0, 1, 2, ... and their text is the whole answer.
    const deltas = events.filter((e) => e.delta).map((e) => e.delta!);
    assert.deepEqual(
      deltas.map((d) => d.index),
      deltas.map((_, i) => i),
      `delta indices of ${events.length} events`,
    );
    assert.equal(deltas.map((d) => d.text).join(""), pieces.join(""), `deltas read: ${deltas.length} of ${events.length} events`);
    assert.ok(events.at(-1)?.compacted, `the last of ${events.length}: ${JSON.stringify(events.at(-1))}`);
  });

  test("Compact streams started, the summary deltas, then compacted; Subscribe sees the same", async () => {
    const sid = "cmp-1";
    await seeded(sid);
    const watch = c.subscribe(sid);
    await watch.ready;
    const all = c.subscribe();
    await all.ready;
    fake.script = [{ chunks: ["## Objective\n", "Fix the ", "failing test."] }];
    const before = fake.requests.length;

    const run = c.compact(sid, { instructions: "focus on the failing test" });
    const events: CompactionEvent[] = [];
    for await (const e of run) events.push(e);
    assert.ok(events[0]?.started, "started comes first");
    assert.equal(events[0]!.started!.auto, false);
    assert.equal(events[0]!.started!.model, "fake-model");
    const deltas = events.filter((e) => e.delta).map((e) => e.delta!);
    assert.deepEqual(deltas.map((d) => d.text), ["## Objective\n", "Fix the ", "failing test."]);
    assert.deepEqual(deltas.map((d) => d.index), [0, 1, 2]);
    const last = events.at(-1)!;
    assert.ok(last.compacted, JSON.stringify(last));
    assert.ok(last.compacted.tokensAfter < last.compacted.tokensBefore);
    assert.equal(last.compacted.auto, false);
    assert.ok(events.every((e) => e.sessionId === sid && e.compactionId === events[0]!.compactionId && e.compactionId !== ""));

    // What the endpoint got: one streamed request with the key, the model and the instructions.
    assert.equal(fake.requests.length, before + 1);
    const req = fake.requests.at(-1)!;
    assert.equal(req.model, "fake-model");
    assert.equal(req.stream, true);
    assert.equal(fake.auth.at(-1), `Bearer ${SECRET}`);
    assert.match(JSON.stringify(req.messages), /focus on the failing test/);
    assert.match(JSON.stringify(req.messages), /user turn 1/);

    // The context now starts at the compaction: the user message, then the summary.
    const ctx = await c.getContext(sid, "native");
    assert.equal(ctx.boundaryMessageId, last.compacted.userMessageId);
    assert.equal(ctx.messages[0]!.info?.id, last.compacted.userMessageId);
    assert.ok(ctx.messages[0]!.parts.some((p) => p.compaction), "a compaction part");
    assert.equal(ctx.messages[1]!.info?.id, last.compacted.summaryMessageId);
    assert.equal(ctx.messages[1]!.info?.summary, true);
    assert.match(ctx.messages[1]!.parts.map((p) => p.text?.text ?? "").join(""), /## Objective\nFix the failing test\./);
    const openai = await c.getOpenAIMessages(sid);
    assert.match(JSON.stringify(openai), /Fix the failing test\./);

    // Watchers saw the same compaction, by session and unfiltered.
    const collect = async (it: AsyncIterator<SessionEvent>, n: number) => {
      const out: SessionEvent[] = [];
      while (out.length < n) {
        const r = await it.next();
        if (r.done) break;
        if (r.value.compaction?.compactionId === last.compactionId) out.push(r.value);
      }
      return out;
    };
    const watched = await collect(watch, events.length);
    assert.deepEqual(watched.map((e) => e.compaction), events, "Subscribe(session) relays every compaction event");
    const global = await collect(all, events.length);
    assert.equal(global.length, events.length);
    assert.ok(global.every((e) => e.sessionId === sid));
    watch.cancel();
    all.cancel();
    assert.equal((await watch.next()).done, true, "a cancelled subscription just ends");
  });

  test("result() gathers the summary; the stream's compact update streams the same events after its ack", async () => {
    fake.script = [{ chunks: ["first ", "summary"] }];
    const sid = "cmp-2";
    await seeded(sid);
    const r = await c.compact(sid).result();
    assert.equal(r.summary, "first summary");
    assert.ok(r.compacted);
    assert.equal(r.failed, undefined);

    // More turns, then compact from the main stream.
    fake.script = [{ chunks: ["second ", "summary ", "via stream"] }];
    for (const n of [4, 5, 6]) {
      await c.upsertMessage(sid, userMsg(`u${n}`));
      await c.upsertPart(sid, textPart(`u${n}`, `u${n}-t`, `user turn ${n}`));
    }
    const s = c.stream();
    const relayed: CompactionEvent[] = [];
    s.on("compaction", (e) => relayed.push(e));
    const run = await s.compact(sid, { tailTurns: 1 });
    assert.equal(run.ack.kind, "compact");
    assert.equal(run.ack.seq, 1);
    const res = await run.result();
    assert.equal(res.summary, "second summary via stream");
    assert.ok(res.compacted, JSON.stringify(res.events));
    assert.deepEqual(relayed, res.events, "the compaction listener saw the same events");
    await s.end();
  });

  test("a failed summary ends with failed (kind, retryable); the session is unchanged", async () => {
    fake.script = [{ chunks: [] }];
    const sid = "cmp-3";
    await seeded(sid);
    const before = await c.getContext(sid, "native");
    const r = await c.compact(sid).result();
    assert.equal(r.compacted, undefined);
    assert.ok(r.failed, JSON.stringify(r.events));
    assert.ok(r.failed.kind.length > 0);
    assert.equal(typeof r.failed.retryable, "boolean");
    const afterCtx = await c.getContext(sid, "native");
    assert.deepEqual(afterCtx.messages.map((m) => m.info?.id), before.messages.map((m) => m.info?.id));
  });

  test("cancel_compaction on the stream ends a running compaction with failed/cancelled; a second Compact meanwhile is FAILED_PRECONDITION", async () => {
    fake.script = [{ chunks: [], hang: true }];
    const sid = "cmp-4";
    await seeded(sid);
    const aborted = fake.aborted;
    const sent = fake.requests.length;
    const s = c.stream();
    const run = await s.compact(sid);
    // This compaction's own request, not any request holding "user turn 3" (earlier
    // tests' do; this one's summarizes turn 1 only), which was true at once: a cancel
    // before the request is sent leaves none to drop.
    await waitFor(() => fake.requests.length > sent, 15_000, "the LLM request");
    await assert.rejects(c.compact(sid).result(), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "FAILED_PRECONDITION");
      return true;
    });
    const cancel = await s.cancelCompaction(sid);
    assert.equal(cancel.kind, "cancel_compaction");
    const res = await run.result();
    assert.equal(res.failed?.kind, "cancelled", JSON.stringify(res.events));
    await waitFor(() => fake.aborted > aborted, 15_000, "the LLM request to be dropped");
    await s.end();
  });

  test("dropping the Compact call cancels it: break out of the iterator", async () => {
    fake.script = [{ chunks: [], hang: true }];
    const sid = "cmp-5";
    await seeded(sid);
    const aborted = fake.aborted;
    const n = fake.requests.length;
    for await (const e of c.compact(sid)) {
      assert.ok(e.started);
      await waitFor(() => fake.requests.length > n, 15_000, "the LLM request");
      break;
    }
    await waitFor(() => fake.aborted > aborted, 15_000, "the LLM request to be dropped");
    // The session accepts a new compaction once the cancelled one has wound down.
    fake.script = [{ chunks: ["after ", "cancel"] }];
    const deadline = Date.now() + 15_000;
    let r;
    for (;;) {
      try {
        r = await c.compact(sid).result();
        break;
      } catch (e) {
        if (!(e instanceof CompactdError && e.codeName === "FAILED_PRECONDITION")) throw e;
        // The cancelled one is still winding down.
        assert.ok(Date.now() < deadline, `the cancelled compaction still holds the session after 15 s: ${e.message}`);
        await new Promise((res) => setTimeout(res, 20));
      }
    }
    assert.equal(r?.summary, "after cancel");
  });

  /** Starts a compaction of `sid` that hangs at the LLM, and waits for `started` and its request. */
  async function hanging(sid: string, opts?: { signal?: AbortSignal }) {
    fake.script = [{ chunks: [], hang: true }];
    await seeded(sid);
    const aborted = fake.aborted;
    const sent = fake.requests.length;
    const run = c.compact(sid, {}, opts);
    const first = await run.next();
    assert.ok(first.value?.started, JSON.stringify(first.value));
    await waitFor(() => fake.requests.length > sent, 15_000, "the LLM request");
    return { run, aborted, started: first.value as CompactionEvent };
  }

  /** The compaction's result, or a failure after 15 s (generous: it is due at once). */
  async function resultWithin(run: ReturnType<CompactdClient["compact"]>) {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error("result() still pending after 15 s")), 15_000)));
    try {
      return await Promise.race([run.result(), late]);
    } finally {
      clearTimeout(timer);
    }
  }

  test("a compact() run cancelled after started ends failed, kind cancelled", async () => {
    const sid = "cmp-cancel";
    const { run, aborted, started } = await hanging(sid);
    run.cancel();
    const r = await resultWithin(run);
    assert.equal(r.compacted, undefined);
    assert.equal(r.failed?.kind, "cancelled", JSON.stringify(r));
    assert.equal(r.failed?.retryable, false);
    assert.match(r.failed?.reason ?? "", /cancelled by this client/);
    assert.equal(r.compactionId, started.compactionId);
    const last = r.events.at(-1)!;
    assert.equal(last.sessionId, sid);
    assert.equal(last.compactionId, started.compactionId, "the iteration's last event is the failure");
    await waitFor(() => fake.aborted > aborted, 15_000, "the LLM request to be dropped");
  });

  test("a compact() run cancelled by its abort signal ends failed, kind cancelled", async () => {
    const ac = new AbortController();
    const { run, aborted } = await hanging("cmp-abort", { signal: ac.signal });
    ac.abort();
    const r = await resultWithin(run);
    assert.equal(r.compacted, undefined);
    assert.equal(r.failed?.kind, "cancelled", JSON.stringify(r));
    await waitFor(() => fake.aborted > aborted, 15_000, "the LLM request to be dropped");
  });

  test("a compact() run's outcome that arrived before its cancel is kept", async () => {
    const sid = "cmp-cancel-late";
    await seeded(sid);
    fake.script = [{ chunks: ["## Objective\n", "Kept."] }];
    const run = c.compact(sid);
    // started, two deltas, compacted: all read by the call, none taken yet.
    await waitFor(() => run.buffered >= 4, 15_000, "the compaction's four events");
    run.cancel();
    const r = await resultWithin(run);
    assert.ok(r.compacted, JSON.stringify(r));
    assert.equal(r.failed, undefined);
    assert.equal(r.summary, "## Objective\nKept.");
  });

  test("a deadline on Compact ends the call with DEADLINE_EXCEEDED", async () => {
    fake.script = [{ chunks: [], hang: true }];
    const sid = "cmp-6";
    await seeded(sid);
    await assert.rejects(c.compact(sid, {}, { deadlineMs: 300 }).result(), (e: unknown) => e instanceof CompactdError && e.codeName === "DEADLINE_EXCEEDED");
  });

  test("Compact and Subscribe reject unknown sessions with NOT_FOUND naming session_id", async () => {
    await assert.rejects(c.compact("nope").result(), (e: unknown) => e instanceof CompactdError && e.codeName === "NOT_FOUND" && e.field === "session_id");
    const sub = c.subscribe("nope");
    await assert.rejects(sub.next(), (e: unknown) => e instanceof CompactdError && e.codeName === "NOT_FOUND" && e.field === "session_id");
    await assert.rejects(sub.ready, (e: unknown) => e instanceof CompactdError && e.codeName === "NOT_FOUND");
  });

  test("Subscribe relays overflow events", async () => {
    const sid = "sub-overflow";
    await c.openSession({ id: sid, limits: { context: 16_000, output: 4_000 } });
    const sub = c.subscribe(sid);
    await sub.ready;
    await c.upsertMessage(sid, userMsg("u1"));
    await c.reportUsage(sid, { tokens: { input: 15_000 } });
    const first = await sub.next();
    assert.equal(first.done, false);
    assert.equal(first.value.sessionId, sid);
    assert.equal(first.value.overflow?.overflow, true);
    assert.equal(first.value.overflow?.used, 15_000);
    sub.cancel();
  });
});

test("collectCompaction: a retry voids the deltas streamed before it", async () => {
  // compactd drops an answer it streamed when the endpoint had truncated the prompt,
  // says so with `retrying`, and streams the next answer from index 0.
  async function* events(): AsyncGenerator<CompactionEvent> {
    const e = (event: Partial<CompactionEvent>) => ({ sessionId: "s", compactionId: "c", ...event }) as CompactionEvent;
    yield e({ delta: { text: "summary of what was kept", index: 0 } });
    yield e({ retrying: { attempt: 2, reason: "the endpoint read 300 tokens", delayMs: 0 } });
    yield e({ delta: { text: "the real ", index: 0 } });
    yield e({ delta: { text: "summary", index: 1 } });
    yield e({ compacted: { userMessageId: "u", summaryMessageId: "s" } as CompactionEvent["compacted"] });
  }
  const r = await collectCompaction(events());
  assert.equal(r.summary, "the real summary");
});

describe("Compact without an endpoint", () => {
  let server: Compactd;
  before(async () => (server = await startCompactd()));
  after(async () => server.stop());

  test("is FAILED_PRECONDITION saying how to configure one", async () => {
    const c = server.client();
    await c.openSession({ id: "x" });
    await seedTurns(c, "x");
    await assert.rejects(c.compact("x").result(), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "FAILED_PRECONDITION");
      assert.match(e.details, /--llm-base-url/);
      return true;
    });
  });
});
