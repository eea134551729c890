/**
 * Approvals against a real server: a namespace whose settings need a person's approval, the
 * claim's `pending_approval` answer, the admin's decision, and what `once` and `guarded` make of
 * each (AwaitingApprovalError, ApprovalDeniedError, waitForApproval).
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  ApprovalClosed,
  ApprovalDeniedError,
  AwaitingApprovalError,
  Client,
  DeniedError,
  Forbidden,
  InvalidRequest,
  KeyConflict,
  NotFound,
  fingerprint,
  guarded,
  once,
  type Acquired,
  type ClaimAnswer,
  type Denied,
  type PendingApproval,
} from "onceguard";
import { gate, ns, useServer } from "./server.js";

const fx = useServer();

/** A namespace of this test's own whose keys need approval (decisions expire after 4h). */
async function approvalNamespace(name: string): Promise<string> {
  const namespace = ns(name);
  await fx.admin.putSettings({ approvalRequired: true, approvalExpiry: "4h" }, { namespacePrefix: namespace, why: "test" });
  return namespace;
}

function pending(answer: ClaimAnswer): PendingApproval {
  assert.equal(answer.outcome, "pending_approval", JSON.stringify(answer));
  return answer as PendingApproval;
}

/** The id of the approval that a first claim of `key` with `request` asks for. */
async function ask(namespace: string, key: string, request: unknown): Promise<string> {
  return pending(await fx.client.claim(namespace, key, { request })).approval.id;
}

describe("approvals: the client", () => {
  it("settings need approval: pending (nothing charged), then approved, then acquired once", async () => {
    const namespace = await approvalNamespace("approval-cycle");
    const entry = (await fx.admin.listSettings()).find((e) => e.namespacePrefix === namespace);
    assert.equal(entry?.settings.approvalRequired, true);
    assert.equal(entry?.settings.approvalExpiry, "4h");

    const run = `approval-run-${Math.random().toString(36).slice(2, 10)}`;
    const request = { order: 1234, amount: 25 };
    const summary = "refund 25 EUR on order 1234\nasked by the support agent";
    const first = pending(await fx.client.claim(namespace, "refund-1234", { request, run, cost: 3, summary }));
    assert.ok(first.retryAfter > 0);
    const approval = first.approval;
    assert.match(approval.id, /^apr_[0-9a-f]+$/);
    assert.equal(approval.state, "pending");
    assert.equal(approval.namespace, namespace);
    assert.equal(approval.key, "refund-1234");
    assert.equal(approval.fingerprint, await fingerprint(request));
    assert.equal(approval.run, run);
    assert.equal(approval.cost, 3);
    assert.equal(approval.summary, summary);
    assert.equal(approval.decision, null);
    assert.equal(approval.expiresAt.getTime() - approval.requestedAt.getTime(), 4 * 3600 * 1000);
    assert.equal(await fx.client.getRecord(namespace, "refund-1234"), null, "nothing was acquired");
    assert.equal(await fx.client.getRun(run), null, "nothing was charged");

    // Claiming again while it is pending answers the same approval.
    assert.equal(pending(await fx.client.claim(namespace, "refund-1234", { request, run, cost: 3 })).approval.id, approval.id);

    const listed = await fx.admin.listApprovals({ state: "pending", limit: 1000 });
    assert.ok(listed.approvals.some((a) => a.id === approval.id));
    assert.deepEqual(await fx.admin.getApproval(approval.id), approval);
    assert.equal(await fx.admin.getApproval("apr_000000000000000000000000"), null);

    const approved = await fx.admin.approve(approval.id, { why: "checked the order" });
    assert.equal(approved.id, approval.id);
    assert.equal(approved.state, "approved");
    assert.equal(approved.decision?.approved, true);
    assert.equal(approved.decision?.why, "checked the order");
    assert.ok(approved.decision?.by);
    assert.ok(approved.decision?.at instanceof Date);
    assert.equal((await fx.admin.getApproval(approval.id))?.state, "approved");
    assert.ok((await fx.admin.listApprovals({ state: "approved", limit: 1000 })).approvals.some((a) => a.id === approval.id));
    assert.ok(!(await fx.admin.listApprovals({ state: "pending", limit: 1000 })).approvals.some((a) => a.id === approval.id));

    const acquired = await fx.client.claim(namespace, "refund-1234", { request, run, cost: 3 });
    assert.equal(acquired.outcome, "acquired");
    assert.equal((acquired as Acquired).attempt, 1);
    assert.deepEqual((await fx.client.getRun(run))?.usage, { effects: 1, cost: 3 });
  });

  it("iterApprovals follows the cursor through every page", async () => {
    const namespace = await approvalNamespace("approval-pages");
    const ids = [];
    for (const key of ["a", "b", "c"]) ids.push(await ask(namespace, key, key));
    const seen = [];
    for await (const a of fx.admin.iterApprovals({ state: "pending", pageSize: 1 })) if (a.namespace === namespace) seen.push(a.id);
    assert.deepEqual(seen.sort(), ids.sort());
    const page = await fx.admin.listApprovals({ limit: 1 });
    assert.equal(page.approvals.length, 1);
    assert.ok(page.next);
  });

  it("a batch answers pending_approval per item, as alone", async () => {
    const namespace = await approvalNamespace("approval-batch");
    const free = ns("approval-batch-free");
    const answers = await fx.client.claimBatch([
      { namespace, key: "k", request: 1, summary: "batch item" },
      { namespace: free, key: "k", request: 1 },
    ]);
    assert.deepEqual(answers.map((a) => a.outcome), ["pending_approval", "acquired"]);
    const approval = (answers[0] as PendingApproval).approval;
    assert.equal(approval.summary, "batch item");
    assert.equal(pending(await fx.client.claim(namespace, "k", { request: 1 })).approval.id, approval.id);
  });

  it("8 concurrent claims after the approval: exactly one acquires, the others find it in flight", async () => {
    const namespace = await approvalNamespace("approval-race");
    const id = await ask(namespace, "k", { n: 1 });
    await fx.admin.approve(id, { why: "go" });
    const answers = await Promise.all(Array.from({ length: 8 }, () => fx.client.claim(namespace, "k", { request: { n: 1 } })));
    const outcomes = answers.map((a) => a.outcome).sort();
    assert.deepEqual(outcomes, ["acquired", ...Array<string>(7).fill("in_flight")]);
  });

  it("a denial refuses every claim of the key with that request", async () => {
    const namespace = await approvalNamespace("approval-deny");
    const id = await ask(namespace, "k", 1);
    const denied = await fx.admin.deny(id, { why: "too large a refund" });
    assert.equal(denied.state, "denied");
    assert.equal(denied.decision?.approved, false);
    assert.equal(denied.decision?.why, "too large a refund");
    for (let i = 0; i < 3; i++) {
      const answer = await fx.client.claim(namespace, "k", { request: 1 });
      assert.equal(answer.outcome, "denied");
      const d = answer as Denied;
      assert.equal(d.kind, "approval");
      assert.equal(d.retryable, false);
      assert.deepEqual(d.reason, { reason: "approval_denied", approval: id, by: denied.decision?.by, why: "too large a refund" });
    }
  });

  it("only admin keys decide; a decision is taken once; an unknown id is not found", async () => {
    const namespace = await approvalNamespace("approval-decide");
    const id = await ask(namespace, "k", 1);
    await assert.rejects(fx.client.approve(id, { why: "I am only an agent" }), Forbidden);
    await assert.rejects(fx.client.deny(id, { why: "I am only an agent" }), Forbidden);
    assert.equal((await fx.admin.getApproval(id))?.state, "pending", "the agent's attempts changed nothing");
    await assert.rejects(fx.admin.approve(id, { why: "" }), InvalidRequest);

    await fx.admin.approve(id, { why: "ok" });
    await assert.rejects(fx.admin.deny(id, { why: "changed my mind" }), (e: unknown) => {
      assert.ok(e instanceof ApprovalClosed);
      assert.equal(e.status, 409);
      assert.equal(e.type, "https://onceguard.dev/problems/approval-closed");
      return true;
    });
    await assert.rejects(fx.admin.approve(id, { why: "again" }), ApprovalClosed);
    assert.equal((await fx.admin.getApproval(id))?.decision?.approved, true, "the first decision stands");
    await assert.rejects(fx.admin.approve("apr_000000000000000000000000", { why: "x" }), NotFound);
  });

  it("another request of an approved key is a mismatch; the approved one still acquires", async () => {
    const namespace = await approvalNamespace("approval-mismatch");
    const id = await ask(namespace, "k", { amount: 25 });
    await fx.admin.approve(id, { why: "25 is fine" });
    assert.equal((await fx.client.claim(namespace, "k", { request: { amount: 2500 } })).outcome, "mismatch");
    let runs = 0;
    const refund = once(
      async (amount: number) => {
        runs++;
        return amount;
      },
      { client: fx.client, namespace, key: "k", params: ["amount"], wait: null },
    );
    await assert.rejects(refund(2500), KeyConflict);
    assert.equal(runs, 0);
    assert.equal(await refund(25), 25);
    assert.equal(runs, 1);
  });
});

describe("approvals: once and guarded", () => {
  it("a pending approval: AwaitingApprovalError, and the function does not run", async () => {
    const namespace = await approvalNamespace("approval-once");
    let runs = 0;
    const refund = once(
      async (order: number, amount: number) => {
        runs++;
        return { refund: `re_${order}`, amount };
      },
      {
        client: fx.client,
        namespace,
        name: "refund",
        params: ["order", "amount"],
        wait: null,
        summary: (order, amount) => `refund ${amount} on order ${order}`,
      },
    );
    let id = "";
    for (let i = 0; i < 2; i++) {
      await assert.rejects(refund(1234, 25), (e: unknown) => {
        assert.ok(e instanceof AwaitingApprovalError);
        assert.equal(e.namespace, namespace);
        assert.equal(e.approval.state, "pending");
        assert.equal(e.approval.summary, "refund 25 on order 1234");
        assert.ok(e.retryAfter > 0);
        id ||= e.approval.id;
        assert.equal(e.approval.id, id, "the same approval while it is pending");
        assert.match(e.message, /awaits a person's approval/);
        assert.ok(e.message.includes(id));
        assert.match(e.message, /Nothing was done/);
        assert.match(e.message, /same arguments/);
        return true;
      });
    }
    assert.equal(runs, 0);
    await fx.admin.approve(id, { why: "ok" });
    assert.deepEqual(await refund(1234, 25), { refund: "re_1234", amount: 25 });
    assert.deepEqual(await refund(1234, 25), { refund: "re_1234", amount: 25 });
    assert.equal(runs, 1);
  });

  it("a denied approval: ApprovalDeniedError (a DeniedError) on every call, and the function never runs", async () => {
    const namespace = await approvalNamespace("approval-once-deny");
    let runs = 0;
    const job = () => {
      runs++;
      return "ran";
    };
    const id = await ask(namespace, "k", { amount: 9000 });
    const decision = await fx.admin.deny(id, { why: "over the limit" });
    for (let i = 0; i < 3; i++) {
      await assert.rejects(guarded(fx.client, namespace, "k", { request: { amount: 9000 } }, job), (e: unknown) => {
        assert.ok(e instanceof ApprovalDeniedError);
        assert.ok(e instanceof DeniedError);
        assert.equal(e.kind, "approval");
        assert.equal(e.approval, id);
        assert.equal(e.by, decision.decision?.by);
        assert.equal(e.why, "over the limit");
        assert.equal(e.denied.retryable, false);
        assert.ok(e.message.includes(id) && e.message.includes("over the limit"));
        return true;
      });
    }
    assert.equal(runs, 0);
  });

  it("waitForApproval: the call waits for an approval given meanwhile, then runs once", async () => {
    const namespace = await approvalNamespace("approval-wait");
    // Learn the approval's id from the call's own first answer (a claim that does not wait).
    const asked = gate<string>();
    const watching = new Client({
      baseUrl: fx.server.url,
      apiKey: fx.agentKey,
      fetch: (async (input: string | URL | Request, init?: RequestInit) => {
        const response = await fetch(input, init);
        if (String(input).endsWith("/v1/claims") && response.status === 202) {
          asked.open(((await response.clone().json()) as { approval: { id: string } }).approval.id);
        }
        return response;
      }) as typeof fetch,
    });
    let runs = 0;
    const send = once(
      async (to: string) => {
        runs++;
        return `sent to ${to}`;
      },
      { client: watching, namespace, name: "send", wait: null, waitForApproval: "20s" },
    );
    const call = send("all-customers");
    const approved = await fx.admin.approve(await asked.promise, { why: "the newsletter is ready" });
    assert.equal(approved.state, "approved");
    assert.equal(await call, "sent to all-customers");
    assert.equal(await send("all-customers"), "sent to all-customers");
    assert.equal(runs, 1);
  });

  it("waitForApproval: a denial given meanwhile ends the wait with ApprovalDeniedError", async () => {
    const namespace = await approvalNamespace("approval-wait-deny");
    const key = "k";
    const id = await ask(namespace, key, 1);
    let ran = false;
    const call = guarded(fx.client, namespace, key, { request: 1, waitForApproval: "20s" }, () => {
      ran = true;
    });
    // The expectation is attached before the denial: the call may be refused before deny() answers.
    const refused = assert.rejects(call, (e: unknown) => e instanceof ApprovalDeniedError && e.approval === id);
    await fx.admin.deny(id, { why: "no" });
    await refused;
    assert.equal(ran, false);
  });

  it("waitForApproval that passes undecided: AwaitingApprovalError", async () => {
    const namespace = await approvalNamespace("approval-wait-undecided");
    let ran = false;
    const call = guarded(fx.client, namespace, "k", { request: 1, wait: null, waitForApproval: 0.3 }, () => {
      ran = true;
    });
    await assert.rejects(call, AwaitingApprovalError);
    assert.equal(ran, false);
  });
});
