/**
 * The typed answers of the API.
 *
 * A claim answers exactly one of {@link Acquired}, {@link Replay}, {@link InFlight},
 * {@link Mismatch}, {@link Denied}, where the namespace needs a person's approval
 * {@link PendingApproval}, or, where it is in observe mode, {@link Proceed} (the union
 * {@link ClaimAnswer}), told apart by `outcome`:
 *
 * ```ts
 * const answer = await client.claim("prod/payments-agent", "refund-1234", { request: args });
 * switch (answer.outcome) {
 *   case "acquired": ... // do the effect, then client.complete(..., answer.fence, result)
 *   case "replay":   ... // answer.result: the stored outcome
 *   case "in_flight": ... // retry after answer.retryAfter seconds
 *   case "mismatch": ... // the key was used with another request
 *   case "denied":   ... // a switch, budget, quota or approver refused it (answer.kind)
 *   case "pending_approval": ... // a person must approve answer.approval first; claim again later
 *   case "proceed":  ... // observe mode: run the effect; nothing is held (answer.wouldHaveBeen)
 * }
 * ```
 *
 * A fenced call (complete, fail, extend, checkpoint, report-unknown) answers {@link Applied}
 * with the record as it now is, or {@link Stale} when the fence is no longer the holder's.
 *
 * A run being rolled back shows its {@link Rollback}; a worker's claim of one of its
 * compensation tasks answers {@link AcquiredCompensation}, {@link CompensationsBusy} or
 * {@link CompensationsDone} (the union {@link CompensationClaimAnswer}).
 *
 * Durations in answers are seconds; times are `Date`s.
 *
 * @module
 */

import { ResultNotKeptError, StaleFence } from "./errors.js";
import { fromBase64, parseOptionalTime, parseTime, utf8, type Duration } from "./wire.js";

type Json = Record<string, unknown>;

const JSON_MEDIA_TYPE = "application/json";

function isJsonMedia(contentType: string): boolean {
  return (contentType.split(";")[0] ?? "").trim().toLowerCase() === JSON_MEDIA_TYPE;
}

function int(value: unknown): number {
  return Number(value);
}

function optionalInt(value: unknown): number | null {
  return value === null || value === undefined ? null : Number(value);
}

function optionalString(value: unknown): string | null {
  return value === null || value === undefined ? null : String(value);
}

/** A recovery point saved by an attempt. */
export interface Checkpoint {
  readonly name: string;
  readonly data: unknown;
  /** The fence of the attempt that saved it. */
  readonly fence: number;
  readonly at: Date;
}

function checkpointOf(d: Json): Checkpoint {
  return { name: String(d["name"]), data: d["data"] ?? null, fence: int(d["fence"]), at: parseTime(d["at"]) };
}

/** Why an acquired claim is a recovery: an earlier attempt may have done part of the work. */
export interface Recovery {
  readonly previousFence: number;
  readonly previousAttempt: number;
  /** `lease_expired` or `reported_unknown`. */
  readonly reason: "lease_expired" | "reported_unknown" | (string & {});
  /** What the previous holder reported, for `reported_unknown`. */
  readonly detail: string | null;
  /** The last checkpoint the previous attempts saved, if any. */
  readonly lastCheckpoint: Checkpoint | null;
}

function recoveryOf(d: Json): Recovery {
  const cp = d["last_checkpoint"];
  return {
    previousFence: int(d["previous_fence"]),
    previousAttempt: int(d["previous_attempt"]),
    reason: String(d["reason"]),
    detail: optionalString(d["detail"]),
    lastCheckpoint: cp ? checkpointOf(cp as Json) : null,
  };
}

/** `201 acquired`: you hold the key. Do the effect, then complete or fail with `fence`. */
export interface Acquired {
  readonly outcome: "acquired";
  readonly fence: number;
  readonly attempt: number;
  readonly leaseExpiresAt: Date;
  /** Set when an earlier attempt may have done part of the work. */
  readonly recovery: Recovery | null;
}

export function acquiredOf(d: Json): Acquired {
  const rec = d["recovery"];
  return {
    outcome: "acquired",
    fence: int(d["fence"]),
    attempt: int(d["attempt"]),
    leaseExpiresAt: parseTime(d["lease_expires_at"]),
    recovery: rec ? recoveryOf(rec as Json) : null,
  };
}

/**
 * What a namespace that keeps a digest only (`outcome_kept: digest` in its settings) keeps of
 * an outcome, in place of its bytes.
 */
export interface ResultDigest {
  /** The size of the outcome's bytes. */
  readonly size: number;
  /** The SHA-256 of the outcome's bytes, in lowercase hex. */
  readonly sha256: string;
}

/** An outcome as stored: `raw` is its bytes exactly as given at completion. */
export interface StoredOutcome {
  /** `success`, or `failure` for a stored permanent failure. */
  readonly status: "success" | "failure" | (string & {});
  readonly contentType: string;
  /** The outcome's bytes exactly as given at completion (empty where only `digest` is kept). */
  readonly raw: Uint8Array;
  /**
   * The outcome: the decoded JSON for `application/json`, else the raw bytes. Where only a
   * `digest` is kept, reading it throws {@link ResultNotKeptError} (and it is left out of
   * copies and of `JSON.stringify`, as it is of the server's answer).
   */
  readonly result: unknown;
  /** Cost units (money) reported at completion: what a replay saved. */
  readonly cost: number | null;
  /** Model tokens reported at completion: what a replay saved. */
  readonly tokens: number | null;
  /**
   * The size and SHA-256 of the outcome, where its namespace keeps a digest only (then there
   * are no bytes); `null` where the outcome is kept.
   */
  readonly digest: ResultDigest | null;
  /**
   * Whether a recovering attempt stored it from what the downstream system said had happened,
   * without running the effect again (a completion with `reconciled: true`).
   */
  readonly reconciled: boolean;
}

/**
 * `head` (a new object, which this completes) with the stored outcome in `d`: its bytes and
 * value (`text`: the JSON result as sent). Built with `Object.assign`: Node 20 copies an object
 * spread into a literal with more members on a slow path, about 5 µs, a replay's largest piece
 * of work in this file.
 */
function storedOf<T extends object>(head: T, d: Json, text: string | undefined): T & StoredOutcome {
  const status = String(d["status"]);
  const contentType = String(d["content_type"]);
  const spent = { cost: optionalInt(d["cost"]), tokens: optionalInt(d["tokens"]), reconciled: d["reconciled"] === true };
  const kept = d["result_digest"] as Json | null | undefined;
  if (kept !== null && typeof kept === "object") {
    // A namespace that keeps a digest only: no bytes, no `result`.
    const digest: ResultDigest = { size: int(kept["size"]), sha256: String(kept["sha256"]) };
    const out = Object.assign(head, { status, contentType, raw: new Uint8Array(0) }, spent, { digest });
    return Object.defineProperty(out, "result", {
      get: (): never => {
        throw new ResultNotKeptError(digest, status);
      },
      enumerable: false,
    }) as T & StoredOutcome;
  }
  let raw: Uint8Array;
  if (typeof d["result_base64"] === "string") raw = fromBase64(d["result_base64"]);
  else raw = utf8(text ?? JSON.stringify(d["result"] ?? null));
  let result: unknown = raw;
  if (isJsonMedia(contentType)) result = "result" in d ? d["result"] : JSON.parse(new TextDecoder().decode(raw));
  return Object.assign(head, { status, contentType, raw, result }, spent, { digest: null });
}

/**
 * `200 replay`: the key completed; its stored outcome, byte for byte, or only its `digest`
 * where its namespace keeps no more.
 */
export interface Replay extends StoredOutcome {
  readonly outcome: "replay";
  /** The fence of the attempt that completed it. */
  readonly fence: number;
  readonly attempt: number;
  readonly completedAt: Date;
}

export function replayOf(d: Json, text: string | undefined): Replay {
  const head = {
    outcome: "replay",
    fence: int(d["fence"]),
    attempt: int(d["attempt"]),
    completedAt: parseTime(d["completed_at"]),
  } as const;
  return storedOf(head, d, text);
}

/** `409 in-flight`: someone holds a live lease; retry after `retryAfter` seconds. */
export interface InFlight {
  readonly outcome: "in_flight";
  /** Seconds left on the holder's lease. */
  readonly retryAfter: number;
  /** The holder's attempt, when the server says. */
  readonly attempt: number | null;
  readonly detail: string;
}

/** `422 fingerprint-mismatch`: the key was used with a different request; nothing changed. */
export interface Mismatch {
  readonly outcome: "mismatch";
  readonly detail: string;
}

/**
 * What refused a claim: a kill switch, a run's budget, the tenant's quota, a person who denied
 * the call's approval, or the recovery policy (`recovery`: the key's last attempt did not finish
 * and may have run; the namespace's policy is `verify` and the claim did not say it verifies).
 */
export type DeniedKind = "switch" | "budget" | "quota" | "approval" | "recovery";

/** The denial kind of each problem kind. */
export const DENIED_KINDS: Readonly<Record<string, DeniedKind>> = {
  "switch-engaged": "switch",
  "budget-exhausted": "budget",
  "quota-exceeded": "quota",
  "approval-denied": "approval",
  "recovery-needs-verify": "recovery",
};

/**
 * `423 / 429 / 403 denied`: a kill switch, a run's budget, the tenant's quota, or an approver
 * (`approval`, 403: every claim of the key with that request is refused while the decision is
 * kept) refused the claim; nothing was written and nothing charged.
 */
export interface Denied {
  readonly outcome: "denied";
  readonly kind: DeniedKind;
  /**
   * The server's reason, e.g. `{"reason": "switch_engaged", "target": "…", "why": "…"}`,
   * `{"reason": "budget_exhausted", "limit": "effects"}` or `{"reason": "quota_exceeded",
   * "quota": "rate", …}` or `{"reason": "approval_denied", "approval": "apr_…", "by": "…", "why":
   * "…"}`.
   */
  readonly reason: Readonly<Record<string, unknown>>;
  /** Seconds until a retry may succeed (quotas); `null` otherwise. */
  readonly retryAfter: number | null;
  readonly detail: string;
  /** Whether the same claim may succeed later (a quota refills, a switch is released). */
  readonly retryable: boolean;
}

/** A person's decision on an {@link Approval}. */
export interface ApprovalDecision {
  /** `true` approved, `false` denied. */
  readonly approved: boolean;
  /** Who decided: an admin API key id, or `cli:<user>`. */
  readonly by: string;
  /** Why, in the approver's words. */
  readonly why: string;
  readonly at: Date;
  /** Of a recovery: marked done (reconciled) rather than failed. */
  readonly reconciled: boolean;
  /** Of a recovery marked done: the result its key completed with. */
  readonly result: unknown;
}

/**
 * What a claim asked a person to approve: this key with this fingerprint (only a claim of the
 * same request is approved).
 */
export interface Approval {
  /** `apr_…`: what an admin approves or denies. */
  readonly id: string;
  /**
   * `pending`, `approved`, `denied`, `reconciled` (a recovery marked done), or `expired` (nobody
   * decided before `expiresAt`).
   */
  readonly state: "pending" | "approved" | "denied" | "reconciled" | "expired" | (string & {});
  readonly namespace: string;
  readonly key: string;
  /** The fingerprint of the request to approve. */
  readonly fingerprint: string;
  /** The run the claim named. */
  readonly run: string | null;
  /** The cost units the claim declared. */
  readonly cost: number | null;
  /** What the caller said the call does (the claim's `summary`). */
  readonly summary: string | null;
  /** When the first claim asked. */
  readonly requestedAt: Date;
  /** Decide before this; after it, undecided, the next claim asks again. */
  readonly expiresAt: Date;
  /** The decision, once taken. */
  readonly decision: ApprovalDecision | null;
  /**
   * Set on an approval of a recovery (recovery policy `ask`): the attempt that did not finish.
   * Approve to re-run it once, deny to store it as failed, or `reconcile` to mark it done.
   */
  readonly recovery: RecoveryAsk | null;
}

/** The attempt an approval of a recovery asks about. */
export interface RecoveryAsk {
  /** The fence of the attempt that did not finish. */
  readonly previousFence: number;
  /** Its attempt number. */
  readonly previousAttempt: number;
  /** `lease_expired` or `reported_unknown`. */
  readonly reason: string;
  /** What its holder reported, for `reported_unknown`. */
  readonly unknownDetail: string | null;
  /** The name of its last checkpoint (the data is the record's). */
  readonly lastCheckpoint: string | null;
}

export function approvalOf(d: Json): Approval {
  const decision = d["decision"] as Json | null | undefined;
  return {
    id: String(d["id"]),
    state: String(d["state"]),
    namespace: String(d["namespace"]),
    key: String(d["key"]),
    fingerprint: String(d["fingerprint"]),
    run: optionalString(d["run"]),
    cost: optionalInt(d["cost"]),
    summary: optionalString(d["summary"]),
    requestedAt: parseTime(d["requested_at"]),
    expiresAt: parseTime(d["expires_at"]),
    decision:
      decision !== null && typeof decision === "object"
        ? {
            approved: Boolean(decision["approved"]),
            by: String(decision["by"] ?? ""),
            why: String(decision["why"] ?? ""),
            at: parseTime(decision["at"]),
            reconciled: decision["reconciled"] === true,
            result: decision["result"] ?? null,
          }
        : null,
    recovery: recoveryAskOf(d["recovery"]),
  };
}

function recoveryAskOf(d: unknown): RecoveryAsk | null {
  if (d === null || typeof d !== "object") return null;
  const r = d as Json;
  return {
    previousFence: int(r["previous_fence"]),
    previousAttempt: int(r["previous_attempt"]),
    reason: String(r["reason"] ?? ""),
    unknownDetail: optionalString(r["unknown_detail"]),
    lastCheckpoint: optionalString(r["last_checkpoint"]),
  };
}

/**
 * `202 pending_approval`: the key needs a person's approval, which nobody has given yet.
 * Nothing was acquired or charged. Claim again (the same key and request) once it is decided,
 * or with a `wait`, which waits for the decision.
 */
export interface PendingApproval {
  readonly outcome: "pending_approval";
  /** Seconds until it is worth claiming again. */
  readonly retryAfter: number;
  /** What is to be approved (its `id`, for an admin to approve or deny). */
  readonly approval: Approval;
}

export function pendingApprovalOf(d: Json): PendingApproval {
  return {
    outcome: "pending_approval",
    retryAfter: int(d["retry_after_ms"] ?? 0) / 1000,
    approval: approvalOf((d["approval"] ?? {}) as Json),
  };
}

/** A page of approvals, by id; pass `next` as `cursor` for the next page (`null` on the last). */
export interface ApprovalPage {
  readonly approvals: readonly Approval[];
  readonly next: string | null;
}

/** What enforcement would have answered a claim that observe mode let proceed. */
export type WouldHaveBeen = "replay" | "in_flight" | "mismatch" | "denied" | "pending_approval";

/**
 * `200 proceed`, in a namespace in observe mode (`mode: "observe"` in its settings): the claim
 * was decided and recorded as in enforce mode, but enforcement would not have let the caller
 * run (`wouldHaveBeen`), and observe mode lets it. Run the effect. Nothing is held: there is no
 * fence and no lease, so there is nothing to complete, fail, checkpoint or extend, and no
 * outcome is stored. A claim that acquires in observe mode answers {@link Acquired}, as ever.
 */
export interface Proceed {
  readonly outcome: "proceed";
  readonly mode: "observe" | (string & {});
  /** What enforcement would have answered: `replay`, `in_flight`, `mismatch`, `denied` or `pending_approval`. */
  readonly wouldHaveBeen: WouldHaveBeen | (string & {});
  /** Why, for `denied` (e.g. "the run's budget is spent (effects)"); `null` otherwise. */
  readonly reason: string | null;
}

/** What enforcement may have answered where observe mode says `proceed`. */
const WOULD_HAVE_BEEN: ReadonlySet<unknown> = new Set(["replay", "in_flight", "mismatch", "denied", "pending_approval"]);

/** Whether a claim's 200 answer `d` says `proceed` (else it is a replay). */
export function isProceed(d: unknown): boolean {
  return d !== null && typeof d === "object" && (d as Json)["outcome"] === "proceed";
}

/**
 * Whether a `proceed` answer is well formed: observe mode, naming a known would-be outcome.
 * Only such an answer lets a call run holding nothing; any other is refused, never run.
 */
export function isWellFormedProceed(d: Json): boolean {
  return d["mode"] === "observe" && WOULD_HAVE_BEEN.has(d["would_have_been"]);
}

export function proceedOf(d: Json): Proceed {
  return {
    outcome: "proceed",
    mode: String(d["mode"] ?? "observe"),
    wouldHaveBeen: String(d["would_have_been"]),
    reason: optionalString(d["reason"]),
  };
}

/** The one answer of a claim. */
export type ClaimAnswer = Acquired | Replay | InFlight | Mismatch | Denied | PendingApproval | Proceed;

/** A key's record as the API shows it. */
export interface KeyRecord {
  readonly namespace: string;
  readonly key: string;
  /** `in_progress`, `completed` or `released`. */
  readonly state: "in_progress" | "completed" | "released" | (string & {});
  /** In progress with no live lease: the next claim is a recovery. */
  readonly stuck: boolean;
  readonly fingerprint: string;
  readonly fence: number;
  readonly attempt: number;
  readonly run: string | null;
  readonly leaseExpiresAt: Date | null;
  /** What the holder reported when it did not know the outcome. */
  readonly unknown: string | null;
  /**
   * Whether its outcome was reconciled: a recovering attempt completed it from what the
   * downstream system said had happened, without running the effect again.
   */
  readonly reconciled: boolean;
  readonly completedAt: Date | null;
  readonly createdAt: Date;
  readonly updatedAt: Date;
  /** When the record stops existing; `null` while in progress. */
  readonly expiresAt: Date | null;
  /** Recovery points, oldest first. */
  readonly checkpoints: readonly Checkpoint[];
  /** The stored outcome (only from {@link Client.getRecord}). */
  readonly stored: StoredOutcome | null;
}


export function recordOf(d: Json, storedText?: string): KeyRecord {
  const stored = d["stored"];
  return {
    namespace: String(d["namespace"]),
    key: String(d["key"]),
    state: String(d["state"]),
    stuck: Boolean(d["stuck"]),
    fingerprint: String(d["fingerprint"]),
    fence: int(d["fence"]),
    attempt: int(d["attempt"]),
    run: optionalString(d["run"]),
    leaseExpiresAt: parseOptionalTime(d["lease_expires_at"]),
    unknown: optionalString(d["unknown"]),
    reconciled: d["reconciled"] === true,
    completedAt: parseOptionalTime(d["completed_at"]),
    createdAt: parseTime(d["created_at"]),
    updatedAt: parseTime(d["updated_at"]),
    expiresAt: parseOptionalTime(d["expires_at"]),
    checkpoints: Array.isArray(d["checkpoints"]) ? (d["checkpoints"] as Json[]).map(checkpointOf) : [],
    stored: stored ? storedOf({}, stored as Json, storedText) : null,
  };
}

/** A fenced call took effect: the record as it now is. */
export interface Applied {
  readonly outcome: "applied";
  readonly record: KeyRecord;
}

/** Why a fenced call changed nothing. */
export type StaleReason = "superseded" | "no_record" | "finished" | (string & {});

/**
 * A fenced call changed nothing: the fence is not the current holder's. `superseded`: another
 * claim took the key over (your lease passed, or a switch revoked it); `no_record`: no live
 * record; `finished`: your attempt already finished differently. A result you tried to store
 * is **not** stored.
 */
export interface Stale {
  readonly outcome: "stale";
  readonly reason: StaleReason;
  readonly detail: string;
}

/** The answer of a fenced call. */
export type FencedAnswer = Applied | Stale;

/** The record of an `applied` answer; throws {@link StaleFence} for a `stale` one. */
export function applied(answer: FencedAnswer): KeyRecord {
  if (answer.outcome === "stale") throw StaleFence.of(answer);
  return answer.record;
}

/** A page of records; pass `next` as `cursor` for the next page (`null` on the last). */
export interface RecordPage {
  readonly records: readonly KeyRecord[];
  readonly next: string | null;
}

/** An API key; `token` only in the answer that created it. */
export interface ApiKey {
  readonly id: string;
  readonly tenant: string;
  readonly role: "agent" | "admin" | (string & {});
  readonly label: string;
  readonly createdAt: Date;
  readonly revokedAt: Date | null;
  readonly token: string | null;
}

export function apiKeyOf(d: Json): ApiKey {
  return {
    id: String(d["id"]),
    tenant: String(d["tenant"]),
    role: String(d["role"]),
    label: String(d["label"] ?? ""),
    createdAt: parseTime(d["created_at"]),
    revokedAt: parseOptionalTime(d["revoked_at"]),
    token: optionalString(d["token"]),
  };
}

/** A tenant. */
export interface Tenant {
  readonly id: string;
  readonly createdAt: Date;
}

export function tenantOf(d: Json): Tenant {
  return { id: String(d["id"]), createdAt: parseTime(d["created_at"]) };
}

/**
 * How to undo an effect, registered with its completion: a name a worker knows and JSON data
 * (at most 16 KiB serialized). Never code nor an address: Onceguard calls nothing itself.
 */
export interface Compensation {
  /** 1 to 128 printable ASCII characters, e.g. `refund-charge`. */
  readonly name: string;
  /** What the undo needs, e.g. `{"charge": "ch_1"}` (`null` if none). */
  readonly data: unknown;
}

function compensationOf(d: unknown): Compensation {
  const c = (d ?? {}) as Json;
  return { name: String(c["name"] ?? ""), data: c["data"] ?? null };
}

/** The completed effect a compensation task undoes. */
export interface Effect {
  readonly namespace: string;
  readonly key: string;
  /** The fence of the attempt that completed it. */
  readonly fence: number;
  readonly completedAt: Date | null;
}

function effectOf(d: unknown): Effect {
  const e = (d ?? {}) as Json;
  return {
    namespace: String(e["namespace"]),
    key: String(e["key"]),
    fence: int(e["fence"]),
    completedAt: parseOptionalTime(e["completed_at"]),
  };
}

/** Where a compensation task is: `pending`, `in_progress`, `compensated` or `failed` (permanently: kept, shown, never retried). */
export type CompensationState = "pending" | "in_progress" | "compensated" | "failed" | (string & {});

/** One compensable effect of a run being rolled back, and its compensation's progress. */
export interface CompensationTask {
  /** The task's own key (under `<effect namespace>/_undo`), which a worker claims and completes. */
  readonly namespace: string;
  readonly key: string;
  readonly effect: Effect;
  readonly compensation: Compensation;
  readonly state: CompensationState;
  /** How many times a worker took it. */
  readonly attempt: number;
}

function compensationTaskOf(d: Json): CompensationTask {
  return {
    namespace: String(d["namespace"]),
    key: String(d["key"]),
    effect: effectOf(d["effect"]),
    compensation: compensationOf(d["compensation"]),
    state: String(d["state"]),
    attempt: int(d["attempt"] ?? 0),
  };
}

/** A rollback's counts, as a {@link Run} shows them. */
export interface RollbackProgress {
  readonly run: string;
  /** Why it was rolled back, in the admin's words. */
  readonly why: string;
  /** The id of the API key that started it. */
  readonly startedBy: string | null;
  readonly startedAt: Date | null;
  /** The run's completed successful effects. */
  readonly effects: number;
  /** Effects whose compensation completed. */
  readonly compensated: number;
  /** Tasks a worker holds, or held until its lease passed (the next worker recovers them). */
  readonly inProgress: number;
  /** Tasks not started yet, or released after a retryable failure. */
  readonly pending: number;
  /** Tasks whose compensation failed permanently: kept, shown, never retried. */
  readonly failed: number;
  /** Completed effects that registered no compensation. */
  readonly notCompensable: number;
  /** Keys of the run still in progress: whether their effects happened is unknown. */
  readonly effectsInFlight: number;
  /** No task is pending or in progress. */
  readonly done: boolean;
}

/** A run's rollback: its counts and every compensable effect's task, newest effect first. */
export interface Rollback extends RollbackProgress {
  readonly tasks: readonly CompensationTask[];
}

function rollbackProgressOf(d: Json): RollbackProgress {
  return {
    run: String(d["run"]),
    why: String(d["why"] ?? ""),
    startedBy: optionalString(d["started_by"]),
    startedAt: parseOptionalTime(d["started_at"]),
    effects: int(d["effects"] ?? 0),
    compensated: int(d["compensated"] ?? 0),
    inProgress: int(d["in_progress"] ?? 0),
    pending: int(d["pending"] ?? 0),
    failed: int(d["failed"] ?? 0),
    notCompensable: int(d["not_compensable"] ?? 0),
    effectsInFlight: int(d["effects_in_flight"] ?? 0),
    done: d["done"] === true,
  };
}

export function rollbackOf(d: Json): Rollback {
  const tasks = d["tasks"];
  return { ...rollbackProgressOf(d), tasks: Array.isArray(tasks) ? (tasks as Json[]).map(compensationTaskOf) : [] };
}

/**
 * `201 acquired`: a worker holds a compensation task, exactly as an acquired claim of the
 * task's own `namespace` and `key`: run the compensation, then complete (or fail) the task
 * with `fence`. A `recovery` says an earlier worker took it and did not finish.
 */
export interface AcquiredCompensation extends Acquired {
  /** The task's own key, for the fenced calls. */
  readonly namespace: string;
  readonly key: string;
  /** The effect to undo. */
  readonly effect: Effect;
  /** How: the name a handler is found by, and its data. */
  readonly compensation: Compensation;
}

/** `200 busy`: nothing to take now, other workers hold the rest; ask again after `retryAfter` seconds. */
export interface CompensationsBusy {
  readonly outcome: "busy";
  /** Seconds to wait before asking again. */
  readonly retryAfter: number;
  /** Tasks other workers hold. */
  readonly inProgress: number;
}

/** `200 done`: nothing is left to run; the rollback's totals. */
export interface CompensationsDone {
  readonly outcome: "done";
  readonly compensated: number;
  readonly failed: number;
}

/** The answer of a worker's claim of a compensation task. */
export type CompensationClaimAnswer = AcquiredCompensation | CompensationsBusy | CompensationsDone;

export function compensationClaimOf(status: number, d: Json): CompensationClaimAnswer {
  if (status === 201) {
    return {
      ...acquiredOf(d),
      namespace: String(d["namespace"]),
      key: String(d["key"]),
      effect: effectOf(d["effect"]),
      compensation: compensationOf(d["compensation"]),
    };
  }
  if (d["outcome"] === "busy") {
    return { outcome: "busy", retryAfter: int(d["retry_after_ms"] ?? 0) / 1000, inProgress: int(d["in_progress"] ?? 0) };
  }
  return { outcome: "done", compensated: int(d["compensated"] ?? 0), failed: int(d["failed"] ?? 0) };
}

/** A run's limits; `null` means unlimited. */
export interface Budget {
  readonly maxEffects: number | null;
  readonly maxCost: number | null;
  readonly deadline: Date | null;
}

/** What a run has spent: acquired effects (each key once) and cost units. */
export interface Usage {
  readonly effects: number;
  readonly cost: number;
}

/** A run with its budget and usage. */
export interface Run {
  readonly run: string;
  readonly budget: Budget;
  readonly usage: Usage;
  /** Its rollback's progress (without the tasks) while it is rolled back; `null` otherwise. */
  readonly rollback: RollbackProgress | null;
  readonly createdAt: Date | null;
  readonly updatedAt: Date | null;
}

export function runOf(d: Json): Run {
  const b = (d["budget"] ?? {}) as Json;
  const u = (d["usage"] ?? {}) as Json;
  const rollback = d["rollback"] as Json | null | undefined;
  return {
    run: String(d["run"]),
    budget: {
      maxEffects: optionalInt(b["max_effects"]),
      maxCost: optionalInt(b["max_cost"]),
      deadline: parseOptionalTime(b["deadline"]),
    },
    usage: { effects: int(u["effects"] ?? 0), cost: int(u["cost"] ?? 0) },
    rollback: rollback !== null && typeof rollback === "object" ? rollbackProgressOf(rollback) : null,
    createdAt: parseOptionalTime(d["created_at"]),
    updatedAt: parseOptionalTime(d["updated_at"]),
  };
}

/** What a kill switch covers: the whole tenant, a namespace prefix (and below), or one run. */
export type SwitchTarget =
  | { readonly kind: "tenant" }
  | { readonly kind: "namespace"; readonly prefix: string }
  | { readonly kind: "run"; readonly run: string };

/** An engaged (or just released) kill switch. */
export interface Switch {
  readonly target: SwitchTarget;
  readonly reason: string;
  readonly revokeLeases: boolean;
  /** How many live leases were revoked when it was engaged. */
  readonly revoked: number;
  /** The id of the API key that engaged it (`tripwire:<rule>` for a tripwire's). */
  readonly engagedBy: string | null;
  readonly engagedAt: Date | null;
  /** The tripwire that engaged it and its figures; `null` for a person's. */
  readonly tripwire: Trip | null;
}

/** What a tripwire tripped on: the figures across instances over its window. */
export interface Trip {
  readonly rule: string;
  /** The run whose calls crossed the threshold (a rule counted per run). */
  readonly run: string | null;
  readonly calls: number;
  /** The bad calls among them (or the units spent). */
  readonly bad: number;
  readonly windowSecs: number;
  /** When the switch is released by itself; `null`: by a person. */
  readonly releaseAt: Date | null;
}

/** What a tripwire counts, and its threshold (as the API spells it). */
export type Symptom =
  | { readonly kind: "failure_rate"; readonly above: number }
  | { readonly kind: "latency"; readonly quantile: number; readonly above_ms: number }
  | { readonly kind: "spend"; readonly unit: "cost" | "tokens"; readonly per_minute: number }
  | { readonly kind: "mismatches"; readonly per_minute: number };

/** A tripwire rule: it engages a kill switch by itself when its symptom crosses the threshold. */
export interface Tripwire {
  readonly name: string;
  /** The namespace prefix it watches; `null`: the whole tenant. */
  readonly prefix: string | null;
  readonly symptom: Symptom;
  readonly window: string;
  readonly minCalls: number;
  readonly per: "namespace" | "run";
  /** `switch`: engage a kill switch; `observe`: turn the prefix to observe mode. */
  readonly action: "switch" | "observe";
  readonly revokeLeases: boolean;
  readonly rollback: boolean;
  readonly autoReleaseAfter: string | null;
  readonly setBy: string | null;
  readonly setAt: Date | null;
}

function tripOf(d: unknown): Trip | null {
  if (d === null || typeof d !== "object") return null;
  const t = d as Json;
  return {
    rule: String(t["rule"] ?? ""),
    run: optionalString(t["run"]),
    calls: int(t["calls"] ?? 0),
    bad: int(t["bad"] ?? 0),
    windowSecs: int(t["window_secs"] ?? 0),
    releaseAt: parseOptionalTime(t["release_at"]),
  };
}

export function tripwireOf(d: Json): Tripwire {
  return {
    name: String(d["name"] ?? ""),
    prefix: optionalString(d["prefix"]),
    symptom: (d["symptom"] ?? { kind: "failure_rate", above: 0 }) as Symptom,
    window: String(d["window"] ?? ""),
    minCalls: int(d["min_calls"] ?? 0),
    per: d["per"] === "run" ? "run" : "namespace",
    action: d["action"] === "observe" ? "observe" : "switch",
    revokeLeases: Boolean(d["revoke_leases"]),
    rollback: Boolean(d["rollback"]),
    autoReleaseAfter: optionalString(d["auto_release_after"]),
    setBy: optionalString(d["set_by"]),
    setAt: parseOptionalTime(d["set_at"]),
  };
}

function targetOf(d: unknown): SwitchTarget {
  const t = (d ?? {}) as Json;
  if (t["kind"] === "namespace") return { kind: "namespace", prefix: String(t["prefix"]) };
  if (t["kind"] === "run") return { kind: "run", run: String(t["run"]) };
  return { kind: "tenant" };
}

export function switchOf(d: Json): Switch {
  return {
    target: targetOf(d["target"]),
    reason: String(d["reason"] ?? ""),
    revokeLeases: Boolean(d["revoke_leases"]),
    revoked: int(d["revoked"] ?? 0),
    engagedBy: optionalString(d["engaged_by"]),
    engagedAt: parseOptionalTime(d["engaged_at"]),
    tripwire: tripOf(d["tripwire"]),
  };
}

/** A tenant's claim rate: `perSecond` on average, bursts of up to `burst`. */
export interface ClaimRate {
  readonly perSecond: number;
  readonly burst: number;
}

/**
 * Settings of a tenant or of a namespace prefix; an absent field inherits (from the tenant for
 * a prefix, from the server's limits for the tenant).
 */
export interface Settings {
  readonly defaultLease?: Duration;
  readonly maxLease?: Duration;
  readonly defaultRetention?: Duration;
  readonly maxRetention?: Duration;
  /** Tenant only: at most this many keys in flight at once. */
  readonly maxInFlight?: number;
  /** Tenant only: the claim rate. */
  readonly claimRate?: ClaimRate;
  /**
   * `full` (the default) or `digest`: keep only the size and SHA-256 of each outcome, never its
   * bytes (replays then carry a {@link ResultDigest}).
   */
  readonly outcomeKept?: "full" | "digest";
  /**
   * Whether a key needs a person's approval before its first claim acquires it: until then a
   * claim answers {@link PendingApproval} (nothing acquired or charged).
   */
  readonly approvalRequired?: boolean;
  /** How long a pending approval waits for a decision (1s to 30 days; default 24h). */
  readonly approvalExpiry?: Duration;
  /**
   * `enforce` (the default), or `observe`: claims are decided and recorded as ever, but one that
   * enforcement would refuse or replay answers {@link Proceed} and the caller runs its effect.
   * A kill switch still refuses.
   */
  readonly mode?: "enforce" | "observe";
  /**
   * What a claim of a key whose last attempt did not finish may do: `rerun` (the default),
   * `verify` (only a call given a `verify` hook takes it over; others throw
   * {@link RecoveryNeedsVerifyError}) or `ask` (a person decides: the call awaits an approval of
   * the recovery).
   */
  readonly recovery?: "rerun" | "verify" | "ask";
  /**
   * A canary: enforce for this percentage of keys (0 to 100), observe the rest, each key always
   * on the same side; in place of `mode`.
   */
  readonly enforcePercent?: number;
}

function settingsOf(d: unknown): Settings {
  const s = (d ?? {}) as Json;
  const out: { -readonly [K in keyof Settings]: Settings[K] } = {};
  for (const [wire, name] of [
    ["default_lease", "defaultLease"],
    ["max_lease", "maxLease"],
    ["default_retention", "defaultRetention"],
    ["max_retention", "maxRetention"],
    ["approval_expiry", "approvalExpiry"],
  ] as const) {
    if (typeof s[wire] === "string") out[name] = s[wire];
  }
  if (typeof s["approval_required"] === "boolean") out.approvalRequired = s["approval_required"];
  if (s["max_in_flight"] !== null && s["max_in_flight"] !== undefined) out.maxInFlight = int(s["max_in_flight"]);
  const rate = s["claim_rate"] as Json | null | undefined;
  if (rate) out.claimRate = { perSecond: int(rate["per_second"]), burst: int(rate["burst"]) };
  if (s["outcome_kept"] === "full" || s["outcome_kept"] === "digest") out.outcomeKept = s["outcome_kept"];
  if (s["mode"] === "enforce" || s["mode"] === "observe") out.mode = s["mode"];
  if (s["recovery"] === "rerun" || s["recovery"] === "verify" || s["recovery"] === "ask") out.recovery = s["recovery"];
  if (typeof s["enforce_percent"] === "number") out.enforcePercent = s["enforce_percent"];
  return out;
}

/** The settings of the tenant (`namespacePrefix` `null`) or of a namespace prefix. */
export interface SettingsEntry {
  readonly namespacePrefix: string | null;
  readonly settings: Settings;
  /** Who set them: an API key id, `cli:<user>`, `embedded` or `tripwire:<rule>`. */
  readonly updatedBy: string | null;
  readonly updatedAt: Date | null;
  /**
   * Set by a tripwire whose action is `observe`: why, and the figures it tripped on. Observe
   * mode then holds for every key under the prefix, over more specific entries, until a person
   * sets these settings again.
   */
  readonly tripwire: ObserveTrip | null;
}

/** Why a tripwire turned a prefix to observe mode: the sentence and the figures. */
export interface ObserveTrip {
  readonly reason: string;
  readonly trip: Trip;
}

export function settingsEntryOf(d: Json): SettingsEntry {
  const trip = tripOf(d["tripwire"]);
  const reason = (d["tripwire"] as Json | null | undefined)?.["reason"];
  return {
    namespacePrefix: optionalString(d["namespace_prefix"]),
    settings: settingsOf(d["settings"]),
    updatedBy: optionalString(d["updated_by"]),
    updatedAt: parseOptionalTime(d["updated_at"]),
    tripwire: trip === null ? null : { reason: String(reason ?? ""), trip },
  };
}

/** One admin action: who, when, what, why. */
export interface AuditEntry {
  readonly id: string;
  readonly at: Date;
  readonly actor: string;
  readonly action: string;
  readonly target: string | null;
  readonly why: string | null;
  readonly details: Readonly<Record<string, unknown>>;
}

export function auditEntryOf(d: Json): AuditEntry {
  const target = d["target"];
  return {
    id: String(d["id"]),
    at: parseTime(d["at"]),
    actor: String(d["actor"] ?? ""),
    action: String(d["action"]),
    target: target === null || target === undefined ? null : typeof target === "string" ? target : JSON.stringify(target),
    why: optionalString(d["why"]),
    details: (d["details"] ?? {}) as Record<string, unknown>,
  };
}

/** A page of the audit log, newest first; `next` is the cursor of the next page. */
export interface AuditPage {
  readonly entries: readonly AuditEntry[];
  readonly next: string | null;
}
