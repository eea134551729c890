// LangGraph.js: a guarded tool in a ToolNode, and a guarded task in a workflow that crashes
// after charging and is run again on the same thread: the card is charged once.
import { AIMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { MemorySaver, entrypoint } from "@langchain/langgraph";
import { ToolNode } from "@langchain/langgraph/prebuilt";
import { Client } from "onceguard";
import { guardTask, guardTool, threadId } from "onceguard/langchain";
import { z } from "zod";

const client = new Client();
let refunds = 0;
let charges = 0;

const refund = guardTool(
  tool(async ({ order }) => `refund re_${++refunds} for order ${order}`, {
    name: "refund",
    description: "Refund an order",
    schema: z.object({ order: z.number() }),
  }),
  { client, namespace: "examples/langgraph-tools", runId: threadId },
);
const tools = new ToolNode([refund]);
const thread = { configurable: { thread_id: "thread-1" } };
for (const id of ["call_1", "call_2"]) {
  const turn = new AIMessage({ content: "", tool_calls: [{ id, name: "refund", args: { order: 1234 }, type: "tool_call" }] });
  const { messages } = (await tools.invoke({ messages: [turn] }, thread)) as { messages: Array<{ content: unknown }> };
  console.log(id, messages[0]?.content);
}

const charge = guardTask("charge-card", async (order: string) => ({ charge: `ch_${++charges}`, order }), {
  client,
  namespace: "examples/langgraph-tasks",
  runId: threadId,
});
let crash = true;
const checkout = entrypoint({ name: "checkout", checkpointer: new MemorySaver() }, async (order: string) => {
  const receipt = await charge(order);
  if (crash) throw new Error("the worker died after charging");
  return receipt;
});
await checkout.invoke("o-1", thread).catch((error: Error) => console.log("first run:", error.message));
crash = false;
console.log("second run:", await checkout.invoke("o-1", thread));
console.log(`refunds made by this run: ${refunds}, charges: ${charges}`);
