/**
 * Onceguard: workflow idempotency keys for AI agents. Every side effect of an agent or a RAG
 * pipeline happens once, however often the call is retried, duplicated, replayed or crashed
 * half-way.
 *
 * - {@link Client}: every call of the HTTP API, with typed answers.
 * - {@link once} and {@link guarded}: run a function once per key (with `undo`: and register
 *   how to undo it, should its run be rolled back).
 * - {@link Client.rollback} and {@link runCompensations} (`runCompensations(client, run)`): roll
 *   a run back, and work through its compensations; {@link registerUndo}: this process's undo
 *   functions by name.
 * - The framework helpers live in their own entry points: `onceguard/ai` (Vercel AI SDK),
 *   `onceguard/openai-agents` (OpenAI Agents SDK), `onceguard/langchain` (LangChain.js
 *   tools and LangGraph.js tasks), `onceguard/a2a` (the A2A JavaScript SDK's sends, keyed
 *   by run and step for `onceguard a2a`).
 *
 * @module
 */

export { Client, DEFAULT_URL, TimeoutError } from "./client.js";
export { applied } from "./models.js";
export type {
  ApprovalFilter,
  AuditFilter,
  CallOptions,
  ClaimItem,
  ClaimOptions,
  ClientOptions,
  CompleteItem,
  CompleteOptions,
  RecordFilter,
  TenantOption,
} from "./client.js";
export { MAX_COMPENSATION_DATA } from "./compensation.js";
export { registerUndo, registeredUndo } from "./undo.js";
export type { Undo, UndoContext } from "./undo.js";
export { runCompensations } from "./rollback.js";
export type { CompensationSummary, RunCompensationsOptions } from "./rollback.js";
export { NO_RETRY, Retry } from "./retry.js";
export type { RetryOptions } from "./retry.js";
export * from "./errors.js";
export type * from "./models.js";
export { Attempt, Happened, argumentsOf, current, guarded, happened, once, withSignal } from "./guard.js";
export type { ClaimOf, Decoded, ErrorMatcher, GuardOptions, GuardedOptions, OnceOptions, Verify, VerifyContext } from "./guard.js";
export { canonicalJson, checkKey, deriveKey, digest, fingerprint, toJsonValue, toolKey } from "./keys.js";
export type { JsonOf, JsonValue, ToolCall } from "./keys.js";
export { RawJson, formatDuration } from "./wire.js";
export type { Duration } from "./wire.js";
