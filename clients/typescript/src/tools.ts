/**
 * What the framework helpers share: the options of a guarded tool, the key of a tool call,
 * and running it under a guard.
 *
 * @module
 */

import type { Client } from "./client.js";
import { policyOf, runGuarded, type Attempt, type GuardOptions, type Policy } from "./guard.js";
import { checkKey, toJsonValue, toolKey, type ToolCall } from "./keys.js";

/** A function from a tool call to its idempotency key. */
export type KeyFn = (call: ToolCall) => string | Promise<string>;

/** The run id of a tool call: a string, or a function of what the framework hands the tool. */
export type RunId<Context> = string | null | undefined | ((context: Context) => string | null | undefined);

/** The options every framework helper takes. */
export interface ToolGuardOptions<Context> extends GuardOptions {
  /** The client the guard claims with. */
  readonly client: Client;
  /** The namespace of the tool's keys, e.g. `prod/payments-agent`. */
  readonly namespace: string;
  /**
   * The run (conversation, thread) the call belongs to: part of the key and charged with the
   * run's budget. Without one, the same tool called with the same arguments is one effect
   * across every run.
   */
  readonly runId?: RunId<Context>;
  /** The key of a call (default: {@link toolKey}: run, tool and arguments, never the call id). */
  readonly keyFn?: KeyFn;
  /**
   * What a call does, for the person who approves it where the namespace needs approvals: a
   * string, or a function of the call (at most 1024 bytes; stored as given, no secrets).
   */
  readonly summary?: string | ((call: ToolCall) => string | null | undefined);
}

/** A guard for the calls of one tool. */
export class ToolGuard<Context> {
  readonly client: Client;
  readonly policy: Policy;
  readonly #runId: RunId<Context>;
  readonly #keyFn: KeyFn | undefined;
  readonly #summary: ToolGuardOptions<Context>["summary"];

  constructor(options: ToolGuardOptions<Context>) {
    this.client = options.client;
    this.policy = policyOf(options.namespace, options);
    this.#runId = options.runId;
    this.#keyFn = options.keyFn;
    this.#summary = options.summary;
  }

  /** The call of `tool` with `args` in `context`. */
  call(tool: string, args: unknown, context: Context, callId?: string): ToolCall {
    const run = typeof this.#runId === "function" ? this.#runId(context) : this.#runId;
    return { tool, arguments: toJsonValue(args ?? {}), run: run ?? null, callId };
  }

  /**
   * Run `job()` once per the call's key (the call's arguments are the claim's request). Throws
   * as {@link runGuarded}: a refusal (in flight, denied, awaiting approval…) is an error whose
   * message the framework reports to the model as the tool's error, and `job` does not run.
   */
  async run<T>(call: ToolCall, job: (attempt: Attempt) => T | PromiseLike<T>, signal?: AbortSignal): Promise<Awaited<T>> {
    const key = checkKey(this.#keyFn !== undefined ? await this.#keyFn(call) : await toolKey(call));
    const summary = typeof this.#summary === "function" ? this.#summary(call) : this.#summary;
    return runGuarded(this.client, this.policy, key, job, { request: call.arguments, run: call.run, summary, signal });
  }
}
