/**
 * A scripted model's answers for the AI SDK tests (`MockLanguageModelV3` from `ai/test`, in ai 6
 * and ai 7 alike): a tool call, or text. Shared by test/ai.test.ts and test/ai7/ai7.test.ts.
 */

import type { MockLanguageModelV3 } from "ai/test";

export type GenerateResult = Awaited<ReturnType<MockLanguageModelV3["doGenerate"]>>;

const usage = {
  inputTokens: { total: 10, noCache: 10, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 5, text: 5, reasoning: undefined },
};

/** A step in which the model calls `toolName` with `input`. */
export function toolCall(toolCallId: string, toolName: string, input: unknown): GenerateResult {
  return {
    content: [{ type: "tool-call", toolCallId, toolName, input: JSON.stringify(input) }],
    finishReason: { unified: "tool-calls", raw: "tool_calls" },
    usage,
    warnings: [],
  };
}

/** A step in which the model answers `value`. */
export function text(value: string): GenerateResult {
  return { content: [{ type: "text", text: value }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
}
