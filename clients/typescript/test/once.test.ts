/** `once` and `guarded`: run, replay, failures, heartbeat, checkpoints and recovery, races. */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, it } from "node:test";
import {
  Attempt,
  Client,
  InFlightError,
  KeyConflict,
  OutcomeUnknown,
  Permanent,
  PermanentFailure,
  StaleFence,
  current,
  deriveKey,
  guarded,
  once,
  withSignal,
  type Acquired,
} from "onceguard";
import { gate, ns, useServer } from "./server.js";

const fx = useServer();

class CardDeclined extends Error {
  override name = "CardDeclined";
}

describe("once", () => {
  it("runs once per arguments; every later call replays the stored value", async () => {
    const namespace = ns("once-replay");
    let runs = 0;
    const refund = once(
      async (order: number, amount: number) => {
        runs++;
        return { refund: `re_${order}`, amount, at: new Date(0) };
      },
      { client: fx.client, namespace, name: "refund", version: "v1", params: ["order", "amount"] },
    );
    const first = await refund(1234, 25);
    assert.deepEqual(first, { refund: "re_1234", amount: 25, at: "1970-01-01T00:00:00.000Z" }); // as stored, for everyone
    assert.deepEqual(await refund(1234, 25), first);
    assert.equal(runs, 1);
    await refund(1234, 26);
    assert.equal(runs, 2);

    // The key is the Python client's for refund(order=1234, amount=25), name "refund", version "v1".
    const python = JSON.parse(readFileSync(new URL("../../test/fixtures/python-keys.json", import.meta.url), "utf8")) as {
      calls: Array<{ key: string }>;
    };
    const key = python.calls[0]?.key ?? "";
    assert.equal(key, await deriveKey("refund", "v1", { order: 1234, amount: 25 }));
    const record = await fx.client.getRecord(namespace, key);
    assert.equal(record?.state, "completed");
    assert.deepEqual(record?.stored?.result, first);
  });

  it("a new version gives new keys; a fixed key reused with other arguments is a KeyConflict", async () => {
    const namespace = ns("once-version");
    let runs = 0;
    const make = (version: string) => once(async (x: number) => ++runs + x * 0, { client: fx.client, namespace, name: "f", version });
    await make("v1")(1);
    await make("v1")(1);
    await make("v2")(1);
    assert.equal(runs, 2);

    const fixed = once(async (x: number) => x, { client: fx.client, namespace, key: "the-one-key" });
    assert.equal(await fixed(1), 1);
    await assert.rejects(fixed(2), KeyConflict);
    await assert.rejects(
      (async () => once(async () => 1, { client: fx.client, namespace, name: "bad:name" }))(),
      RangeError,
    );
  });

  it("the attempt is this and current(): fence, attempt number, checkpoint", async () => {
    const namespace = ns("once-attempt");
    const seen: Attempt[] = [];
    const effect = once(
      async function (this: Attempt, order: string) {
        assert.equal(current(), this);
        seen.push(this);
        await this.checkpoint("charged", { order });
        return this.fence;
      },
      { client: fx.client, namespace, name: "effect" },
    );
    const fence = await effect("o-1");
    const attempt = seen[0];
    assert.ok(attempt instanceof Attempt);
    assert.equal(attempt.fence, fence);
    assert.equal(attempt.attempt, 1);
    assert.equal(attempt.replayed, false);
    const record = await fx.client.getRecord(namespace, attempt.key);
    assert.deepEqual(record?.checkpoints.map((c) => [c.name, c.data]), [["charged", { order: "o-1" }]]);
    assert.throws(() => current(), /only available inside/);
  });

  it("any other error releases the key: the next call runs again, attempt 2", async () => {
    const namespace = ns("once-retryable");
    const attempts: number[] = [];
    const flaky = once(
      async () => {
        attempts.push(current().attempt);
        if (attempts.length === 1) throw new Error("connection reset");
        return "ok";
      },
      { client: fx.client, namespace, key: "flaky" },
    );
    await assert.rejects(flaky(), /connection reset/);
    assert.equal(await flaky(), "ok");
    assert.deepEqual(attempts, [1, 2]);
  });

  it("a permanent failure is stored and thrown to every caller", async () => {
    const namespace = ns("once-permanent");
    let runs = 0;
    const charge = once(
      async (card: string) => {
        runs++;
        throw new CardDeclined(`card ${card} declined`);
      },
      { client: fx.client, namespace, name: "charge", permanent: [CardDeclined] },
    );
    await assert.rejects(charge("4242"), (e: unknown) => {
      assert.ok(e instanceof PermanentFailure);
      assert.equal(e.replayed, false);
      assert.equal(e.errorType, "CardDeclined");
      assert.equal(e.errorMessage, "card 4242 declined");
      assert.ok(e.cause instanceof CardDeclined);
      return true;
    });
    await assert.rejects(charge("4242"), (e: unknown) => e instanceof PermanentFailure && e.replayed && e.errorType === "CardDeclined");
    assert.equal(runs, 1);

    const explicit = once(async () => {
      throw new Permanent("no such customer");
    }, { client: fx.client, namespace, key: "explicit" });
    await assert.rejects(explicit(), (e: unknown) => e instanceof PermanentFailure && e.errorMessage === "no such customer");
  });

  it("an unknown outcome is reported: the next call is a recovery with the last checkpoint", async () => {
    const namespace = ns("once-unknown");
    const recoveries: unknown[] = [];
    const ship = once(
      async (order: string) => {
        const attempt = current();
        recoveries.push(attempt.recovery);
        if (attempt.attempt === 1) {
          await attempt.checkpoint("label-printed", { label: "L1" });
          throw new OutcomeUnknown("carrier timed out after the request was sent");
        }
        return `shipped ${order} with ${String((attempt.recovery?.lastCheckpoint?.data as { label: string }).label)}`;
      },
      { client: fx.client, namespace, name: "ship" },
    );
    await assert.rejects(ship("o-9"), OutcomeUnknown);
    assert.equal(await ship("o-9"), "shipped o-9 with L1");
    const recovery = recoveries[1] as Acquired["recovery"];
    assert.equal(recoveries[0], null);
    assert.equal(recovery?.reason, "reported_unknown");
    assert.match(recovery?.detail ?? "", /OutcomeUnknown: carrier timed out/);
  });

  it("aborting the call while the function runs reports the outcome unknown", async () => {
    const namespace = ns("once-abort");
    const started = gate();
    const work = once(
      async () => {
        started.open();
        const attempt = current();
        await new Promise((_, reject) => attempt.signal.addEventListener("abort", () => reject(attempt.signal.reason)));
      },
      { client: fx.client, namespace, key: "abortable" },
    );
    const controller = new AbortController();
    const call = withSignal(work, controller.signal)();
    await started.promise;
    controller.abort(new DOMException("the user went away", "AbortError"));
    await assert.rejects(call, { name: "AbortError" });
    const next = await fx.client.claim(namespace, "abortable", { request: [] });
    assert.equal(next.outcome, "acquired");
    assert.equal((next as Acquired).recovery?.reason, "reported_unknown");
  });

  it("two callers at once: one runs, the other waits on the server and gets its value", async () => {
    const namespace = ns("once-race");
    const release = gate();
    const started = gate();
    let runs = 0;
    const slow = once(
      async (n: number) => {
        runs++;
        started.open();
        await release.promise;
        return n * 2;
      },
      { client: fx.client, namespace, name: "slow", wait: "10s" },
    );
    const first = slow(21);
    await started.promise;
    const second = slow(21);
    // The second claim is parked on the server while the first holds the key; nothing else
    // can tell the test that it arrived, so check the key is in flight through a third claim.
    const peek = await fx.client.claim(namespace, await deriveKey("slow", "v1", [21]), { request: [21] });
    assert.equal(peek.outcome, "in_flight");
    release.open();
    assert.deepEqual(await Promise.all([first, second]), [42, 42]);
    assert.equal(runs, 1);
  });

  it("still in flight after the wait: InFlightError", async () => {
    const namespace = ns("once-inflight");
    await fx.client.claim(namespace, "held", { request: [], lease: "10s" });
    const f = once(async () => "never", { client: fx.client, namespace, key: "held", wait: null });
    await assert.rejects(f(), (e: unknown) => e instanceof InFlightError && e.retryAfter > 0 && e.attempt === 1);
  });
});

describe("heartbeat", () => {
  it("keeps a short lease alive for as long as the function runs", async () => {
    const namespace = ns("heartbeat");
    const extended = gate();
    let extends_ = 0;
    // Count the heartbeat's extensions on the wire: the function holds the key until the lease
    // has been extended four times, longer than one lease (300 ms, a beat every 100 ms).
    const counting = new Client({
      baseUrl: fx.server.url,
      apiKey: fx.agentKey,
      fetch: (async (input: string | URL | Request, init?: RequestInit) => {
        const response = await fetch(input, init);
        if (String(input).endsWith("/v1/claims/extend") && ++extends_ === 4) extended.open();
        return response;
      }) as typeof fetch,
    });
    const work = once(
      async () => {
        await extended.promise;
        const other = await fx.client.claim(namespace, "long", { request: [] });
        assert.equal(other.outcome, "in_flight", "the lease is still held after four beats");
        return "done";
      },
      { client: counting, namespace, key: "long", lease: 0.3 },
    );
    assert.equal(await work(), "done");
    assert.ok(extends_ >= 4);
  });

  it("a lease taken over while the function runs: StaleFence, and nothing is stored", async () => {
    const namespace = ns("stale-lease");
    const started = gate();
    const release = gate();
    const call = guarded(fx.client, namespace, "k", { request: 1, lease: 0.2, heartbeat: false }, async () => {
      started.open();
      await release.promise;
      return "late";
    });
    await started.promise;
    // This claim waits on the server until the holder's lease passes, then takes the key over.
    const takeover = await fx.client.claim(namespace, "k", { request: 1, wait: "5s" });
    assert.equal(takeover.outcome, "acquired");
    assert.equal((takeover as Acquired).recovery?.reason, "lease_expired");
    release.open();
    await assert.rejects(call, (e: unknown) => e instanceof StaleFence && e.reason === "superseded");
    assert.equal((await fx.client.getRecord(namespace, "k"))?.state, "in_progress");
  });
});

describe("typed results", () => {
  it("answer the stored JSON's type (a Date as its ISO string), or decode's", async () => {
    const namespace = ns("typed");
    const at = new Date("2026-01-02T03:04:05Z");
    const stamp = once(async (n: number) => ({ n, at, tags: new Set(["b", "a"]), note: undefined as string | undefined }), {
      client: fx.client,
      namespace,
      name: "stamp",
    });
    for (const _ of [1, 2]) {
      const value = await stamp(1);
      // Checked when compiled: the declared types are the JSON's.
      const iso: string = value.at;
      const tags: string[] = value.tags;
      const note: string | undefined = value.note;
      // @ts-expect-error a Date comes back as its ISO string
      const wrong: Date = value.at;
      assert.deepEqual([value.n, iso, tags, note, typeof wrong], [1, "2026-01-02T03:04:05.000Z", ["a", "b"], undefined, "string"]);
    }
    const revived = once(async () => at, { client: fx.client, namespace, name: "revived", decode: (v) => new Date(v as string) });
    for (const _ of [1, 2]) {
      const date: Date = await revived();
      assert.ok(date instanceof Date && date.getTime() === at.getTime());
    }
    const big = await guarded(fx.client, namespace, "big", () => ({ n: 5n, bytes: new Uint8Array([1, 2]) }));
    const n: number = big.n;
    const bytes: string = big.bytes;
    assert.deepEqual([n, bytes], [5, "AQI="]);
  });
});

describe("guarded", () => {
  it("a wait longer than the server's 30s outlasts a crashed holder's lease, and recovers the key once", async () => {
    const namespace = ns("outlast");
    // The holder claims with a 31s lease and crashes: it never completes.
    const held = await fx.client.claim(namespace, "k", { request: 1, lease: 31 });
    assert.equal(held.outcome, "acquired");
    let runs = 0;
    const started = Date.now();
    const value = await guarded(fx.client, namespace, "k", { request: 1, wait: "45s" }, (attempt) => {
      runs += 1;
      return { recovered: attempt.recovery?.reason ?? null };
    });
    const waited = (Date.now() - started) / 1000;
    assert.deepEqual(value, { recovered: "lease_expired" });
    assert.equal(runs, 1);
    // One claim waits at most 30s on the server, and the lease ran 31s: the call claimed again.
    assert.ok(waited >= 30, `waited ${waited}s: longer than one claim's 30s`);
  });

  it("runs the function once per key, passes the attempt, and replays", async () => {
    const namespace = ns("guarded");
    let runs = 0;
    const open = (attempt: Attempt) => {
      runs++;
      assert.equal(attempt.replayed, false);
      attempt.cost = 12;
      attempt.tokens = undefined;
      return { ticket: `T-${attempt.fence}` };
    };
    const first = await guarded(fx.client, namespace, "ticket-1", { request: { alert: 1 }, run: "guarded-run" }, open);
    const second = await guarded(fx.client, namespace, "ticket-1", { request: { alert: 1 } }, open);
    assert.deepEqual(second, first);
    assert.equal(runs, 1);
    assert.deepEqual((await fx.client.getRun("guarded-run"))?.usage, { effects: 1, cost: 12 });
  });

  it("complete() stores early: an error after it stands as completed", async () => {
    const namespace = ns("guarded-early");
    await assert.rejects(
      guarded(fx.client, namespace, "k", async (attempt) => {
        assert.deepEqual(await attempt.complete({ sent: true }), { sent: true });
        throw new Error("after the effect");
      }),
      /after the effect/,
    );
    assert.deepEqual(await guarded(fx.client, namespace, "k", () => "not run"), { sent: true });
  });

  it("encode and decode rebuild the value for every caller", async () => {
    const namespace = ns("guarded-codec");
    const options = {
      encode: (v: unknown) => ({ at: (v as Date).toISOString() }),
      decode: (v: unknown) => new Date((v as { at: string }).at),
    };
    const when = new Date("2026-11-29T12:00:00Z");
    const first = await guarded(fx.client, namespace, "k", options, () => when);
    const again = await guarded(fx.client, namespace, "k", options, () => new Date(0));
    assert.ok(first instanceof Date && again instanceof Date);
    assert.equal(again.getTime(), when.getTime());
  });
});
