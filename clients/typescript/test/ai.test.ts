/**
 * Vercel AI SDK: guarded tools in `generateText` with a scripted model (`MockLanguageModelV3`
 * from `ai/test`): the model re-emits a tool call with a new `toolCallId`; the effect happens once.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { generateText, stepCountIs, tool } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { AwaitingApprovalError, PermanentFailure } from "onceguard";
import { guardTool, guardTools } from "onceguard/ai";
import { z } from "zod";
import { text, toolCall, type GenerateResult } from "./ai-script.js";
import { ns, useServer } from "./server.js";

const fx = useServer();

/** A model that answers each step from `script`, in order. */
function scripted(...script: GenerateResult[]): MockLanguageModelV3 {
  return new MockLanguageModelV3({ doGenerate: [...script] });
}

function invoiceTool(sent: Array<{ customer: string; amount: number }>) {
  return tool({
    description: "Send an invoice to a customer",
    inputSchema: z.object({ customer: z.string(), amount: z.number() }),
    execute: async ({ customer, amount }) => {
      sent.push({ customer, amount });
      return { invoice: `inv_${sent.length}`, customer, amount };
    },
  });
}

describe("Vercel AI SDK", () => {
  it("a re-emitted tool call (new toolCallId) replays the first call's output", async () => {
    const namespace = ns("ai-sdk");
    const sent: Array<{ customer: string; amount: number }> = [];
    const conversation = "conv-1";
    const tools = guardTools({ sendInvoice: invoiceTool(sent) }, { client: fx.client, namespace, runId: () => conversation });

    const first = await generateText({
      model: scripted(toolCall("call_1", "sendInvoice", { customer: "c_1", amount: 100 }), text("sent")),
      tools,
      prompt: "invoice c_1 for 100",
      stopWhen: stepCountIs(3),
    });
    assert.equal(first.text, "sent");
    const firstOutput = first.steps[0]?.toolResults[0]?.output;
    assert.deepEqual(firstOutput, { invoice: "inv_1", customer: "c_1", amount: 100 });

    // The model, resumed, emits the same call again with another id (and the keys in another order).
    const second = await generateText({
      model: scripted(toolCall("call_2", "sendInvoice", { amount: 100, customer: "c_1" }), text("sent again")),
      tools,
      prompt: "invoice c_1 for 100",
      stopWhen: stepCountIs(3),
    });
    assert.deepEqual(second.steps[0]?.toolResults[0]?.output, firstOutput);
    assert.equal(sent.length, 1, "the invoice was sent once");

    // Another conversation is another run: its own effect.
    const other = guardTools({ sendInvoice: invoiceTool(sent) }, { client: fx.client, namespace, runId: "conv-2" });
    await generateText({
      model: scripted(toolCall("call_3", "sendInvoice", { customer: "c_1", amount: 100 }), text("ok")),
      tools: other,
      prompt: "invoice c_1 for 100",
      stopWhen: stepCountIs(3),
    });
    assert.equal(sent.length, 2);
    const run = await fx.client.getRun(conversation);
    assert.equal(run?.usage.effects, 1);
  });

  it("the run id can come from experimental_context; failures reach the model after the guard", async () => {
    const namespace = ns("ai-sdk-context");
    let calls = 0;
    class Declined extends Error {
      override name = "Declined";
    }
    const charge = guardTool(
      tool({
        description: "Charge a card",
        inputSchema: z.object({ card: z.string() }),
        execute: async ({ card }): Promise<string> => {
          calls++;
          throw new Declined(`card ${card} declined`);
        },
      }),
      {
        name: "charge",
        client: fx.client,
        namespace,
        runId: (options) => (options.experimental_context as { runId: string }).runId,
        permanent: [Declined],
      },
    );
    for (const id of ["call_a", "call_b"]) {
      const result = await generateText({
        model: scripted(toolCall(id, "charge", { card: "4242" }), text("could not charge")),
        tools: { charge },
        prompt: "charge 4242",
        experimental_context: { runId: "ctx-run-7" },
        stopWhen: stepCountIs(3),
      });
      const error = result.steps[0]?.content.find((part) => part.type === "tool-error");
      assert.ok(error && error.type === "tool-error", "the model is told the tool failed");
      assert.ok(error.error instanceof PermanentFailure);
      assert.equal(error.error.errorType, "Declined");
    }
    assert.equal(calls, 1, "the stored failure replays: the card is charged once");
    assert.ok(await fx.client.getRun("ctx-run-7"));
  });

  it("a call that awaits approval reaches the model as the tool's error, and execute does not run", async () => {
    const namespace = ns("ai-sdk-approval");
    await fx.admin.putSettings({ approvalRequired: true }, { namespacePrefix: namespace, why: "test" });
    const sent: Array<{ customer: string; amount: number }> = [];
    const tools = guardTools(
      { sendInvoice: invoiceTool(sent) },
      { client: fx.client, namespace, runId: "conv-approval", wait: null, summary: (call) => `invoice ${JSON.stringify(call.arguments)}` },
    );
    const model = scripted(toolCall("call_1", "sendInvoice", { customer: "c_1", amount: 100 }), text("waiting for approval"));
    const result = await generateText({ model, tools, prompt: "invoice c_1 for 100", stopWhen: stepCountIs(3) });
    assert.equal(sent.length, 0, "the invoice was not sent");
    const error = result.steps[0]?.content.find((part) => part.type === "tool-error");
    assert.ok(error && error.type === "tool-error" && error.error instanceof AwaitingApprovalError);
    const approval = error.error.approval;
    assert.equal(approval.summary, 'invoice {"customer":"c_1","amount":100}');
    // What the model read in its next step: the tool's answer says it awaits approval.
    const told = JSON.stringify(model.doGenerateCalls[1]?.prompt.filter((m) => m.role === "tool"));
    assert.match(told, /awaits a person's approval/);
    assert.ok(told.includes(approval.id));
    assert.match(told, /Nothing was done/);
    assert.match(told, /Call again later with the same arguments/);
  });

  it("a call already running reaches the model as one sentence saying when to call again", async () => {
    const namespace = ns("ai-sdk-in-flight");
    const held = await fx.client.claim(namespace, "invoice-c_9", { request: { customer: "c_9", amount: 1 }, lease: "30s" });
    assert.equal(held.outcome, "acquired");
    const sent: Array<{ customer: string; amount: number }> = [];
    const tools = guardTools(
      { sendInvoice: invoiceTool(sent) },
      { client: fx.client, namespace, runId: "conv-held", wait: null, keyFn: () => "invoice-c_9" },
    );
    const model = scripted(toolCall("call_1", "sendInvoice", { customer: "c_9", amount: 1 }), text("later"));
    const result = await generateText({ model, tools, prompt: "invoice c_9", stopWhen: stepCountIs(3) });
    assert.equal(sent.length, 0, "the invoice was not sent again");
    const told = JSON.stringify(model.doGenerateCalls[1]?.prompt.filter((m) => m.role === "tool"));
    assert.match(told, /This call is already running/);
    assert.match(told, /call the tool again with the same arguments in \d+s or later/);
    assert.ok(result.steps[0]?.content.some((part) => part.type === "tool-error"));
  });

  it("observe mode: a re-emitted tool call runs again, and nothing but the first outcome is stored", async () => {
    const namespace = ns("ai-sdk-observe");
    await fx.admin.putSettings({ mode: "observe" }, { namespacePrefix: namespace, why: "test" });
    const sent: Array<{ customer: string; amount: number }> = [];
    const tools = guardTools({ sendInvoice: invoiceTool(sent) }, { client: fx.client, namespace, runId: "conv-observe" });
    const outputs = [];
    for (const id of ["call_1", "call_2"]) {
      const result = await generateText({
        model: scripted(toolCall(id, "sendInvoice", { customer: "c_1", amount: 100 }), text("sent")),
        tools,
        prompt: "invoice c_1 for 100",
        stopWhen: stepCountIs(3),
      });
      outputs.push(result.steps[0]?.toolResults[0]?.output);
    }
    assert.equal(sent.length, 2, "observe mode let the duplicate run");
    assert.deepEqual(outputs, [
      { invoice: "inv_1", customer: "c_1", amount: 100 },
      { invoice: "inv_2", customer: "c_1", amount: 100 },
    ]);
    const [record] = (await fx.client.listRecords({ namespacePrefix: namespace })).records;
    assert.equal(record?.state, "completed");
  });

  it("a tool without execute is left as it is", () => {
    const clientSide = tool({ description: "ask the user", inputSchema: z.object({ q: z.string() }) });
    assert.equal(guardTool(clientSide, { name: "ask", client: fx.client, namespace: "ai/x" }), clientSide);
  });
});
