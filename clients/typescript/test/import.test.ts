// ImportSessionChunked: a document past compactd's max_update_bytes imports in chunks,
// as text or as an object, against the real binary.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { Server, ServerCredentials, type sendUnaryData, type ServerUnaryCall } from "@grpc/grpc-js";
import { CompactdClient, CompactdError, SessionsService, SessionSummary, type ImportSessionRequest } from "@compactd/client";
import { REPO, startCompactd, type Compactd } from "./harness.js";

const CAP = 65536;
const TRACE = readFileSync(join(REPO, "tests/data/traces/claudecode-subagent-6633a783.json"), "utf8");
const DOC = JSON.parse(TRACE) as { messages: { info: { id: string } }[] };

describe("chunked import", () => {
  let server: Compactd;
  before(async () => {
    server = await startCompactd(["--max-update-bytes", String(CAP)]);
  });
  after(async () => server.stop());

  test("a document past the cap is refused whole and imports in chunks", async () => {
    assert.ok(Buffer.byteLength(TRACE) > 4 * CAP);
    const whole: CompactdClient = server.client({ importChunkBytes: 0 });
    await assert.rejects(whole.importSession({ exportJson: TRACE, sessionId: "ts-whole" }), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "RESOURCE_EXHAUSTED");
      assert.match(e.details, /max_update_bytes/);
      return true;
    });
    const c = server.client({ importChunkBytes: CAP / 2 });
    const text = await c.importSession({ exportJson: TRACE, sessionId: "ts-text" });
    const object = await c.importSession({ export: DOC, sessionId: "ts-object" });
    assert.equal(text.messages, DOC.messages.length);
    assert.equal(object.messages, text.messages);
    assert.equal(object.parts, text.parts);
    assert.equal(object.estimatedTokens, text.estimatedTokens);
    const held = await c.getSession("ts-text");
    assert.deepEqual(
      held.messages.map((m) => m.info?.id),
      DOC.messages.map((m) => m.info.id),
    );
  });

  test("a refused chunked import rejects with the server's error", async () => {
    const c = server.client({ importChunkBytes: CAP / 2 });
    const broken = TRACE.replace('"messages"', '"messagez"');
    await assert.rejects(c.importSession({ exportJson: broken, sessionId: "ts-broken" }), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "INVALID_ARGUMENT");
      return true;
    });
  });

  test("a long document in many large chunks waits for the call to drain, and arrives whole", async () => {
    // A document of about 6 MB in 300 KiB chunks: more than grpc-js buffers before
    // write() says to wait.
    const text = TRACE + " ".repeat(6 * 2 ** 20); // still one JSON document
    const big = DOC;
    const roomy = await startCompactd();
    try {
      const c = roomy.client({ importChunkBytes: 300 * 1024 });
      const writes: boolean[] = [];
      spyOnWrites(c, (ok) => writes.push(ok));
      const s = await c.importSession({ exportJson: text, sessionId: "ts-drained" });
      assert.equal(s.messages, big.messages.length);
      assert.ok(writes.length > 16 && writes.includes(false), `write() results: ${writes.join()}`);
    } finally {
      await roomy.stop();
    }
  });

  test("an abort mid-upload cancels the call", async () => {
    const c = server.client({ importChunkBytes: 16 * 1024 });
    const abort = new AbortController();
    spyOnWrites(c, () => abort.abort());
    await assert.rejects(c.importSession({ exportJson: TRACE, sessionId: "ts-aborted" }, { signal: abort.signal }), (e: unknown) => {
      assert.ok(e instanceof CompactdError);
      assert.equal(e.codeName, "CANCELLED");
      return true;
    });
    await assert.rejects(c.getSession("ts-aborted"), (e: unknown) => e instanceof CompactdError && e.codeName === "NOT_FOUND");
  });
});

/** Calls `seen` with what each write() of `c`'s client-streaming calls returned. */
function spyOnWrites(c: CompactdClient, seen: (ok: boolean) => void): void {
  const raw = c.raw as unknown as { makeClientStreamRequest: (...args: unknown[]) => { write: (chunk: unknown) => boolean } };
  const make = raw.makeClientStreamRequest.bind(raw);
  raw.makeClientStreamRequest = (...args: unknown[]) => {
    const call = make(...args);
    const write = call.write.bind(call);
    call.write = (chunk: unknown) => {
      const ok = write(chunk);
      seen(ok);
      return ok;
    };
    return call;
  };
}

test("a compactd without ImportSessionChunked gets the document whole", async () => {
  const seen: number[] = [];
  const old = new Server();
  old.addService(SessionsService, {
    importSession: (call: ServerUnaryCall<ImportSessionRequest, SessionSummary>, done: sendUnaryData<SessionSummary>) => {
      seen.push(call.request.exportJson.length);
      done(null, SessionSummary.fromPartial({ id: call.request.sessionId, messages: 1 }));
    },
  } as never);
  const port = await new Promise<number>((resolve, reject) =>
    old.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  const c = new CompactdClient({ address: `127.0.0.1:${port}`, importChunkBytes: CAP / 2 });
  try {
    const s = await c.importSession({ exportJson: TRACE, sessionId: "old" });
    assert.equal(s.id, "old");
    assert.deepEqual(seen, [TRACE.length]);
  } finally {
    c.close();
    old.forceShutdown();
  }
});

test("importChunkBytes is checked", () => {
  for (const bad of [-1, 1.5, Number.NaN]) {
    assert.throws(() => new CompactdClient({ importChunkBytes: bad }), RangeError);
  }
});
