// Keepalive: a call with no deadline to a compactd that stops answering without closing
// the connection (SIGSTOP here; a hang or a network partition alike) fails UNAVAILABLE,
// by the client's default pings (every 20 s while calls are open, 10 s to answer).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { CompactdError } from "@compactd/client";
import { startCompactd, type Compactd } from "./harness.js";

describe("keepalive (client defaults)", () => {
  let server: Compactd;
  before(async () => (server = await startCompactd()));
  after(async () => {
    server.proc.kill("SIGCONT");
    await server.stop();
  });

  test("a subscription to a stopped compactd fails UNAVAILABLE within 60 s", async () => {
    const c = server.client();
    const sub = c.subscribe();
    await sub.ready;
    const next = sub.next().then(
      (r) => ({ ok: r }),
      (e: unknown) => ({ err: e }),
    );
    assert.ok(server.proc.kill("SIGSTOP"), "the server stopped");
    let timer: ReturnType<typeof setTimeout> | undefined;
    try {
      const late = new Promise<"late">((r) => (timer = setTimeout(() => r("late"), 60_000)));
      const got = await Promise.race([next, late]);
      assert.notEqual(got, "late", "the subscription still waits 60 s after the server stopped");
      const err = (got as { err?: unknown }).err;
      assert.ok(err instanceof CompactdError, `a CompactdError, not ${JSON.stringify(got)}`);
      assert.equal(err.codeName, "UNAVAILABLE", err.message);
    } finally {
      clearTimeout(timer);
      server.proc.kill("SIGCONT");
      c.close();
    }
  });
});
