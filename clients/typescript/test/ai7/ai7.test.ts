/**
 * Vercel AI SDK 7 (`ai@7`, the current major), in a project of its own where `ai` is that major
 * and `onceguard` is the packed tarball (scripts/typescript-tests makes it): guarded tools in
 * `generateText` with a scripted model; a re-emitted tool call runs once, and the run id comes
 * from the tool's context (`contextSchema`, passed as `toolsContext`).
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { generateText, stepCountIs, tool } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { guardTool, guardTools } from "onceguard/ai";
import { z } from "zod";
import { text, toolCall } from "./ai-script.js";
import { ns, useServer } from "./server.js";

const fx = useServer();

describe("Vercel AI SDK 7", () => {
  it("a re-emitted tool call runs once per run, the run id read from the tool's context", async () => {
    const namespace = ns("ai7");
    const sent: string[] = [];
    const sendInvoice = tool({
      description: "Send an invoice to a customer",
      inputSchema: z.object({ customer: z.string(), amount: z.number() }),
      contextSchema: z.object({ runId: z.string() }),
      execute: async ({ customer, amount }) => {
        sent.push(customer);
        return { invoice: `inv_${sent.length}`, customer, amount };
      },
    });
    const guarded = guardTool(sendInvoice, {
      name: "sendInvoice",
      client: fx.client,
      namespace,
      runId: (options) => (options.context as { runId: string }).runId,
    });
    const outputs = [];
    for (const [id, run] of [["call_1", "conv-7"], ["call_2", "conv-7"], ["call_3", "conv-8"]] as const) {
      const result = await generateText({
        model: new MockLanguageModelV3({ doGenerate: [toolCall(id, "sendInvoice", { customer: "c_1", amount: 100 }), text("sent")] }),
        tools: { sendInvoice: guarded },
        toolsContext: { sendInvoice: { runId: run } },
        prompt: "invoice c_1 for 100",
        stopWhen: stepCountIs(3),
      });
      outputs.push(result.steps[0]?.toolResults[0]?.output);
    }
    assert.deepEqual(outputs[1], outputs[0], "the re-emitted call replays the first one's output");
    assert.equal(sent.length, 2, "once per run: conv-7 once, conv-8 once");
    assert.equal((await fx.client.getRun("conv-7"))?.usage.effects, 1);
    assert.equal((await fx.client.getRun("conv-8"))?.usage.effects, 1);
    // A tool set guards each tool by its name.
    const set = guardTools({ sendInvoice }, { client: fx.client, namespace, runId: "conv-9" });
    assert.equal(typeof set.sendInvoice.execute, "function");
  });
});
