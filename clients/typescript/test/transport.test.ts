/** Retries, timeouts, aborts and what goes on the wire. */

import assert from "node:assert/strict";
import { createServer as createHttpServer } from "node:http";
import { connect, createServer, type AddressInfo, type Server as NetServer, type Socket } from "node:net";
import { describe, it } from "node:test";
import { Client, Retry, TransportError, UnexpectedResponse, applied, type Acquired, type Replay } from "onceguard";
import { freePort, ns, useServer } from "./server.js";

const fx = useServer();
const quick = new Retry({ attempts: 3, initial: 0.01, maxDelay: 0.02 });

/** A `fetch` that records every request and answers from `script` (then passes through). */
function scripted(script: Array<(input: string, init: RequestInit) => Promise<Response>>): {
  fetch: typeof fetch;
  requests: Array<{ url: string; body: string | undefined }>;
} {
  const requests: Array<{ url: string; body: string | undefined }> = [];
  const impl = async (input: string | URL | Request, init: RequestInit = {}): Promise<Response> => {
    const url = String(input);
    requests.push({ url, body: typeof init.body === "string" ? init.body : undefined });
    const step = script.shift();
    return step ? step(url, init) : fetch(input, init);
  };
  return { fetch: impl as typeof fetch, requests };
}

function connectionReset(): Promise<Response> {
  return Promise.reject(new TypeError("fetch failed", { cause: Object.assign(new Error("socket hang up"), { code: "ECONNRESET" }) }));
}

describe("retries", () => {
  it("a 503 is retried, honouring Retry-After up to the policy's longest wait", async () => {
    const unavailable = (): Promise<Response> =>
      Promise.resolve(
        new Response('{"type":"https://onceguard.dev/problems/store-unavailable","status":503,"title":"x","detail":"y","retryable":true}', {
          status: 503,
          headers: { "content-type": "application/problem+json", "retry-after": "0" },
        }),
      );
    const wire = scripted([unavailable, unavailable]);
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, retry: quick, fetch: wire.fetch });
    const answer = await client.claim(ns("retry-503"), "k", { request: 1 });
    assert.equal(answer.outcome, "acquired");
    assert.equal(wire.requests.length, 3);
  });

  it("a dropped connection is retried for a claim, never for creating an API key", async () => {
    const claimWire = scripted([connectionReset]);
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, retry: quick, fetch: claimWire.fetch });
    assert.equal((await client.claim(ns("retry-reset"), "k", { request: 1 })).outcome, "acquired");
    assert.equal(claimWire.requests.length, 2);

    const keyWire = scripted([connectionReset]);
    const admin = new Client({ baseUrl: fx.server.url, apiKey: fx.server.adminKey, retry: quick, fetch: keyWire.fetch });
    await assert.rejects(admin.createApiKey("agent"), (e: unknown) => e instanceof TransportError && e.attempts === 1);
    assert.equal(keyWire.requests.length, 1);
  });

  it("a closed port fails with TransportError after every try", async () => {
    const port = await freePort();
    const client = new Client({ baseUrl: `http://127.0.0.1:${port}`, apiKey: "og_x_y", retry: quick });
    await assert.rejects(client.createApiKey("agent"), (e: unknown) => e instanceof TransportError && e.attempts === 3);
    assert.equal(await client.ready(), false);
  });

  it("a paused server: each try times out, then TransportError", async () => {
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, timeout: 0.3, retry: new Retry({ attempts: 2, initial: 0.01 }) });
    await fx.server.pause();
    try {
      await assert.rejects(client.claim(ns("paused"), "k", { request: 1 }), (e: unknown) => {
        assert.ok(e instanceof TransportError);
        assert.equal(e.attempts, 2);
        assert.equal((e.cause as Error).name, "TimeoutError");
        return true;
      });
    } finally {
      fx.server.resume();
    }
    assert.equal((await fx.client.claim(ns("resumed"), "k", { request: 1 })).outcome, "acquired");
  });
});

describe("abort signals", () => {
  it("abort a call at once, without retries", async () => {
    let tries = 0;
    const hang = ((_input: string, init: RequestInit) => {
      tries++;
      return new Promise<Response>((_resolve, reject) => init.signal?.addEventListener("abort", () => reject(init.signal?.reason)));
    }) as unknown as typeof fetch;
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, fetch: hang });
    const controller = new AbortController();
    const call = client.claim(ns("abort"), "k", { request: 1, signal: controller.signal });
    controller.abort(new Error("user went away"));
    await assert.rejects(call, /user went away/);
    assert.equal(tries, 1);
    await assert.rejects(client.getRecord("a", "b", { signal: AbortSignal.abort() }), { name: "AbortError" });
  });
});

describe("the wire", () => {
  it("a completion sends cost and tokens only when given, and a replay says them", async () => {
    const namespace = ns("tokens");
    const wire = scripted([]);
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, fetch: wire.fetch });
    const a = (await client.claim(namespace, "k", { request: 1 })) as Acquired;
    applied(await client.complete(namespace, "k", a.fence, { ok: true }, { cost: 7 }));
    const sent = JSON.parse(wire.requests.at(-1)?.body ?? "{}") as Record<string, unknown>;
    assert.deepEqual(sent, { namespace, key: "k", fence: a.fence, cost: 7, result: { ok: true } });

    const replay = (await client.claim(namespace, "k", { request: 1 })) as Replay;
    assert.deepEqual([replay.outcome, replay.cost, replay.tokens], ["replay", 7, null]);

    const b = (await client.claim(namespace, "k2", { request: 2 })) as Acquired;
    applied(await client.complete(namespace, "k2", b.fence, "r", { tokens: 1200 }));
    assert.equal(JSON.parse(wire.requests.at(-1)?.body ?? "{}").tokens, 1200);
    const saved = (await client.claim(namespace, "k2", { request: 2 })) as Replay;
    assert.deepEqual([saved.cost, saved.tokens], [null, 1200]);
  });

  it("the API key and the URL come from ONCEGUARD_API_KEY and ONCEGUARD_URL", async () => {
    const saved = { url: process.env["ONCEGUARD_URL"], key: process.env["ONCEGUARD_API_KEY"] };
    process.env["ONCEGUARD_URL"] = fx.server.url + "/";
    process.env["ONCEGUARD_API_KEY"] = fx.agentKey;
    try {
      const client = new Client();
      assert.equal(client.baseUrl, fx.server.url);
      assert.equal((await client.claim(ns("env"), "k", { request: 1 })).outcome, "acquired");
    } finally {
      for (const [name, value] of [["ONCEGUARD_URL", saved.url], ["ONCEGUARD_API_KEY", saved.key]] as const) {
        if (value === undefined) delete process.env[name];
        else process.env[name] = value;
      }
    }
  });
});

describe("answers that cannot be classified", () => {
  it("a proceed is taken only from a well-formed observe-mode answer; any other is refused, never run", async () => {
    const answer = (body: unknown) => (): Promise<Response> =>
      Promise.resolve(new Response(JSON.stringify(body), { status: 200, headers: { "content-type": "application/json" } }));
    const good = { outcome: "proceed", mode: "observe", would_have_been: "replay", reason: null };
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, retry: quick, fetch: scripted([answer(good)]).fetch });
    assert.equal((await client.claim(ns("proceed-ok"), "k", { request: 1 })).outcome, "proceed");
    for (const bad of [
      { outcome: "proceed", would_have_been: "replay" },
      { outcome: "proceed", mode: "enforce", would_have_been: "replay" },
      { outcome: "proceed", mode: "observe", would_have_been: "acquired" },
      { outcome: "proceed", mode: "observe" },
    ]) {
      const refusing = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey, retry: quick, fetch: scripted([answer(bad)]).fetch });
      await assert.rejects(refusing.claim(ns("proceed-bad"), "k", { request: 1 }), (e: unknown) => e instanceof UnexpectedResponse, JSON.stringify(bad));
    }
  });
});

/** `server` listening on a free 127.0.0.1 port; its URL. */
async function listen(server: NetServer): Promise<string> {
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/**
 * A proxy in front of the test server that drops its first `drops` connections once a request
 * arrives (the request was sent, no answer comes), then passes connections through.
 */
async function droppingProxy(drops: number): Promise<{ url: string; dropped: () => number; close: () => void }> {
  let dropped = 0;
  const port = Number(new URL(fx.server.url).port);
  const sockets = new Set<Socket>();
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    if (dropped < drops) {
      dropped++;
      socket.once("data", () => socket.destroy());
      return;
    }
    const upstream = connect(port, "127.0.0.1");
    sockets.add(upstream);
    upstream.on("close", () => sockets.delete(upstream));
    socket.pipe(upstream).pipe(socket);
    socket.on("error", () => upstream.destroy());
    upstream.on("error", () => socket.destroy());
  });
  const url = await listen(server);
  return {
    url,
    dropped: () => dropped,
    close: () => {
      for (const socket of sockets) socket.destroy();
      server.close();
    },
  };
}

describe("the Node transport (node:http, the default on Node)", () => {
  it("a connection dropped after the request left is retried for a claim, never for creating an API key", async () => {
    const proxy = await droppingProxy(1);
    try {
      const client = new Client({ baseUrl: proxy.url, apiKey: fx.agentKey, retry: quick });
      assert.equal((await client.claim(ns("node-reset"), "k", { request: 1 })).outcome, "acquired");
      assert.equal(proxy.dropped(), 1);
    } finally {
      proxy.close();
    }
    const again = await droppingProxy(1);
    try {
      const admin = new Client({ baseUrl: again.url, apiKey: fx.server.adminKey, retry: quick });
      await assert.rejects(admin.createApiKey("agent"), (e: unknown) => {
        assert.ok(e instanceof TransportError);
        assert.equal(e.attempts, 1);
        assert.equal((e.cause as { code?: string }).code, "ECONNRESET");
        return true;
      });
    } finally {
      again.close();
    }
  });

  it("an answer that arrives in pieces, a character split between them, is read whole", async () => {
    const result = { note: "réglé 😀 ✓" };
    const text = JSON.stringify({
      outcome: "replay", fence: 1, attempt: 1, completed_at: new Date().toISOString(), status: "success",
      content_type: "application/json", result, cost: null,
    });
    const bytes = new TextEncoder().encode(text);
    const split = new TextEncoder().encode(text.slice(0, text.indexOf("😀"))).length + 2; // inside the emoji's four bytes
    const server = createHttpServer((_request, response) => {
      response.writeHead(200, { "content-type": "application/json" });
      response.write(bytes.subarray(0, split));
      setTimeout(() => response.end(bytes.subarray(split)), 20);
    });
    const url = await listen(server);
    try {
      const client = new Client({ baseUrl: url, apiKey: "og_x_y", retry: quick });
      const answer = (await client.claim(ns("pieces"), "k", { request: 1 })) as Replay;
      assert.equal(answer.outcome, "replay");
      assert.deepEqual(answer.result, result);
      assert.deepEqual(answer.raw, new TextEncoder().encode(JSON.stringify(result)));
    } finally {
      server.closeAllConnections();
      server.close();
    }
  });

  it("aborting a claim that waits on the server cancels it at once with the signal's reason", async () => {
    const namespace = ns("node-abort");
    assert.equal((await fx.client.claim(namespace, "k", { request: 1, lease: "30s" })).outcome, "acquired");
    const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey });
    const controller = new AbortController();
    const started = Date.now();
    setTimeout(() => controller.abort(new Error("user went away")), 100);
    await assert.rejects(client.claim(namespace, "k", { request: 1, wait: "5s", signal: controller.signal }), /user went away/);
    assert.ok(Date.now() - started < 2000, `the abort took ${Date.now() - started} ms`);
  });

  it("a fetch put in place of the platform's is used as it is", async () => {
    const platform = globalThis.fetch;
    let calls = 0;
    globalThis.fetch = ((input: string | URL | Request, init?: RequestInit) => {
      calls++;
      return platform(input, init);
    }) as typeof fetch;
    try {
      const client = new Client({ baseUrl: fx.server.url, apiKey: fx.agentKey });
      assert.equal((await client.claim(ns("replaced-fetch"), "k", { request: 1 })).outcome, "acquired");
      assert.equal(calls, 1);
    } finally {
      globalThis.fetch = platform;
    }
  });
});
