/**
 * The compensation worker: {@link runCompensations} works through the compensation tasks of a
 * run being rolled back (`client.rollback(run, why)`), newest effect first, each one once
 * across every worker:
 *
 * 1. **claim** the next task (`client.claimCompensation`): `acquired` holds it as a claim of
 *    the task's own key holds it (a fence and a lease, which the heartbeat extends while the
 *    handler runs); `busy` (other workers hold the rest) waits the server's `retryAfter`, up to
 *    `idleTimeoutMs` without a task in all; `done` ends the work;
 * 2. find the task's **handler** by its compensation's name: the worker's `handlers` first,
 *    then this process's undo functions (`once(…, { undo })`, {@link registerUndo}). A name no
 *    handler is known for **fails the task permanently** (it is kept and shown, never skipped);
 * 3. run `handler(data, context)` and **settle** the task: its value completes the task; an
 *    error of a class in `retryable` releases it (a retryable failure), to be handed out again
 *    after a backoff; an {@link OutcomeUnknown} (or of a class in `unknown`, or an abort) is
 *    reported unknown, so that the next worker takes it as a recovery that says so; **any other
 *    error fails it permanently**: kept and shown as `failed`, never handed out again (a
 *    compensation is never retried silently; name the errors worth retrying).
 *
 * A worker that dies holding a task leaves it in progress until its lease passes; the next
 * worker then takes it as a recovery (`context.task.recovery`).
 *
 * @module
 */

import type { Client, CallOptions } from "./client.js";
import { PermanentFailure, StaleFence } from "./errors.js";
import { Attempt, classify, policyOf, runAttempt, type ErrorMatcher } from "./guard.js";
import type { AcquiredCompensation } from "./models.js";
import { sleep } from "./retry.js";
import { registeredUndo, type Undo, type UndoContext } from "./undo.js";
import type { Duration } from "./wire.js";

/** The options of {@link runCompensations}. */
export interface RunCompensationsOptions extends CallOptions {
  /** Handlers by compensation name, looked up before this process's registered undo functions. */
  readonly handlers?: Readonly<Record<string, Undo>>;
  /** Take at most this many tasks, then return. Default: no limit. */
  readonly maxTasks?: number;
  /**
   * Return after this long (milliseconds) of `busy` answers in a row: other workers hold every
   * task left (a worker that died holds its task until its lease passes, then it is recovered
   * here). Default 60 000.
   */
  readonly idleTimeoutMs?: number;
  /** How long each task is held without a heartbeat (default 30s); the heartbeat extends it while its handler runs. */
  readonly lease?: Duration;
  /** Errors that release a task to be handed out again (a retryable failure); every other error but an unknown outcome fails it permanently. */
  readonly retryable?: ErrorMatcher;
  /** Errors after which the undo's outcome is unknown, besides {@link OutcomeUnknown} and aborts. */
  readonly unknown?: ErrorMatcher;
}

/** What a worker did. */
export interface CompensationSummary {
  readonly run: string;
  /** Whether nothing is left to run: every task is compensated or failed. */
  readonly done: boolean;
  /** The tasks this worker took. */
  readonly tasks: number;
  /** Tasks this worker compensated. */
  readonly compensated: number;
  /** Tasks this worker failed permanently (kept and shown as `failed`), a task without a handler included. */
  readonly failed: number;
  /** Tasks this worker released after a retryable failure: handed out again. */
  readonly released: number;
  /** Tasks whose undo's outcome this worker reported unknown: the next worker recovers them. */
  readonly unknown: number;
  /** Tasks whose lease was taken over before this worker settled them (another worker recovers them). */
  readonly lost: number;
  /** The rollback's totals when it is done (`compensated`, `failed`, by every worker); else `null`. */
  readonly totals: { readonly compensated: number; readonly failed: number } | null;
}

type Settled = "compensated" | "failed" | "released" | "unknown" | "lost";

/** The JSON stored as the failure of a task whose compensation no handler is known for. */
function noHandler(name: string): { type: string; message: string } {
  return {
    type: "NoHandler",
    message:
      `no handler is known for the compensation ${JSON.stringify(name)}: give the worker one in handlers, ` +
      `or register the undo function (once(…, { undo }), registerUndo) in the worker's process`,
  };
}

/** The handler of compensation `name`: the worker's, else this process's registered undo function. */
function handlerOf(name: string, handlers: Readonly<Record<string, Undo>> | undefined): Undo | undefined {
  if (handlers !== undefined && Object.hasOwn(handlers, name)) return handlers[name];
  return registeredUndo(name);
}

/** Run one task's handler and settle the task. */
async function settleTask(client: Client, run: string, task: AcquiredCompensation, options: RunCompensationsOptions): Promise<Settled> {
  const name = task.compensation.name;
  const handler = handlerOf(name, options.handlers);
  if (handler === undefined) {
    const answer = await client.fail(task.namespace, task.key, task.fence, { retryable: false, error: noHandler(name), signal: options.signal });
    return answer.outcome === "applied" ? "failed" : "lost";
  }
  const unknown = policyOf(task.namespace, options.unknown !== undefined ? { unknown: options.unknown } : {});
  const retryable = options.retryable;
  const isRetryable = (error: unknown): boolean =>
    retryable !== undefined && (typeof retryable === "function" ? retryable(error) : retryable.some((cls) => error instanceof cls));
  // Every error is permanent but those named retryable and an unknown outcome.
  const permanent: ErrorMatcher = (error) => !isRetryable(error) && classify(unknown, error) !== "unknown";
  const policy = policyOf(task.namespace, {
    lease: options.lease ?? 30,
    permanent,
    ...(options.unknown !== undefined ? { unknown: options.unknown } : {}),
  });
  const attempt = new Attempt(client, policy, task.key, task);
  let thrown: { readonly error: unknown } | undefined;
  const undo = async (held: Attempt): Promise<unknown> => {
    const context: UndoContext = { run, task, attempt: held };
    try {
      return await (handler as (data: unknown, context: UndoContext) => unknown)(task.compensation.data, context);
    } catch (error) {
      thrown = { error };
      throw error;
    }
  };
  try {
    await runAttempt(client, policy, attempt, undo, { signal: options.signal });
    return "compensated";
  } catch (error) {
    if (error instanceof StaleFence) return "lost";
    if (error instanceof PermanentFailure && thrown !== undefined && error.cause === thrown.error) return "failed";
    // Not the handler's error (the server could not be reached, the worker was aborted…): it stands.
    if (thrown === undefined || error !== thrown.error || options.signal?.aborted) throw error;
    return classify(policy, error) === "unknown" ? "unknown" : "released";
  }
}

/**
 * Work through the compensation tasks of `run`, being rolled back, with `client` (a worker; any
 * role), until nothing is left to run (`done`), `maxTasks` were taken, or `idleTimeoutMs`
 * passed without a task to take. Each task is run by its handler (`handlers`, then this
 * process's registered undo functions) and settled as the module says; returns what this
 * worker did. Throws {@link NotFound} if the run is not being rolled back, and the client's
 * errors (e.g. {@link TransportError}) as they come.
 *
 * ```ts
 * const summary = await runCompensations(client, "agent-run-7", { idleTimeoutMs: 5_000 });
 * ```
 */
export async function runCompensations(client: Client, run: string, options: RunCompensationsOptions = {}): Promise<CompensationSummary> {
  const { maxTasks, signal } = options;
  if (maxTasks !== undefined && (!Number.isSafeInteger(maxTasks) || maxTasks < 0)) {
    throw new RangeError(`maxTasks is a whole number, at least 0, not ${maxTasks}`);
  }
  const idleTimeout = options.idleTimeoutMs ?? 60_000;
  const lease = options.lease ?? 30;
  const counts: Record<Settled, number> = { compensated: 0, failed: 0, released: 0, unknown: 0, lost: 0 };
  let tasks = 0;
  let idleSince: number | undefined; // when the busy answers in a row began
  let setbacks = 0; // tasks released or left unknown in a row: back off before the next claim
  const summary = (totals: CompensationSummary["totals"]): CompensationSummary => ({ run, done: totals !== null, tasks, ...counts, totals });
  for (;;) {
    if (maxTasks !== undefined && tasks >= maxTasks) return summary(null);
    const answer = await client.claimCompensation(run, { lease, signal });
    if (answer.outcome === "done") return summary({ compensated: answer.compensated, failed: answer.failed });
    if (answer.outcome === "busy") {
      idleSince ??= Date.now();
      const left = idleTimeout - (Date.now() - idleSince);
      if (left <= 0) return summary(null);
      await sleep(Math.min(Math.max(answer.retryAfter, 0.05), left / 1000), signal);
      continue;
    }
    idleSince = undefined;
    tasks += 1;
    const settled = await settleTask(client, run, answer, options);
    counts[settled] += 1;
    if (settled === "released" || settled === "unknown") {
      setbacks += 1;
      await sleep(client.retry.delay(setbacks), signal);
    } else {
      setbacks = 0;
    }
  }
}
