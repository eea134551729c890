/**
 * OpenAI Agents SDK: guarded function tools run by the SDK's `Runner` with its scripted model
 * (`ScriptedModel` from `@openai/agents/testing`): a re-emitted call runs the effect once.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Agent, Runner, type RunContext } from "@openai/agents";
import { ScriptedModel, assistantMessage, functionCall } from "@openai/agents/testing";
import { AwaitingApprovalError } from "onceguard";
import { guardedTool } from "onceguard/openai-agents";
import { z } from "zod";
import { ns, useServer } from "./server.js";

const fx = useServer();
const runner = new Runner({ tracingDisabled: true });

interface Ctx {
  readonly runId: string;
}

/** A `send_invoice` tool's options; `sent()` counts each invoice it sends. */
function invoiceTool(sent: () => number) {
  return {
    name: "send_invoice",
    description: "Send an invoice",
    parameters: z.object({ customer: z.string() }),
    execute: async ({ customer }: { customer: string }) => `invoice ${sent()} for ${customer}`,
  };
}

describe("OpenAI Agents SDK", () => {
  it("a call that awaits approval reaches the model as the tool's error, and execute does not run", async () => {
    const namespace = ns("openai-agents-approval");
    await fx.admin.putSettings({ approvalRequired: true }, { namespacePrefix: namespace, why: "test" });
    let sent = 0;
    const sendInvoice = guardedTool(
      invoiceTool(() => ++sent),
      { client: fx.client, namespace, runId: "agents-approval", wait: null },
    );
    const model = new ScriptedModel([[functionCall("send_invoice", { customer: "c_1" }, { callId: "call_1" })], [assistantMessage("waiting")]]);
    const agent = new Agent({ name: "billing", instructions: "bill", model, tools: [sendInvoice] });
    const result = await runner.run(agent, "invoice c_1");
    assert.equal(sent, 0, "the invoice was not sent");
    const output = result.newItems.find((item) => item.type === "tool_call_output_item") as unknown as { output: unknown };
    const told = String(output.output);
    const [pending] = (await fx.admin.listApprovals({ state: "pending", limit: 1000 })).approvals.filter((a) => a.namespace === namespace);
    assert.ok(pending, "the call asked for an approval");
    assert.match(told, /awaits a person's approval/);
    assert.ok(told.includes(pending.id));
    assert.match(told, /Nothing was done/);
    assert.match(told, /Call again later with the same arguments/);

    // A tool with its own error function gets the error itself, and says what it likes.
    const errors: unknown[] = [];
    const own = guardedTool(
      {
        ...invoiceTool(() => ++sent),
        errorFunction: (_ctx, error) => {
          errors.push(error);
          return "not yet: a person must approve this first";
        },
      },
      { client: fx.client, namespace, runId: "agents-approval", wait: null },
    );
    const again = new ScriptedModel([[functionCall("send_invoice", { customer: "c_1" }, { callId: "call_2" })], [assistantMessage("waiting")]]);
    const second = await runner.run(new Agent({ name: "billing", instructions: "bill", model: again, tools: [own] }), "invoice c_1");
    const reply = second.newItems.find((item) => item.type === "tool_call_output_item") as unknown as { output: unknown };
    assert.equal(reply.output, "not yet: a person must approve this first");
    assert.ok(errors[0] instanceof AwaitingApprovalError);
    assert.equal(errors[0].approval.id, pending.id, "the same call asks for the same approval");
    assert.equal(sent, 0);
  });

  it("a call already running reaches the model as one sentence saying when to call again", async () => {
    const namespace = ns("openai-agents-in-flight");
    const held = await fx.client.claim(namespace, "invoice-c_9", { request: { customer: "c_9" }, lease: "30s" });
    assert.equal(held.outcome, "acquired");
    let sent = 0;
    const sendInvoice = guardedTool(
      invoiceTool(() => ++sent),
      { client: fx.client, namespace, runId: "agents-in-flight", wait: null, keyFn: (call) => `invoice-${(call.arguments as { customer: string }).customer}` },
    );
    const model = new ScriptedModel([[functionCall("send_invoice", { customer: "c_9" }, { callId: "call_9" })], [assistantMessage("later")]]);
    const result = await runner.run(new Agent({ name: "billing", instructions: "bill", model, tools: [sendInvoice] }), "invoice c_9");
    const output = result.newItems.find((item) => item.type === "tool_call_output_item") as unknown as { output: unknown };
    const told = String(output.output);
    assert.match(told, /^This call is already running/);
    assert.match(told, /call the tool again with the same arguments in \d+s or later/);
    assert.doesNotMatch(told, /An error occurred/);
    assert.equal(sent, 0, "the invoice was not sent again");
  });

  it("a call the model re-emits (another call id) replays the stored result", async () => {
    const namespace = ns("openai-agents");
    const sent: string[] = [];
    const sendInvoice = guardedTool(
      {
        name: "send_invoice",
        description: "Send an invoice",
        parameters: z.object({ customer: z.string(), amount: z.number() }),
        execute: async ({ customer, amount }) => {
          sent.push(customer);
          return `invoice inv_${sent.length} for ${customer}: ${amount}`;
        },
      },
      { client: fx.client, namespace, runId: (ctx: RunContext<Ctx>) => ctx.context.runId },
    );
    assert.equal(sendInvoice.name, "send_invoice");

    const outputs: unknown[] = [];
    for (const callId of ["call_1", "call_2"]) {
      const model = new ScriptedModel([
        [functionCall("send_invoice", { customer: "c_1", amount: 100 }, { callId })],
        [assistantMessage("done")],
      ]);
      const agent = new Agent<Ctx>({ name: "billing", instructions: "bill", model, tools: [sendInvoice] });
      const result = await runner.run(agent, "invoice c_1 for 100", { context: { runId: "agents-run-1" } });
      assert.equal(result.finalOutput, "done");
      const output = result.newItems.find((item) => item.type === "tool_call_output_item");
      assert.ok(output, "the tool's output went back to the model");
      outputs.push((output as unknown as { output: unknown }).output);
      model.assertComplete();
    }
    assert.deepEqual(sent, ["c_1"], "the invoice was sent once");
    assert.equal(outputs[0], "invoice inv_1 for c_1: 100");
    assert.deepEqual(outputs[1], outputs[0]);
    assert.equal((await fx.client.getRun("agents-run-1"))?.usage.effects, 1);
  });

  it("the tool's error function applies after the guard released the key", async () => {
    const namespace = ns("openai-agents-error");
    let attempts = 0;
    const flaky = guardedTool(
      {
        name: "flaky",
        description: "Fails the first time",
        parameters: z.object({ id: z.string() }),
        execute: async ({ id }) => {
          attempts++;
          if (attempts === 1) throw new Error("upstream 502");
          return `ok ${id}`;
        },
      },
      { client: fx.client, namespace, runId: "agents-run-2" },
    );
    const outputs: unknown[] = [];
    for (const callId of ["c1", "c2"]) {
      const model = new ScriptedModel([[functionCall("flaky", { id: "x" }, { callId })], [assistantMessage("end")]]);
      const agent = new Agent({ name: "a", instructions: "i", model, tools: [flaky] });
      const result = await runner.run(agent, "go");
      const output = result.newItems.find((item) => item.type === "tool_call_output_item") as unknown as { output: unknown };
      outputs.push(output.output);
    }
    assert.match(String(outputs[0]), /error/i, "the model was told the tool failed");
    assert.equal(outputs[1], "ok x", "the failure was not stored: the next call ran again");
    assert.equal(attempts, 2);
  });
});
