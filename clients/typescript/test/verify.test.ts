/**
 * Reconciliation: a completion `reconciled: true` from a recovering attempt, and the `verify`
 * hook of `once` / `guarded`, which asks the downstream system on a recovery and either stores
 * what it says happened (without running the function) or lets the function run.
 *
 * A recovery is made without waiting for a lease: a first attempt that reports the outcome
 * unknown (it throws `OutcomeUnknown`) makes the next claim a recovery at once.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  AwaitingApprovalError,
  Happened,
  InvalidRequest,
  OutcomeUnknown,
  RecoveryNeedsVerifyError,
  applied,
  current,
  guarded,
  happened,
  once,
  type Approval,
  type VerifyContext,
} from "onceguard";
import { acquired, ns, replay, useServer } from "./server.js";

const fx = useServer();

/** Claim `key` and report the outcome unknown: the next claim is a recovery. Returns the first fence. */
async function unknownFirstAttempt(namespace: string, key: string, request: unknown): Promise<number> {
  const first = acquired(await fx.client.claim(namespace, key, { request }));
  applied(await fx.client.reportUnknown(namespace, key, first.fence, "timed out after sending"));
  return first.fence;
}

describe("reconciled completions", () => {
  it("a recovery completes reconciled: the record and every replay say so", async () => {
    const namespace = ns("reconciled");
    await unknownFirstAttempt(namespace, "k", 1);
    const second = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(second.attempt, 2);
    const record = applied(await fx.client.complete(namespace, "k", second.fence, { charge: "ch_1" }, { reconciled: true, cost: 4 }));
    assert.equal(record.reconciled, true);
    const r = replay(await fx.client.claim(namespace, "k", { request: 1 }));
    assert.equal(r.reconciled, true);
    assert.deepEqual(r.result, { charge: "ch_1" });
    assert.equal(r.cost, 4);
    const stored = await fx.client.getRecord(namespace, "k");
    assert.equal(stored?.reconciled, true);
    assert.equal(stored?.stored?.reconciled, true);

    // An outcome completed as usual is not reconciled.
    const plain = acquired(await fx.client.claim(namespace, "plain", { request: 1 }));
    applied(await fx.client.complete(namespace, "plain", plain.fence, "ok"));
    assert.equal(replay(await fx.client.claim(namespace, "plain", { request: 1 })).reconciled, false);
    assert.equal((await fx.client.getRecord(namespace, "plain"))?.reconciled, false);
  });

  it("a first attempt may not complete reconciled (400), alone or in a batch", async () => {
    const namespace = ns("reconciled-first");
    const first = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    await assert.rejects(fx.client.complete(namespace, "k", first.fence, "ok", { reconciled: true }), (e: unknown) => {
      assert.ok(e instanceof InvalidRequest);
      assert.equal(e.status, 400);
      assert.match(e.detail, /reconciled/);
      return true;
    });
    await assert.rejects(fx.client.completeBatch([{ namespace, key: "k", fence: first.fence, result: "ok", reconciled: true }]), InvalidRequest);
    assert.equal((await fx.client.getRecord(namespace, "k"))?.state, "in_progress", "nothing was stored");
  });

  it("completeBatch takes reconciled per item", async () => {
    const namespace = ns("reconciled-batch");
    await unknownFirstAttempt(namespace, "a", "a");
    const a = acquired(await fx.client.claim(namespace, "a", { request: "a" }));
    const b = acquired(await fx.client.claim(namespace, "b", { request: "b" }));
    const done = await fx.client.completeBatch([
      { namespace, key: "a", fence: a.fence, result: "found", reconciled: true },
      { namespace, key: "b", fence: b.fence, result: "ran" },
    ]);
    assert.deepEqual(done.map((d) => d.outcome === "applied" && d.record.reconciled), [true, false]);
  });
});

describe("verify", () => {
  it("happened(x) on a recovery: the function does not run, x is stored reconciled and returned", async () => {
    const namespace = ns("verify-happened");
    const run = `verify-run-${Math.random().toString(36).slice(2, 10)}`;
    const asked: VerifyContext[] = [];
    let runs = 0;
    const charge = once(
      async (order: string, amount: number) => {
        runs++;
        const attempt = current();
        await attempt.checkpoint("sending", { reference: `pay-${order}` });
        throw new OutcomeUnknown("the payment API timed out after the request was sent");
      },
      {
        client: fx.client,
        namespace,
        name: "charge",
        params: ["order", "amount"],
        run,
        verify: async (context) => {
          asked.push(context);
          const reference = (context.checkpoint?.data as { reference: string }).reference;
          return happened({ charge: `ch_for_${reference}`, amount: 25 }, { cost: 7 });
        },
      },
    );
    await assert.rejects(charge("o-1", 25), OutcomeUnknown);
    assert.equal(runs, 1);
    assert.equal(asked.length, 0, "verify is never called on a first attempt");

    const receipt = await charge("o-1", 25);
    assert.deepEqual(receipt, { charge: "ch_for_pay-o-1", amount: 25 });
    assert.equal(runs, 1, "the function did not run again");
    assert.equal(asked.length, 1);
    const context = asked[0] as VerifyContext;
    assert.equal(context.namespace, namespace);
    assert.equal(context.attempt, 2);
    assert.equal(context.recovery.reason, "reported_unknown");
    assert.match(context.recovery.detail ?? "", /timed out after the request was sent/);
    assert.equal(context.checkpoint?.name, "sending");
    assert.deepEqual(context.request, { order: "o-1", amount: 25 });

    const record = await fx.client.getRecord(namespace, context.key);
    assert.equal(record?.state, "completed");
    assert.equal(record?.reconciled, true);
    assert.equal(record?.attempt, 2);
    assert.equal(record?.fence, context.fence);
    assert.deepEqual(record?.stored?.result, receipt);
    assert.equal(record?.stored?.cost, 7);
    assert.deepEqual((await fx.client.getRun(run))?.usage, { effects: 1, cost: 7 });

    // Every later call replays it: neither verify nor the function runs.
    assert.deepEqual(await charge("o-1", 25), receipt);
    assert.equal(runs, 1);
    assert.equal(asked.length, 1);
  });

  it("undefined (it did not happen): the function runs once, and the outcome is not reconciled", async () => {
    const namespace = ns("verify-undefined");
    const attempts: number[] = [];
    let verified = 0;
    const ship = once(
      async () => {
        attempts.push(current().attempt);
        if (attempts.length === 1) throw new OutcomeUnknown("carrier timed out");
        return "shipped";
      },
      {
        client: fx.client,
        namespace,
        key: "ship-o-9",
        verify: () => {
          verified++;
          return undefined;
        },
      },
    );
    await assert.rejects(ship(), OutcomeUnknown);
    assert.equal(await ship(), "shipped");
    assert.equal(await ship(), "shipped");
    assert.deepEqual(attempts, [1, 2], "the function ran once on the recovery");
    assert.equal(verified, 1);
    assert.equal((await fx.client.getRecord(namespace, "ship-o-9"))?.reconciled, false);
  });

  it("null from guarded's verify runs the function; verify is not called on a first attempt", async () => {
    const namespace = ns("verify-null");
    let verified = 0;
    const verify = async () => {
      verified++;
      return null;
    };
    // A first attempt: verify is not asked.
    assert.equal(await guarded(fx.client, namespace, "fresh", { request: 1, verify }, () => "first"), "first");
    assert.equal(verified, 0);
    // A recovery: verify says it did not happen, the function runs.
    await unknownFirstAttempt(namespace, "k", 1);
    let runs = 0;
    const value = await guarded(fx.client, namespace, "k", { request: 1, verify }, (attempt) => {
      runs++;
      assert.equal(attempt.attempt, 2);
      assert.ok(attempt.recovery);
      return "ran";
    });
    assert.equal(value, "ran");
    assert.equal(runs, 1);
    assert.equal(verified, 1);
  });

  it("verify returning anything else is a TypeError; the key stays a recovery (reported unknown), never released", async () => {
    const namespace = ns("verify-bad");
    await unknownFirstAttempt(namespace, "k", 1);
    let runs = 0;
    const verify = (() => "yes, it happened") as unknown as () => Happened;
    await assert.rejects(
      guarded(fx.client, namespace, "k", { request: 1, verify }, () => {
        runs++;
      }),
      (e: unknown) => e instanceof TypeError && /happened\(result\)/.test(e.message),
    );
    assert.equal(runs, 0);
    const record = await fx.client.getRecord(namespace, "k");
    assert.equal(record?.state, "in_progress");
    assert.match(record?.unknown ?? "", /verify failed/);
    // The next call is a recovery again, and verifies before running anything.
    let verified = 0;
    const fixed = () => {
      verified++;
      return happened("found it");
    };
    assert.equal(await guarded(fx.client, namespace, "k", { request: 1, verify: fixed }, () => "ran"), "found it");
    assert.equal(verified, 1);
  });

  it("a verify error listed in `unknown` keeps the key a recovery: the next call verifies again", async () => {
    const namespace = ns("verify-unknown");
    await unknownFirstAttempt(namespace, "k", 1);
    class DownstreamUnreachable extends Error {}
    let calls = 0;
    const verify = () => {
      calls++;
      if (calls === 1) throw new DownstreamUnreachable("the payment API is down");
      return happened("found it");
    };
    const options = { request: 1, verify, unknown: [DownstreamUnreachable] };
    await assert.rejects(guarded(fx.client, namespace, "k", options, () => "ran"), DownstreamUnreachable);
    assert.equal(await guarded(fx.client, namespace, "k", options, () => "ran"), "found it");
    assert.equal(calls, 2);
    assert.equal((await fx.client.getRecord(namespace, "k"))?.reconciled, true);
  });
});

describe("recovery policies", () => {
  it("verify: a call without a verify hook is refused on a recovery and does not run; one with a hook recovers", async () => {
    const prefix = ns("policy-verify");
    const entry = await fx.admin.putSettings({ recovery: "verify" }, { namespacePrefix: prefix, why: "payments" });
    assert.equal(entry.settings.recovery, "verify");
    let runs = 0;
    const charge = once(
      async (amount: number) => {
        runs++;
        throw new OutcomeUnknown(`no answer after sending ${amount}`);
      },
      { client: fx.client, namespace: prefix, name: "charge", params: ["amount"] },
    );
    await assert.rejects(charge(20), OutcomeUnknown);
    for (let i = 0; i < 2; i++) {
      await assert.rejects(charge(20), (e: unknown) => {
        assert.ok(e instanceof RecoveryNeedsVerifyError);
        assert.equal(e.kind, "recovery");
        assert.match(e.message, /verify hook/);
        assert.equal(e.denied.reason["previous_attempt"], 1);
        return true;
      });
    }
    assert.equal(runs, 1, "the function did not run again");
    const checked = once(async (_amount: number) => ({ charge: "again" }), {
      client: fx.client,
      namespace: prefix,
      name: "charge",
      params: ["amount"],
      verify: async () => happened({ charge: "ch_1" }),
    });
    assert.deepEqual(await checked(20), { charge: "ch_1" });
    assert.equal(runs, 1);
  });

  it("ask: a person decides; approved, the call re-runs once; reconciled, it replays the result given", async () => {
    const prefix = ns("policy-ask");
    await fx.admin.putSettings({ recovery: "ask" }, { namespacePrefix: prefix, why: "emails" });
    const runs: string[] = [];
    const send = once(
      async (to: string) => {
        runs.push(to);
        if (runs.filter((r) => r === to).length === 1) throw new OutcomeUnknown("the mail server did not answer");
        return `sent to ${to}`;
      },
      { client: fx.client, namespace: prefix, name: "send", params: ["to"] },
    );
    for (const to of ["ops", "sales"]) {
      await assert.rejects(send(to), OutcomeUnknown);
      let approval: Approval | undefined;
      await assert.rejects(send(to), (e: unknown) => {
        assert.ok(e instanceof AwaitingApprovalError);
        approval = e.approval;
        return true;
      });
      assert.equal(approval?.recovery?.previousAttempt, 1);
      assert.equal(approval?.recovery?.reason, "reported_unknown");
      assert.equal(runs.filter((r) => r === to).length, 1, "nothing ran while a person decides");
      const id = approval?.id ?? "";
      if (to === "ops") {
        assert.equal((await fx.admin.approve(id, { why: "the mail server lost it" })).state, "approved");
        assert.equal(await send(to), "sent to ops");
        assert.equal(await send(to), "sent to ops");
        assert.equal(runs.filter((r) => r === to).length, 2, "re-run once");
      } else {
        const decided = await fx.admin.reconcile(id, { why: "the mail log shows it", result: "sent to sales (log)" });
        assert.equal(decided.state, "reconciled");
        assert.equal(await send(to), "sent to sales (log)");
        assert.equal(runs.filter((r) => r === to).length, 1, "never run again");
      }
    }
  });
});
