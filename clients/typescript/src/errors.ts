/**
 * The errors of the client.
 *
 * Two families:
 *
 * - **Problems**: the server refused or could not serve a request. It answers
 *   `application/problem+json` (RFC 9457) with a stable `type`
 *   (`https://onceguard.dev/problems/<kind>`); each kind is one class here, chosen by that
 *   type and never by the message. Each carries `type`, `status`, `title`, `detail` and
 *   `retryable`. {@link TransportError} is the client's own: the server could not be reached
 *   (after the retries).
 * - **Guard outcomes**, thrown by {@link once} and {@link guarded}, which turn the claim's
 *   answers that are neither "run it" nor "here is the replay" into errors:
 *   {@link InFlightError}, {@link KeyConflict}, {@link DeniedError} (and its
 *   {@link ApprovalDeniedError}), {@link AwaitingApprovalError}, {@link PermanentFailure}; and
 *   {@link StaleFence} when storing the outcome was refused because the attempt's fence is
 *   no longer the holder's.
 * - {@link ResultNotKeptError}: a replay whose namespace keeps only a digest of the outcome, so
 *   there is no result to return (thrown by reading its `result` and by the guards, which never
 *   run the function again for it).
 *
 * A claim's answers themselves, and a fenced call's `applied` / `stale`, are values that
 * {@link Client} returns, not errors.
 *
 * Two classes are for the guarded function to throw: {@link Permanent} (store this failure,
 * replay it to every caller) and {@link OutcomeUnknown} (the effect may have happened).
 *
 * @module
 */

import type { Approval, Denied, DeniedKind, ResultDigest, Stale, StaleReason } from "./models.js";

/** The prefix of every problem type. */
export const PROBLEM_PREFIX = "https://onceguard.dev/problems/";

/** The base of every error of this package. */
export class OnceguardError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/**
 * The server could not be reached or did not answer, after the client's retries. The cause
 * (the runtime's `fetch` error, or the timeout) is `cause`. Whether the request took effect is
 * unknown when it was sent; every call of a guard is idempotent by key and fence, so sending it
 * again is safe.
 */
export class TransportError extends OnceguardError {
  /** How many times the request was tried. */
  readonly attempts: number;
  constructor(message: string, attempts: number, cause: unknown) {
    super(message, { cause });
    this.attempts = attempts;
  }
}

/** An answer that is neither the documented success nor a problem (e.g. from a proxy). */
export class UnexpectedResponse extends OnceguardError {
  readonly status: number;
  readonly body: string;
  constructor(status: number, body: string) {
    super(`unexpected answer ${status}: ${body.slice(0, 200)}`);
    this.status = status;
    this.body = body;
  }
}

/** The body of a problem answer. */
export type Problem = Readonly<Record<string, unknown>> & { readonly type?: unknown };

/** A problem answer (RFC 9457). Subclasses name each stable `type`. */
export class ProblemError extends OnceguardError {
  /** The kind this class stands for (the last segment of `type`); `""` for the base. */
  static readonly kind: string = "";
  /** The whole problem document. */
  readonly problem: Problem;
  readonly type: string;
  readonly status: number;
  readonly title: string;
  readonly detail: string;
  /** Whether the same request may succeed if sent again later. */
  readonly retryable: boolean;

  constructor(problem: Problem, status: number) {
    const type = String(problem.type ?? "");
    const kind = type.startsWith(PROBLEM_PREFIX) ? type.slice(PROBLEM_PREFIX.length) : type;
    const detail = String(problem["detail"] ?? "");
    const title = String(problem["title"] ?? "");
    super(`${kind || status}: ${detail || title}`);
    this.problem = problem;
    this.type = type;
    this.status = Number(problem["status"] ?? status) || status;
    this.title = title;
    this.detail = detail;
    this.retryable = Boolean(problem["retryable"]);
  }

  /** The last segment of `type`, e.g. `invalid-request`. */
  get kind(): string {
    return this.type.startsWith(PROBLEM_PREFIX) ? this.type.slice(PROBLEM_PREFIX.length) : this.type;
  }
}

/** 400: malformed JSON, unknown fields, a value outside its rules. Fix the request. */
export class InvalidRequest extends ProblemError {
  static override readonly kind = "invalid-request";
}
/** 401: no API key, or a malformed, unknown or revoked one. */
export class Unauthenticated extends ProblemError {
  static override readonly kind = "unauthenticated";
}
/** 403: the API key's role may not do this call (e.g. an agent key purging). */
export class Forbidden extends ProblemError {
  static override readonly kind = "forbidden";
}
/** 404: no such record, run, switch, API key or endpoint in your tenant. */
export class NotFound extends ProblemError {
  static override readonly kind = "not-found";
}
/** 405. */
export class MethodNotAllowed extends ProblemError {
  static override readonly kind = "method-not-allowed";
}
/** 409 `conflict`: something that must be new exists already (e.g. a tenant). */
export class Conflict extends ProblemError {
  static override readonly kind = "conflict";
}
/**
 * 409 `approval-closed`: an approval cannot be decided: it was decided already, or it expired
 * undecided (the next claim of its key then asks again). Nothing changed.
 */
export class ApprovalClosed extends ProblemError {
  static override readonly kind = "approval-closed";
}
/** 413: the body, an outcome or a checkpoint is larger than the server allows. */
export class PayloadTooLarge extends ProblemError {
  static override readonly kind = "payload-too-large";
}
/** 415: the body was not sent as JSON. */
export class UnsupportedMediaType extends ProblemError {
  static override readonly kind = "unsupported-media-type";
}
/** 503: the store could not answer; nothing was decided. The client retries it first. */
export class StoreUnavailable extends ProblemError {
  static override readonly kind = "store-unavailable";
}
/** 500: a bug in the server. */
export class InternalServerError extends ProblemError {
  static override readonly kind = "internal";
}
/** 502 (proxy mode): the upstream could not be reached or failed after the request was sent. */
export class UpstreamFailed extends ProblemError {
  static override readonly kind = "upstream-failed";
}
/** 504 (proxy mode): the upstream did not answer in time. */
export class UpstreamTimeout extends ProblemError {
  static override readonly kind = "upstream-timeout";
}

/**
 * 409 `stale-fence`: the fence is not the current holder's; nothing changed. Your attempt is
 * over: another claim took the key over (`superseded`: your lease passed, or a kill switch
 * revoked it), there is no live record (`no_record`), or your attempt already finished
 * differently (`finished`). A result you tried to store is **not** stored.
 *
 * {@link Client}'s fenced calls answer this as a {@link Stale} value; {@link once} and
 * {@link guarded} throw it.
 */
export class StaleFence extends ProblemError {
  static override readonly kind = "stale-fence";
  /** `superseded`, `no_record` or `finished`. */
  readonly reason: StaleReason;
  constructor(problem: Problem, status: number) {
    super(problem, status);
    const reason = problem["reason"];
    this.reason = reason === null || reason === undefined ? "" : String(reason);
  }

  /** The {@link Stale} answer this error stands for. */
  get stale(): Stale {
    return { outcome: "stale", reason: this.reason, detail: this.detail };
  }

  /** The error of a {@link Stale} answer. */
  static of(stale: Stale): StaleFence {
    return new StaleFence(
      { type: PROBLEM_PREFIX + "stale-fence", status: 409, detail: stale.detail, reason: stale.reason, outcome: "stale" },
      409,
    );
  }
}

/**
 * A claim's answer (`in-flight`, `fingerprint-mismatch`, a denial) to a call that is not a
 * claim. {@link Client.claim} returns these answers as values instead.
 */
export class ClaimProblem extends ProblemError {}

const PROBLEM_CLASSES: ReadonlyMap<string, new (problem: Problem, status: number) => ProblemError> = new Map(
  [
    InvalidRequest,
    Unauthenticated,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    Conflict,
    ApprovalClosed,
    PayloadTooLarge,
    UnsupportedMediaType,
    StoreUnavailable,
    InternalServerError,
    UpstreamFailed,
    UpstreamTimeout,
    StaleFence,
  ].map((cls) => [cls.kind, cls] as const),
);

/** The error for a problem body, chosen by its `type`. */
export function problemError(problem: Problem, status: number): ProblemError {
  const type = String(problem.type ?? "");
  const kind = type.startsWith(PROBLEM_PREFIX) ? type.slice(PROBLEM_PREFIX.length) : "";
  const cls = PROBLEM_CLASSES.get(kind) ?? ("outcome" in problem ? ClaimProblem : ProblemError);
  return new cls(problem, status);
}

// -- guard outcomes ----------------------------------------------------------------------------

/** A claim made by `once` / `guarded` neither let the function run nor replayed it. */
export class GuardError extends OnceguardError {
  readonly namespace: string;
  readonly key: string;
  constructor(message: string, namespace: string, key: string, options?: { cause?: unknown }) {
    super(message, options);
    this.namespace = namespace;
    this.key = key;
  }
}

/**
 * Another caller holds the key with a live lease, still after the bounded wait. Retry after
 * `retryAfter` seconds: you then get its replay, or the key itself if the holder's lease passed.
 */
export class InFlightError extends GuardError {
  readonly retryAfter: number;
  readonly attempt: number | null;
  constructor(namespace: string, key: string, retryAfter: number, attempt: number | null) {
    super(`key ${JSON.stringify(key)} in ${namespace} is in flight; retry after ${retryAfter.toFixed(3)}s`, namespace, key);
    this.retryAfter = retryAfter;
    this.attempt = attempt;
  }

  /** The refusal as a tool's answer to a model: one sentence it can act on. */
  get modelMessage(): string {
    return (
      `This call is already running (an earlier call with the same arguments started it), so it was not run again; ` +
      `call the tool again with the same arguments in ${Math.max(1, Math.round(this.retryAfter))}s or later to get its result.`
    );
  }
}

/**
 * The key was used before with a different request (fingerprint mismatch). Nothing changed:
 * use another key, or a new version label.
 */
export class KeyConflict extends GuardError {
  readonly detail: string;
  constructor(namespace: string, key: string, detail = "") {
    super(`key ${JSON.stringify(key)} in ${namespace} was used with a different request`, namespace, key);
    this.detail = detail;
  }
}

/**
 * A kill switch, a run's budget, the tenant's quota or an approver refused the claim (fail
 * closed); nothing ran. An approver's denial is an {@link ApprovalDeniedError}.
 */
export class DeniedError extends GuardError {
  /** The claim's answer. */
  readonly denied: Denied;
  constructor(denied: Denied, namespace: string, key: string) {
    super(
      `claim of ${JSON.stringify(key)} in ${namespace} denied (${denied.kind}): ${denied.detail || JSON.stringify(denied.reason)}`,
      namespace,
      key,
    );
    this.denied = denied;
  }
  /** `switch`, `budget`, `quota`, `approval` or `recovery`. */
  get kind(): DeniedKind {
    return this.denied.kind;
  }
  /** The server's reason, e.g. `{"reason": "budget_exhausted", "limit": "cost"}`. */
  get reason(): Readonly<Record<string, unknown>> {
    return this.denied.reason;
  }
  /** Seconds until a retry may succeed (quotas), else `null`. */
  get retryAfter(): number | null {
    return this.denied.retryAfter;
  }
}

/**
 * A person denied the approval this call needed (its key with this request): nothing ran, and
 * every later call with the same arguments is refused the same way while the decision is kept.
 * Not retryable: do not call it again with the same arguments.
 */
export class ApprovalDeniedError extends DeniedError {
  constructor(denied: Denied, namespace: string, key: string) {
    super(denied, namespace, key);
    const by = this.by ? ` by ${this.by}` : "";
    const why = this.why ? `: ${this.why}` : "";
    this.message =
      `A person denied this call (approval ${this.approval}${by})${why}. Nothing was done; ` +
      `do not call it again with the same arguments. (key ${JSON.stringify(key)} in ${namespace})`;
  }
  /** The id of the denied approval, `apr_…`. */
  get approval(): string {
    return String(this.denied.reason["approval"] ?? "");
  }
  /** Who denied it (an admin API key id, or `cli:<user>`). */
  get by(): string {
    return String(this.denied.reason["by"] ?? "");
  }
  /** Why, in the approver's words. */
  get why(): string {
    return String(this.denied.reason["why"] ?? "");
  }
}

/**
 * The key's last attempt did not finish and may have done its effect, and the namespace's
 * recovery policy is `verify`: only a call given a `verify` hook (which checks downstream
 * whether the effect happened before running it again) may take the key over. Nothing ran or
 * changed. Not retryable as is: pass `verify`, or ask an operator to resolve the key.
 */
export class RecoveryNeedsVerifyError extends DeniedError {
  constructor(denied: Denied, namespace: string, key: string) {
    super(denied, namespace, key);
    this.message =
      `The last attempt at this call did not finish and may have run; its namespace's recovery policy is ` +
      `'verify', so it is not run again without a verify hook: pass verify (a function checking whether the ` +
      `effect happened) or ask an operator to resolve the key. (key ${JSON.stringify(key)} in ${namespace})`;
  }
}

/**
 * The call needs a person's approval, which nobody has given yet (after the wait): nothing ran
 * and nothing was charged. Call again later with the same arguments: once `approval` is
 * approved the call runs (once), once it is denied the call throws {@link ApprovalDeniedError}.
 * `waitForApproval` makes the guard wait for the decision instead.
 *
 * The message says so in words a model can act on, since the framework helpers report it to
 * the model as the tool's error.
 */
export class AwaitingApprovalError extends GuardError {
  /** What is to be approved: its `id` is what an admin approves or denies. */
  readonly approval: Approval;
  /** Seconds until it is worth calling again. */
  readonly retryAfter: number;
  constructor(approval: Approval, retryAfter: number, namespace: string, key: string) {
    super(
      `This call awaits a person's approval (approval ${approval.id}). Nothing was done. Call again later ` +
        `with the same arguments, in ${retryAfter}s or more. (key ${JSON.stringify(key)} in ${namespace}; ` +
        `decide before ${approval.expiresAt.toISOString()})`,
      namespace,
      key,
    );
    this.approval = approval;
    this.retryAfter = retryAfter;
  }
}

/**
 * The guarded function failed permanently and the failure is stored: the first caller and
 * every later one get this same error. `error` is the stored JSON:
 * `{"type": "<error name>", "message": "…"}`.
 */
export class PermanentFailure extends GuardError {
  /** The stored failure, as JSON. */
  readonly error: unknown;
  /** Whether this caller got it from the store (`false`: its own attempt failed). */
  readonly replayed: boolean;
  readonly errorType: string;
  readonly errorMessage: string;
  constructor(error: unknown, namespace: string, key: string, replayed: boolean, cause?: unknown) {
    const info = error !== null && typeof error === "object" ? (error as Record<string, unknown>) : {};
    const errorType = String(info["type"] ?? "");
    const errorMessage = String(info["message"] ?? (typeof error === "object" ? "" : error));
    super(
      `${errorType || "failure"}: ${errorMessage} (stored failure of key ${JSON.stringify(key)} in ${namespace})`,
      namespace,
      key,
      cause === undefined ? undefined : { cause },
    );
    this.error = error;
    this.replayed = replayed;
    this.errorType = errorType;
    this.errorMessage = errorMessage;
  }
}

/**
 * The effect ran once, and its namespace keeps only a digest of the outcome (`outcome_kept:
 * digest` in its settings): the size and SHA-256 of its bytes, never the bytes. There is no
 * result to return, and the function is not run again.
 *
 * Thrown by reading `result` of a {@link Replay} or {@link StoredOutcome} that has a `digest`,
 * and by {@link once}, {@link guarded} and the framework guards on such a replay (those set
 * `namespace` and `key`). `status` is `success`, or `failure` for a stored permanent failure.
 */
export class ResultNotKeptError extends OnceguardError {
  /** The size and SHA-256 of the bytes stored at completion. */
  readonly digest: ResultDigest;
  readonly status: string;
  readonly namespace: string | null;
  readonly key: string | null;
  constructor(digest: ResultDigest, status = "success", namespace: string | null = null, key: string | null = null) {
    const what = key === null ? "the effect" : `the call of key ${JSON.stringify(key)} in ${namespace}`;
    const failed = status === "failure" ? " and failed" : "";
    super(
      `${what} already ran once${failed}; its result is not kept: its namespace keeps only a digest (${digest.size} bytes, sha256 ${digest.sha256})`,
    );
    this.digest = digest;
    this.status = status;
    this.namespace = namespace;
    this.key = key;
  }
}

// -- thrown by the guarded function --------------------------------------------------------

/**
 * Throw it from a guarded function to store the failure (the cause's name and message) so
 * that this and every later call get a {@link PermanentFailure}, as for an error class listed
 * in `permanent`.
 */
export class Permanent extends OnceguardError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}

/**
 * Throw it from a guarded function when the effect may have happened (a timeout after the
 * request was sent): the key is reported unknown, and the next claim is a recovery that is
 * told so, as for an error class listed in `unknown`.
 */
export class OutcomeUnknown extends OnceguardError {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}
