/**
 * Run a function once per key: {@link once} and {@link guarded}.
 *
 * The protocol, the same for both and for the framework helpers:
 *
 * 1. **claim** the key (with the request, so that a key reused for another request is caught),
 *    waiting up to `wait` on the server if another caller holds it or a person's approval is
 *    pending (with `waitForApproval`, claiming again until the approval is decided, up to that
 *    long in all);
 * 2. the claim answers
 *    - `replay`: the stored outcome is returned (decoded from the stored JSON) without running
 *      anything; a stored permanent failure throws {@link PermanentFailure} again; where the
 *      namespace keeps only a digest of each outcome, {@link ResultNotKeptError} (it ran once,
 *      and there is no result to return);
 *    - `acquired` as a **recovery** (an earlier attempt may have done the effect) with a
 *      `verify` hook: `verify` asks the downstream system first; {@link happened}`(result)`
 *      completes the key with that result, `reconciled`, without running the function;
 *      `undefined` or `null` (it did not happen) goes on as a first attempt does;
 *    - `acquired`: the function runs while a **heartbeat** extends the lease every third of
 *      it; the {@link Attempt} (passed to a `guarded` function, `this` and {@link current} in a
 *      `once` function) gives the fence, the attempt number, the `recovery` of a crashed
 *      earlier attempt and `checkpoint()`;
 *    - `in_flight` after the wait: {@link InFlightError}; `mismatch`: {@link KeyConflict};
 *      `denied`: {@link DeniedError} ({@link ApprovalDeniedError} when an approver denied it);
 *      `pending_approval` after the wait: {@link AwaitingApprovalError} (nothing ran);
 *    - `proceed` (a namespace in observe mode, where enforcement would have answered one of the
 *      above, or a replay): the function runs, with no heartbeat, and its value is returned as
 *      it would have been stored, without storing it (nothing is held, so nothing is completed,
 *      failed or checkpointed); the {@link Attempt}'s `observed` says what enforcement would
 *      have answered;
 * 3. the heartbeat is stopped (and waited for), then
 *    - a return value is serialized as JSON and **completed**; every caller, the first
 *      included, gets the value decoded from those stored bytes; a `stale` answer (the lease
 *      was taken over meanwhile) throws {@link StaleFence}: the result is **not** stored; with
 *      an `undo`, the completion also registers how to undo the effect (a compensation: its
 *      name and data), which a worker runs if the run is rolled back;
 *    - an error that is {@link Permanent} or of a class in `permanent` is stored as a failure
 *      (`{"type": "<error name>", "message": "…"}`) and thrown as {@link PermanentFailure}, now
 *      and on every replay;
 *    - an error that is {@link OutcomeUnknown} or of a class in `unknown`, or an abort (the
 *      call's `signal`), is **reported unknown**: the effect may have happened; the next claim
 *      is a recovery that is told so;
 *    - any other error **releases** the key (`fail` retryable) and propagates: the next call
 *      runs again. `verify` throwing, or returning anything but `happened(…)`, `undefined` or
 *      `null` (a `TypeError`), propagates too, but the key is **reported unknown**, never
 *      released: a released key's next claim is a plain attempt that would run the function
 *      without asking `verify`, and the effect may have happened.
 *
 * @module
 */

import type { Client } from "./client.js";
import { checkCompensation } from "./compensation.js";
import {
  ApprovalDeniedError,
  RecoveryNeedsVerifyError,
  AwaitingApprovalError,
  DeniedError,
  InFlightError,
  KeyConflict,
  OnceguardError,
  OutcomeUnknown,
  Permanent,
  PermanentFailure,
  ResultNotKeptError,
  StaleFence,
} from "./errors.js";
import { checkKey, checkLabel, deriveKey, toJsonValue, type JsonOf } from "./keys.js";
import { applied, type Acquired, type Checkpoint, type ClaimAnswer, type Compensation, type Proceed, type Recovery } from "./models.js";
import { sleep } from "./retry.js";
import { registerUndo, type Undo } from "./undo.js";
import { RawJson, dumps, durationSeconds, type Duration } from "./wire.js";

/** The longest `wait` the server takes for one claim, in seconds. */
const MAX_CLAIM_WAIT = 30;

/**
 * What `verify` returns when the downstream system says the effect happened: the result to
 * store (as the function's value would be), and what the effect cost. Make it with
 * {@link happened}.
 */
export class Happened {
  /** The result every caller gets, as the function would have returned it. */
  readonly result: unknown;
  /** Cost units (money) the effect consumed, charged to the run. */
  readonly cost: number | undefined;
  /** Tokens the effect consumed. */
  readonly tokens: number | undefined;
  constructor(result: unknown, options: { readonly cost?: number; readonly tokens?: number } = {}) {
    this.result = result;
    this.cost = options.cost;
    this.tokens = options.tokens;
  }
}

/**
 * The answer of a `verify` hook when the effect happened: `result` is stored as the key's
 * outcome, marked `reconciled`, and returned without running the function.
 */
export function happened(result?: unknown, options: { readonly cost?: number; readonly tokens?: number } = {}): Happened {
  return new Happened(result, options);
}

/** What a `verify` hook is told about the recovering attempt. */
export interface VerifyContext {
  readonly namespace: string;
  readonly key: string;
  /** This attempt's fence: the downstream system may know it from the earlier attempt's. */
  readonly fence: number;
  /** This attempt's number (2 or later). */
  readonly attempt: number;
  /** Why this attempt is a recovery: the earlier attempt's fence, reason and detail. */
  readonly recovery: Recovery;
  /** The last checkpoint the earlier attempts saved (e.g. a downstream id), if any. */
  readonly checkpoint: Checkpoint | null;
  /** The claim's request (the call's arguments as JSON); `null` where a fingerprint was given. */
  readonly request: unknown;
  /** Aborted when the call is, or when the lease was taken over. */
  readonly signal: AbortSignal;
}

/**
 * Ask the downstream system whether a recovering attempt's effect happened: `happened(result)`
 * if it did, `undefined` or `null` if it did not (then the function runs).
 */
export type Verify = (context: VerifyContext) => Happened | null | undefined | PromiseLike<Happened | null | undefined>;

/** Error classes (`[CardDeclined]`) or a predicate over the error. */
export type ErrorMatcher = ReadonlyArray<abstract new (...args: never[]) => unknown> | ((error: unknown) => boolean);

/**
 * How a guard claims, runs and stores: the options `once`, `guarded` and the helpers share
 * (`R`: the function's value, as `undoData` receives it).
 */
export interface GuardOptions<R = unknown> {
  /** How long the key is held without a heartbeat (default 30s); the heartbeat extends it. */
  readonly lease?: Duration;
  /** How long the outcome replays once stored (default: the server's, 24h). */
  readonly retention?: Duration;
  /**
   * How long a call waits for another caller holding the key (default 10s; `null` not to wait).
   * The client asks the server for at most 30s on one claim (its `limits.max_wait`, 30s by
   * default, must allow that); a longer wait claims again until it has passed, so
   * that a wait longer than the lease outlasts a holder that crashed (its lease passes, and the
   * call recovers the key).
   */
  readonly wait?: Duration | null;
  /** Cost units declared to the run's budget with the claim, once per key. */
  readonly cost?: number;
  /** Errors stored as a permanent failure, besides {@link Permanent}. */
  readonly permanent?: ErrorMatcher;
  /** Errors after which the outcome is unknown, besides {@link OutcomeUnknown} and aborts. */
  readonly unknown?: ErrorMatcher;
  /** The JSON value stored for a result (default: {@link toJsonValue}). */
  readonly encode?: (value: unknown) => unknown;
  /** The value every caller gets, from the stored JSON (default: the JSON itself). */
  readonly decode?: (value: unknown) => unknown;
  /** Extend the lease while the function runs (default on). */
  readonly heartbeat?: boolean;
  /**
   * Where the namespace needs a person's approval: how long a call waits in all for a pending
   * approval's decision (claiming again, up to 30s at a time), then runs once approved or throws
   * {@link ApprovalDeniedError}. Default: no longer than `wait`, then {@link AwaitingApprovalError}.
   */
  readonly waitForApproval?: Duration | null;
  /**
   * Called before the function on a **recovery** (an earlier attempt may have done the effect;
   * never on a first attempt): ask the downstream system. `happened(result)` stores `result`
   * as the outcome, `reconciled`, without running the function; `undefined` or `null` runs it.
   */
  readonly verify?: Verify;
  /**
   * The function that undoes the effect if its run is rolled back. Each completion then
   * registers a compensation named `undoName` (default: this function's own name) whose data is
   * `undoData(value)` (default: the stored result), and the function is registered under that
   * name for this process's compensation workers (`runCompensations`).
   */
  readonly undo?: Undo;
  /**
   * The compensation's name: 1 to 128 printable ASCII characters (default: `undo`'s own name).
   * Given without `undo`, completions register the compensation and a worker elsewhere knows it.
   */
  readonly undoName?: string;
  /** What the undo needs, from the function's value (JSON, at most 16 KiB serialized); default: the stored result. */
  readonly undoData?: (result: R) => unknown;
}

/** A guard's settled policy. */
export interface Policy {
  readonly namespace: string;
  readonly lease: number;
  readonly retention: Duration | undefined;
  /** Seconds a call waits in all for a key in flight, if it does. */
  readonly wait: number | undefined;
  readonly cost: number | undefined;
  readonly permanent: ErrorMatcher;
  readonly unknown: ErrorMatcher;
  readonly encode: (value: unknown) => unknown;
  readonly decode: (value: unknown) => unknown;
  readonly heartbeat: boolean;
  /** Seconds a call waits in all for a pending approval's decision, if it does. */
  readonly waitForApproval: number | undefined;
  readonly verify: Verify | undefined;
  /** The compensation each completion registers: its name, and its data from the function's value. */
  readonly undo: { readonly name: string; readonly data: ((result: unknown) => unknown) | undefined } | undefined;
}

/** The {@link Policy} of `options` for `namespace`. */
export function policyOf<R>(namespace: string, options: GuardOptions<R> = {}): Policy {
  return {
    namespace,
    lease: durationSeconds(options.lease ?? 30),
    retention: options.retention,
    wait: options.wait === null ? undefined : durationSeconds(options.wait ?? 10),
    cost: options.cost,
    permanent: options.permanent ?? [],
    unknown: options.unknown ?? [],
    encode: options.encode ?? toJsonValue,
    decode: options.decode ?? ((value) => value),
    heartbeat: options.heartbeat ?? true,
    waitForApproval:
      options.waitForApproval === undefined || options.waitForApproval === null ? undefined : durationSeconds(options.waitForApproval),
    verify: options.verify,
    undo: undoOf(options),
  };
}

/** The compensation of a guard's `undo`, `undoName` and `undoData`, its function registered by name. */
function undoOf<R>(options: GuardOptions<R>): Policy["undo"] {
  const { undo, undoName, undoData } = options;
  if (undo === undefined && undoName === undefined) {
    if (undoData !== undefined) throw new TypeError("undoData goes with undo (or undoName): the compensation it is the data of");
    return undefined;
  }
  if (undo !== undefined && typeof undo !== "function") throw new TypeError("undo is the function that undoes the effect");
  if (undoName === undefined && undo?.name === "undo") {
    // A function written inline in the options is named after the option: every one would be "undo".
    throw new RangeError("the undo function has no name of its own (an inline function is named 'undo'): name it, or give undoName");
  }
  if (undoName === undefined && undo?.name === "") {
    throw new RangeError("the undo function has no name: name it (async function refundCharge(…)), or give undoName");
  }
  const name = undo === undefined ? checkCompensation({ name: undoName as string, data: null }).name : registerUndo(undo, undoName);
  return { name, data: undoData as ((result: unknown) => unknown) | undefined };
}

function matches(matcher: ErrorMatcher, error: unknown): boolean {
  if (typeof matcher === "function") return matcher(error);
  return matcher.some((cls) => error instanceof cls);
}

function isAbort(error: unknown): boolean {
  return error instanceof Error && (error.name === "AbortError" || error.name === "TimeoutError");
}

/** `permanent`, `unknown` or `retryable`. */
export function classify(policy: Policy, error: unknown): "permanent" | "unknown" | "retryable" {
  if (error instanceof Permanent || matches(policy.permanent, error)) return "permanent";
  if (error instanceof OutcomeUnknown || isAbort(error) || matches(policy.unknown, error)) return "unknown";
  return "retryable";
}

function errorName(error: unknown): string {
  if (!(error instanceof Error)) return typeof error;
  if (error.name && error.name !== "Error") return error.name;
  return error.constructor?.name || "Error";
}

/** The stored JSON of a permanent failure: `{"type": "<error name>", "message": "…"}`. */
export function failureOf(error: unknown): { type: string; message: string } {
  return { type: errorName(error), message: error instanceof Error ? error.message : String(error) };
}

function detailOf(error: unknown): string {
  return `${errorName(error)}: ${error instanceof Error ? error.message : String(error)}`.slice(0, 1000);
}

// -- the attempt running in this context -----------------------------------------------------

interface Storage {
  run<R>(store: Attempt, fn: () => R): R;
  getStore(): Attempt | undefined;
}

let storage: Storage | null | undefined;
let loading: Promise<Storage | null> | undefined;

/** An `AsyncLocalStorage` where the runtime has one (Node, Bun, Deno, Workers with Node compatibility). */
function loadStorage(): Promise<Storage | null> {
  if (storage !== undefined) return Promise.resolve(storage);
  loading ??= (async (): Promise<Storage | null> => {
    type Als = new () => Storage;
    let cls = (globalThis as { AsyncLocalStorage?: Als }).AsyncLocalStorage;
    if (cls === undefined) {
      const specifier = "node:async_hooks";
      try {
        cls = ((await import(specifier)) as { AsyncLocalStorage?: Als }).AsyncLocalStorage;
      } catch {
        cls = undefined;
      }
    }
    storage = cls === undefined ? null : new cls();
    return storage;
  })();
  return loading;
}

/**
 * The attempt of the guarded function running in this async context. Throws outside of one, and
 * on a runtime without `AsyncLocalStorage` (there, use the attempt passed to the function).
 */
export function current(): Attempt {
  const attempt = storage?.getStore();
  if (attempt === undefined) {
    throw new OnceguardError("current() is only available inside a function guarded by once() or guarded()");
  }
  return attempt;
}

// -- the attempt ---------------------------------------------------------------------------

/** A replayed claim's value. */
interface Replayed {
  readonly replayed: true;
  readonly fence: number;
  readonly attempt: number;
  readonly value: unknown;
}

/** A claim that observe mode let proceed: nothing is held. */
interface Observed {
  readonly observed: Proceed;
}

/**
 * The handle of a guarded call: the claim's facts (`fence` to hand downstream, `attempt`,
 * `recovery`), `checkpoint()`, and the outcome.
 */
export class Attempt {
  readonly namespace: string;
  readonly key: string;
  /** The claim's fence: hand it to the downstream system so that it can refuse a stale writer. */
  readonly fence: number;
  /** 1 for the first attempt. */
  readonly attempt: number;
  /** Set when an earlier attempt may have done part of the work (with its last checkpoint). */
  readonly recovery: Recovery | null;
  /** Whether the outcome came from the store (nothing ran). */
  readonly replayed: boolean;
  /**
   * Set in observe mode when enforcement would not have let this call run: what it would have
   * answered (`wouldHaveBeen`, `reason`). Nothing is held: `fence` and `attempt` are 0, there is
   * no lease nor heartbeat, `checkpoint()` does nothing, and the outcome is not stored.
   */
  readonly observed: Proceed | null;
  readonly leaseExpiresAt: Date | null;
  /** Cost units (money) to report when the attempt completes or fails. */
  cost: number | undefined;
  /** Tokens to report when the attempt completes. */
  tokens: number | undefined;
  readonly #client: Client;
  readonly #policy: Policy;
  readonly #lost = new AbortController();
  #lostError: StaleFence | undefined;
  #completed = false;
  #effectDone = false;
  #result: unknown;

  /** @internal */
  constructor(client: Client, policy: Policy, key: string, found: Acquired | Replayed | Observed) {
    this.#client = client;
    this.#policy = policy;
    this.namespace = policy.namespace;
    this.key = key;
    this.replayed = "replayed" in found;
    this.observed = "observed" in found ? found.observed : null;
    this.fence = "observed" in found ? 0 : found.fence;
    this.attempt = "observed" in found ? 0 : found.attempt;
    this.recovery = "recovery" in found ? found.recovery : null;
    this.leaseExpiresAt = "leaseExpiresAt" in found ? found.leaseExpiresAt : null;
    if ("replayed" in found) {
      this.#result = found.value;
      this.#completed = true;
    }
  }

  /**
   * Aborted when the call's signal aborts, or when the heartbeat finds the lease taken over
   * (then the outcome will not be stored): hand it to the work that can stop.
   */
  get signal(): AbortSignal {
    return this.#lost.signal;
  }

  /** Whether the heartbeat found the lease taken over (storing the outcome will throw `StaleFence`). */
  get leaseLost(): boolean {
    return this.#lostError !== undefined;
  }

  /** Whether the outcome is stored (always, for a replay). */
  get completed(): boolean {
    return this.#completed;
  }

  /** The replayed value; after completion, the value decoded from the stored bytes. */
  get result(): unknown {
    return this.#result;
  }

  /**
   * Save a recovery point: if this attempt crashes, the next one receives it in
   * `recovery.lastCheckpoint`. Throws {@link StaleFence} if the attempt is over. Does nothing
   * in observe mode where nothing is held (`observed`).
   */
  async checkpoint(name: string, data?: unknown): Promise<void> {
    this.#requireHolder();
    if (this.observed !== null) return;
    applied(await this.#client.checkpoint(this.namespace, this.key, this.fence, name, data === undefined ? null : toJsonValue(data)));
  }

  /**
   * Store `value` now, before the function returns; returns it as every caller will see it.
   * From then on the effect counts as done: if storing fails, the key is reported unknown,
   * never released. Throws {@link StaleFence} if the lease was taken over (nothing stored). In
   * observe mode where nothing is held (`observed`), stores nothing and returns it as it would
   * have been stored.
   */
  async complete(value?: unknown): Promise<unknown> {
    this.#requireHolder();
    if (this.#completed) throw new OnceguardError("the outcome is stored already");
    this.#effectDone = true;
    const text = this.#serialize(value);
    if (this.observed !== null) return this.#stored(text);
    const compensation = this.#compensation(value, text);
    applied(await this.#client.complete(this.namespace, this.key, this.fence, new RawJson(text), { cost: this.cost, tokens: this.tokens, compensation }));
    return this.#stored(text);
  }

  /** The compensation a completion of `value` (stored as `text`) registers, where the guard has an undo. */
  #compensation(value: unknown, text: string): Compensation | undefined {
    const undo = this.#policy.undo;
    if (undo === undefined) return undefined;
    const data: unknown = undo.data === undefined ? JSON.parse(text) : toJsonValue(undo.data(value));
    return checkCompensation({ name: undo.name, data });
  }

  #requireHolder(): void {
    if (this.replayed) throw new OnceguardError("this key replayed: there is no attempt to checkpoint or complete");
  }

  #serialize(value: unknown): string {
    return dumps(this.#policy.encode(value));
  }

  #stored(text: string): unknown {
    this.#completed = true;
    this.#result = this.#policy.decode(JSON.parse(text));
    return this.#result;
  }

  /** @internal abort this attempt's signal with the call's */
  follow(signal: AbortSignal | undefined): () => void {
    if (signal === undefined) return () => undefined;
    const onAbort = (): void => this.#lost.abort(signal.reason);
    if (signal.aborted) onAbort();
    else signal.addEventListener("abort", onAbort, { once: true });
    return () => signal.removeEventListener("abort", onAbort);
  }

  /** @internal the heartbeat found the lease taken over */
  loseLease(error: StaleFence): void {
    this.#lostError = error;
    this.#lost.abort(error);
  }

  /**
   * @internal store what `verify` said happened, `reconciled` (the function did not run);
   * returns it as every caller will see it
   */
  async settleReconciled(happened: Happened): Promise<unknown> {
    let text: string;
    let compensation: Compensation | undefined;
    try {
      text = this.#serialize(happened.result);
      compensation = this.#compensation(happened.result, text);
    } catch (error) {
      await this.#reportUnknown(`the reconciled result could not be stored: ${detailOf(error)}`);
      throw error;
    }
    const options = {
      cost: happened.cost !== undefined ? happened.cost : this.cost,
      tokens: happened.tokens !== undefined ? happened.tokens : this.tokens,
      reconciled: true,
      compensation,
    };
    applied(await this.#client.complete(this.namespace, this.key, this.fence, new RawJson(text), options));
    return this.#stored(text);
  }

  /**
   * @internal store the function's value (unless it completed early; in observe mode, return it
   * as it would have been stored)
   */
  async settleSuccess(value: unknown): Promise<unknown> {
    if (this.#completed) return this.#result;
    if (this.observed !== null) return this.#stored(this.#serialize(value));
    let text: string;
    let compensation: Compensation | undefined;
    try {
      text = this.#serialize(value);
      compensation = this.#compensation(value, text);
    } catch (error) {
      await this.#reportUnknown(`the result could not be stored: ${detailOf(error)}`);
      throw error;
    }
    applied(await this.#client.complete(this.namespace, this.key, this.fence, new RawJson(text), { cost: this.cost, tokens: this.tokens, compensation }));
    return this.#stored(text);
  }

  /**
   * @internal after the function threw `error`: store, report or release; throws
   * `PermanentFailure` for a stored failure, else returns so that `error` propagates.
   */
  async settleFailure(error: unknown): Promise<void> {
    if (this.#completed) return; // the outcome was stored before the function threw: it stands
    if (this.observed !== null) return; // nothing is held: the error propagates as it is
    const kind = this.#effectDone ? "unknown" : classify(this.#policy, error);
    if (kind === "permanent") {
      const failure = failureOf(error);
      applied(await this.#client.fail(this.namespace, this.key, this.fence, { retryable: false, error: failure, cost: this.cost, tokens: this.tokens }));
      throw new PermanentFailure(failure, this.namespace, this.key, false, error);
    }
    if (kind === "unknown") {
      await this.#reportUnknown(detailOf(error));
      return;
    }
    try {
      await this.#client.fail(this.namespace, this.key, this.fence, { retryable: true, error: failureOf(error), cost: this.cost, tokens: this.tokens });
    } catch {
      // the lease will pass; the next claim is then a recovery
    }
  }

  async #reportUnknown(detail: string): Promise<void> {
    try {
      await this.#client.reportUnknown(this.namespace, this.key, this.fence, detail);
    } catch {
      // the lease will pass; the next claim is then a recovery
    }
  }
}

/** Seconds between two heartbeats: a third of the lease. */
function interval(lease: number): number {
  return Math.max(lease / 3, 0.03);
}

/** Extends the lease every third of it, in the background, until stopped (and waited for). */
class Heartbeat {
  readonly #client: Client;
  readonly #attempt: Attempt;
  readonly #lease: number;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #beat: Promise<void> | undefined;
  #stopped = false;

  constructor(client: Client, attempt: Attempt, lease: number) {
    this.#client = client;
    this.#attempt = attempt;
    this.#lease = lease;
  }

  start(): void {
    if (this.#stopped) return;
    this.#timer = setTimeout(() => {
      this.#beat = this.#once().then((again) => {
        this.#beat = undefined;
        if (again) this.start();
      });
    }, interval(this.#lease) * 1000);
    // A heartbeat never keeps a process alive by itself.
    (this.#timer as { unref?: () => void }).unref?.();
  }

  /** Extend once; `false` (no more beats) if the lease was taken over. */
  async #once(): Promise<boolean> {
    const a = this.#attempt;
    try {
      const answer = await this.#client.extendOnce(a.namespace, a.key, a.fence, this.#lease);
      if (answer.outcome === "stale") {
        a.loseLease(StaleFence.of(answer));
        return false;
      }
    } catch {
      // the next beat tries again
    }
    return !this.#stopped;
  }

  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#timer);
    await this.#beat;
  }
}

/**
 * An acquired claim, the replayed value, or a claim observe mode let proceed; throws for the
 * other answers, and for a replay whose namespace keeps only a digest (there is no value, and
 * it must not run again).
 */
function interpret(answer: ClaimAnswer, policy: Policy, key: string): Acquired | Replayed | Observed {
  const ns = policy.namespace;
  switch (answer.outcome) {
    case "acquired":
      return answer;
    case "replay":
      if (answer.digest !== null) throw new ResultNotKeptError(answer.digest, answer.status, ns, key);
      if (answer.status !== "success") throw new PermanentFailure(answer.result, ns, key, true);
      return { replayed: true, fence: answer.fence, attempt: answer.attempt, value: policy.decode(answer.result) };
    case "in_flight":
      throw new InFlightError(ns, key, answer.retryAfter, answer.attempt);
    case "mismatch":
      throw new KeyConflict(ns, key, answer.detail);
    case "denied":
      if (answer.kind === "approval") throw new ApprovalDeniedError(answer, ns, key);
      if (answer.kind === "recovery") throw new RecoveryNeedsVerifyError(answer, ns, key);
      throw new DeniedError(answer, ns, key);
    case "pending_approval":
      throw new AwaitingApprovalError(answer.approval, answer.retryAfter, ns, key);
    case "proceed":
      return { observed: answer };
  }
}

/** What a guarded call claims with besides its key. */
export interface ClaimOf {
  /** What the effect means (JSON; its fingerprint catches a key reused for another request). */
  readonly request?: unknown;
  /** Or a fingerprint you computed, `algorithm:hex`. */
  readonly fingerprint?: string | undefined;
  /** The run the key is charged to. */
  readonly run?: string | null | undefined;
  /** What the call does, for the person who approves it where the namespace needs approvals. */
  readonly summary?: string | null | undefined;
  /** Abort the call (the claim, or the function: then the outcome is reported unknown). */
  readonly signal?: AbortSignal | undefined;
}

/**
 * The claim's answer. A key in flight is waited for up to `wait` in all, and with
 * `waitForApproval` a pending approval until it is decided or that time has passed: the server
 * waits at most 30s on one claim, so a longer wait claims again (each claim waiting the rest, up
 * to 30s), which outlasts a crashed holder's lease.
 */
async function claimKey(client: Client, policy: Policy, key: string, claim: ClaimOf): Promise<ClaimAnswer> {
  const started = Date.now();
  const ask = (wait: number | undefined): Promise<ClaimAnswer> =>
    client.claim(policy.namespace, key, {
      fingerprint: claim.fingerprint,
      request: claim.fingerprint !== undefined ? undefined : (claim.request ?? null),
      lease: policy.lease,
      retention: policy.retention,
      run: claim.run ?? undefined,
      wait,
      cost: policy.cost,
      summary: claim.summary ?? undefined,
      verifyHook: typeof policy.verify === "function",
      signal: claim.signal,
    });
  const until = (seconds: number | undefined): number => started + (seconds ?? 0) * 1000;
  let answer = await ask(policy.wait === undefined ? undefined : Math.min(MAX_CLAIM_WAIT, policy.wait));
  for (;;) {
    const deadline =
      answer.outcome === "in_flight" ? until(policy.wait) : answer.outcome === "pending_approval" ? until(policy.waitForApproval) : started;
    const left = (deadline - Date.now()) / 1000;
    if (left <= 0) return answer;
    const asked = Date.now();
    answer = await ask(Math.min(MAX_CLAIM_WAIT, left));
    // Should a server answer before the wait it was given, it is not asked again at once.
    const spent = (Date.now() - asked) / 1000;
    if (answer.outcome === "in_flight" && spent < Math.min(MAX_CLAIM_WAIT, left) / 2) {
      await sleep(Math.min(1, Math.max(0, (deadline - Date.now()) / 1000)), claim.signal);
    }
  }
}

/** What `verify` said of a recovery: `happened(…)`, or `undefined` (run the function). */
async function verifyRecovery(attempt: Attempt, verify: Verify, recovery: Recovery, request: unknown): Promise<Happened | undefined> {
  const verdict: unknown = await verify({
    namespace: attempt.namespace,
    key: attempt.key,
    fence: attempt.fence,
    attempt: attempt.attempt,
    recovery,
    checkpoint: recovery.lastCheckpoint,
    request,
    signal: attempt.signal,
  });
  if (verdict instanceof Happened) return verdict;
  if (verdict === undefined || verdict === null) return undefined;
  const what = typeof verdict === "object" ? (verdict.constructor?.name ?? "object") : typeof verdict;
  throw new TypeError(`verify returns happened(result) when the effect happened, or undefined or null when it did not; not a ${what}`);
}

/**
 * Run `job(attempt)` once per `key` and return its value as stored, or the stored value of an
 * earlier run: what {@link once}, {@link guarded} and the framework helpers do for each call.
 */
export async function runGuarded<T>(
  client: Client,
  policy: Policy,
  key: string,
  job: (attempt: Attempt) => T | PromiseLike<T>,
  claim: ClaimOf = {},
): Promise<Awaited<T>> {
  checkKey(key);
  const found = interpret(await claimKey(client, policy, key, claim), policy, key);
  if ("replayed" in found) return found.value as Awaited<T>; // nothing runs: no attempt to make
  return runAttempt(client, policy, new Attempt(client, policy, key, found), job, claim);
}

/**
 * Run `job(attempt)` in an attempt that holds its key (or that observe mode let proceed),
 * under the heartbeat, asking `verify` first on a recovery, and settle it: store the value, or
 * store, report or release after an error (see the module's protocol). What {@link runGuarded}
 * does once the key is acquired, and a compensation worker once it holds a task.
 */
export async function runAttempt<T>(
  client: Client,
  policy: Policy,
  attempt: Attempt,
  job: (attempt: Attempt) => T | PromiseLike<T>,
  claim: ClaimOf = {},
): Promise<Awaited<T>> {
  const als = await loadStorage();
  const holds = attempt.observed === null;
  if (claim.signal?.aborted) {
    // aborted before anything ran: release the key for the next call
    if (holds) await client.fail(policy.namespace, attempt.key, attempt.fence, { retryable: true }).catch(() => undefined);
    throw claim.signal.reason;
  }
  const unfollow = attempt.follow(claim.signal);
  const beat = policy.heartbeat && holds ? new Heartbeat(client, attempt, policy.lease) : undefined;
  beat?.start();
  // A recovery with a verify hook asks the downstream system first (inside the attempt, as the
  // function would run: its errors are the function's).
  const verify = policy.verify;
  const recovery = attempt.recovery;
  let reconciled: Happened | undefined;
  let verifying = false;
  const work = async (): Promise<T> => {
    if (verify !== undefined && recovery !== null) {
      verifying = true;
      reconciled = await verifyRecovery(attempt, verify, recovery, claim.fingerprint !== undefined ? null : (claim.request ?? null));
      verifying = false;
      if (reconciled !== undefined) return undefined as T;
    }
    return job(attempt);
  };
  let value: Awaited<T>;
  try {
    value = await (als ? als.run(attempt, work) : work());
  } catch (error) {
    await beat?.stop();
    unfollow();
    // A verify that failed leaves the effect as unknown as it was: the key stays a recovery.
    const settled = verifying ? new OutcomeUnknown(`verify failed: ${String(error)}`, { cause: error }) : error;
    await attempt.settleFailure(settled);
    throw error;
  }
  await beat?.stop();
  unfollow();
  if (reconciled !== undefined) return (await attempt.settleReconciled(reconciled)) as Awaited<T>;
  return (await attempt.settleSuccess(value)) as Awaited<T>;
}

/** The options of {@link guarded} (`T`: the function's value). */
export interface GuardedOptions<T = unknown> extends GuardOptions<Awaited<T>>, ClaimOf {}

/**
 * What `decode` makes of the stored JSON: the type `once` and `guarded` then answer (without
 * it, {@link JsonOf} the function's value).
 */
export interface Decoded<D> {
  /** The value every caller gets, from the stored JSON: e.g. a schema's `parse`. */
  readonly decode?: (value: unknown) => D;
}

/**
 * Run `fn` once per `key`: the first call claims the key, runs `fn(attempt)` and stores its
 * value; every later call (another task, process or machine) gets the stored value without
 * running `fn`.
 *
 * ```ts
 * const ticket = await guarded(client, "prod/tickets", `ticket-${alert.id}`, { request: { alert: alert.id } },
 *   async (attempt) => tickets.open(alert, { fence: attempt.fence }));
 * ```
 *
 * `request` is what the effect means (JSON; default `null`), or give `fingerprint`. Throws
 * {@link InFlightError}, {@link KeyConflict}, {@link DeniedError} (an approver's:
 * {@link ApprovalDeniedError}), {@link AwaitingApprovalError}, {@link PermanentFailure}
 * (a stored failure), {@link ResultNotKeptError} (it ran once, in a namespace that keeps only
 * a digest), or {@link StaleFence} if the lease was taken over before the value was stored.
 */
export function guarded<T>(client: Client, namespace: string, key: string, fn: (attempt: Attempt) => T | Promise<T>): Promise<JsonOf<Awaited<T>>>;
export function guarded<T, D = JsonOf<Awaited<T>>>(
  client: Client,
  namespace: string,
  key: string,
  options: GuardedOptions<T> & Decoded<D>,
  fn: (attempt: Attempt) => T | Promise<T>,
): Promise<D>;
export function guarded<T>(
  client: Client,
  namespace: string,
  key: string,
  optionsOrFn: GuardedOptions<T> | ((attempt: Attempt) => T | Promise<T>),
  maybeFn?: (attempt: Attempt) => T | Promise<T>,
): Promise<unknown> {
  const [options, fn] = typeof optionsOrFn === "function" ? [{}, optionsOrFn] : [optionsOrFn, maybeFn];
  if (fn === undefined) throw new TypeError("guarded() needs the function to run");
  return runGuarded(client, policyOf(namespace, options), key, fn, options);
}

/** The options of {@link once} (`A`: the function's arguments, `R`: its value). */
export type OnceOptions<A extends unknown[], R = unknown> = GuardOptions<Awaited<R>> & {
  readonly client: Client;
  readonly namespace: string;
  /** Part of derived keys: change it when the function's effect changes meaning. Default `"v1"`. */
  readonly version?: string;
  /**
   * The names of the positional parameters: the arguments become the object
   * `{name: argument}` (as the Python client binds them), so that `deriveKey` and a Python
   * function with those parameters make the same keys. Without it, the arguments are the array
   * of the call's arguments.
   */
  readonly params?: readonly string[];
  /** Arguments left out of the key and the request: names (with `params`) or positions. */
  readonly ignore?: ReadonlyArray<string | number>;
  /** The run the key is charged to: a string, or a function of the arguments. */
  readonly run?: string | ((...args: A) => string | null | undefined);
  /**
   * What the call does, for the person who approves it where the namespace needs approvals: a
   * string, or a function of the arguments (at most 1024 bytes; stored as given, no secrets).
   */
  readonly summary?: string | ((...args: A) => string | null | undefined);
  /** Abort every call (or pass a signal per call with {@link withSignal}). */
  readonly signal?: AbortSignal;
} & (
    // The variant with a key comes first: options giving neither are reported against the last
    // one, whose error names what is missing, `name`.
    | { readonly name?: string; readonly key: string | ((...args: A) => string | Promise<string>) }
    | {
        /** Part of derived keys: pin it (bundlers rename functions). Required unless `key` is given. */
        readonly name: string;
        /** A fixed key, or a function of the arguments returning one. Default: derived. */
        readonly key?: string | ((...args: A) => string | Promise<string>);
      }
  );

/** The JSON arguments of a call, as `once` makes them for the key and the request. */
export function argumentsOf(args: readonly unknown[], params?: readonly string[], ignore: ReadonlyArray<string | number> = []): unknown {
  const skip = new Set(ignore);
  if (params === undefined) {
    return toJsonValue(args.filter((_, i) => !skip.has(i)));
  }
  if (args.length > params.length) {
    throw new TypeError(`${args.length} arguments given for the ${params.length} parameters ${params.join(", ")}`);
  }
  const out: Record<string, unknown> = {};
  params.forEach((name, i) => {
    if (!skip.has(name) && !skip.has(i)) out[name] = args[i];
  });
  return toJsonValue(out);
}

/**
 * Make an async function run once per key:
 *
 * ```ts
 * const refund = once(async (order: number, amount: number) => payments.refund(order, amount, { fence: current().fence }),
 *   { client, namespace: "prod/payments-agent", name: "refund", version: "v1", params: ["order", "amount"] });
 * await refund(1234, 25);   // runs: claim → run → complete
 * await refund(1234, 25);   // replays the stored result
 * ```
 *
 * The key is derived from `name`, `version` and the canonical JSON of the arguments (see
 * {@link deriveKey}), or given (`key`). The arguments (as JSON) are the claim's request, so a
 * fixed or computed key reused with other arguments throws {@link KeyConflict}. In the
 * function, the {@link Attempt} is `this` (for a `function`) and {@link current}().
 */
export function once<A extends unknown[], R, D = JsonOf<Awaited<R>>>(
  fn: (this: Attempt, ...args: A) => R | Promise<R>,
  options: OnceOptions<A, R> & Decoded<D>,
): (...args: A) => Promise<D> {
  const policy = policyOf(options.namespace, options);
  const version = checkLabel("version", options.version ?? "v1", 32);
  const name = options.name === undefined ? undefined : checkLabel("name", options.name, 128);
  if (name === undefined && options.key === undefined) throw new TypeError("once() needs a name (or a key)");
  if (typeof options.key === "string") checkKey(options.key);
  const guardedFn = async (signal: AbortSignal | undefined, args: A): Promise<D> => {
    const request = argumentsOf(args, options.params, options.ignore);
    let key: string;
    if (options.key === undefined) key = await deriveKey(name as string, version, request);
    else if (typeof options.key === "string") key = options.key;
    else key = checkKey(await options.key(...args));
    const run = typeof options.run === "function" ? options.run(...args) : options.run;
    const summary = typeof options.summary === "function" ? options.summary(...args) : options.summary;
    const value = await runGuarded(options.client, policy, key, (attempt) => fn.apply(attempt, args), {
      request,
      run,
      summary,
      signal,
    });
    // The value decoded from the stored JSON (`decode`, or the JSON itself).
    return value as unknown as D;
  };
  const wrapper = (...args: A): Promise<D> => guardedFn(options.signal, args);
  SIGNALLED.set(wrapper, guardedFn as (signal: AbortSignal | undefined, args: unknown[]) => Promise<unknown>);
  return wrapper;
}

const SIGNALLED = new WeakMap<object, (signal: AbortSignal | undefined, args: unknown[]) => Promise<unknown>>();

/**
 * The function `once` made, called with `signal` for this call: aborting it cancels the claim,
 * or, once the function runs, aborts `current().signal`-aware work and reports the outcome
 * unknown.
 */
export function withSignal<A extends unknown[], R>(guardedFn: (...args: A) => Promise<R>, signal: AbortSignal): (...args: A) => Promise<R> {
  const inner = SIGNALLED.get(guardedFn);
  if (inner === undefined) throw new TypeError("withSignal() takes a function made by once()");
  return (...args: A) => inner(signal, args) as Promise<R>;
}
