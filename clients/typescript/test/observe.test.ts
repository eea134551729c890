/**
 * Observe mode against a real server: a namespace whose settings say `mode: "observe"` answers
 * `proceed` where enforcement would have replayed, found the key in flight, a mismatch or a
 * denial; `once` and `guarded` then run the function and store nothing; back in enforce mode
 * the key replays what was stored.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { DeniedError, KeyConflict, applied, current, guarded, once, type Attempt, type ClaimAnswer, type Proceed } from "onceguard";
import { acquired, ns, useServer } from "./server.js";

const fx = useServer();

/** A namespace of this test's own, in observe mode. */
async function observed(name: string): Promise<string> {
  const namespace = ns(name);
  await fx.admin.putSettings({ mode: "observe" }, { namespacePrefix: namespace, why: "measure before enforcing" });
  return namespace;
}

function proceed(answer: ClaimAnswer, wouldHaveBeen: string): Proceed {
  assert.equal(answer.outcome, "proceed", JSON.stringify(answer));
  const p = answer as Proceed;
  assert.equal(p.mode, "observe");
  assert.equal(p.wouldHaveBeen, wouldHaveBeen);
  return p;
}

describe("observe mode: the client", () => {
  it("the setting reads back; a first claim acquires as ever, later ones proceed with what they would have been", async () => {
    const namespace = await observed("observe-claims");
    const entry = (await fx.admin.listSettings()).find((e) => e.namespacePrefix === namespace);
    assert.equal(entry?.settings.mode, "observe");

    const first = acquired(await fx.client.claim(namespace, "k", { request: { n: 1 }, lease: "10s" }));
    const inFlight = proceed(await fx.client.claim(namespace, "k", { request: { n: 1 }, wait: "5s" }), "in_flight");
    assert.equal(inFlight.reason, null);
    assert.equal(proceed(await fx.client.claim(namespace, "k", { request: { n: 2 } }), "mismatch").reason, null);
    applied(await fx.client.complete(namespace, "k", first.fence, { done: 1 }));
    assert.equal(proceed(await fx.client.claim(namespace, "k", { request: { n: 1 } }), "replay").reason, null);

    // The claims were recorded as in enforce mode: the key is completed with the first outcome.
    const record = await fx.client.getRecord(namespace, "k");
    assert.equal(record?.state, "completed");
    assert.equal(record?.fence, first.fence);
    assert.deepEqual(record?.stored?.result, { done: 1 });
  });

  it("a run's spent budget proceeds, with the denial's reason", async () => {
    const namespace = await observed("observe-budget");
    const run = `observe-budget-${Math.random().toString(36).slice(2, 10)}`;
    await fx.admin.setRunBudget(run, { maxEffects: 1, why: "test" });
    acquired(await fx.client.claim(namespace, "a", { request: 1, run }));
    const p = proceed(await fx.client.claim(namespace, "b", { request: 1, run }), "denied");
    assert.ok(p.reason, "a denial says why");
  });

  it("a kill switch still refuses in observe mode", async () => {
    const namespace = await observed("observe-switch");
    await fx.admin.engageSwitch({ kind: "namespace", prefix: namespace }, "incident 7");
    const answer = await fx.client.claim(namespace, "k", { request: 1 });
    assert.equal(answer.outcome, "denied");
    assert.equal(answer.outcome === "denied" && answer.kind, "switch");
    await fx.admin.releaseSwitch({ kind: "namespace", prefix: namespace }, { why: "over" });
  });

  it("a batch answers proceed per item", async () => {
    const namespace = await observed("observe-batch");
    const done = acquired(await fx.client.claim(namespace, "done", { request: 1 }));
    applied(await fx.client.complete(namespace, "done", done.fence, "ok"));
    const answers = await fx.client.claimBatch([
      { namespace, key: "done", request: 1 },
      { namespace, key: "new", request: 1 },
      { namespace, key: "new", request: 1 },
    ]);
    assert.deepEqual(answers.map((a) => a.outcome), ["proceed", "acquired", "proceed"]);
    assert.equal((answers[0] as Proceed).wouldHaveBeen, "replay");
    assert.equal((answers[2] as Proceed).wouldHaveBeen, "in_flight");
  });
});

describe("observe mode: once and guarded", () => {
  it("a function called twice with the same key runs twice; a mismatch runs; back to enforce, it replays", async () => {
    const namespace = await observed("observe-once");
    let runs = 0;
    const seen: Attempt[] = [];
    const refund = once(
      async (order: number, amount: number) => {
        runs++;
        const attempt = current();
        seen.push(attempt);
        await attempt.checkpoint("refunding", { order }); // nothing is held in observe mode: it does nothing
        return { refund: `re_${order}_${runs}`, amount, at: new Date(0) };
      },
      { client: fx.client, namespace, key: "refund-1234", params: ["order", "amount"] },
    );
    const first = await refund(1234, 25);
    assert.deepEqual(first, { refund: "re_1234_1", amount: 25, at: "1970-01-01T00:00:00.000Z" });
    assert.equal(seen[0]?.observed, null, "the first call acquired the key, as in enforce mode");

    const second = await refund(1234, 25);
    assert.equal(runs, 2, "it ran again: observe mode lets it");
    assert.deepEqual(second, { refund: "re_1234_2", amount: 25, at: "1970-01-01T00:00:00.000Z" }, "as it would have been stored");
    assert.equal(seen[1]?.observed?.wouldHaveBeen, "replay");
    assert.equal(seen[1]?.fence, 0);

    const other = await refund(1234, 99); // the same key with another request: a mismatch, let proceed
    assert.equal(runs, 3);
    assert.equal(other.amount, 99);
    assert.equal(seen[2]?.observed?.wouldHaveBeen, "mismatch");

    // Nothing the proceeding calls did was stored: the key holds the first outcome.
    const record = await fx.client.getRecord(namespace, "refund-1234");
    assert.deepEqual(record?.stored?.result, first);
    assert.deepEqual(record?.checkpoints.map((c) => c.name), ["refunding"]);

    await fx.admin.putSettings({ mode: "enforce" }, { namespacePrefix: namespace, why: "enforce now" });
    assert.equal((await fx.admin.listSettings()).find((e) => e.namespacePrefix === namespace)?.settings.mode, "enforce");
    assert.deepEqual(await refund(1234, 25), first, "enforced: the stored outcome replays");
    await assert.rejects(refund(1234, 99), KeyConflict);
    assert.equal(runs, 3);
  });

  it("an error of a proceeding call propagates as it is and stores nothing", async () => {
    const namespace = await observed("observe-error");
    assert.equal(await guarded(fx.client, namespace, "k", { request: 1 }, () => "stored"), "stored");
    await assert.rejects(
      guarded(fx.client, namespace, "k", { request: 1 }, () => {
        throw new Error("downstream said no");
      }),
      /downstream said no/,
    );
    const record = await fx.client.getRecord(namespace, "k");
    assert.equal(record?.state, "completed");
    assert.deepEqual(record?.stored?.result, "stored");
  });

  it("a denial observe mode lets proceed runs the function; without it, DeniedError", async () => {
    const namespace = await observed("observe-denied");
    const run = `observe-denied-${Math.random().toString(36).slice(2, 10)}`;
    await fx.admin.setRunBudget(run, { maxEffects: 1, why: "test" });
    let runs = 0;
    const effect = once(async (n: number) => ++runs + n * 0, { client: fx.client, namespace, name: "effect", run });
    await effect(1);
    await effect(2); // over the budget: would have been denied
    assert.equal(runs, 2);
    await fx.admin.putSettings({ mode: "enforce" }, { namespacePrefix: namespace, why: "enforce now" });
    await assert.rejects(effect(3), (e: unknown) => e instanceof DeniedError && e.kind === "budget");
    assert.equal(runs, 2);
  });
});
