/**
 * How the client retries its own transport failures and 503s: the same policy as the Python
 * client's `Retry`.
 *
 * @module
 */

/** The retry policy of a {@link Client}. */
export interface RetryOptions {
  /** Every try, the first included (`1`: no retry). Default 6. */
  readonly attempts?: number;
  /** Seconds before the first retry. Default 0.1. */
  readonly initial?: number;
  /** The longest wait between two tries, in seconds. Default 2. */
  readonly maxDelay?: number;
  /** Each retry waits `multiplier` times longer than the one before. Default 2. */
  readonly multiplier?: number;
  /** Wait a random time between half the delay and the delay. Default true. */
  readonly jitter?: boolean;
}

/**
 * The n-th retry waits `min(maxDelay, initial * multiplier ** (n - 1))`, a random time between
 * half of it and all of it when `jitter`; a `Retry-After` on a 503 is honoured up to `maxDelay`.
 */
export class Retry {
  readonly attempts: number;
  readonly initial: number;
  readonly maxDelay: number;
  readonly multiplier: number;
  readonly jitter: boolean;

  constructor(options: RetryOptions = {}) {
    this.attempts = Math.max(1, Math.floor(options.attempts ?? 6));
    this.initial = options.initial ?? 0.1;
    this.maxDelay = options.maxDelay ?? 2.0;
    this.multiplier = options.multiplier ?? 2.0;
    this.jitter = options.jitter ?? true;
  }

  /** Seconds to wait before retry number `retry` (1 for the first retry). */
  delay(retry: number, retryAfter?: number | null): number {
    let backoff = Math.min(this.maxDelay, this.initial * this.multiplier ** (retry - 1));
    if (this.jitter) backoff = backoff / 2 + Math.random() * (backoff / 2);
    if (retryAfter !== undefined && retryAfter !== null) backoff = Math.max(backoff, Math.min(retryAfter, this.maxDelay));
    return backoff;
  }
}

/** No retries: one try. */
export const NO_RETRY = new Retry({ attempts: 1 });

/**
 * Whether a `fetch` failure happened before the request left (nothing was sent, so sending it
 * again is always safe): the connection was refused, the name did not resolve, the connection
 * could not be made in time. Anything else may have been sent.
 */
export function notSent(error: unknown): boolean {
  for (let e: unknown = error, depth = 0; e !== null && typeof e === "object" && depth < 5; depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && NOT_SENT_CODES.has(code)) return true;
    e = (e as { cause?: unknown }).cause;
  }
  return false;
}

const NOT_SENT_CODES = new Set([
  "ECONNREFUSED",
  "ENOTFOUND",
  "EAI_AGAIN",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "UND_ERR_CONNECT_TIMEOUT",
  "ConnectionRefused",
]);

/** Wait `seconds`, or until `signal` aborts (then throws its reason). */
export function sleep(seconds: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, seconds * 1000);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
