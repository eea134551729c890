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
 * Needs the `ai` package, 6 or 7. The run id is read from what the SDK hands the tool's
 * `execute`: with ai 7, the tool's context (`options.context`, which the tool declares with a
 * `contextSchema` and `generateText` passes as `toolsContext`); with ai 6, the call's
 * `experimental_context`.
 *
 * @module
 */

import type { Tool } from "ai";
import { InFlightError } from "./errors.js";
import { ToolGuard, type ToolGuardOptions } from "./tools.js";

export type { KeyFn, RunId } from "./tools.js";
export type { ToolCall } from "./keys.js";

/**
 * What the AI SDK hands a tool's `execute` beside its input, in the shape both majors share
 * (ai 7's `ToolExecutionOptions<CONTEXT>` and ai 6's `ToolExecutionOptions`).
 */
export interface AiToolExecution {
  /** The call's id, new for every call the model emits (never part of a key). */
  readonly toolCallId: string;
  /** Aborts the call when the generation is aborted. */
  readonly abortSignal?: AbortSignal | undefined;
  /** ai 7: the tool's context, as declared by its `contextSchema` (`toolsContext` of the call). */
  readonly context?: unknown;
  /** ai 6: the call's `experimental_context`. */
  readonly experimental_context?: unknown;
}

/**
 * The options of {@link guardTool}: the client, the namespace, and the run id, a string or a
 * function of the call's {@link AiToolExecution} (e.g. reading `context` with ai 7, or
 * `experimental_context` with ai 6).
 */
export type AiToolGuardOptions = ToolGuardOptions<AiToolExecution>;

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
export function guardTool<TOOL extends Tool>(tool: TOOL, options: AiToolGuardOptions & { readonly name: string }): TOOL {
  type Execute = (input: unknown, options: AiToolExecution) => AsyncIterable<unknown> | PromiseLike<unknown> | unknown;
  const execute = (tool as { readonly execute?: Execute }).execute;
  if (execute === undefined) return tool;
  const guard = new ToolGuard<AiToolExecution>(options);
  const name = options.name;
  const guardedExecute = async (input: unknown, execution: AiToolExecution): Promise<unknown> => {
    const call = guard.call(name, input, execution, execution.toolCallId);
    try {
      return await guard.run(
        call,
        async () => {
          const value = await execute(input, execution);
          return isAsyncIterable(value) ? await lastOf(value) : value;
        },
        execution.abortSignal,
      );
    } catch (error) {
      // The SDK hands the model the error's message: for a call already running, one sentence
      // it can act on.
      if (error instanceof InFlightError) error.message = error.modelMessage;
      throw error;
    }
  };
  return { ...tool, execute: guardedExecute };
}

/** Every tool of a tool set guarded as {@link guardTool}, each named by its key in the set. */
export function guardTools<TOOLS extends Record<string, Tool>>(tools: TOOLS, options: AiToolGuardOptions): TOOLS {
  const out: Record<string, Tool> = {};
  for (const [name, tool] of Object.entries(tools)) out[name] = guardTool(tool, { ...options, name });
  return out as TOOLS;
}
