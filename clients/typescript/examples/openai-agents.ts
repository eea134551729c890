// An OpenAI Agents SDK agent whose model calls the same tool twice, with two call ids: the
// invoice is sent once.
import { Agent, Runner, type RunContext } from "@openai/agents";
import { ScriptedModel, assistantMessage, functionCall } from "@openai/agents/testing";
import { Client } from "onceguard";
import { guardedTool } from "onceguard/openai-agents";
import { z } from "zod";

const client = new Client();
let invoices = 0;

const sendInvoice = guardedTool(
  {
    name: "send_invoice",
    description: "Send an invoice",
    parameters: z.object({ customer: z.string(), amount: z.number() }),
    execute: async ({ customer, amount }) => `invoice inv_${++invoices} sent to ${customer} for ${amount}`,
  },
  { client, namespace: "examples/billing-agents", runId: (ctx: RunContext<{ runId: string }>) => ctx.context.runId },
);

// A scripted model standing in for yours: it calls the tool twice, then answers.
const model = new ScriptedModel([
  [functionCall("send_invoice", { customer: "c_1", amount: 100 }, { callId: "call_1" })],
  [functionCall("send_invoice", { customer: "c_1", amount: 100 }, { callId: "call_2" })],
  [assistantMessage("Invoice sent.")],
]);
const agent = new Agent<{ runId: string }>({ name: "billing", instructions: "Send invoices.", model, tools: [sendInvoice] });
const result = await new Runner({ tracingDisabled: true }).run(agent, "Invoice c_1 for 100", { context: { runId: "run-2026-11-29" } });
console.log(result.finalOutput);
console.log(`invoices sent by this run: ${invoices}`);
