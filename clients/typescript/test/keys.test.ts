/**
 * Keys and fingerprints: RFC 8785 canonical JSON, byte for byte what the Python client makes
 * (fixtures/python-keys.json, written by fixtures/python_keys.py) and what the server computes.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, it } from "node:test";
import { applied, argumentsOf, canonicalJson, deriveKey, digest, fingerprint, toJsonValue, toolKey, type JsonValue } from "onceguard";
import { ns, useServer } from "./server.js";

interface PythonKeys {
  values: Array<{ value: JsonValue; canonical: string; digest: string }>;
  calls: Array<{ name: string; version: string; arguments: JsonValue; key: string }>;
  tools: Array<{ tool: string; run: string | null; arguments: JsonValue; key: string }>;
}

const fixtures = new URL("../../test/fixtures/", import.meta.url);
const python = JSON.parse(readFileSync(new URL("python-keys.json", fixtures), "utf8")) as PythonKeys;
const fx = useServer();

describe("canonical JSON", () => {
  it("is what the Python client writes, for every value of the fixture", async () => {
    assert.ok(python.values.length > 30);
    for (const { value, canonical, digest: hex } of python.values) {
      assert.equal(canonicalJson(value), canonical, `canonical JSON of ${JSON.stringify(value)}`);
      assert.equal(await digest(value), hex);
    }
  });

  it("sorts members by UTF-16 code units, writes numbers as ECMAScript does", () => {
    assert.equal(canonicalJson({ b: 1, a: { d: [1.0, 2.5e-7], c: "x" } }), '{"a":{"c":"x","d":[1,2.5e-7]},"b":1}');
    assert.equal(canonicalJson({ "\u{1F600}": 1, "\uFB33": 2 }), '{"\u{1F600}":1,"\uFB33":2}');
    assert.equal(canonicalJson([-0, 1e21, 1e-7, 123e-20]), "[0,1e+21,1e-7,1.23e-18]");
    assert.equal(canonicalJson("\u0001\n\u001f\"\\/\u007f"), '"\\u0001\\n\\u001f\\"\\\\/\u007f"');
  });

  it("converts what JSON.stringify converts, and more; refuses what is not JSON", () => {
    assert.deepEqual(toJsonValue({ at: new Date("2026-01-02T03:04:05Z"), skip: undefined, list: [undefined, 1n] }), {
      at: "2026-01-02T03:04:05.000Z",
      list: [null, 1],
    });
    assert.deepEqual(toJsonValue(new Map([["k", new Set(["b", "a", 10])]])), { k: ["a", "b", 10] });
    assert.equal(toJsonValue(new Uint8Array([0, 255, 1])), "AP8B");
    assert.throws(() => canonicalJson(Number.NaN), TypeError);
    assert.throws(() => canonicalJson({ f: Symbol("s") as unknown }), TypeError);
    assert.throws(() => canonicalJson(2n ** 60n), TypeError);
    assert.throws(() => canonicalJson("\ud800"), TypeError);
    const cycle: Record<string, unknown> = {};
    cycle["self"] = cycle;
    assert.throws(() => canonicalJson(cycle), TypeError);
  });
});

describe("keys", () => {
  it("derive_key: the same keys as the Python client", async () => {
    for (const call of python.calls) {
      assert.equal(await deriveKey(call.name, call.version, call.arguments), call.key);
    }
  });

  it("with params, once's arguments are those Python binds by name", async () => {
    const args = argumentsOf([1234, 25], ["order", "amount"]);
    assert.deepEqual(args, { order: 1234, amount: 25 });
    const refund = python.calls[0];
    assert.ok(refund);
    assert.equal(await deriveKey("refund", "v1", args), refund.key);
    assert.deepEqual(argumentsOf([1, 2, 3], undefined, [1]), [1, 3]);
    assert.throws(() => argumentsOf([1, 2, 3], ["a", "b"]), TypeError);
  });

  it("tool keys: the same as the Python client's default_key", async () => {
    for (const t of python.tools) {
      assert.equal(await toolKey({ tool: t.tool, run: t.run, arguments: t.arguments }), t.key, t.tool);
    }
  });

  it("refuses names and versions that cannot stand in a key", async () => {
    await assert.rejects(deriveKey("a:b", "v1", {}), RangeError);
    await assert.rejects(deriveKey("a", "", {}), RangeError);
    await assert.rejects(deriveKey("a", "v".repeat(33), {}), RangeError);
  });
});

describe("fingerprints", () => {
  it("are the server's, for every value of the fixture", async () => {
    const namespace = ns("fingerprints");
    let n = 0;
    for (const { value } of python.values) {
      const key = `fp-${n++}`;
      const answer = await fx.client.claim(namespace, key, { request: value, lease: "5s" });
      assert.equal(answer.outcome, "acquired");
      const record = applied(await fx.client.extend(namespace, key, answer.fence, { lease: "5s" }));
      assert.equal(record.fingerprint, await fingerprint(value), `fingerprint of ${JSON.stringify(value)}`);
    }
  });

  it("a fingerprint computed here is one the server takes for the same request", async () => {
    const namespace = ns("fingerprint-given");
    const request = { amount: 25, order: 1234, memo: "é 😀" };
    const first = await fx.client.claim(namespace, "k", { fingerprint: await fingerprint(request), lease: "5s" });
    assert.equal(first.outcome, "acquired");
    // The same request spelled differently is the same fingerprint: in flight, not a mismatch.
    const again = await fx.client.claim(namespace, "k", { request: { memo: "é 😀", order: 1234.0, amount: 25 } });
    assert.equal(again.outcome, "in_flight");
    const other = await fx.client.claim(namespace, "k", { request: { ...request, amount: 26 } });
    assert.equal(other.outcome, "mismatch");
  });
});
