// Connection options: bearer token, Unix socket, address from the environment.
import assert from "node:assert/strict";
import { createServer, type AddressInfo, type Socket } from "node:net";
import { join } from "node:path";
import { inspect } from "node:util";
import { after, before, describe, test } from "node:test";
import { CompactdClient, CompactdError } from "@compactd/client";
import { startCompactd, tempDir, writeFile, type Compactd } from "./harness.js";

const TOKEN = "s3cret-token-for-the-ts-client";

describe("bearer token (--auth-token-file)", () => {
  let server: Compactd;
  let dir: ReturnType<typeof tempDir>;
  before(async () => {
    dir = tempDir();
    const file = writeFile(join(dir.path, "token"), `${TOKEN}\n`);
    server = await startCompactd(["--auth-token-file", file]);
  });
  after(async () => {
    await server.stop();
    dir.remove();
  });

  test("calls without the token are UNAUTHENTICATED, on every kind of call", async () => {
    const anon = server.client();
    await assert.rejects(anon.listSessions(), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAUTHENTICATED" && e.code === 16);
    await assert.rejects(anon.subscribe().next(), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAUTHENTICATED");
    const s = anon.stream();
    await assert.rejects(s.open({ id: "x" }), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAUTHENTICATED");
    const ended = await s.closed;
    assert.equal(ended?.codeName, "UNAUTHENTICATED", "the stream ends with the status");
    const wrong = server.client({ token: "wrong" });
    await assert.rejects(wrong.listSessions(), (e: unknown) => e instanceof CompactdError && e.codeName === "UNAUTHENTICATED");
  });

  test("calls with the token go through (unary and stream)", async () => {
    const c = server.client({ token: TOKEN });
    await c.openSession({ id: "authed" });
    const s = c.stream();
    assert.equal((await s.upsertMessage("authed", { id: "u1", role: "user" })).kind, "upsert_message");
    await s.end();
    assert.deepEqual((await c.listSessions()).map((x) => x.id), ["authed"]);
    // A host that logs its client (console.log, a logger dumping objects) shows no token.
    for (const shown of [inspect(c, { showHidden: true, depth: 5 }), JSON.stringify(Object.entries(c))]) {
      assert.ok(!shown.includes(TOKEN), shown);
    }
  });

  test("a token read with its file's newline works, as the server reads it; one no header can carry fails without showing it", async () => {
    // A Kubernetes secret or `cat token` keeps the newline: the server trims it, so does the client.
    const c = server.client({ token: `  ${TOKEN}\n` });
    assert.ok((await c.listSessions()).length >= 0);
    c.close();
    const bad = `${TOKEN}\u0007inside`;
    assert.throws(
      () => server.client({ token: bad }),
      (e: unknown) => e instanceof Error && /token/.test(e.message) && !e.message.includes(TOKEN) && !(e.stack ?? "").includes(TOKEN),
    );
  });

  test("the token can come from COMPACTD_AUTH_TOKEN, the address from COMPACTD_ADDR", async () => {
    const saved = { a: process.env.COMPACTD_ADDR, t: process.env.COMPACTD_AUTH_TOKEN };
    process.env.COMPACTD_ADDR = server.addr;
    process.env.COMPACTD_AUTH_TOKEN = TOKEN;
    try {
      const c = new CompactdClient();
      assert.equal(c.address, server.addr);
      assert.ok((await c.listSessions()).length >= 1);
      c.close();
    } finally {
      for (const [k, v] of [["COMPACTD_ADDR", saved.a], ["COMPACTD_AUTH_TOKEN", saved.t]] as const) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    }
  });
});

describe("Unix socket (--listen unix:/path)", () => {
  let server: Compactd;
  let dir: ReturnType<typeof tempDir>;
  before(async () => {
    dir = tempDir();
    server = await startCompactd(["--listen", `unix:${join(dir.path, "compactd.sock")}`]);
  });
  after(async () => {
    await server.stop();
    dir.remove();
  });

  test("the start log's address works as the client address", async () => {
    assert.match(server.addr, /^unix:/);
    const c = server.client();
    await c.waitForReady();
    await c.openSession({ id: "uds" });
    const s = c.stream();
    await s.upsertMessage("uds", { id: "u1", role: "user" });
    await s.upsertPart("uds", { id: "p1", messageId: "u1", text: { text: "over a socket" } });
    const ctx = await s.getContext("uds", "openai");
    assert.deepEqual(ctx.openaiMessages, [{ role: "user", content: "over a socket" }]);
    await s.end();
  });
});

describe("waitForReady", () => {
  test("a server that never speaks HTTP/2: DEADLINE_EXCEEDED at the timeout", async () => {
    // A TCP listener that accepts and stays silent: the connection never becomes ready.
    const sockets = new Set<Socket>();
    const silent = createServer((sock) => sockets.add(sock));
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
    const c = new CompactdClient({ address: `127.0.0.1:${(silent.address() as AddressInfo).port}` });
    try {
      await assert.rejects(c.waitForReady(300), (e: unknown) => {
        assert.ok(e instanceof CompactdError, String(e));
        assert.equal(e.codeName, "DEADLINE_EXCEEDED", e.message);
        assert.match(e.details, /not ready within 300 ms/);
        return true;
      });
    } finally {
      c.close();
      for (const sock of sockets) sock.destroy();
      await new Promise((r) => silent.close(r));
    }
  });

  test("a refused address: UNAVAILABLE at the timeout, naming the failing attempts", async () => {
    // A port just freed: connecting is refused, again and again until the timeout (a
    // refusal takes a moment: 2 s is plenty for the first).
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
    const port = (probe.address() as AddressInfo).port;
    await new Promise((r) => probe.close(r));
    const c = new CompactdClient({ address: `127.0.0.1:${port}` });
    try {
      await assert.rejects(c.waitForReady(2_000), (e: unknown) => {
        assert.ok(e instanceof CompactdError, String(e));
        assert.equal(e.codeName, "UNAVAILABLE", e.message);
        assert.match(e.details, /TRANSIENT_FAILURE: its connection attempts are failing/);
        return true;
      });
    } finally {
      c.close();
    }
  });

  test("a running compactd: ready", async () => {
    const server = await startCompactd();
    try {
      await server.client().waitForReady(20_000);
    } finally {
      await server.stop();
    }
  });
});
