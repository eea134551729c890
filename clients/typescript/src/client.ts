/**
 * {@link Client}: every call of the HTTP API, sent by a {@link Transport} (`node:http` on Node,
 * else the platform's `fetch`, or the `fetch` it is given), with the retries of {@link Retry}.
 *
 * Which calls may be sent again after a failure that may have reached the server (a timeout,
 * a dropped connection): claims (a lost claim's repeat answers `in_flight`, never a second
 * `acquired`), fenced calls (by key and fence), reads, purges, budgets, settings and engaging a
 * switch, starting a rollback (a second start answers the rollback under way), claiming a
 * compensation task (a lost claim's task is recovered once its lease passes); not creating API
 * keys or tenants, nor releasing a switch (the second release would answer 404), nor approving
 * or denying an approval (the second decision would answer 409). A request that never left (the
 * connection was refused) and a 503 are retried for every call.
 *
 * @module
 */

import {
  PROBLEM_PREFIX,
  StaleFence,
  TransportError,
  UnexpectedResponse,
  problemError,
  type Problem,
} from "./errors.js";
import {
  DENIED_KINDS,
  acquiredOf,
  apiKeyOf,
  approvalOf,
  auditEntryOf,
  compensationClaimOf,
  isProceed,
  isWellFormedProceed,
  pendingApprovalOf,
  proceedOf,
  recordOf,
  replayOf,
  rollbackOf,
  runOf,
  settingsEntryOf,
  switchOf,
  tenantOf,
  tripwireOf,
  type ApiKey,
  type Approval,
  type ApprovalPage,
  type AuditEntry,
  type AuditPage,
  type ClaimAnswer,
  type Compensation,
  type CompensationClaimAnswer,
  type FencedAnswer,
  type KeyRecord,
  type RecordPage,
  type Rollback,
  type Run,
  type Settings,
  type SettingsEntry,
  type Switch,
  type SwitchTarget,
  type Symptom,
  type Tenant,
  type Tripwire,
} from "./models.js";
import { checkCompensation } from "./compensation.js";
import { NO_RETRY, Retry, notSent, sleep, type RetryOptions } from "./retry.js";
import { defaultTransport, fetchTransport, type Answer, type AnswerHeaders, type Transport } from "./transport.js";
import {
  body,
  durationSeconds,
  elementSpans,
  env,
  formatDuration,
  formatTime,
  memberSpans,
  rawMember,
  toBase64,
  type Duration,
} from "./wire.js";

/** The address of a server when neither an option nor `ONCEGUARD_URL` names one. */
export const DEFAULT_URL = "http://127.0.0.1:8080";
const USER_AGENT = "onceguard-typescript/0.1.0";

type Json = Record<string, unknown>;

/** What every call takes besides its own options. */
export interface CallOptions {
  /** Abort the call: the request is cancelled and the call throws the signal's reason. */
  readonly signal?: AbortSignal | undefined;
}

/** The options of a {@link Client}. */
export interface ClientOptions {
  /** The server's URL. Default: `$ONCEGUARD_URL`, else `http://127.0.0.1:8080`. */
  readonly baseUrl?: string;
  /** The API key (`og_<id>_<secret>`). Default: `$ONCEGUARD_API_KEY`. */
  readonly apiKey?: string;
  /** Seconds each try may take (a claim that waits gets its `wait` on top). Default 10. */
  readonly timeout?: number;
  /** The retry policy; `NO_RETRY` for none. Default: `new Retry()` (6 tries, 0.1 s to 2 s). */
  readonly retry?: Retry | RetryOptions;
  /** More headers for every request. */
  readonly headers?: Readonly<Record<string, string>>;
  /** The `fetch` to use. Default: `node:http` on Node (keep-alive), else the platform's `fetch`. */
  readonly fetch?: typeof fetch;
}

/** One request and the reader of its answer. */
interface Call<T> {
  readonly method: string;
  readonly path: string;
  readonly read: (answer: Answer) => T;
  readonly params?: Readonly<Record<string, string | number | boolean | null | undefined>>;
  readonly body?: string;
  /** Whether sending it twice is harmless, so that a request that may have been sent may be sent again. */
  readonly idempotent?: boolean;
  /** Seconds the server may legitimately take beyond the usual (a claim's `wait`). */
  readonly extraTime?: number;
}

// -- reading answers -----------------------------------------------------------------------

function parse(answer: Answer): unknown {
  try {
    return JSON.parse(answer.text) as unknown;
  } catch {
    throw new UnexpectedResponse(answer.status, answer.text);
  }
}

function problemOf(answer: Answer): Problem | null {
  const media = (answer.headers.get("content-type") ?? "").split(";")[0]?.trim().toLowerCase();
  if (media !== "application/problem+json" && media !== "application/json") return null;
  let value: unknown;
  try {
    value = JSON.parse(answer.text);
  } catch {
    return null;
  }
  return value !== null && typeof value === "object" && !Array.isArray(value) && "type" in value ? (value as Problem) : null;
}

function errorOf(answer: Answer): Error {
  const problem = problemOf(answer);
  return problem === null ? new UnexpectedResponse(answer.status, answer.text) : problemError(problem, answer.status);
}

function expect(answer: Answer, ...ok: number[]): Json {
  if (ok.includes(answer.status)) return parse(answer) as Json;
  throw errorOf(answer);
}

function retryAfterOf(problem: Problem, headers?: AnswerHeaders): number | null {
  const ms = problem["retry_after_ms"];
  if (typeof ms === "number") return ms / 1000;
  const header = headers?.get("retry-after");
  if (header !== null && header !== undefined && header !== "" && !Number.isNaN(Number(header))) return Number(header);
  return null;
}

/** A claim's answer from its status and body (`resultText`: a replay's result as sent). */
function claimAnswer(status: number, value: unknown, resultText?: string, headers?: AnswerHeaders): ClaimAnswer {
  if (status === 201) return acquiredOf(value as Json);
  if (status === 200 && isProceed(value)) {
    if (!isWellFormedProceed(value as Json)) throw new UnexpectedResponse(status, JSON.stringify(value));
    return proceedOf(value as Json);
  }
  if (status === 200) return replayOf(value as Json, resultText);
  if (status === 202 && value !== null && typeof value === "object" && typeof (value as Json)["approval"] === "object") {
    return pendingApprovalOf(value as Json);
  }
  if (value === null || typeof value !== "object" || !("type" in value)) {
    throw new UnexpectedResponse(status, JSON.stringify(value));
  }
  const problem = value as Problem;
  const error = problemError(problem, status);
  const retryAfter = retryAfterOf(problem, headers);
  if (error.kind === "in-flight") {
    const reason = problem["reason"] as Json | null | undefined;
    const attempt = reason !== null && typeof reason === "object" ? reason["attempt"] : undefined;
    return {
      outcome: "in_flight",
      retryAfter: retryAfter ?? 0,
      attempt: typeof attempt === "number" ? attempt : null,
      detail: error.detail,
    };
  }
  if (error.kind === "fingerprint-mismatch") return { outcome: "mismatch", detail: error.detail };
  const kind = DENIED_KINDS[error.kind];
  if (kind !== undefined) {
    const reason = problem["reason"];
    return {
      outcome: "denied",
      kind,
      reason: reason !== null && typeof reason === "object" ? (reason as Json) : { reason },
      retryAfter,
      detail: error.detail,
      retryable: error.retryable,
    };
  }
  throw error;
}

function readClaim(answer: Answer): ClaimAnswer {
  if (answer.status === 202) return claimAnswer(202, parse(answer));
  if (answer.status === 200 || answer.status === 201) {
    const value = parse(answer) as Json;
    const text = answer.status === 200 && "result" in value ? rawMember(answer.text, "result") : undefined;
    return claimAnswer(answer.status, value, text);
  }
  const problem = problemOf(answer);
  if (problem === null) throw new UnexpectedResponse(answer.status, answer.text);
  return claimAnswer(answer.status, problem, undefined, answer.headers);
}

function fencedAnswer(status: number, value: unknown): FencedAnswer {
  if (status === 200) return { outcome: "applied", record: recordOf(value as Json) };
  const error =
    value !== null && typeof value === "object" && "type" in value
      ? problemError(value as Problem, status)
      : new UnexpectedResponse(status, JSON.stringify(value));
  if (error instanceof StaleFence) return error.stale;
  throw error;
}

function readFenced(answer: Answer): FencedAnswer {
  if (answer.status === 200) return fencedAnswer(200, parse(answer));
  const problem = problemOf(answer);
  if (problem === null) throw new UnexpectedResponse(answer.status, answer.text);
  return fencedAnswer(answer.status, problem);
}

function isNotFound(answer: Answer): boolean {
  return answer.status === 404 && String(problemOf(answer)?.type ?? "") === PROBLEM_PREFIX + "not-found";
}

function readOptionalRecord(answer: Answer): KeyRecord | null {
  if (isNotFound(answer)) return null;
  const value = expect(answer, 200);
  const stored = value["stored"] as Json | null | undefined;
  const text = stored && "result" in stored ? rawMember(answer.text, "stored", "result") : undefined;
  return recordOf(value, text);
}

function readNothing(answer: Answer): void {
  if (answer.status !== 200 && answer.status !== 204) throw errorOf(answer);
}

/** Each item's status and body of a batch's answer (exactly `sent` of them). */
function batchResults(answer: Answer, sent: number): Array<[number, unknown]> {
  if (answer.status !== 200) throw errorOf(answer);
  const value = parse(answer) as Json;
  const results = value["results"];
  if (!Array.isArray(results) || results.length !== sent) throw new UnexpectedResponse(answer.status, answer.text);
  return results.map((item: unknown) => {
    const entry = item as Json;
    if (typeof entry["status"] !== "number" || !("body" in entry)) throw new UnexpectedResponse(answer.status, answer.text);
    return [entry["status"], entry["body"]];
  });
}

function readClaimBatch(answer: Answer, sent: number): ClaimAnswer[] {
  const items = batchResults(answer, sent);
  let spans: Array<[number, number]> | undefined;
  return items.map(([status, value], n) => {
    let text: string | undefined;
    if (status === 200 && value !== null && typeof value === "object" && "result" in value) {
      // A replay's result is cut out of the answer's text, where the server wrote its stored bytes.
      spans ??= elementSpans(answer.text, (memberSpans(answer.text).get("results") as [number, number])[0]);
      const [start] = spans[n] as [number, number];
      const bodyStart = (memberSpans(answer.text, start).get("body") as [number, number])[0];
      const resultSpan = memberSpans(answer.text, bodyStart).get("result");
      text = resultSpan === undefined ? undefined : answer.text.slice(resultSpan[0], resultSpan[1]);
    }
    return claimAnswer(status, value, text);
  });
}

function readCompleteBatch(answer: Answer, sent: number): FencedAnswer[] {
  return batchResults(answer, sent).map(([status, value]) => fencedAnswer(status, value));
}

// -- building requests ---------------------------------------------------------------------

function optionalDuration(value: Duration | undefined): string | undefined {
  return value === undefined ? undefined : formatDuration(value);
}

function count(what: string, value: number | undefined): number | undefined {
  if (value !== undefined && (!Number.isSafeInteger(value) || value < 0)) {
    throw new RangeError(`${what} is a whole number, at least 0, not ${value}`);
  }
  return value;
}

/** What a claim asks besides the namespace and the key. */
export interface ClaimOptions extends CallOptions {
  /**
   * What the request means (any JSON, e.g. the tool call's arguments): its fingerprint is the
   * SHA-256 of its RFC 8785 canonical form. Give this or `fingerprint`.
   */
  readonly request?: unknown;
  /** A fingerprint you computed, `algorithm:hex`. */
  readonly fingerprint?: string | undefined;
  /** How long you may hold the key without extending (default 30s, 100ms to 1h). */
  readonly lease?: Duration | undefined;
  /** How long the outcome replays, from completion (default 24h). */
  readonly retention?: Duration | undefined;
  /** The run the key belongs to: its budget applies. */
  readonly run?: string | null | undefined;
  /** If the key is in flight, wait up to this long (at most 30s) for its replay. */
  readonly wait?: Duration | undefined;
  /** Cost units this call declares, charged to the run's budget with the key, once. */
  readonly cost?: number | undefined;
  /**
   * What the call does, in words, for the person who approves it where the namespace needs
   * approvals (at most 1024 bytes, no control characters but newlines). Stored as given, not
   * sealed: say what an approver needs, no secrets.
   */
  readonly summary?: string | undefined;
  /**
   * `true` if you check, on a recovery, whether the unfinished attempt's effect happened before
   * running it again (the guard sends it when given a `verify` hook). Where the namespace's
   * recovery policy is `verify`, only such a claim takes over a key whose last attempt did not
   * finish; others are `denied` (kind `recovery`).
   */
  readonly verifyHook?: boolean | undefined;
}

function claimFields(namespace: string, key: string, options: ClaimOptions, allowWait: boolean): Json {
  const hasRequest = options.request !== undefined;
  if (hasRequest === (options.fingerprint !== undefined)) {
    throw new TypeError("give exactly one of 'request' (the request's meaning as JSON) and 'fingerprint'");
  }
  if (!allowWait && options.wait !== undefined) throw new TypeError("a batch never waits: no 'wait' in its claims");
  return {
    namespace,
    key,
    request: options.request,
    fingerprint: options.fingerprint,
    lease: optionalDuration(options.lease),
    retention: optionalDuration(options.retention),
    run: options.run ?? undefined,
    wait: allowWait ? optionalDuration(options.wait) : undefined,
    cost: count("cost", options.cost),
    summary: options.summary,
    verify_hook: options.verifyHook === true ? true : undefined,
  };
}

/** What a completion stores besides the namespace, key and fence. */
export interface CompleteOptions extends CallOptions {
  /** The outcome's bytes, when it is not JSON (then `result` is not given). */
  readonly raw?: Uint8Array | undefined;
  /** The media type of `raw` (default `application/octet-stream`). */
  readonly contentType?: string | undefined;
  /** Cost units (money) the effect consumed: charged to the run, counted as saved by every replay. */
  readonly cost?: number | undefined;
  /** Tokens the effect consumed; sent only when given. */
  readonly tokens?: number | undefined;
  /**
   * `true` from a recovering attempt (attempt 2 or later) that did not run the effect: the
   * downstream system said it had happened, and `result` is what it said. The record and every
   * replay then say `reconciled`. A first attempt may not ({@link InvalidRequest}).
   */
  readonly reconciled?: boolean | undefined;
  /**
   * How to undo the effect if its run is rolled back: a name a worker knows it by (1 to 128
   * printable ASCII characters) and JSON data (at most 16 KiB serialized). Stored with the
   * outcome; see {@link Client.rollback} and the worker `runCompensations`.
   */
  readonly compensation?: Compensation | undefined;
}

function completeFields(namespace: string, key: string, fence: number, result: unknown, options: CompleteOptions): Json {
  const common = {
    namespace,
    key,
    fence,
    cost: count("cost", options.cost),
    tokens: count("tokens", options.tokens),
    reconciled: options.reconciled,
    compensation: options.compensation === undefined ? undefined : checkCompensation(options.compensation),
  };
  // Object.assign, not a spread: Node 20 copies a spread into a literal with more members slowly.
  if (options.raw !== undefined) {
    return Object.assign(common, {
      result_base64: toBase64(options.raw),
      content_type: options.contentType ?? "application/octet-stream",
    });
  }
  if (options.contentType !== undefined && options.contentType !== "application/json") {
    throw new TypeError("a result is JSON; send other media types as raw bytes with contentType");
  }
  return Object.assign(common, { result: result === undefined ? null : result });
}

/** One claim of {@link Client.claimBatch}: a claim's arguments (a batch never waits). */
export interface ClaimItem extends Omit<ClaimOptions, "wait" | "signal"> {
  readonly namespace: string;
  readonly key: string;
}

/** One completion of {@link Client.completeBatch}. */
export interface CompleteItem extends Omit<CompleteOptions, "signal"> {
  readonly namespace: string;
  readonly key: string;
  readonly fence: number;
  /** The result (any JSON; a {@link RawJson} is sent verbatim). */
  readonly result?: unknown;
}

function targetJson(target: SwitchTarget): Json {
  if (target.kind === "namespace") return { kind: "namespace", prefix: target.prefix };
  if (target.kind === "run") return { kind: "run", run: target.run };
  return { kind: "tenant" };
}

function settingsJson(settings: Settings): Json {
  const out: Json = {};
  const durations = [
    ["default_lease", settings.defaultLease],
    ["max_lease", settings.maxLease],
    ["default_retention", settings.defaultRetention],
    ["max_retention", settings.maxRetention],
  ] as const;
  for (const [name, value] of durations) if (value !== undefined) out[name] = formatDuration(value);
  if (settings.maxInFlight !== undefined) out["max_in_flight"] = settings.maxInFlight;
  if (settings.claimRate !== undefined) {
    out["claim_rate"] = { per_second: settings.claimRate.perSecond, burst: settings.claimRate.burst };
  }
  if (settings.outcomeKept !== undefined) out["outcome_kept"] = settings.outcomeKept;
  if (settings.approvalRequired !== undefined) out["approval_required"] = settings.approvalRequired;
  if (settings.approvalExpiry !== undefined) out["approval_expiry"] = formatDuration(settings.approvalExpiry);
  if (settings.mode !== undefined) out["mode"] = settings.mode;
  if (settings.recovery !== undefined) out["recovery"] = settings.recovery;
  if (settings.enforcePercent !== undefined) out["enforce_percent"] = settings.enforcePercent;
  return out;
}

function runPath(run: string): string {
  return "/v1/runs/" + encodeURIComponent(run);
}

function approvalPath(id: string): string {
  return "/v1/approvals/" + encodeURIComponent(id);
}

/** Filters of {@link Client.listApprovals}. */
export interface ApprovalFilter {
  /** `pending`, `approved` or `denied` (approvals that expired undecided are not kept). */
  readonly state?: "pending" | "approved" | "denied";
}

/** Filters of {@link Client.listRecords}. */
export interface RecordFilter {
  readonly namespacePrefix?: string;
  /** `in_progress`, `completed` or `released`. */
  readonly state?: "in_progress" | "completed" | "released";
  /** In-progress keys whose lease passed (or whose outcome was reported unknown). */
  readonly stuck?: boolean;
  readonly run?: string;
}

/** Filters of {@link Client.listAudit}. */
export interface AuditFilter {
  /** E.g. `switch.engage`. */
  readonly action?: string;
  /** An API key id, `cli:<user>` or `embedded`. */
  readonly actor?: string;
  /** Another tenant (the operator tenant's admins). */
  readonly tenant?: string;
}

/** The `tenant` option of the calls an operator tenant's admin may make for another tenant. */
export interface TenantOption extends CallOptions {
  readonly tenant?: string | undefined;
}

/**
 * The client: every call of the HTTP API. Make one per process; it holds no connections of
 * its own (Node's global HTTP agents keep them, or the `fetch` it uses).
 *
 * ```ts
 * const client = new Client({ baseUrl: "http://127.0.0.1:8080", apiKey: "og_…" }); // or $ONCEGUARD_URL, $ONCEGUARD_API_KEY
 * ```
 */
export class Client {
  readonly baseUrl: string;
  readonly apiKey: string | undefined;
  /** Seconds each try may take. */
  readonly timeout: number;
  readonly retry: Retry;
  readonly #headers: Readonly<Record<string, string>>;
  /** {@link Client.#headers} with the `content-type` of a JSON body. */
  readonly #jsonHeaders: Readonly<Record<string, string>>;
  /** The transport over the `fetch` the client was given, if it was. */
  readonly #transport: Transport | undefined;

  constructor(options: ClientOptions = {}) {
    this.baseUrl = (options.baseUrl ?? env("ONCEGUARD_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
    this.apiKey = options.apiKey ?? env("ONCEGUARD_API_KEY");
    this.timeout = options.timeout ?? 10;
    this.retry = options.retry instanceof Retry ? options.retry : new Retry(options.retry);
    const headers: Record<string, string> = { accept: "application/json" };
    if (typeof (globalThis as { window?: unknown }).window === "undefined") headers["user-agent"] = USER_AGENT;
    if (this.apiKey) headers["authorization"] = `Bearer ${this.apiKey}`;
    this.#headers = { ...headers, ...options.headers };
    this.#jsonHeaders = { ...this.#headers, "content-type": "application/json" };
    this.#transport = options.fetch === undefined ? undefined : fetchTransport(options.fetch);
  }

  /** One try of `call`: the answer, or the transport's failure. */
  async #try<T>(call: Call<T>, url: string, signal: AbortSignal | undefined): Promise<Answer> {
    const controller = new AbortController();
    const onAbort = (): void => controller.abort(signal?.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    const limit = (this.timeout + (call.extraTime ?? 0)) * 1000;
    const timer = setTimeout(() => controller.abort(new TimeoutError(limit / 1000)), limit);
    try {
      const chosen = this.#transport ?? defaultTransport();
      const transport = typeof chosen === "function" ? chosen : await chosen;
      const headers = call.body === undefined ? this.#headers : this.#jsonHeaders;
      return await transport({ method: call.method, url, headers, body: call.body, signal: controller.signal });
    } finally {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
    }
  }

  /** Send one call, retrying as the client's {@link Retry} (or `retry`) allows. */
  async #send<T>(call: Call<T>, signal?: AbortSignal, retry: Retry = this.retry): Promise<T> {
    let url = this.baseUrl + call.path;
    if (call.params) {
      const query = new URLSearchParams();
      for (const [name, value] of Object.entries(call.params)) {
        if (value !== undefined && value !== null) query.set(name, String(value));
      }
      const text = query.toString();
      if (text) url += "?" + text;
    }
    for (let tries = 1; ; tries++) {
      signal?.throwIfAborted();
      let answer: Answer;
      try {
        answer = await this.#try(call, url, signal);
      } catch (error) {
        if (signal?.aborted) throw signal.reason;
        const cause = error instanceof Error && error.name === "AbortError" && error.cause ? error.cause : error;
        const again = notSent(cause) || (call.idempotent !== false && !(cause instanceof SyntaxError));
        if (tries < retry.attempts && again) {
          await sleep(retry.delay(tries), signal);
          continue;
        }
        throw new TransportError(`${call.method} ${url} failed after ${tries} tries: ${String(cause)}`, tries, cause);
      }
      if (answer.status === 503 && tries < retry.attempts) {
        const header = answer.headers.get("retry-after");
        await sleep(retry.delay(tries, header ? Number(header) || null : null), signal);
        continue;
      }
      return call.read(answer);
    }
  }

  // -- claims ----------------------------------------------------------------------------

  /**
   * Claim a key: one atomic step answering `acquired`, `replay`, `in_flight`, `mismatch`,
   * `denied`, where the namespace needs approvals `pending_approval`, or, where it is in observe
   * mode, `proceed` in place of any answer but `acquired` and a kill switch's `denied` (run the
   * effect; nothing is held). Give `request` (what the request means) or `fingerprint`. A `wait`
   * waits for an in-flight key's replay, and for a pending approval's decision (not in observe
   * mode, which answers at once).
   */
  claim(namespace: string, key: string, options: ClaimOptions): Promise<ClaimAnswer> {
    const fields = claimFields(namespace, key, options, true);
    const extraTime = options.wait === undefined ? 0 : durationSeconds(options.wait);
    return this.#send({ method: "POST", path: "/v1/claims", read: readClaim, body: body(fields), extraTime }, options.signal);
  }

  /**
   * Claim many keys in one request (at most the server's `limits.max_batch`, 1,000 by
   * default), each answered exactly as {@link claim} answers it alone, in order. A key given
   * twice is `in_flight` the second time. An invalid item refuses the whole batch
   * ({@link InvalidRequest}) before anything is decided.
   */
  claimBatch(items: readonly ClaimItem[], options: CallOptions = {}): Promise<ClaimAnswer[]> {
    const parts = items.map((item) => body(claimFields(item.namespace, item.key, item, false)));
    const text = '{"claims":[' + parts.join(",") + "]}";
    const read = (answer: Answer): ClaimAnswer[] => readClaimBatch(answer, parts.length);
    return this.#send({ method: "POST", path: "/v1/claims/batch", read, body: text }, options.signal);
  }

  /**
   * Store a successful outcome: `result` (JSON; a {@link RawJson} is sent verbatim) or `raw`
   * bytes with their `contentType`. Every later claim replays it byte for byte. Answers
   * `stale` if `fence` is not the holder's (nothing stored). Repeating a completion that took
   * effect, identically, answers as the first time.
   */
  complete(namespace: string, key: string, fence: number, result?: unknown, options: CompleteOptions = {}): Promise<FencedAnswer> {
    const fields = completeFields(namespace, key, fence, result, options);
    return this.#send({ method: "POST", path: "/v1/claims/complete", read: readFenced, body: body(fields) }, options.signal);
  }

  /**
   * Store many outcomes in one request, each as {@link complete} alone, in order: `applied`,
   * or `stale` for a completion whose fence is not the holder's (nothing stored for it).
   */
  completeBatch(items: readonly CompleteItem[], options: CallOptions = {}): Promise<FencedAnswer[]> {
    const parts = items.map((item) => body(completeFields(item.namespace, item.key, item.fence, item.result, item)));
    const text = '{"completions":[' + parts.join(",") + "]}";
    const read = (answer: Answer): FencedAnswer[] => readCompleteBatch(answer, parts.length);
    return this.#send({ method: "POST", path: "/v1/claims/complete/batch", read, body: text }, options.signal);
  }

  /**
   * Report a failure: `retryable: true` releases the key (the next claim runs again);
   * `false` stores `error` (JSON) as a failure that replays.
   */
  fail(
    namespace: string,
    key: string,
    fence: number,
    options: {
      readonly retryable: boolean;
      readonly error?: unknown;
      readonly cost?: number | undefined;
      readonly tokens?: number | undefined;
    } & CallOptions,
  ): Promise<FencedAnswer> {
    const fields = {
      namespace,
      key,
      fence,
      retryable: options.retryable,
      error: options.error,
      cost: count("cost", options.cost),
      tokens: count("tokens", options.tokens),
    };
    return this.#send({ method: "POST", path: "/v1/claims/fail", read: readFenced, body: body(fields) }, options.signal);
  }

  /** Push the lease out to now + `lease` (default: the server's). */
  extend(namespace: string, key: string, fence: number, options: { readonly lease?: Duration | undefined } & CallOptions = {}): Promise<FencedAnswer> {
    return this.#send(this.#extendCall(namespace, key, fence, options.lease), options.signal);
  }

  #extendCall(namespace: string, key: string, fence: number, lease: Duration | undefined): Call<FencedAnswer> {
    const fields = { namespace, key, fence, lease: optionalDuration(lease) };
    return { method: "POST", path: "/v1/claims/extend", read: readFenced, body: body(fields) };
  }

  /** Extend once, without retries (the heartbeat's beat). */
  extendOnce(namespace: string, key: string, fence: number, lease: Duration | undefined, signal?: AbortSignal): Promise<FencedAnswer> {
    return this.#send(this.#extendCall(namespace, key, fence, lease), signal, NO_RETRY);
  }

  /**
   * Save a named recovery point with small JSON `data`; a recovering attempt receives the last
   * one in `recovery.lastCheckpoint`.
   */
  checkpoint(namespace: string, key: string, fence: number, name: string, data?: unknown, options: CallOptions = {}): Promise<FencedAnswer> {
    const fields = { namespace, key, fence, name, data };
    return this.#send({ method: "POST", path: "/v1/claims/checkpoint", read: readFenced, body: body(fields) }, options.signal);
  }

  /**
   * You do not know whether the effect happened: your lease ends now and the next claim is a
   * recovery carrying `detail`.
   */
  reportUnknown(namespace: string, key: string, fence: number, detail: string, options: CallOptions = {}): Promise<FencedAnswer> {
    const fields = { namespace, key, fence, detail };
    return this.#send({ method: "POST", path: "/v1/claims/report-unknown", read: readFenced, body: body(fields) }, options.signal);
  }

  // -- records ---------------------------------------------------------------------------

  /** One live record with its stored outcome, or `null`. */
  getRecord(namespace: string, key: string, options: CallOptions = {}): Promise<KeyRecord | null> {
    return this.#send({ method: "GET", path: "/v1/record", read: readOptionalRecord, params: { namespace, key } }, options.signal);
  }

  /** One page of records by namespace and key; see {@link iterRecords} for all of them. */
  listRecords(options: RecordFilter & { readonly limit?: number; readonly cursor?: string } & CallOptions = {}): Promise<RecordPage> {
    const params = {
      namespace_prefix: options.namespacePrefix,
      state: options.state,
      stuck: options.stuck,
      run: options.run,
      limit: options.limit,
      cursor: options.cursor,
    };
    const read = (answer: Answer): RecordPage => {
      const value = expect(answer, 200);
      return { records: (value["records"] as Json[]).map((r) => recordOf(r)), next: (value["next"] as string | null | undefined) ?? null };
    };
    return this.#send({ method: "GET", path: "/v1/records", read, params }, options.signal);
  }

  /** Every matching record, fetching pages through the cursor as it goes. */
  async *iterRecords(options: RecordFilter & { readonly pageSize?: number } & CallOptions = {}): AsyncGenerator<KeyRecord> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.listRecords({ ...options, limit: options.pageSize ?? 100, ...(cursor ? { cursor } : {}) });
      yield* page.records;
      if (!page.next) return;
      cursor = page.next;
    }
  }

  /**
   * Delete a record whatever its state (admin; audited with `why`); `true` if one existed.
   * The next claim of the key runs again, with a greater fence.
   */
  purge(namespace: string, key: string, options: { readonly why?: string } & CallOptions = {}): Promise<boolean> {
    const read = (answer: Answer): boolean => Boolean(expect(answer, 200)["purged"]);
    return this.#send({ method: "DELETE", path: "/v1/record", read, params: { namespace, key, why: options.why } }, options.signal);
  }

  // -- runs, switches, settings, audit -----------------------------------------------------

  /**
   * Set a run's budget (admin): at most `maxEffects` acquired keys, `maxCost` cost units,
   * until `deadline` (absent limits do not limit; the run keeps what it spent).
   */
  setRunBudget(
    run: string,
    options: {
      readonly maxEffects?: number;
      readonly maxCost?: number;
      readonly deadline?: Date | string;
      readonly why?: string;
    } & TenantOption = {},
  ): Promise<Run> {
    const fields = {
      max_effects: count("maxEffects", options.maxEffects),
      max_cost: count("maxCost", options.maxCost),
      deadline: options.deadline === undefined ? undefined : formatTime(options.deadline),
      why: options.why,
    };
    const read = (answer: Answer): Run => runOf(expect(answer, 200, 201));
    return this.#send({ method: "PUT", path: runPath(run), read, params: { tenant: options.tenant }, body: body(fields) }, options.signal);
  }

  /** A run's budget and usage (and its rollback's progress), or `null` if it was never used nor budgeted. */
  getRun(run: string, options: CallOptions = {}): Promise<Run | null> {
    const read = (answer: Answer): Run | null => (isNotFound(answer) ? null : runOf(expect(answer, 200)));
    return this.#send({ method: "GET", path: runPath(run), read }, options.signal);
  }

  // -- rollbacks ---------------------------------------------------------------------------

  /**
   * Roll a run back (admin; `why` says why, kept with it): a kill switch is engaged on the run
   * (its new claims are denied), and each of its completed effects that registered a
   * compensation becomes a task for `runCompensations` workers, newest effect first.
   * Starting a rollback under way answers it as it is.
   */
  rollback(run: string, why: string, options: CallOptions = {}): Promise<Rollback> {
    const read = (answer: Answer): Rollback => rollbackOf(expect(answer, 200, 201));
    return this.#send({ method: "POST", path: `${runPath(run)}/rollback`, read, body: body({ why }) }, options.signal);
  }

  /** A run's rollback with every task, newest effect first, or `null` if the run is not rolled back. */
  rollbackStatus(run: string, options: CallOptions = {}): Promise<Rollback | null> {
    const read = (answer: Answer): Rollback | null => (isNotFound(answer) ? null : rollbackOf(expect(answer, 200)));
    return this.#send({ method: "GET", path: `${runPath(run)}/rollback`, read }, options.signal);
  }

  /**
   * Take the next compensation task of a run being rolled back, newest effect first: `acquired`
   * (hold it for `lease`, default the server's; run the compensation, then complete or fail the
   * task's `namespace` and `key` with its `fence`), `busy` (other workers hold the rest; ask
   * again after `retryAfter` seconds) or `done` (nothing is left). Throws {@link NotFound} if
   * the run is not being rolled back. The worker `runCompensations(client, run)` does all of it.
   */
  claimCompensation(run: string, options: { readonly lease?: Duration | undefined } & CallOptions = {}): Promise<CompensationClaimAnswer> {
    const read = (answer: Answer): CompensationClaimAnswer => compensationClaimOf(answer.status, expect(answer, 200, 201));
    const fields = { lease: optionalDuration(options.lease) };
    return this.#send({ method: "POST", path: `${runPath(run)}/compensations/claim`, read, body: body(fields) }, options.signal);
  }

  /**
   * Engage a kill switch (admin): claims under `target` are denied, replays included; with
   * `revokeLeases` the live leases it covers are revoked, so that their holders' later calls
   * answer stale. Engaging an engaged switch replaces its reason.
   */
  engageSwitch(target: SwitchTarget, reason: string, options: { readonly revokeLeases?: boolean } & TenantOption = {}): Promise<Switch> {
    const fields = { target: targetJson(target), reason, revoke_leases: options.revokeLeases ?? false, tenant: options.tenant };
    const read = (answer: Answer): Switch => switchOf(expect(answer, 200, 201));
    // revoking leases answers after a second pass 1.25 s later
    return this.#send({ method: "POST", path: "/v1/switches", read, body: body(fields), extraTime: 3 }, options.signal);
  }

  /** Release an engaged switch (admin); throws {@link NotFound} if none is. Not retried once sent. */
  releaseSwitch(target: SwitchTarget, options: { readonly why?: string } & TenantOption = {}): Promise<Switch> {
    const fields = { target: targetJson(target), why: options.why, tenant: options.tenant };
    const read = (answer: Answer): Switch => switchOf(expect(answer, 200));
    return this.#send({ method: "POST", path: "/v1/switches/release", read, body: body(fields), idempotent: false }, options.signal);
  }

  /** The engaged switches. */
  listSwitches(options: TenantOption = {}): Promise<Switch[]> {
    const read = (answer: Answer): Switch[] => (expect(answer, 200)["switches"] as Json[]).map(switchOf);
    return this.#send({ method: "GET", path: "/v1/switches", read, params: { tenant: options.tenant } }, options.signal);
  }

  /** Set (replace) the settings of the tenant, or of `namespacePrefix` (admin). */
  putSettings(settings: Settings, options: { readonly namespacePrefix?: string; readonly why?: string } & TenantOption = {}): Promise<SettingsEntry> {
    const fields = { namespace_prefix: options.namespacePrefix, settings: settingsJson(settings), why: options.why, tenant: options.tenant };
    const read = (answer: Answer): SettingsEntry => settingsEntryOf(expect(answer, 200, 201));
    return this.#send({ method: "PUT", path: "/v1/settings", read, body: body(fields) }, options.signal);
  }

  // -- approvals ---------------------------------------------------------------------------

  /** One page of your tenant's approvals, by id; see {@link iterApprovals} for all of them. */
  listApprovals(options: ApprovalFilter & { readonly limit?: number; readonly cursor?: string } & CallOptions = {}): Promise<ApprovalPage> {
    const params = { state: options.state, limit: options.limit, cursor: options.cursor };
    const read = (answer: Answer): ApprovalPage => {
      const value = expect(answer, 200);
      return { approvals: (value["approvals"] as Json[]).map(approvalOf), next: (value["next"] as string | null | undefined) ?? null };
    };
    return this.#send({ method: "GET", path: "/v1/approvals", read, params }, options.signal);
  }

  /** Every matching approval, by id, fetching pages through the cursor as it goes. */
  async *iterApprovals(options: ApprovalFilter & { readonly pageSize?: number } & CallOptions = {}): AsyncGenerator<Approval> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.listApprovals({ ...options, limit: options.pageSize ?? 100, ...(cursor ? { cursor } : {}) });
      yield* page.approvals;
      if (!page.next) return;
      cursor = page.next;
    }
  }

  /** One approval of your tenant, or `null` if none of that id is kept. */
  getApproval(id: string, options: CallOptions = {}): Promise<Approval | null> {
    const read = (answer: Answer): Approval | null => (isNotFound(answer) ? null : approvalOf(expect(answer, 200)));
    return this.#send({ method: "GET", path: approvalPath(id), read }, options.signal);
  }

  /**
   * Approve a pending approval (admin; audited with `why`, required): the next claim of its key
   * with its request acquires, once. Throws {@link NotFound} for an unknown id and
   * {@link ApprovalClosed} if it was decided already or expired. Not retried once sent.
   */
  approve(id: string, options: { readonly why: string } & CallOptions): Promise<Approval> {
    return this.#decide(id, "approve", options);
  }

  /**
   * Deny a pending approval (admin; audited with `why`, required): every claim of its key with
   * its request is then refused (`denied`, kind `approval`) while the decision is kept. Throws
   * as {@link approve}. Not retried once sent.
   */
  deny(id: string, options: { readonly why: string } & CallOptions): Promise<Approval> {
    return this.#decide(id, "deny", options);
  }

  /**
   * Mark a pending approval of a recovery done (admin; recovery policy `ask`; audited with
   * `why`): the unfinished attempt's effect happened; its key completes with `result` (JSON,
   * default `null`), marked reconciled, which every later call replays, and nothing runs again.
   * Throws as {@link approve}, and {@link InvalidRequest} for an approval of a call. Not retried
   * once sent.
   */
  reconcile(id: string, options: { readonly why: string; readonly result?: unknown } & CallOptions): Promise<Approval> {
    return this.#decide(id, "reconcile", options, { result: options.result ?? null });
  }

  #decide(
    id: string,
    decision: "approve" | "deny" | "reconcile",
    options: { readonly why: string } & CallOptions,
    extra: Json = {},
  ): Promise<Approval> {
    const read = (answer: Answer): Approval => approvalOf(expect(answer, 200));
    const payload = body({ why: options.why, ...extra });
    const call = { method: "POST", path: `${approvalPath(id)}/${decision}`, read, body: payload, idempotent: false };
    return this.#send(call, options.signal);
  }

  /**
   * Set (replace) a tripwire rule (admin): it engages a kill switch by itself when `symptom`
   * crosses its threshold over `window` (whole minutes, e.g. `"5m"`) on at least `minCalls`
   * calls. `per: "run"` counts each run apart and switches off the offending run. `action:
   * "observe"` (per namespace) turns the prefix to observe mode instead, over any canary in it,
   * until a person sets its settings again.
   */
  putTripwire(
    name: string,
    symptom: Symptom,
    options: {
      readonly window: Duration;
      readonly minCalls: number;
      readonly prefix?: string;
      readonly per?: "namespace" | "run";
      readonly action?: "switch" | "observe";
      readonly revokeLeases?: boolean;
      readonly rollback?: boolean;
      readonly autoReleaseAfter?: Duration;
      readonly why?: string;
    } & TenantOption,
  ): Promise<Tripwire> {
    const fields = {
      name,
      prefix: options.prefix,
      symptom,
      window: formatDuration(options.window),
      min_calls: options.minCalls,
      per: options.per ?? "namespace",
      // Sent only when given: a server of an earlier version knows no action.
      action: options.action,
      revoke_leases: options.revokeLeases ?? false,
      rollback: options.rollback ?? false,
      auto_release_after: optionalDuration(options.autoReleaseAfter),
      why: options.why,
      tenant: options.tenant,
    };
    const read = (answer: Answer): Tripwire => tripwireOf(expect(answer, 200));
    return this.#send({ method: "PUT", path: "/v1/tripwires", read, body: body(fields) }, options.signal);
  }

  /** The tenant's tripwire rules, by name (admin). */
  listTripwires(options: TenantOption = {}): Promise<Tripwire[]> {
    const read = (answer: Answer): Tripwire[] => (expect(answer, 200)["tripwires"] as Json[]).map(tripwireOf);
    return this.#send({ method: "GET", path: "/v1/tripwires", read, params: { tenant: options.tenant } }, options.signal);
  }

  /** Delete a tripwire rule (admin); a switch it engaged stays. Throws {@link NotFound} if none. Not retried once sent. */
  deleteTripwire(name: string, options: { readonly why?: string } & TenantOption = {}): Promise<Tripwire> {
    const params = { name, why: options.why, tenant: options.tenant };
    const read = (answer: Answer): Tripwire => tripwireOf(expect(answer, 200));
    return this.#send({ method: "DELETE", path: "/v1/tripwires", read, params, idempotent: false }, options.signal);
  }

  /** The tenant's settings, its own entry first (admin). */
  listSettings(options: TenantOption = {}): Promise<SettingsEntry[]> {
    const read = (answer: Answer): SettingsEntry[] => (expect(answer, 200)["settings"] as Json[]).map(settingsEntryOf);
    return this.#send({ method: "GET", path: "/v1/settings", read, params: { tenant: options.tenant } }, options.signal);
  }

  /** Delete settings (admin): what they set is inherited again. Throws {@link NotFound} if none. */
  deleteSettings(options: { readonly namespacePrefix?: string; readonly why?: string } & TenantOption = {}): Promise<SettingsEntry> {
    const params = { namespace_prefix: options.namespacePrefix, why: options.why, tenant: options.tenant };
    const read = (answer: Answer): SettingsEntry => settingsEntryOf(expect(answer, 200));
    return this.#send({ method: "DELETE", path: "/v1/settings", read, params }, options.signal);
  }

  /** One page of the audit log (admin), newest first. */
  listAudit(options: AuditFilter & { readonly limit?: number; readonly cursor?: string } & CallOptions = {}): Promise<AuditPage> {
    const params = { action: options.action, actor: options.actor, limit: options.limit, cursor: options.cursor, tenant: options.tenant };
    const read = (answer: Answer): AuditPage => {
      const value = expect(answer, 200);
      return { entries: (value["entries"] as Json[]).map(auditEntryOf), next: (value["next"] as string | null | undefined) ?? null };
    };
    return this.#send({ method: "GET", path: "/v1/audit", read, params }, options.signal);
  }

  /** Every matching audit entry, newest first, through the cursor. */
  async *iterAudit(options: AuditFilter & { readonly pageSize?: number } & CallOptions = {}): AsyncGenerator<AuditEntry> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.listAudit({ ...options, limit: options.pageSize ?? 100, ...(cursor ? { cursor } : {}) });
      yield* page.entries;
      if (!page.next) return;
      cursor = page.next;
    }
  }

  // -- tenants and API keys ----------------------------------------------------------------

  /** Create an API key (admin); its `token` is in this answer only. Not retried once sent. */
  createApiKey(role: "agent" | "admin", options: { readonly label?: string } & TenantOption = {}): Promise<ApiKey> {
    const fields = { role, label: options.label ?? "", tenant: options.tenant };
    const read = (answer: Answer): ApiKey => apiKeyOf(expect(answer, 200, 201));
    return this.#send({ method: "POST", path: "/v1/api-keys", read, body: body(fields), idempotent: false }, options.signal);
  }

  /** Your tenant's API keys, never their secrets (admin). */
  listApiKeys(options: CallOptions = {}): Promise<ApiKey[]> {
    const read = (answer: Answer): ApiKey[] => (parseList(answer) as Json[]).map(apiKeyOf);
    return this.#send({ method: "GET", path: "/v1/api-keys", read }, options.signal);
  }

  /** Revoke an API key (admin). */
  revokeApiKey(id: string, options: CallOptions = {}): Promise<void> {
    return this.#send({ method: "DELETE", path: "/v1/api-keys/" + encodeURIComponent(id), read: readNothing }, options.signal);
  }

  /** Create a tenant (an admin of the operator tenant). Not retried once sent. */
  createTenant(id: string, options: CallOptions = {}): Promise<Tenant> {
    const read = (answer: Answer): Tenant => tenantOf(expect(answer, 200, 201));
    return this.#send({ method: "POST", path: "/v1/tenants", read, body: body({ id }), idempotent: false }, options.signal);
  }

  /** Every tenant (an admin of the operator tenant). */
  listTenants(options: CallOptions = {}): Promise<Tenant[]> {
    const read = (answer: Answer): Tenant[] => (parseList(answer) as Json[]).map(tenantOf);
    return this.#send({ method: "GET", path: "/v1/tenants", read }, options.signal);
  }

  /** Whether the server answers and its store is reachable (`/readyz`); no retries. */
  async ready(options: CallOptions = {}): Promise<boolean> {
    try {
      return await this.#send({ method: "GET", path: "/readyz", read: (answer) => answer.status === 200 }, options.signal, NO_RETRY);
    } catch (error) {
      if (error instanceof TransportError) return false;
      throw error;
    }
  }
}

function parseList(answer: Answer): unknown[] {
  if (answer.status !== 200) throw errorOf(answer);
  const value = parse(answer);
  if (!Array.isArray(value)) throw new UnexpectedResponse(answer.status, answer.text);
  return value;
}

/** A try that took longer than the client's timeout. */
export class TimeoutError extends Error {
  constructor(seconds: number) {
    super(`no answer within ${seconds}s`);
    this.name = "TimeoutError";
  }
}

