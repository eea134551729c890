/**
 * Guard OpenAI Agents SDK function tools: each tool call's effect happens once per run, tool
 * and arguments, however often the model re-emits the call or the run is resumed.
 *
 * ```ts
 * import { Agent } from "@openai/agents";
 * import { guardedTool } from "onceguard/openai-agents";
 *
 * const sendInvoice = guardedTool(
 *   { name: "send_invoice", description: "…", parameters: z.object({ customer: z.string(), amount: z.number() }), execute },
 *   { client, namespace: "prod/billing", runId: (ctx) => ctx.context.runId },
 * );
 * const agent = new Agent({ name: "billing", tools: [sendInvoice] });
 * ```
 *
 * `guardedTool(options, guard)` takes what `tool(options)` takes and guards its `execute`
 * inside the SDK's tool, so the tool's failure policy (`errorFunction`; by default a fixed
 * "An error occurred…" message for the model) applies outside the guard: after the key was
 * released or the failure stored, and never stored as the tool's result.
 *
 * A call that awaits a person's approval, or that an approver denied, answers the model with
 * what {@link AwaitingApprovalError} / {@link ApprovalDeniedError} say (the approval's id,
 * that nothing was done, whether to call again later with the same arguments) in place of the
 * SDK's fixed message, which would tell it to try again at once. A tool with its own
 * `errorFunction` receives those errors as any other; with `errorFunction: null`, or an
 * `outputSchema`, they propagate as the SDK has every error do.
 *
 * Needs `@openai/agents`.
 *
 * @module
 */

import { tool, type RunContext, type ToolInputParameters, type ToolOptions, type ToolOutputSchema } from "@openai/agents";
import { ApprovalDeniedError, AwaitingApprovalError, InFlightError } from "./errors.js";
import { ToolGuard, type ToolGuardOptions } from "./tools.js";

export type { KeyFn, RunId } from "./tools.js";
export type { ToolCall } from "./keys.js";

/** The options of {@link guardedTool}: the run id is a string or a function of the `RunContext`. */
export type AgentsToolGuardOptions<Context = unknown> = ToolGuardOptions<RunContext<Context>>;

type Details = { readonly signal?: AbortSignal; readonly toolCall?: { readonly callId?: string } };

/**
 * `tool(options)` with its `execute` run once per key: `<name>:<sha256 of the canonical
 * {"run", "tool", "arguments"}>` (or `keyFn`'s), the arguments being the parsed input. A
 * repeated call (another call id, the same run, tool and arguments) replays the first one's
 * stored result.
 */
export function guardedTool<
  TParameters extends ToolInputParameters = undefined,
  Context = unknown,
  Result = string,
  TOutputSchema extends ToolOutputSchema | undefined = undefined,
>(
  options: ToolOptions<TParameters, Context, TOutputSchema>,
  guard: AgentsToolGuardOptions<Context>,
): ReturnType<typeof tool<TParameters, Context, Result, TOutputSchema>> {
  const toolGuard = new ToolGuard<RunContext<Context>>(guard);
  const execute = options.execute as (input: unknown, context?: RunContext<Context>, details?: Details) => unknown;
  let name = "";
  // Where the SDK's default error function would hide it, an approval's answer is told to the model.
  const toldToModel = options.errorFunction === undefined && options.outputSchema === undefined;
  const guardedExecute = async (input: unknown, context?: RunContext<Context>, details?: Details): Promise<unknown> => {
    const call = toolGuard.call(name, input, context as RunContext<Context>, details?.toolCall?.callId);
    try {
      return await toolGuard.run(call, () => execute(input, context, details), details?.signal);
    } catch (error) {
      if (toldToModel && error instanceof InFlightError) return error.modelMessage;
      if (toldToModel && (error instanceof AwaitingApprovalError || error instanceof ApprovalDeniedError)) return error.message;
      throw error;
    }
  };
  const built = tool<TParameters, Context, Result, TOutputSchema>({
    ...options,
    name: options.name || execute.name, // what tool() names it by, not the wrapper
    execute: guardedExecute,
  } as ToolOptions<TParameters, Context, TOutputSchema>);
  name = built.name; // the name the SDK gives the tool (and the model sees)
  return built;
}
