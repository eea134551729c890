/**
 * Guard LangChain.js tools and LangGraph.js tasks: each tool call's (or task's) effect happens
 * once per run, name and arguments, however often the model re-emits the call or the graph
 * re-runs the node.
 *
 * ```ts
 * import { ToolNode } from "@langchain/langgraph/prebuilt";
 * import { guardTool, guardTask } from "onceguard/langchain";
 *
 * const refund = guardTool(refundTool, { client, namespace: "prod/payments-agent", runId: threadId });
 * const tools = new ToolNode([refund]);                          // or createReactAgent({ llm, tools: [refund] })
 *
 * const chargeCard = guardTask("charge-card", async (order: string) => payments.charge(order), { client, namespace: "prod/payments" });
 * ```
 *
 * Needs `@langchain/core` (tools) and `@langchain/langgraph` (tasks).
 *
 * @module
 */

import type { RunnableConfig } from "@langchain/core/runnables";
import { tool as lcTool, type StructuredToolInterface } from "@langchain/core/tools";
import { getConfig, task } from "@langchain/langgraph";
import { ToolGuard, type ToolGuardOptions } from "./tools.js";
import { InFlightError } from "./errors.js";

export type { KeyFn, RunId } from "./tools.js";
export type { ToolCall } from "./keys.js";

/** The options of {@link guardTool} and {@link guardTask}: the run id is a string or a function of the `RunnableConfig`. */
export type LangChainGuardOptions = ToolGuardOptions<RunnableConfig>;

/** The LangGraph thread id of a config (`configurable.thread_id`): a run id for {@link guardTool} and {@link guardTask}. */
export function threadId(config: RunnableConfig): string | undefined {
  const id = (config.configurable as { thread_id?: unknown } | undefined)?.thread_id;
  return typeof id === "string" ? id : undefined;
}

/** `config` without the tool call the framework put in it, so that the inner tool answers its content, not a message. */
function withoutToolCall(config: RunnableConfig): RunnableConfig {
  const { toolCall: _toolCall, ...rest } = config as RunnableConfig & { toolCall?: unknown };
  return rest;
}

/**
 * `job()`'s value, or, for a call already running made by a model (`toolCall`: a `ToolNode` or
 * an agent), its one-sentence answer to the model; a direct `invoke` gets the `InFlightError`.
 */
async function runTelling(byModel: boolean, contentAndArtifact: boolean, job: () => Promise<unknown>): Promise<unknown> {
  try {
    return await job();
  } catch (error) {
    if (!byModel || !(error instanceof InFlightError)) throw error;
    return contentAndArtifact ? [error.modelMessage, null] : error.modelMessage;
  }
}

interface ToolMessageLike {
  readonly content: unknown;
  readonly artifact?: unknown;
}

/**
 * A tool like `tool` (same name, description, schema and response format) whose every call is
 * guarded. The key is `keyFn(ToolCall)` if given, else `<tool>:<sha256 of the canonical
 * {"run", "tool", "arguments"}>`: the arguments are the model's (parsed by the tool's schema),
 * never the tool call id. Failures follow `once`; a `ToolNode`'s error handling applies outside
 * the guard, so an error turned into a message for the model releases the key and is never
 * stored as the tool's result. The result is stored as JSON: the tool should return JSON-able
 * values (strings, objects…).
 */
export function guardTool<SchemaT, SchemaInputT, ToolOutputT>(
  tool: StructuredToolInterface<SchemaT, SchemaInputT, ToolOutputT>,
  options: LangChainGuardOptions,
): StructuredToolInterface<SchemaT, SchemaInputT, ToolOutputT> {
  const guard = new ToolGuard<RunnableConfig>(options);
  const extra = tool as { readonly responseFormat?: string; readonly metadata?: Record<string, unknown> };
  const contentAndArtifact = extra.responseFormat === "content_and_artifact";
  const run = async (input: unknown, config: RunnableConfig): Promise<unknown> => {
    const callId = (config as { toolCall?: { id?: string } }).toolCall?.id;
    const call = guard.call(tool.name, input, config, callId);
    // A call already running that a model made is answered to it, in one sentence, as the
    // tool's result (a thrown error would reach it with "Please fix your mistakes" appended).
    return runTelling(callId !== undefined, contentAndArtifact, () => guard.run(
      call,
      async () => {
        if (!contentAndArtifact) return tool.invoke(input as never, withoutToolCall(config));
        // Only a tool call makes such a tool hand back its artifact: call it with one.
        const message = (await tool.invoke(
          { type: "tool_call", id: callId ?? "onceguard", name: tool.name, args: input as Record<string, unknown> } as never,
          withoutToolCall(config),
        )) as unknown as ToolMessageLike;
        return [message.content, message.artifact ?? null];
      },
      config.signal,
    ));
  };
  const fields = {
    name: tool.name,
    description: tool.description,
    schema: tool.schema,
    returnDirect: tool.returnDirect,
    ...(extra.responseFormat ? { responseFormat: extra.responseFormat } : {}),
    ...(extra.metadata ? { metadata: extra.metadata } : {}),
  };
  // The same schema, input and output types as the tool's: the guard replays what it returned.
  return lcTool(run as never, fields as never) as unknown as StructuredToolInterface<SchemaT, SchemaInputT, ToolOutputT>;
}

/**
 * A LangGraph.js `task` whose function runs once per key: `<name>:<sha256 of the canonical
 * {"run", "tool", "arguments"}>` with the task's name and its arguments (the array of them), or
 * `keyFn`'s. Inside an `entrypoint`, a run that is re-invoked, resumed elsewhere, or retried
 * after a crash gets the stored result instead of repeating the effect. `runId` receives the
 * task's `RunnableConfig` (e.g. {@link threadId}).
 */
export function guardTask<A extends unknown[], R>(
  name: string,
  fn: (...args: A) => R | Promise<R>,
  options: LangChainGuardOptions,
): (...args: A) => Promise<Awaited<R>> {
  const guard = new ToolGuard<RunnableConfig>(options);
  return task(name, async (...args: A): Promise<Awaited<R>> => {
    const config = getConfig();
    return guard.run(guard.call(name, args, config), () => fn(...args), config.signal);
  }) as (...args: A) => Promise<Awaited<R>>;
}
