/**
 * Compensations and rollbacks against a real server: completions that register how to undo
 * their effect (`complete(…, { compensation })`, `once(…, { undo })`), an admin rolling a run
 * back, and workers (`runCompensations`) undoing each effect once, newest first: several at
 * once, a handler failing permanently or retryably, a compensation no handler is known for, and
 * a worker that takes a task and never finishes.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  DeniedError,
  Forbidden,
  NotFound,
  Permanent,
  applied,
  once,
  registerUndo,
  registeredUndo,
  runCompensations,
  type AcquiredCompensation,
  type Denied,
  type UndoContext,
} from "onceguard";
import { acquired, ns, useServer } from "./server.js";

const fx = useServer();

/** A run id of this test's own, with characters a path must percent-encode. */
function runId(name: string): string {
  return `${name}/${Math.random().toString(36).slice(2, 10)}#?%`;
}

const pause = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe("compensations: the client", () => {
  it("complete registers a compensation; rollback lists the tasks newest first and stops the run", async () => {
    const namespace = ns("rollback-client");
    const run = runId("rb-client");
    for (const n of [1, 2]) {
      const a = acquired(await fx.client.claim(namespace, `charge-${n}`, { request: n, run }));
      const compensation = { name: "refund-charge", data: { charge: `ch_${n}` } };
      applied(await fx.client.complete(namespace, `charge-${n}`, a.fence, { charge: `ch_${n}` }, { compensation }));
    }
    const email = acquired(await fx.client.claim(namespace, "email", { request: 1, run }));
    applied(await fx.client.complete(namespace, "email", email.fence, "sent"));
    acquired(await fx.client.claim(namespace, "in-flight", { request: 1, run, lease: "30s" }));

    assert.equal(await fx.client.rollbackStatus(run), null, "not rolled back yet");
    await assert.rejects(fx.client.claimCompensation(run), NotFound);
    await assert.rejects(fx.client.rollback(run, "an agent may not"), Forbidden);

    const view = await fx.admin.rollback(run, "runaway agent");
    assert.equal(view.run, run);
    assert.equal(view.why, "runaway agent");
    assert.ok(view.startedBy);
    assert.ok(view.startedAt instanceof Date);
    assert.deepEqual(
      [view.effects, view.compensated, view.inProgress, view.pending, view.failed, view.notCompensable, view.effectsInFlight, view.done],
      [3, 0, 0, 2, 0, 1, 1, false],
    );
    assert.deepEqual(view.tasks.map((t) => t.effect.key), ["charge-2", "charge-1"], "newest effect first");
    const [task] = view.tasks;
    assert.equal(task?.effect.namespace, namespace);
    assert.ok(task?.effect.fence);
    assert.ok(task?.effect.completedAt instanceof Date);
    assert.deepEqual(task?.compensation, { name: "refund-charge", data: { charge: "ch_2" } });
    assert.equal(task?.state, "pending");
    assert.equal(task?.attempt, 0);

    // Starting it again answers the rollback under way; any role of the tenant reads it.
    assert.deepEqual((await fx.admin.rollback(run, "again")).startedAt, view.startedAt);
    assert.deepEqual(await fx.client.rollbackStatus(run), view);
    const shown = (await fx.client.getRun(run))?.rollback;
    assert.equal(shown?.pending, 2);
    assert.equal(shown?.notCompensable, 1);
    assert.ok(shown !== undefined && shown !== null && !("tasks" in shown), "a run shows its rollback without the tasks");

    // The run's new claims are refused: a kill switch is engaged on it.
    const refused = await fx.client.claim(namespace, "charge-3", { request: 3, run });
    assert.equal(refused.outcome, "denied");
    assert.equal((refused as Denied).kind, "switch");
  });

  it("a compensation the server would refuse is refused before it is sent", async () => {
    const namespace = ns("compensation-bad");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1 }));
    for (const name of ["", "tab\tin it", "é", "x".repeat(129)]) {
      assert.throws(() => fx.client.complete(namespace, "k", a.fence, 1, { compensation: { name, data: null } }), RangeError);
    }
    const large = { name: "undo-large", data: "x".repeat(16 * 1024) };
    assert.throws(() => fx.client.complete(namespace, "k", a.fence, 1, { compensation: large }), /more than 16384/);
    assert.equal((await fx.client.getRecord(namespace, "k"))?.state, "in_progress", "nothing was sent");
    const record = applied(await fx.client.complete(namespace, "k", a.fence, 1, { compensation: { name: "x".repeat(128), data: undefined } }));
    assert.equal(record.state, "completed");
  });
});

describe("compensations: once with undo, and workers", () => {
  it("three effects with undo, one without: two workers at once undo each effect exactly once", async () => {
    const namespace = ns("rollback-workers");
    const run = runId("rb-workers");
    const undone: string[] = [];
    async function refundChargeTwoWorkers(data: { charge: string }, context: UndoContext) {
      assert.equal(context.run, run);
      undone.push(data.charge);
      await pause(20); // both workers hold a task at once
      return { refunded: data.charge, effect: context.task.effect.key };
    }
    const charge = once(async (order: string) => ({ charge: `ch_${order}`, order, card: "4242" }), {
      client: fx.client,
      namespace,
      name: "charge",
      params: ["order"],
      run,
      undo: refundChargeTwoWorkers,
      undoData: (result) => ({ charge: result.charge }),
    });
    const notify = once(async (order: string) => `mailed ${order}`, { client: fx.client, namespace, name: "notify", run });
    for (const order of ["a", "b", "c"]) await charge(order);
    await notify("a");
    assert.equal(registeredUndo("refundChargeTwoWorkers"), refundChargeTwoWorkers);

    const view = await fx.admin.rollback(run, "runaway agent");
    assert.equal(view.effects, 4);
    assert.equal(view.pending, 3);
    assert.equal(view.notCompensable, 1);
    assert.deepEqual(
      view.tasks.map((t) => t.compensation),
      ["c", "b", "a"].map((o) => ({ name: "refundChargeTwoWorkers", data: { charge: `ch_${o}` } })),
    );

    const options = { idleTimeoutMs: 10_000 };
    const [one, two] = await Promise.all([runCompensations(fx.client, run, options), runCompensations(fx.client, run, options)]);
    assert.deepEqual([...undone].sort(), ["ch_a", "ch_b", "ch_c"], "each undo ran exactly once");
    assert.equal(one.compensated + two.compensated, 3);
    assert.equal(one.tasks + two.tasks, 3);
    for (const summary of [one, two]) {
      assert.equal(summary.done, true);
      assert.equal(summary.failed, 0);
      assert.deepEqual(summary.totals, { compensated: 3, failed: 0 });
    }

    const status = await fx.client.rollbackStatus(run);
    assert.equal(status?.compensated, 3);
    assert.equal(status?.done, true);
    assert.deepEqual(status?.tasks.map((t) => t.state), ["compensated", "compensated", "compensated"]);
    const task = status?.tasks[0];
    const stored = await fx.client.getRecord(task?.namespace ?? "", task?.key ?? "");
    assert.deepEqual(stored?.stored?.result, { refunded: "ch_c", effect: task?.effect.key }, "the handler's value completes the task");
  });

  it("a single worker undoes the newest effect first; maxTasks stops it early", async () => {
    const namespace = ns("rollback-order");
    const run = runId("rb-order");
    // undoName without undo: the completion registers the compensation, the worker is handed its handler.
    const charge = once(async (order: string) => ({ charge: `ch_${order}` }), {
      client: fx.client,
      namespace,
      name: "charge",
      params: ["order"],
      run,
      undoName: "refund-in-order",
    });
    for (const order of ["a", "b", "c"]) await charge(order);
    await fx.admin.rollback(run, "wrong customer");

    const order: string[] = [];
    const handlers = { "refund-in-order": (data: { charge: string }) => void order.push(data.charge) };
    const first = await runCompensations(fx.client, run, { handlers, maxTasks: 1 });
    assert.deepEqual(first, { run, done: false, tasks: 1, compensated: 1, failed: 0, released: 0, unknown: 0, lost: 0, totals: null });
    const rest = await runCompensations(fx.client, run, { handlers });
    assert.equal(rest.done, true);
    assert.equal(rest.compensated, 2);
    assert.deepEqual(order, ["ch_c", "ch_b", "ch_a"]);
  });

  it("a handler failing permanently: the task is shown failed and never run again", async () => {
    const namespace = ns("rollback-permanent");
    const run = runId("rb-permanent");
    const calls = new Map<string, number>();
    async function refundUnlessDisputed(data: { charge: string }) {
      calls.set(data.charge, (calls.get(data.charge) ?? 0) + 1);
      if (data.charge === "ch_b") throw new Permanent("the charge is disputed: refund refused");
      return "refunded";
    }
    const charge = once(async (order: string) => ({ charge: `ch_${order}` }), {
      client: fx.client,
      namespace,
      name: "charge",
      params: ["order"],
      run,
      undo: refundUnlessDisputed,
    });
    for (const order of ["a", "b", "c"]) await charge(order);
    await fx.admin.rollback(run, "test");

    const summary = await runCompensations(fx.client, run, { idleTimeoutMs: 5_000 });
    assert.equal(summary.done, true);
    assert.equal(summary.compensated, 2);
    assert.equal(summary.failed, 1);
    assert.deepEqual(summary.totals, { compensated: 2, failed: 1 });

    const status = await fx.client.rollbackStatus(run);
    assert.equal(status?.failed, 1);
    assert.equal(status?.compensated, 2);
    assert.equal(status?.done, true);
    const failed = status?.tasks.find((t) => t.state === "failed");
    assert.deepEqual(failed?.compensation.data, { charge: "ch_b" });
    const record = await fx.client.getRecord(failed?.namespace ?? "", failed?.key ?? "");
    assert.equal(record?.stored?.status, "failure");
    assert.deepEqual(record?.stored?.result, { type: "Permanent", message: "the charge is disputed: refund refused" });

    // Another worker finds nothing to run: the failure is kept, not retried.
    const again = await runCompensations(fx.client, run, { idleTimeoutMs: 5_000 });
    assert.deepEqual([again.done, again.tasks], [true, 0]);
    assert.equal(await fx.client.claimCompensation(run).then((a) => a.outcome), "done");
    assert.deepEqual(Object.fromEntries(calls), { ch_a: 1, ch_b: 1, ch_c: 1 });
  });

  it("an error named retryable releases the task: it is run again", async () => {
    const namespace = ns("rollback-retryable");
    const run = runId("rb-retryable");
    class ConnectionReset extends Error {}
    let tries = 0;
    async function refundFlaky() {
      tries += 1;
      if (tries === 1) throw new ConnectionReset("connection reset");
      return "refunded";
    }
    const charge = once(async (order: string) => `ch_${order}`, { client: fx.client, namespace, name: "charge", run, undo: refundFlaky });
    await charge("a");
    await fx.admin.rollback(run, "test");
    const summary = await runCompensations(fx.client, run, { idleTimeoutMs: 5_000, retryable: [ConnectionReset] });
    assert.deepEqual([summary.done, summary.tasks, summary.released, summary.compensated, summary.failed], [true, 2, 1, 1, 0]);
    assert.equal(tries, 2);
    const task = (await fx.client.rollbackStatus(run))?.tasks[0];
    assert.equal(task?.state, "compensated");
    assert.equal(task?.attempt, 2);
  });

  it("any other error fails the task permanently: it is never retried silently", async () => {
    const namespace = ns("rollback-plain-error");
    const run = runId("rb-plain-error");
    let tries = 0;
    async function refundBroken() {
      tries += 1;
      throw new Error("refund API changed");
    }
    const charge = once(async (order: string) => `ch_${order}`, { client: fx.client, namespace, name: "charge", run, undo: refundBroken });
    await charge("a");
    await fx.admin.rollback(run, "test");
    const summary = await runCompensations(fx.client, run, { idleTimeoutMs: 5_000 });
    assert.deepEqual([summary.done, summary.tasks, summary.failed, summary.released], [true, 1, 1, 0]);
    assert.equal(tries, 1);
    assert.equal((await fx.client.rollbackStatus(run))?.tasks[0]?.state, "failed");
  });

  it("a compensation no handler is known for fails permanently, saying so", async () => {
    const namespace = ns("rollback-unknown-name");
    const run = runId("rb-unknown-name");
    const a = acquired(await fx.client.claim(namespace, "k", { request: 1, run }));
    const compensation = { name: "undo-nobody-knows", data: { id: 1 } };
    applied(await fx.client.complete(namespace, "k", a.fence, "done", { compensation }));
    await fx.admin.rollback(run, "test");

    const summary = await runCompensations(fx.client, run, { idleTimeoutMs: 5_000 });
    assert.deepEqual([summary.done, summary.failed, summary.compensated], [true, 1, 0]);
    const task = (await fx.client.rollbackStatus(run))?.tasks[0];
    assert.equal(task?.state, "failed");
    const record = await fx.client.getRecord(task?.namespace ?? "", task?.key ?? "");
    const error = record?.stored?.result as { type: string; message: string };
    assert.equal(error.type, "NoHandler");
    assert.match(error.message, /no handler is known for the compensation "undo-nobody-knows"/);
  });

  it("a worker that takes a task and never finishes: the next one recovers it once the lease passes", async () => {
    const namespace = ns("rollback-crash");
    const run = runId("rb-crash");
    const recoveries: Array<AcquiredCompensation["recovery"]> = [];
    async function refundAfterCrash(data: string, context: UndoContext) {
      recoveries.push(context.task.recovery);
      return `refunded ${data}`;
    }
    const charge = once(async (order: string) => `ch_${order}`, { client: fx.client, namespace, name: "charge", run, undo: refundAfterCrash });
    await charge("a");
    await fx.admin.rollback(run, "test");

    // The crashed worker: it takes the task with the server's shortest lease (100ms) and stops there.
    const held = await fx.client.claimCompensation(run, { lease: "100ms" });
    assert.equal(held.outcome, "acquired");
    const task = held as AcquiredCompensation;
    assert.deepEqual(task.compensation, { name: "refundAfterCrash", data: "ch_a" });
    assert.equal(task.attempt, 1);
    assert.equal(task.recovery, null);

    const summary = await runCompensations(fx.client, run, { idleTimeoutMs: 10_000 });
    assert.deepEqual([summary.done, summary.tasks, summary.compensated], [true, 1, 1]);
    assert.equal(recoveries.length, 1);
    assert.equal(recoveries[0]?.reason, "lease_expired");
    assert.equal(recoveries[0]?.previousFence, task.fence);
    // The crashed worker's late completion changes nothing.
    assert.equal((await fx.client.complete(task.namespace, task.key, task.fence, "late")).outcome, "stale");
    assert.equal((await fx.client.rollbackStatus(run))?.tasks[0]?.state, "compensated");
  });

  it("an undo's name is refused clearly; a result too large to be its data is reported unknown", async () => {
    const namespace = ns("undo-names");
    const client = fx.client;
    const effect = async () => 1;
    assert.throws(() => once(effect, { client, namespace, name: "e", undo: async () => 1 }), /no name of its own/);
    const anonymous = [async () => 1][0] as () => Promise<number>;
    assert.throws(() => once(effect, { client, namespace, name: "e", undo: anonymous }), /no name/);
    async function undoEffect() {}
    assert.throws(() => once(effect, { client, namespace, name: "e", undo: undoEffect, undoName: "bad\nname" }), /printable ASCII/);
    assert.throws(() => once(effect, { client, namespace, name: "e", undo: undoEffect, undoName: "x".repeat(129) }), /printable ASCII/);
    assert.throws(() => once(effect, { client, namespace, name: "e", undoData: () => 1 }), TypeError);
    assert.equal(registerUndo(undoEffect, "undo-effect-test"), "undo-effect-test");
    assert.throws(() => registerUndo(async function other() {}, "undo-effect-test"), /another undo function is registered/);

    async function undoLarge() {}
    const large = once(async () => "x".repeat(20_000), { client, namespace, key: "large", undo: undoLarge });
    await assert.rejects(large(), /more than 16384/);
    const record = await fx.client.getRecord(namespace, "large");
    assert.equal(record?.state, "in_progress");
    assert.match(record?.unknown ?? "", /could not be stored/);
  });

  it("a denied claim of a rolled-back run is a DeniedError for once", async () => {
    const namespace = ns("rollback-denied");
    const run = runId("rb-denied");
    let runs = 0;
    const effect = once(async (n: number) => ++runs + n * 0, { client: fx.client, namespace, name: "effect", run });
    await effect(1);
    await fx.admin.rollback(run, "stop it");
    await assert.rejects(effect(2), (e: unknown) => e instanceof DeniedError && e.kind === "switch");
    assert.equal(runs, 1);
  });
});
