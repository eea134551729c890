/**
 * Send A2A messages once: an agent that calls another agent through `onceguard a2a` gets one
 * stable key per step of its run, so a retried, re-run or resumed step is answered from the
 * gateway's store instead of starting a second task.
 *
 * ```ts
 * import { ClientFactory } from "@a2a-js/sdk/client";
 * import { guardA2A } from "onceguard/a2a";
 *
 * const client = await new ClientFactory(options).createFromUrl("http://127.0.0.1:8083/"); // the gateway
 * const billing = guardA2A(client, { run: "order-1234" });
 * const answer = await billing.sendMessage({ tenant: "", message, configuration: undefined, metadata: undefined }, { step: "invoice" });
 * ```
 *
 * The key of a step is {@link a2aKey}`(run, step)`. Each send sets the message's `messageId` to
 * it when the message has none, and sends it as the `Idempotency-Key` header, with the run as
 * `X-Onceguard-Run-Id` (the run whose budget the send is charged to). The same run and step
 * are one send, whatever process sends it; the gateway refuses the key used again for another
 * message (`fingerprint-mismatch`): a step that sends something else needs a step name of its
 * own.
 *
 * Needs `@a2a-js/sdk` 1.x (A2A v1.0). Only its types are used: nothing of it is loaded.
 *
 * @module
 */

import type { Message, SendMessageRequest, SendMessageResult, StreamResponse, Task } from "@a2a-js/sdk";
import type { Client, RequestOptions } from "@a2a-js/sdk/client";
import { checkLabel, deriveKey } from "./keys.js";

/** Where the gateway marks an answer replayed from its store: `metadata["dev.onceguard/replayed"] = true`. */
export const REPLAYED = "dev.onceguard/replayed";
/** The header whose key the gateway claims (before the message's `messageId`). */
export const IDEMPOTENCY_KEY_HEADER = "Idempotency-Key";
/** The header naming the run a send is charged to. */
export const RUN_HEADER = "X-Onceguard-Run-Id";

const RUN_ID = /^[\x21-\x7e]{1,128}$/;

function checkRun(run: string): string {
  if (typeof run !== "string" || !RUN_ID.test(run)) {
    throw new RangeError(`a run id is 1 to 128 bytes of printable ASCII without spaces, not ${JSON.stringify(run)}`);
  }
  return run;
}

/**
 * The key of a step of a run: `a2a:<version>:<sha256 hex>`, the {@link deriveKey} of
 * `("a2a", version, {"run": run, "step": step})` (the Python client's `derive_key` gives the
 * same). `step` is any non-empty string that names the send within the run (e.g. `"invoice"`,
 * `"invoice/answer-1"`). Change `version` (default `"v1"`) when the steps' messages change
 * meaning: the gateway refuses a key sent again with another message.
 */
export async function a2aKey(run: string, step: string, version = "v1"): Promise<string> {
  checkRun(run);
  if (typeof step !== "string" || step.length === 0) throw new RangeError("a step is a non-empty string");
  return deriveKey("a2a", checkLabel("version", version, 32), { run, step });
}

/** A `SendMessageRequest` whose message may leave `messageId` out (or empty): the send sets it to the step's key. */
export type A2ASendParams = Omit<SendMessageRequest, "message"> & {
  readonly message: Omit<Message, "messageId"> & { readonly messageId?: string | undefined };
};

/** The options of one send: the SDK's `RequestOptions` and the step it is. */
export interface A2AStepOptions extends RequestOptions {
  /** The step of the run this send is: with the run, its key. */
  readonly step: string;
}

/** The options of {@link guardA2A}. */
export interface GuardA2AOptions {
  /** The run (workflow, conversation) the sends belong to: part of every key, and sent as `X-Onceguard-Run-Id`. */
  readonly run: string;
  /** The keys' version (default `"v1"`; {@link a2aKey}). */
  readonly version?: string | undefined;
}

/** An A2A client whose sends are keyed by run and step ({@link guardA2A}). */
export interface GuardedA2AClient {
  /** The SDK's client, for everything that is not a send (`getTask`, `cancelTask`, …). */
  readonly client: Client;
  /** The run of every send. */
  readonly run: string;
  /** The key of `step` in this run ({@link a2aKey}). */
  key(step: string): Promise<string>;
  /** `client.sendMessage` of the step: its key as the `messageId` (when the message has none) and the `Idempotency-Key`. */
  sendMessage(params: A2ASendParams, options: A2AStepOptions): Promise<SendMessageResult>;
  /** `client.sendMessageStream` of the step, keyed as {@link sendMessage}. */
  sendMessageStream(params: A2ASendParams, options: A2AStepOptions): AsyncGenerator<StreamResponse, void, undefined>;
}

/** `params` and `options` of a step as the SDK's client takes them: the key in the message and the headers. */
function keyed(key: string, run: string, params: A2ASendParams, options: RequestOptions): [SendMessageRequest, RequestOptions] {
  const headers: Record<string, string> = {};
  for (const [name, value] of Object.entries(options.serviceParameters ?? {})) {
    const lower = name.toLowerCase();
    // Ours replace the caller's, whatever their case (two spellings would both go on the wire).
    if (lower !== IDEMPOTENCY_KEY_HEADER.toLowerCase() && lower !== RUN_HEADER.toLowerCase()) headers[name] = value;
  }
  headers[IDEMPOTENCY_KEY_HEADER] = key;
  headers[RUN_HEADER] = run;
  const message: Message = { ...params.message, messageId: params.message.messageId || key };
  return [{ ...params, message }, { ...options, serviceParameters: headers }];
}

/**
 * `client` with sends keyed by `run` and each send's `step`: a re-run of the run (after a crash,
 * on another worker) sends each step with the same key, and the gateway answers it from its
 * store (or attaches it to the task the first send started) instead of running it again.
 */
export function guardA2A(client: Client, options: GuardA2AOptions): GuardedA2AClient {
  const run = checkRun(options.run);
  const version = checkLabel("version", options.version ?? "v1", 32);
  const key = (step: string): Promise<string> => a2aKey(run, step, version);
  return {
    client,
    run,
    key,
    async sendMessage(params, { step, ...rest }) {
      return client.sendMessage(...keyed(await key(step), run, params, rest));
    },
    async *sendMessageStream(params, { step, ...rest }) {
      yield* client.sendMessageStream(...keyed(await key(step), run, params, rest));
    },
  };
}

/** Whether the gateway answered `answer` (a `Message`, a `Task` or a stream event) from its store. */
export function replayed(answer: Message | Task | StreamResponse): boolean {
  const value = "payload" in answer ? answer.payload?.value : answer;
  const metadata = (value as { metadata?: Record<string, unknown> | undefined } | undefined)?.metadata;
  return metadata?.[REPLAYED] === true;
}
