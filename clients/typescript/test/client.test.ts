/** The client against a real server: every claim answer, the fenced calls, records, problems. */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  Client,
  Forbidden,
  InvalidRequest,
  NotFound,
  RawJson,
  StaleFence,
  Unauthenticated,
  applied,
  type Acquired,
  type Replay,
} from "onceguard";
import { acquired, ns, replay, useServer } from "./server.js";

const fx = useServer();

describe("claims", () => {
  it("acquired, then in_flight, then replay with the stored bytes exactly", async () => {
    const namespace = ns("claim-cycle");
    const request = { order: 1234, amount: 25 };
    const a = acquired(await fx.client.claim(namespace, "refund-1234", { request, lease: "5s", run: "run-a", cost: 2 }));
    assert.equal(a.attempt, 1);
    assert.ok(a.fence >= 1);
    assert.equal(a.recovery, null);
    assert.ok(a.leaseExpiresAt.getTime() > Date.now());

    const busy = await fx.client.claim(namespace, "refund-1234", { request });
    assert.equal(busy.outcome, "in_flight");
    if (busy.outcome === "in_flight") {
      assert.ok(busy.retryAfter > 0 && busy.retryAfter <= 5);
      assert.equal(busy.attempt, 1);
    }

    const text = '{ "refund" : "re_1", "amount": 25.0 }';
    const done = applied(await fx.client.complete(namespace, "refund-1234", a.fence, new RawJson(text), { cost: 3 }));
    assert.equal(done.state, "completed");

    const r = replay(await fx.client.claim(namespace, "refund-1234", { request: { amount: 25, order: 1234 } }));
    assert.equal(new TextDecoder().decode(r.raw), text);
    assert.deepEqual(r.result, { refund: "re_1", amount: 25 });
    assert.equal(r.status, "success");
    assert.equal(r.contentType, "application/json");
    assert.equal(r.fence, a.fence);
    assert.equal(r.cost, 3);
    assert.ok(r.completedAt instanceof Date);

    const run = await fx.client.getRun("run-a");
    assert.deepEqual(run?.usage, { effects: 1, cost: 5 });
  });

  it("mismatch when the key is reused with another request", async () => {
    const namespace = ns("mismatch");
    acquired(await fx.client.claim(namespace, "k", { request: { a: 1 } }));
    const answer = await fx.client.claim(namespace, "k", { request: { a: 2 } });
    assert.equal(answer.outcome, "mismatch");
  });

  it("a claim that waits gets the replay when the holder completes", async () => {
    const namespace = ns("wait");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1, lease: "10s" }));
    const waiting = fx.client.claim(namespace, "k", { request: 1, wait: "10s" });
    // the waiter is parked on the server until the completion below
    await fx.client.complete(namespace, "k", a.fence, { done: true });
    const r = replay(await waiting);
    assert.deepEqual(r.result, { done: true });
  });

  it("a non-JSON result replays as its bytes", async () => {
    const namespace = ns("raw");
    const a = acquired(await fx.client.claim(namespace, "k", { request: null }));
    const bytes = new Uint8Array([0, 1, 2, 250, 255]);
    applied(await fx.client.complete(namespace, "k", a.fence, undefined, { raw: bytes, contentType: "application/octet-stream" }));
    const r = replay(await fx.client.claim(namespace, "k", { request: null }));
    assert.deepEqual([...r.raw], [...bytes]);
    assert.equal(r.contentType, "application/octet-stream");
    assert.ok(r.result instanceof Uint8Array);
  });

  it("refuses a claim without exactly one of request and fingerprint", () => {
    assert.throws(() => fx.client.claim("a", "k", {}), TypeError);
    assert.throws(() => fx.client.claim("a", "k", { request: 1, fingerprint: "sha256:" + "ab".repeat(32) }), TypeError);
  });
});

describe("fenced calls", () => {
  it("answer stale with a reason for any fence but the holder's", async () => {
    const namespace = ns("stale");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    const stale = await fx.client.complete(namespace, "k", a.fence + 100, "late");
    assert.equal(stale.outcome, "stale");
    if (stale.outcome === "stale") assert.equal(stale.reason, "superseded");
    assert.throws(() => applied(stale), (e: unknown) => e instanceof StaleFence && e.reason === "superseded");
    const none = await fx.client.extend(namespace, "never-claimed", 1);
    assert.equal(none.outcome, "stale");
    if (none.outcome === "stale") assert.equal(none.reason, "no_record");
  });

  it("checkpoint, report unknown, and the recovery that carries them", async () => {
    const namespace = ns("recovery");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1, lease: "30s" }));
    const cp = applied(await fx.client.checkpoint(namespace, "k", a.fence, "charged-card", { charge: "ch_1" }));
    assert.equal(cp.checkpoints.length, 1);
    applied(await fx.client.extend(namespace, "k", a.fence, { lease: 20 }));
    const unknown = applied(await fx.client.reportUnknown(namespace, "k", a.fence, "timed out after sending"));
    assert.equal(unknown.unknown, "timed out after sending");
    const b = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(b.attempt, 2);
    assert.ok(b.fence > a.fence);
    assert.equal(b.recovery?.reason, "reported_unknown");
    assert.equal(b.recovery?.detail, "timed out after sending");
    assert.equal(b.recovery?.previousFence, a.fence);
    assert.deepEqual(b.recovery?.lastCheckpoint?.data, { charge: "ch_1" });
    assert.equal(b.recovery?.lastCheckpoint?.name, "charged-card");
  });

  it("fail: retryable releases the key, permanent stores the failure", async () => {
    const namespace = ns("fail");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(applied(await fx.client.fail(namespace, "k", a.fence, { retryable: true, error: { why: "blip" } })).state, "released");
    const b = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(b.attempt, 2);
    applied(await fx.client.fail(namespace, "k", b.fence, { retryable: false, error: { type: "CardDeclined", message: "no" } }));
    const r = replay(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(r.status, "failure");
    assert.deepEqual(r.result, { type: "CardDeclined", message: "no" });
  });
});

describe("batches", () => {
  it("claim and complete many keys in one request, each as alone", async () => {
    const namespace = ns("batch");
    const first = await fx.client.claimBatch([
      { namespace, key: "doc#0", request: { d: 0 } },
      { namespace, key: "doc#1", request: { d: 1 } },
      { namespace, key: "doc#0", request: { d: 0 } },
    ]);
    assert.deepEqual(first.map((a) => a.outcome), ["acquired", "acquired", "in_flight"]);
    const [a0, a1] = first as [Acquired, Acquired];
    const done = await fx.client.completeBatch([
      { namespace, key: "doc#0", fence: a0.fence, result: new RawJson('[0.5, 0.25]') },
      { namespace, key: "doc#1", fence: a1.fence + 50, result: [1] },
    ]);
    assert.deepEqual(done.map((d) => d.outcome), ["applied", "stale"]);
    const again = await fx.client.claimBatch([
      { namespace, key: "doc#0", request: { d: 0 } },
      { namespace, key: "doc#1", request: { d: 1 } },
      { namespace, key: "doc#2", request: { d: 2 } },
    ]);
    assert.deepEqual(again.map((a) => a.outcome), ["replay", "in_flight", "acquired"]);
    assert.equal(new TextDecoder().decode((again[0] as Replay).raw), "[0.5, 0.25]");
  });

  it("an invalid item refuses the whole batch", async () => {
    await assert.rejects(
      fx.client.claimBatch([{ namespace: ns("batch-bad"), key: "ok", request: 1 }, { namespace: "bad namespace!", key: "k", request: 1 }]),
      InvalidRequest,
    );
  });
});

describe("records", () => {
  it("get, list through the cursor, and purge", async () => {
    const namespace = ns("records");
    for (const key of ["a", "b", "c"]) {
      const a = acquired(await fx.client.claim(namespace, key, { request: key, run: "records-run" }));
      if (key !== "c") await fx.client.complete(namespace, key, a.fence, { key });
    }
    const record = await fx.client.getRecord(namespace, "a");
    assert.equal(record?.state, "completed");
    assert.deepEqual(record?.stored?.result, { key: "a" });
    assert.equal(new TextDecoder().decode(record?.stored?.raw), '{"key":"a"}');
    assert.equal(await fx.client.getRecord(namespace, "missing"), null);

    const page = await fx.client.listRecords({ namespacePrefix: namespace, limit: 2 });
    assert.equal(page.records.length, 2);
    assert.ok(page.next);
    const all = [];
    for await (const r of fx.client.iterRecords({ namespacePrefix: namespace, pageSize: 1 })) all.push(r.key);
    assert.deepEqual(all, ["a", "b", "c"]);
    const inProgress = await fx.client.listRecords({ namespacePrefix: namespace, state: "in_progress" });
    assert.deepEqual(inProgress.records.map((r) => r.key), ["c"]);

    await assert.rejects(fx.client.purge(namespace, "a"), Forbidden);
    assert.equal(await fx.admin.purge(namespace, "a", { why: "test" }), true);
    assert.equal(await fx.admin.purge(namespace, "a", { why: "test" }), false);
    const again = acquired(await fx.client.claim(namespace, "a", { request: "a" }));
    assert.ok(again.fence > (record?.fence ?? 0));
  });
});

describe("problems", () => {
  it("are typed errors chosen by their type", async () => {
    const nobody = new Client({ baseUrl: fx.server.url, apiKey: "og_nope_nope" });
    await assert.rejects(nobody.claim(ns("unauth"), "k", { request: 1 }), Unauthenticated);
    await assert.rejects(fx.client.claim("bad namespace!", "k", { request: 1 }), (e: unknown) => {
      assert.ok(e instanceof InvalidRequest);
      assert.equal(e.status, 400);
      assert.equal(e.kind, "invalid-request");
      assert.equal(e.retryable, false);
      return true;
    });
    await assert.rejects(fx.client.createApiKey("agent"), Forbidden);
    await assert.rejects(fx.admin.releaseSwitch({ kind: "namespace", prefix: ns("none") }), NotFound);
  });
});

describe("tenants and API keys", () => {
  it("create, list and revoke keys; list and create tenants", async () => {
    const key = await fx.admin.createApiKey("agent", { label: "short-lived" });
    assert.ok(key.token?.startsWith("og_"));
    assert.equal(key.role, "agent");
    const keys = await fx.admin.listApiKeys();
    assert.ok(keys.some((k) => k.id === key.id && k.token === null));
    const scoped = new Client({ baseUrl: fx.server.url, apiKey: key.token ?? "" });
    assert.equal(acquired(await scoped.claim(ns("revoke"), "k", { request: 1 })).attempt, 1);
    await fx.admin.revokeApiKey(key.id);
    await assert.rejects(scoped.claim(ns("revoke"), "k", { request: 1 }), Unauthenticated);
    const tenant = `ts-${Math.random().toString(36).slice(2, 10)}`;
    assert.equal((await fx.admin.createTenant(tenant)).id, tenant);
    assert.ok((await fx.admin.listTenants()).some((t) => t.id === tenant));
    assert.ok(await fx.client.ready());
  });
});
