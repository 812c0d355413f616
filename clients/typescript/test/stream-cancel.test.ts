// Cancelling compactions started on a stream (compactd does not tie them to the call):
// a break, the stream's end() and cancel() send cancel_compaction; nothing once one ended.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import type { CompactdClient, SessionEvent } from "@compactd/client";
import { seedTurns, textPart, userMsg, startCompactd, startFakeLlm, waitFor, type Compactd, type FakeLlm } from "./harness.js";

/** A reply slow enough (about 15 s) that a compaction not cancelled is still running when checked. */
const SLOW = { chunks: ["## Objective\n", ...Array.from({ length: 14 }, (_, i) => `slow ${i} `)], delayMs: 1_000 };
const QUICK = { chunks: ["## Objective\n", "Quick."] };

async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what} still pending after ${ms} ms`)), ms)));
  try {
    return await Promise.race([p, late]);
  } finally {
    clearTimeout(timer);
  }
}

describe("stream compactions are cancelled by their caller", () => {
  let fake: FakeLlm;
  let server: Compactd;
  let c: CompactdClient;
  before(async () => {
    fake = await startFakeLlm([QUICK]);
    server = await startCompactd(["--llm-base-url", fake.baseUrl, "--llm-model", "fake-model", "--llm-timeout-secs", "60"], {
      COMPACTD_LLM_API_KEY: "sk-test",
    });
    c = server.client();
  });
  after(async () => {
    await server.stop();
    await fake.stop();
  });

  /** A seeded session, and a subscription gathering its compaction outcomes. */
  async function watched(sid: string) {
    await c.openSession({ id: sid, limits: { context: 100_000, output: 20_000 } });
    await seedTurns(c, sid);
    const sub = c.subscribe(sid);
    await sub.ready;
    const outcomes: string[] = [];
    void (async () => {
      for await (const e of sub as AsyncIterable<SessionEvent>) {
        const x = e.compaction;
        if (x?.compacted) outcomes.push("compacted");
        if (x?.failed) outcomes.push(`failed:${x.failed.kind}`);
      }
    })().catch(() => undefined);
    return { sub, outcomes };
  }

  test("a break after started cancels the compaction: not committed, end() does not wait for it", async () => {
    const sid = "sc-break";
    const { sub, outcomes } = await watched(sid);
    const before = await ids(sid);
    fake.script = [SLOW];
    const s = c.stream();
    const run = await s.compact(sid);
    for await (const e of run) {
      assert.ok(e.started, JSON.stringify(e));
      break;
    }
    const r = await within(run.result(), 10_000, "result()");
    assert.equal(r.compacted, undefined);
    assert.equal(r.failed?.kind, "cancelled", JSON.stringify(r));
    assert.equal(await within(s.end(), 10_000, "end() after a break"), undefined);
    await waitFor(() => outcomes.length > 0, 15_000, "the compaction's outcome");
    assert.deepEqual(outcomes, ["failed:cancelled"]);
    assert.equal(await ids(sid), before, "the session is not compacted");
    sub.cancel();
  });

  test("end() while a stream compaction runs cancels it", async () => {
    const sid = "sc-end";
    const { sub, outcomes } = await watched(sid);
    const before = await ids(sid);
    fake.script = [SLOW];
    const s = c.stream();
    const run = await s.compact(sid);
    assert.ok((await run.next()).value?.started);
    assert.equal(await within(s.end(), 10_000, "end()"), undefined);
    const r = await within(run.result(), 10_000, "result()");
    assert.equal(r.failed?.kind, "cancelled", JSON.stringify(r));
    await waitFor(() => outcomes.length > 0, 15_000, "the compaction's outcome");
    assert.deepEqual(outcomes, ["failed:cancelled"]);
    assert.equal(await ids(sid), before, "the session is not compacted");
    sub.cancel();
  });

  test("cancel() of the stream cancels its running compaction", async () => {
    const sid = "sc-cancel";
    const { sub, outcomes } = await watched(sid);
    fake.script = [SLOW];
    const s = c.stream();
    const run = await s.compact(sid);
    assert.ok((await run.next()).value?.started);
    s.cancel();
    assert.equal((await s.closed)?.codeName, "CANCELLED");
    await waitFor(() => outcomes.length > 0, 10_000, "the compaction's outcome");
    assert.deepEqual(outcomes, ["failed:cancelled"]);
    sub.cancel();
  });

  test("a compaction that ended sends nothing on cancel or break: the session's next one completes", async () => {
    const sid = "sc-ended";
    const { sub, outcomes } = await watched(sid);
    fake.script = [QUICK];
    const s = c.stream();
    const first = await s.compact(sid);
    const firstIt = first[Symbol.asyncIterator]();
    // Read up to the outcome, leaving the iterator open (a break comes later).
    await waitFor(() => outcomes.length > 0, 15_000, "the first outcome");
    assert.deepEqual(outcomes, ["compacted"]);
    for (const n of [4, 5]) await seedMore(sid, n);
    // The next compaction, on another client's call, then on the same stream.
    fake.script = [{ ...SLOW, chunks: SLOW.chunks.slice(0, 4) }];
    const other = c.compact(sid);
    assert.ok((await other.next()).value?.started);
    first.cancel();
    await firstIt.return?.();
    const r = await within(other.result(), 20_000, "the other client's compaction");
    assert.ok(r.compacted, JSON.stringify(r));

    for (const n of [6, 7]) await seedMore(sid, n);
    const second = await s.compact(sid);
    assert.ok((await second.next()).value?.started);
    first.cancel();
    const r2 = await within(second.result(), 20_000, "the stream's second compaction");
    assert.ok(r2.compacted, JSON.stringify(r2));
    assert.deepEqual(outcomes, ["compacted", "compacted", "compacted"]);
    await within(s.end(), 10_000, "end()");
    sub.cancel();
  });

  async function seedMore(sid: string, n: number): Promise<void> {
    await c.upsertMessage(sid, userMsg(`u${n}`));
    await c.upsertPart(sid, textPart(`u${n}`, `u${n}-t`, `user turn ${n} with more words`));
  }

  /** The ids of the session's context messages (a commit replaces the old ones by a summary). */
  async function ids(sid: string): Promise<string> {
    return JSON.stringify((await c.getContext(sid, "native")).messages.map((m) => m.info?.id));
  }
});
