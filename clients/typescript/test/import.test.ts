// ImportSessionChunked: a document past compactd's max_update_bytes imports in chunks,
// as text or as an object, against the real binary.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { CompactdError, type CompactdClient } from "@compactd/client";
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
});
