/** Runs and budgets, kill switches, settings and quotas, and the audit log. */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Client, DeniedError, NotFound, applied, guarded, type Acquired, type Denied, type Proceed } from "onceguard";
import { ns, useServer } from "./server.js";

const fx = useServer();

describe("runs and budgets", () => {
  it("a run's budget denies the key after the last effect, each key charged once", async () => {
    const namespace = ns("budget");
    const run = `budget-${Math.random().toString(36).slice(2, 10)}`;
    const set = await fx.admin.setRunBudget(run, { maxEffects: 2, maxCost: 100, why: "test" });
    assert.equal(set.budget.maxEffects, 2);
    assert.equal(set.budget.maxCost, 100);
    assert.equal(set.budget.deadline, null);
    for (const key of ["a", "b"]) assert.equal((await fx.client.claim(namespace, key, { request: key, run })).outcome, "acquired");
    assert.equal((await fx.client.claim(namespace, "a", { request: "a", run })).outcome, "in_flight"); // not charged again
    const denied = await fx.client.claim(namespace, "c", { request: "c", run });
    assert.equal(denied.outcome, "denied");
    const d = denied as Denied;
    assert.equal(d.kind, "budget");
    assert.equal(d.reason["limit"], "effects");
    assert.equal(d.retryable, false);
    const seen = await fx.client.getRun(run);
    assert.deepEqual(seen?.usage, { effects: 2, cost: 0 });
    assert.equal(await fx.client.getRun("never-seen-run"), null);
  });

  it("a deadline in the past denies every new key of the run", async () => {
    const run = `deadline-${Math.random().toString(36).slice(2, 10)}`;
    await fx.admin.setRunBudget(run, { deadline: new Date(Date.now() - 60_000) });
    const answer = await fx.client.claim(ns("deadline"), "k", { request: 1, run });
    assert.equal(answer.outcome, "denied");
    assert.equal((answer as Denied).reason["limit"], "deadline");
  });
});

describe("kill switches", () => {
  it("engage denies claims (replays too) until released; guarded throws DeniedError", async () => {
    const namespace = ns("switch");
    const first = (await fx.client.claim(namespace, "done", { request: 1 })) as Acquired;
    applied(await fx.client.complete(namespace, "done", first.fence, "ok"));
    const sw = await fx.admin.engageSwitch({ kind: "namespace", prefix: namespace }, "incident 42");
    assert.deepEqual(sw.target, { kind: "namespace", prefix: namespace });
    assert.equal(sw.reason, "incident 42");
    assert.ok((await fx.client.listSwitches()).some((s) => s.target.kind === "namespace" && s.target.prefix === namespace));

    const denied = await fx.client.claim(namespace, "done", { request: 1 });
    assert.equal(denied.outcome, "denied");
    assert.equal((denied as Denied).kind, "switch");
    let ran = false;
    await assert.rejects(
      guarded(fx.client, namespace, "new", { request: 1 }, () => {
        ran = true;
      }),
      (e: unknown) => e instanceof DeniedError && e.kind === "switch" && e.reason["reason"] === "switch_engaged",
    );
    assert.equal(ran, false);

    const released = await fx.admin.releaseSwitch({ kind: "namespace", prefix: namespace }, { why: "fixed" });
    assert.equal(released.reason, "incident 42");
    assert.equal((await fx.client.claim(namespace, "done", { request: 1 })).outcome, "replay");
  });

  it("revoking leases makes the holder's completion stale", async () => {
    const namespace = ns("revoke");
    const a = (await fx.client.claim(namespace, "k", { request: 1, lease: "30s" })) as Acquired;
    const sw = await fx.admin.engageSwitch({ kind: "namespace", prefix: namespace }, "stop now", { revokeLeases: true });
    assert.equal(sw.revoked, 1);
    const late = await fx.client.complete(namespace, "k", a.fence, "late");
    assert.equal(late.outcome, "stale");
    await fx.admin.releaseSwitch({ kind: "namespace", prefix: namespace });
    const b = await fx.client.claim(namespace, "k", { request: 1 });
    assert.equal(b.outcome, "acquired");
    assert.equal((b as Acquired).recovery?.reason, "reported_unknown");
  });
});

describe("settings and the audit log", () => {
  it("put, list and delete settings of a prefix; the audit log records them", async () => {
    const prefix = ns("settings");
    const entry = await fx.admin.putSettings({ defaultLease: 2, maxLease: "1m", defaultRetention: "1h" }, { namespacePrefix: prefix, why: "short leases" });
    assert.equal(entry.namespacePrefix, prefix);
    assert.equal(entry.settings.defaultLease, "2s");
    assert.equal(entry.settings.maxLease, "1m");
    const listed = await fx.admin.listSettings();
    assert.ok(listed.some((e) => e.namespacePrefix === prefix));
    const a = (await fx.client.claim(prefix, "k", { request: 1 })) as Acquired;
    const lease = a.leaseExpiresAt.getTime() - Date.now();
    assert.ok(lease <= 2_500, `a 2s default lease, not ${lease} ms`);
    await fx.admin.deleteSettings({ namespacePrefix: prefix, why: "done" });
    assert.ok(!(await fx.admin.listSettings()).some((e) => e.namespacePrefix === prefix));

    const actions = [];
    for await (const e of fx.admin.iterAudit({ action: "settings.set", pageSize: 5 })) {
      actions.push(e);
      if (e.target?.includes(prefix)) break;
    }
    const set = actions.find((e) => e.target?.includes(prefix));
    assert.ok(set, "settings.set of the prefix is in the audit log");
    assert.equal(set.why, "short leases");
    const page = await fx.admin.listAudit({ limit: 1 });
    assert.equal(page.entries.length, 1);
  });

  it("the tenant's in-flight quota denies with a retry-after", async () => {
    // The quota is set on a tenant of its own, so that it cannot refuse other tests' claims.
    const tenant = `ts-quota-${Math.random().toString(36).slice(2, 8)}`;
    await fx.admin.createTenant(tenant);
    const key = await fx.admin.createApiKey("agent", { tenant, label: "quota" });
    const client = new Client({ baseUrl: fx.server.url, apiKey: key.token ?? "" });
    await fx.admin.putSettings({ maxInFlight: 1 }, { tenant, why: "one at a time" });
    assert.equal((await client.claim("q", "a", { request: 1 })).outcome, "acquired");
    const denied = await client.claim("q", "b", { request: 1 });
    assert.equal(denied.outcome, "denied");
    assert.equal((denied as Denied).kind, "quota");
    assert.equal((denied as Denied).reason["quota"], "in_flight");
  });
});

describe("tripwires", () => {
  it("a rule set through the client switches off a run whose effects keep failing", async () => {
    const namespace = ns("tripwire");
    const name = `ts-${Math.random().toString(36).slice(2, 10)}`;
    const run = `tw-${Math.random().toString(36).slice(2, 10)}`;
    const rule = await fx.admin.putTripwire(name, { kind: "failure_rate", above: 0.5 }, {
      window: "5m",
      minCalls: 4,
      prefix: namespace,
      per: "run",
      why: "stop runs that keep failing",
    });
    assert.deepEqual([rule.name, rule.prefix, rule.per, rule.window, rule.minCalls], [name, namespace, "run", "5m", 4]);
    assert.deepEqual(rule.symptom, { kind: "failure_rate", above: 0.5 });
    assert.ok((await fx.admin.listTripwires()).some((r) => r.name === name));
    try {
      let ran = 0;
      let denied: Denied | undefined;
      const deadline = Date.now() + 30_000;
      while (Date.now() < deadline) {
        const answer = await fx.client.claim(namespace, `charge-${ran}`, { request: ran, run });
        if (answer.outcome === "denied") {
          denied = answer as Denied;
          break;
        }
        assert.equal(answer.outcome, "acquired");
        await fx.client.fail(namespace, `charge-${ran}`, (answer as Acquired).fence, { retryable: false, error: { declined: true } });
        ran += 1;
        // The server adds its counts every second.
        if (ran >= 4) await new Promise((resolve) => setTimeout(resolve, 1_300));
      }
      assert.equal(denied?.kind, "switch", "the run was switched off");
      assert.ok(ran >= 4 && ran <= 6, `${ran} effects ran`);
      const sw = (await fx.client.listSwitches()).find((s) => s.target.kind === "run" && s.target.run === run);
      assert.equal(sw?.engagedBy, `tripwire:${name}`);
      assert.equal(sw?.tripwire?.rule, name);
      assert.equal(sw?.tripwire?.run, run);
      assert.ok((sw?.tripwire?.calls ?? 0) >= 4);
    } finally {
      await fx.admin.deleteTripwire(name, { why: "test done" });
      await fx.admin.releaseSwitch({ kind: "run", run }, { why: "test done" }).catch(() => undefined);
    }
    await assert.rejects(fx.admin.deleteTripwire(name), (e: unknown) => e instanceof NotFound);
  });

  it("a rule whose action is observe turns a canary back to observe mode", async () => {
    const namespace = ns("canary");
    const name = `ts-${Math.random().toString(36).slice(2, 10)}`;
    await fx.admin.putSettings({ enforcePercent: 100 }, { namespacePrefix: namespace, why: "canary" });
    const rule = await fx.admin.putTripwire(name, { kind: "failure_rate", above: 0.5 }, {
      window: "5m",
      minCalls: 4,
      prefix: namespace,
      action: "observe",
      why: "back to observe when enforcing breaks the agent",
    });
    assert.deepEqual([rule.action, rule.per], ["observe", "namespace"]);
    try {
      const done = await fx.client.claim(namespace, "done", { request: 0 });
      assert.equal(done.outcome, "acquired");
      await fx.client.complete(namespace, "done", (done as Acquired).fence, { sent: true });
      assert.equal((await fx.client.claim(namespace, "done", { request: 0 })).outcome, "replay");
      let ran = 0;
      const deadline = Date.now() + 30_000;
      const entryOf = async () => (await fx.admin.listSettings()).find((e) => e.namespacePrefix === namespace);
      let entry = await entryOf();
      while (Date.now() < deadline && entry?.tripwire == null) {
        const answer = await fx.client.claim(namespace, `failing-${ran}`, { request: ran });
        assert.equal(answer.outcome, "acquired");
        await fx.client.fail(namespace, `failing-${ran}`, (answer as Acquired).fence, { retryable: false, error: { declined: true } });
        ran += 1;
        // The server adds its counts every second.
        if (ran >= 4) await new Promise((resolve) => setTimeout(resolve, 1_300));
        entry = await entryOf();
      }
      assert.ok(entry?.tripwire, "the canary was never turned back");
      assert.deepEqual([entry.settings.mode, entry.settings.enforcePercent], ["observe", undefined]);
      assert.equal(entry.updatedBy, `tripwire:${name}`);
      assert.equal(entry.tripwire.trip.rule, name);
      assert.ok(entry.tripwire.reason.startsWith(`tripwire ${name}: failure rate`), entry.tripwire.reason);
      assert.ok(ran >= 4 && ran <= 6, `${ran} effects ran`);
      // Every instance reads settings within a second.
      await new Promise((resolve) => setTimeout(resolve, 1_100));
      const again = await fx.client.claim(namespace, "done", { request: 0 });
      assert.equal(again.outcome, "proceed");
      assert.equal((again as Proceed).wouldHaveBeen, "replay");
    } finally {
      await fx.admin.deleteTripwire(name, { why: "test done" });
      await fx.admin.deleteSettings({ namespacePrefix: namespace, why: "test done" });
    }
  });
});
