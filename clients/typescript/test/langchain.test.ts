/**
 * LangChain.js tools through LangGraph's `ToolNode` (a call the model re-emits with another
 * id), and a guarded LangGraph `task` inside an `entrypoint` re-run on the same thread.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { AIMessage, ToolMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { MemorySaver, entrypoint } from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { guardTask, guardTool, threadId } from "onceguard/langchain";
import { z } from "zod";
import { ns, useServer } from "./server.js";

const fx = useServer();

function modelTurn(id: string, args: Record<string, unknown>): AIMessage {
  return new AIMessage({ content: "", tool_calls: [{ id, name: "refund", args, type: "tool_call" }] });
}

/** A refund tool counting its runs (`calls()`). */
function countedRefund() {
  let calls = 0;
  const refund = tool(
    async ({ order }: { order: number }) => {
      calls++;
      return `refunded ${order}`;
    },
    { name: "refund", description: "Refund", schema: z.object({ order: z.number() }) },
  );
  return { refund, calls: () => calls };
}

describe("LangChain tools", () => {
  it("a ToolNode re-running the model's call (another id) replays the stored result", async () => {
    const namespace = ns("langchain-tool");
    const refunds: number[] = [];
    const refund = tool(
      async ({ order, amount }: { order: number; amount: number }) => {
        refunds.push(order);
        return `refunded ${amount} on order ${order} (re_${refunds.length})`;
      },
      { name: "refund", description: "Refund an order", schema: z.object({ order: z.number(), amount: z.number() }) },
    );
    const guardedRefund = guardTool(refund, { client: fx.client, namespace, runId: threadId });
    assert.equal(guardedRefund.name, "refund");
    // The guarded tool keeps the tool's schema type (a compile-time check: the base interface's
    // schema type is not assignable to the zod object's).
    const schema: typeof refund.schema = guardedRefund.schema;
    assert.equal(schema, refund.schema);
    const node = new ToolNode([guardedRefund]);
    const config = { configurable: { thread_id: "thread-7" } };

    const first = (await node.invoke({ messages: [modelTurn("call_1", { order: 1234, amount: 25 })] }, config)) as { messages: ToolMessage[] };
    const second = (await node.invoke({ messages: [modelTurn("call_2", { amount: 25, order: 1234 })] }, config)) as { messages: ToolMessage[] };
    assert.equal(first.messages[0]?.content, "refunded 25 on order 1234 (re_1)");
    assert.equal(first.messages[0]?.tool_call_id, "call_1");
    assert.equal(second.messages[0]?.content, first.messages[0]?.content);
    assert.equal(second.messages[0]?.tool_call_id, "call_2");
    assert.deepEqual(refunds, [1234]);

    await node.invoke({ messages: [modelTurn("call_3", { order: 1234, amount: 25 })] }, { configurable: { thread_id: "thread-8" } });
    assert.deepEqual(refunds, [1234, 1234], "another thread is another run");
    assert.equal((await fx.client.getRun("thread-7"))?.usage.effects, 1);
  });

  it("a failing tool: the ToolNode's error message is not stored, the next call runs again", async () => {
    const namespace = ns("langchain-error");
    let calls = 0;
    const flaky = tool(
      async ({ order }: { order: number }) => {
        calls++;
        if (calls === 1) throw new Error("payments API 502");
        return `refunded ${order}`;
      },
      { name: "refund", description: "Refund", schema: z.object({ order: z.number() }) },
    );
    const node = new ToolNode([guardTool(flaky, { client: fx.client, namespace, runId: "fixed-run" })]);
    const failed = (await node.invoke({ messages: [modelTurn("a", { order: 1 })] })) as { messages: ToolMessage[] };
    assert.match(String(failed.messages[0]?.content), /payments API 502/);
    const retried = (await node.invoke({ messages: [modelTurn("b", { order: 1 })] })) as { messages: ToolMessage[] };
    assert.equal(retried.messages[0]?.content, "refunded 1");
    assert.equal(calls, 2);
  });

  it("a call that awaits approval: the ToolNode tells the model, and the tool does not run", async () => {
    const namespace = ns("langchain-approval");
    await fx.admin.putSettings({ approvalRequired: true }, { namespacePrefix: namespace, why: "test" });
    const { refund, calls: refunds } = countedRefund();
    const node = new ToolNode([guardTool(refund, { client: fx.client, namespace, runId: "approval-thread", wait: null })]);
    const answer = (await node.invoke({ messages: [modelTurn("a", { order: 1 })] })) as { messages: ToolMessage[] };
    assert.equal(refunds(), 0, "the refund did not run");
    const told = String(answer.messages[0]?.content);
    const [pending] = (await fx.admin.listApprovals({ state: "pending", limit: 1000 })).approvals.filter((a) => a.namespace === namespace);
    assert.ok(pending, "the call asked for an approval");
    assert.equal(answer.messages[0]?.tool_call_id, "a");
    assert.match(told, /awaits a person's approval/);
    assert.ok(told.includes(pending.id));
    assert.match(told, /Nothing was done/);
    assert.match(told, /Call again later with the same arguments/);
  });

  it("a call already running: the ToolNode tells the model when to call again, without an error", async () => {
    const namespace = ns("langchain-in-flight");
    const held = await fx.client.claim(namespace, "refund-9", { request: { order: 9 }, lease: "30s" });
    assert.equal(held.outcome, "acquired");
    const { refund, calls: refunds } = countedRefund();
    const guarded = guardTool(refund, { client: fx.client, namespace, runId: "held", wait: null, keyFn: () => "refund-9" });
    const node = new ToolNode([guarded]);
    const result = (await node.invoke({ messages: [modelTurn("c9", { order: 9 })] })) as { messages: ToolMessage[] };
    const told = String(result.messages[0]?.content);
    assert.match(told, /^This call is already running/);
    assert.doesNotMatch(told, /Please fix your mistakes/);
    assert.equal(refunds(), 0, "the refund did not run");
  });

  it("observe mode: a re-emitted call runs again, and an undo is registered with each completion", async () => {
    const namespace = ns("langchain-observe");
    await fx.admin.putSettings({ mode: "observe" }, { namespacePrefix: namespace, why: "test" });
    let calls = 0;
    const refund = tool(
      async ({ order }: { order: number }) => {
        calls++;
        return `refunded ${order} (${calls})`;
      },
      { name: "refund", description: "Refund", schema: z.object({ order: z.number() }) },
    );
    const node = new ToolNode([guardTool(refund, { client: fx.client, namespace, runId: "observe-thread", undoName: "undo-refund" })]);
    const contents = [];
    for (const id of ["a", "b"]) {
      const answer = (await node.invoke({ messages: [modelTurn(id, { order: 1 })] })) as { messages: ToolMessage[] };
      contents.push(answer.messages[0]?.content);
    }
    assert.deepEqual(contents, ["refunded 1 (1)", "refunded 1 (2)"], "the second call ran: observe mode lets it");
    const view = await fx.admin.rollback("observe-thread", "test");
    assert.deepEqual(view.tasks.map((t) => t.compensation), [{ name: "undo-refund", data: "refunded 1 (1)" }], "only the completed call");
  });

  it("a content-and-artifact tool replays both", async () => {
    const namespace = ns("langchain-artifact");
    let calls = 0;
    const search = tool(
      async ({ q }: { q: string }) => {
        calls++;
        return [`found ${q}`, { hits: [1, 2, 3] }];
      },
      { name: "search", description: "Search", schema: z.object({ q: z.string() }), responseFormat: "content_and_artifact" },
    );
    const guardedSearch = guardTool(search, { client: fx.client, namespace, runId: "r" });
    for (const id of ["s1", "s2"]) {
      const message = (await guardedSearch.invoke({ type: "tool_call", id, name: "search", args: { q: "x" } })) as ToolMessage;
      assert.equal(message.content, "found x");
      assert.deepEqual(message.artifact, { hits: [1, 2, 3] });
      assert.equal(message.tool_call_id, id);
    }
    assert.equal(calls, 1);
  });
});

describe("LangGraph tasks", () => {
  it("a guarded task in an entrypoint runs once per thread, even when the workflow crashed after it", async () => {
    const namespace = ns("langgraph-task");
    const charges: string[] = [];
    const charge = guardTask(
      "charge-card",
      async (order: string, amount: number) => {
        charges.push(order);
        return { charge: `ch_${charges.length}`, order, amount };
      },
      { client: fx.client, namespace, runId: threadId },
    );
    let crash = true;
    const checkout = entrypoint({ name: "checkout", checkpointer: new MemorySaver() }, async (order: string) => {
      const receipt = await charge(order, 25);
      if (crash) throw new Error("the worker died after charging");
      return receipt;
    });
    const config = { configurable: { thread_id: "checkout-1" } };
    await assert.rejects(checkout.invoke("o-1", config), /died after charging/);
    crash = false;
    const receipt = await checkout.invoke("o-1", config);
    assert.deepEqual(receipt, { charge: "ch_1", order: "o-1", amount: 25 });
    assert.deepEqual(charges, ["o-1"], "the card was charged once");

    const other = await checkout.invoke("o-1", { configurable: { thread_id: "checkout-2" } });
    assert.equal((other as { charge: string }).charge, "ch_2");
  });
});
