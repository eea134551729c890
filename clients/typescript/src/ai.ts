/**
 * Guard Vercel AI SDK tools: each tool call's `execute` runs once per run (conversation),
 * tool name and arguments, however often the model re-emits the call (it gives every call a
 * new `toolCallId`, which is therefore never part of the key) or the conversation is resumed.
 *
 * ```ts
 * import { generateText, tool } from "ai";
 * import { guardTools } from "onceguard/ai";
 *
 * const tools = guardTools({ sendInvoice: tool({ inputSchema, execute }) }, {
 *   client, namespace: "prod/billing", runId: (options) => conversationId,
 * });
 * await generateText({ model, tools, prompt });
 * ```
 *
 * Needs the `ai` package (6 or later).
 *
 * @module
 */

import type { Tool, ToolExecutionOptions } from "ai";
import { ToolGuard, type ToolGuardOptions } from "./tools.js";

export type { KeyFn, RunId } from "./tools.js";
export type { ToolCall } from "./keys.js";

/**
 * The options of {@link guardTool}: the client, the namespace, and the run id, a string or a
 * function of the call's `ToolExecutionOptions` (e.g. reading `experimental_context`).
 */
export type AiToolGuardOptions = ToolGuardOptions<ToolExecutionOptions>;

async function lastOf<T>(values: AsyncIterable<T>): Promise<T | undefined> {
  let last: T | undefined;
  for await (const value of values) last = value;
  return last;
}

function isAsyncIterable(value: unknown): value is AsyncIterable<unknown> {
  return value !== null && typeof value === "object" && Symbol.asyncIterator in value;
}

/**
 * A tool like `tool` whose `execute` runs once per key: `<name>:<sha256 of the canonical
 * {"run", "tool", "arguments"}>` (or `keyFn`'s). A repeated call replays the first one's
 * stored output. A tool without `execute` (run by the client) is returned as it is. An
 * `execute` that streams (an async iterable) is stored and replayed as its last value, its
 * final output. Failures follow `once`: the SDK reports them to the model after the guard has
 * released the key (or stored a permanent failure).
 */
export function guardTool<INPUT, OUTPUT>(
  tool: Tool<INPUT, OUTPUT>,
  options: AiToolGuardOptions & { readonly name: string },
): Tool<INPUT, OUTPUT> {
  const execute = tool.execute as
    | ((input: INPUT, options: ToolExecutionOptions) => AsyncIterable<OUTPUT> | PromiseLike<OUTPUT> | OUTPUT)
    | undefined;
  if (execute === undefined) return tool;
  const guard = new ToolGuard<ToolExecutionOptions>(options);
  const name = options.name;
  const guardedExecute = (input: INPUT, execution: ToolExecutionOptions): Promise<OUTPUT> => {
    const call = guard.call(name, input, execution, execution.toolCallId);
    return guard.run(
      call,
      async () => {
        const value = await execute(input, execution);
        return (isAsyncIterable(value) ? await lastOf(value) : value) as OUTPUT;
      },
      execution.abortSignal,
    ) as Promise<OUTPUT>;
  };
  return { ...tool, execute: guardedExecute } as Tool<INPUT, OUTPUT>;
}

/** Every tool of a tool set guarded as {@link guardTool}, each named by its key in the set. */
export function guardTools<TOOLS extends Record<string, Tool>>(tools: TOOLS, options: AiToolGuardOptions): TOOLS {
  const out: Record<string, Tool> = {};
  for (const [name, tool] of Object.entries(tools)) out[name] = guardTool(tool, { ...options, name });
  return out as TOOLS;
}
