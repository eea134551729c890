/**
 * Namespaces that keep a digest only (`outcome_kept: digest`): a replay carries the size and
 * SHA-256 of the stored bytes instead of them, and no guard runs the function again for it.
 */

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { describe, it } from "node:test";
import { generateText, stepCountIs, tool } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { PermanentFailure, ResultNotKeptError, deriveKey, guarded, once, type Acquired, type Replay, type ResultDigest } from "onceguard";
import { guardTool } from "onceguard/ai";
import { z } from "zod";
import { ns, useServer } from "./server.js";

const fx = useServer();

/** The digest of a JSON value as the client sends it: `JSON.stringify`, UTF-8. */
function digestOf(value: unknown): ResultDigest {
  const raw = Buffer.from(JSON.stringify(value), "utf8");
  return { size: raw.length, sha256: createHash("sha256").update(raw).digest("hex") };
}

/** A namespace under a prefix whose settings keep a digest only. */
async function pii(name: string): Promise<string> {
  const prefix = `${ns(name)}/pii`;
  const entry = await fx.admin.putSettings({ outcomeKept: "digest" }, { namespacePrefix: prefix, why: "personal data" });
  assert.equal(entry.settings.outcomeKept, "digest");
  return prefix;
}

function notKept(check: (e: ResultNotKeptError) => void): (e: unknown) => boolean {
  return (e) => {
    assert.ok(e instanceof ResultNotKeptError, String(e));
    check(e);
    return true;
  };
}

const RECEIPT = { customer: "Zoë Faure", amount: 25, card: "•••• 4242" };

describe("namespaces that keep a digest only", () => {
  it("once runs once; a later call throws ResultNotKeptError with the digest", async () => {
    const namespace = await pii("digest-once");
    assert.ok((await fx.admin.listSettings()).some((e) => e.namespacePrefix === namespace && e.settings.outcomeKept === "digest"));
    let runs = 0;
    const sendReceipt = once(
      async (order: number) => {
        runs++;
        return { ...RECEIPT, order };
      },
      { client: fx.client, namespace, name: "send_receipt", params: ["order"] },
    );
    assert.deepEqual(await sendReceipt(7), { ...RECEIPT, order: 7 }); // the caller that ran it gets its whole result
    const key = await deriveKey("send_receipt", "v1", { order: 7 });
    for (let i = 0; i < 2; i++) {
      await assert.rejects(
        sendReceipt(7),
        notKept((e) => {
          assert.deepEqual(e.digest, digestOf({ ...RECEIPT, order: 7 }));
          assert.deepEqual([e.status, e.namespace, e.key], ["success", namespace, key]);
          assert.match(e.message, /already ran once.*not kept/);
        }),
      );
    }
    assert.equal(runs, 1);

    const replay = (await fx.client.claim(namespace, key, { request: { order: 7 } })) as Replay;
    assert.equal(replay.outcome, "replay");
    assert.deepEqual(replay.digest, digestOf({ ...RECEIPT, order: 7 }));
    assert.equal(replay.raw.length, 0);
    assert.equal(replay.contentType, "application/json");
    assert.throws(() => replay.result, notKept((e) => assert.equal(e.key, null)));
    assert.equal("result" in JSON.parse(JSON.stringify(replay)), false);
    const record = await fx.client.getRecord(namespace, key);
    assert.deepEqual(record?.stored?.digest, replay.digest);
    assert.equal(record?.stored?.raw.length, 0);
    assert.throws(() => record?.stored?.result, ResultNotKeptError);
  });

  it("guarded does not run again; a stored permanent failure is not kept either", async () => {
    const namespace = await pii("digest-guarded");
    let runs = 0;
    const note = (): string => {
      runs++;
      return "private note";
    };
    assert.equal(await guarded(fx.client, namespace, "note", { request: 1 }, note), "private note");
    await assert.rejects(
      guarded(fx.client, namespace, "note", { request: 1 }, note),
      notKept((e) => assert.deepEqual(e.digest, digestOf("private note"))),
    );
    assert.equal(runs, 1);

    class Declined extends Error {
      override name = "Declined";
    }
    const charge = once(
      async () => {
        runs++;
        throw new Declined("card of Zoë declined");
      },
      { client: fx.client, namespace, key: "charge", permanent: [Declined] },
    );
    await assert.rejects(charge(), PermanentFailure);
    await assert.rejects(
      charge(),
      notKept((e) => {
        assert.equal(e.status, "failure");
        assert.deepEqual(e.digest, digestOf({ type: "Declined", message: "card of Zoë declined" }));
      }),
    );
    assert.equal(runs, 2);
  });

  for (const withAcquisition of [false, true]) {
    it(`a batch reads a digest item between kept replays${withAcquisition ? " (and an acquisition)" : ""}`, async () => {
      const namespace = await pii("digest-batch");
      const kept = namespace.replace(/\/pii$/, "/kept");
      for (const [n, key] of [[kept, "a"], [namespace, "b"], [kept, "c"]] as const) {
        const held = (await fx.client.claim(n, key, { request: key })) as Acquired;
        await fx.client.complete(n, key, held.fence, { result: key });
      }
      const items = [
        { namespace: kept, key: "a", request: "a" },
        { namespace, key: "b", request: "b" },
        { namespace: kept, key: "c", request: "c" },
        ...(withAcquisition ? [{ namespace: kept, key: "new", request: "new" }] : []),
      ];
      const answers = await fx.client.claimBatch(items);
      const [a, b, c] = answers as [Replay, Replay, Replay];
      assert.deepEqual([a.outcome, b.outcome, c.outcome], ["replay", "replay", "replay"]);
      assert.deepEqual([a.result, a.digest, c.result, c.digest], [{ result: "a" }, null, { result: "c" }, null]);
      assert.deepEqual(b.digest, digestOf({ result: "b" }));
      assert.equal(b.raw.length, 0);
      assert.equal(answers[3]?.outcome, withAcquisition ? "acquired" : undefined);
    });
  }

  it("a guarded AI SDK tool tells the model it ran once", async () => {
    const namespace = await pii("digest-ai");
    const sent: string[] = [];
    const sendInvoice = guardTool(
      tool({
        description: "Send an invoice",
        inputSchema: z.object({ customer: z.string() }),
        execute: async ({ customer }) => {
          sent.push(customer);
          return `invoice sent to ${customer}`;
        },
      }),
      { name: "sendInvoice", client: fx.client, namespace, runId: "conv-digest" },
    );
    const usage = {
      inputTokens: { total: 1, noCache: 1, cacheRead: undefined, cacheWrite: undefined },
      outputTokens: { total: 1, text: 1, reasoning: undefined },
    };
    const results = [];
    for (const id of ["call_1", "call_2"]) {
      const model = new MockLanguageModelV3({
        doGenerate: [
          {
            content: [{ type: "tool-call", toolCallId: id, toolName: "sendInvoice", input: JSON.stringify({ customer: "Zoë" }) }],
            finishReason: { unified: "tool-calls", raw: "tool_calls" },
            usage,
            warnings: [],
          },
          { content: [{ type: "text", text: "ok" }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] },
        ],
      });
      results.push(await generateText({ model, tools: { sendInvoice }, prompt: "bill Zoë", stopWhen: stepCountIs(3) }));
    }
    assert.equal(results[0]?.steps[0]?.toolResults[0]?.output, "invoice sent to Zoë");
    const error = results[1]?.steps[0]?.content.find((part) => part.type === "tool-error");
    assert.ok(error && error.type === "tool-error", "the model is told the call did not answer");
    assert.ok(error.error instanceof ResultNotKeptError);
    assert.deepEqual(error.error.digest, digestOf("invoice sent to Zoë"));
    assert.deepEqual(sent, ["Zoë"]);
  });
});
