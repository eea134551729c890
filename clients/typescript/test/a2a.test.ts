/**
 * `onceguard/a2a` with the A2A JavaScript SDK's real client and JSON-RPC transport, whose
 * `fetch` is a recorder answering as an agent would: what each send puts on the wire (the
 * message's id, the headers). tests/a2a-ts runs the helper through a real gateway.
 */

import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Role, TaskState, type AgentCard, type Message, type StreamResponse, type Task } from "@a2a-js/sdk";
import { ClientFactory, ClientFactoryOptions, JsonRpcTransportFactory, type Client } from "@a2a-js/sdk/client";
import { deriveKey } from "onceguard";
import { REPLAYED, a2aKey, guardA2A, replayed, type A2ASendParams } from "onceguard/a2a";

interface Sent {
  readonly method: string;
  readonly params: { message: { messageId?: string; parts: unknown[] } };
  readonly headers: Record<string, string>;
}

const URL = "http://agent.invalid/";
const card: AgentCard = {
  name: "recorder",
  description: "",
  supportedInterfaces: [{ url: URL, protocolBinding: "JSONRPC", tenant: "", protocolVersion: "1.0" }],
  provider: undefined,
  version: "1",
  capabilities: { streaming: true, extensions: [] },
  securitySchemes: {},
  securityRequirements: [],
  defaultInputModes: ["text/plain"],
  defaultOutputModes: ["text/plain"],
  skills: [],
  signatures: [],
};

const task = { id: "t-1", contextId: "c-1", status: { state: "TASK_STATE_COMPLETED" }, metadata: { [REPLAYED]: true } };

/** An SDK client whose every request is recorded in `sent` and answered with `task` (a stream: one event). */
async function recorder(): Promise<{ client: Client; sent: Sent[] }> {
  const sent: Sent[] = [];
  const fetchImpl = async (_input: unknown, init?: RequestInit): Promise<Response> => {
    const body = JSON.parse(String(init?.body)) as { id: number; method: string; params: Sent["params"] };
    sent.push({ method: body.method, params: body.params, headers: { ...(init?.headers as Record<string, string>) } });
    const answer = JSON.stringify({ jsonrpc: "2.0", id: body.id, result: { task } });
    if (body.method === "SendStreamingMessage") {
      return new Response(`data: ${answer}\n\n`, { headers: { "content-type": "text/event-stream" } });
    }
    return new Response(answer, { headers: { "content-type": "application/json" } });
  };
  const options = ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl: fetchImpl as typeof fetch })],
  });
  return { client: await new ClientFactory(options).createFromAgentCard(card), sent };
}

function params(text: string, messageId?: string): A2ASendParams {
  return {
    tenant: "",
    message: {
      messageId,
      contextId: "",
      taskId: "",
      role: Role.ROLE_USER,
      parts: [{ content: { $case: "text", value: text }, metadata: undefined, filename: "", mediaType: "text/plain" }],
      metadata: undefined,
      extensions: [],
      referenceTaskIds: [],
    },
    configuration: undefined,
    metadata: undefined,
  };
}

describe("onceguard/a2a", () => {
  it("a step's key is deriveKey('a2a', version, {run, step}): stable, and another for another run, step or version", async () => {
    const key = await a2aKey("run-1", "invoice");
    assert.equal(key, await deriveKey("a2a", "v1", { run: "run-1", step: "invoice" }));
    assert.equal(key, "a2a:v1:cf8f7bd7f769920afc35d062b0981083bdcb634d40277b11bb7c0a3c55ac7e2e");
    assert.notEqual(await a2aKey("run-1", "invoice-2"), key);
    assert.notEqual(await a2aKey("run-2", "invoice"), key);
    await assert.rejects(a2aKey("run 1", "invoice"), RangeError, "a run id has no spaces (it is a header)");
    await assert.rejects(a2aKey("run-1", ""), RangeError);
    assert.throws(() => guardA2A({} as Client, { run: "" }), RangeError);

    // Another version: other keys (the Python client's `step_key(run, step, version=…)` too).
    const v2 = guardA2A({} as Client, { run: "run-1", version: "v2" });
    assert.equal(await v2.key("invoice"), await deriveKey("a2a", "v2", { run: "run-1", step: "invoice" }));
    assert.notEqual(await v2.key("invoice"), key);
    assert.equal(await guardA2A({} as Client, { run: "run-1" }).key("invoice"), key);
    assert.throws(() => guardA2A({} as Client, { run: "run-1", version: "v:2" }), RangeError);
  });

  it("a send without a messageId gets the step's key as its messageId, Idempotency-Key and run header", async () => {
    const { client, sent } = await recorder();
    const request = params("task one");
    const answer = (await guardA2A(client, { run: "run-1" }).sendMessage(request, { step: "invoice" })) as Task;
    assert.equal(answer.id, "t-1");
    const key = await a2aKey("run-1", "invoice");
    assert.equal(sent.length, 1);
    const [first] = sent;
    assert.equal(first?.method, "SendMessage");
    assert.equal(first?.params.message.messageId, key);
    assert.equal(first?.headers["Idempotency-Key"], key);
    assert.equal(first?.headers["X-Onceguard-Run-Id"], "run-1");
    assert.equal(first?.headers["A2A-Version"], "1.0", "the SDK's own headers stay");
    assert.equal(request.message.messageId, undefined, "the caller's request is not changed");

    // The run again (another client, another wrapper): the same key on the wire.
    const again = await recorder();
    await guardA2A(again.client, { run: "run-1" }).sendMessage(params("task one"), { step: "invoice" });
    assert.equal(again.sent[0]?.params.message.messageId, key);
    assert.equal(again.sent[0]?.headers["Idempotency-Key"], key);
  });

  it("keeps a messageId the caller set, and the caller's headers, replacing only its own two", async () => {
    const { client, sent } = await recorder();
    const signal = new AbortController().signal;
    await guardA2A(client, { run: "run-1" }).sendMessage(params("task two", "m-7"), {
      step: "invoice",
      signal,
      serviceParameters: { "x-onceguard-key": "og_test", "idempotency-key": "theirs", "x-onceguard-run-id": "other" },
    });
    const headers = sent[0]?.headers ?? {};
    assert.equal(sent[0]?.params.message.messageId, "m-7");
    assert.equal(headers["x-onceguard-key"], "og_test");
    assert.equal(headers["Idempotency-Key"], await a2aKey("run-1", "invoice"), "the key header carries the step's key");
    assert.equal(headers["X-Onceguard-Run-Id"], "run-1");
    assert.equal(headers["idempotency-key"], undefined, "one spelling on the wire");
    assert.equal(headers["x-onceguard-run-id"], undefined);
  });

  it("a stream of a step carries the same key", async () => {
    const { client, sent } = await recorder();
    const events: StreamResponse[] = [];
    for await (const event of guardA2A(client, { run: "run-1" }).sendMessageStream(params("task three"), { step: "stream" })) events.push(event);
    assert.equal(sent[0]?.method, "SendStreamingMessage");
    assert.equal(sent[0]?.params.message.messageId, await a2aKey("run-1", "stream"));
    assert.equal(sent[0]?.headers["Idempotency-Key"], await a2aKey("run-1", "stream"));
    assert.equal(events.length, 1);
    assert.equal(events[0]?.payload?.$case, "task");
    assert.equal(replayed(events[0] as StreamResponse), true);
  });

  it("replayed() reads the gateway's mark on a Task, a Message and a stream event", () => {
    const message = (metadata: Message["metadata"]): Message => ({
      ...(params("x").message as Message),
      messageId: "m",
      role: Role.ROLE_AGENT,
      metadata,
    });
    const plain: Task = { id: "t", contextId: "c", status: { state: TaskState.TASK_STATE_COMPLETED, message: undefined, timestamp: undefined }, artifacts: [], history: [], metadata: undefined };
    assert.equal(replayed({ ...plain, metadata: { [REPLAYED]: true } }), true);
    assert.equal(replayed(plain), false);
    assert.equal(replayed(message({ [REPLAYED]: true })), true);
    assert.equal(replayed(message({ [REPLAYED]: "true" })), false, "only the boolean");
    assert.equal(replayed({ payload: { $case: "message", value: message(undefined) } }), false);
    assert.equal(replayed({ payload: undefined }), false);
  });
});
