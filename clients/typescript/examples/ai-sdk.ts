// A Vercel AI SDK agent whose model sends the same tool call twice (as a resumed conversation
// does, with a new toolCallId each time): the invoice is sent once.
import { generateText, stepCountIs, tool } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { Client } from "onceguard";
import { guardTools } from "onceguard/ai";
import { z } from "zod";

const client = new Client();
let invoices = 0;

const tools = guardTools(
  {
    sendInvoice: tool({
      description: "Send an invoice",
      inputSchema: z.object({ customer: z.string(), amount: z.number() }),
      execute: async ({ customer, amount }) => ({ invoice: `inv_${++invoices}`, customer, amount }),
    }),
  },
  { client, namespace: "examples/billing", runId: "conversation-7" }, // or (options) => an id from options.experimental_context
);

// A scripted model standing in for yours (e.g. openai("gpt-4.1")): a tool call, then text.
function model(toolCallId: string) {
  const usage = {
    inputTokens: { total: 1, noCache: 1, cacheRead: undefined, cacheWrite: undefined },
    outputTokens: { total: 1, text: 1, reasoning: undefined },
  };
  return new MockLanguageModelV3({
    doGenerate: [
      {
        content: [{ type: "tool-call", toolCallId, toolName: "sendInvoice", input: '{"customer":"c_1","amount":100}' }],
        finishReason: { unified: "tool-calls", raw: undefined },
        usage,
        warnings: [],
      },
      { content: [{ type: "text", text: "Invoice sent." }], finishReason: { unified: "stop", raw: undefined }, usage, warnings: [] },
    ],
  });
}

for (const toolCallId of ["call_1", "call_2"]) {
  const result = await generateText({ model: model(toolCallId), tools, prompt: "Invoice c_1 for 100", stopWhen: stepCountIs(3) });
  console.log(toolCallId, JSON.stringify(result.steps[0]?.toolResults[0]?.output));
}
console.log(`invoices sent by this run: ${invoices}`);
