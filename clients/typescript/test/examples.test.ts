/**
 * The examples (examples/*.ts) run as written against a real server, and docs/TYPESCRIPT.md
 * shows them verbatim.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";
import { promisify } from "node:util";
import { REPO, useServer } from "./server.js";

const fx = useServer();
const run = promisify(execFile);
const PACKAGE = join(REPO, "clients", "typescript");

async function example(name: string): Promise<string> {
  const script = join(PACKAGE, "dist", "examples", `${name}.js`);
  const env = { ...process.env, ONCEGUARD_URL: fx.server.url, ONCEGUARD_API_KEY: fx.agentKey, ONCEGUARD_ADMIN_KEY: fx.server.adminKey };
  const { stdout } = await run(process.execPath, [script], { env, cwd: PACKAGE, timeout: 60_000 });
  return stdout;
}

describe("examples", () => {
  it("quickstart: the refund happens once, and not again on the next run", async () => {
    const first = await example("quickstart");
    assert.match(first, /^same result/m);
    assert.match(first, /refunds made by this run: 1$/m);
    assert.match(await example("quickstart"), /refunds made by this run: 0$/m);
  });

  it("claims: acquired and completed, then replayed", async () => {
    assert.match(await example("claims"), /^opened \{ ticket: 'T-1'/m);
    assert.match(await example("claims"), /^replayed \{ ticket: 'T-1'/m);
  });

  it("approvals: awaiting approval, approved, refunded once; a later run replays", async () => {
    const first = await example("approvals");
    assert.match(first, /^awaiting approval apr_[0-9a-f]+: refund 25 EUR on order 1234$/m);
    assert.match(first, /^refunded \{ refund: 're_1234', amount: 25 \}$/m);
    assert.match(first, /^refunded again \{ refund: 're_1234', amount: 25 \}$/m);
    assert.match(first, /refunds made by this run: 1$/m);
    const again = await example("approvals");
    assert.doesNotMatch(again, /awaiting approval/);
    assert.match(again, /refunds made by this run: 0$/m);
  });

  it("verify: the recovery finds the charge and stores it reconciled, without charging again", async () => {
    const out = await example("verify");
    assert.match(out, /^first attempt: the payment API timed out after the request was sent$/m);
    assert.match(out, /^second attempt: \{ charge: 'ch_1', amount: 25 \}$/m);
    assert.match(out, /^reconciled: true, charges made: 1$/m);
  });

  it("observe: a duplicate runs in observe mode, and replays once enforced", async () => {
    const out = await example("observe");
    assert.match(out, /^would have been: replay$/m);
    assert.match(out, /^emails sent in observe mode: 2$/m);
    assert.match(out, /^emails sent in all: 2$/m);
  });

  it("rollback: three charges, each refunded once, newest first", async () => {
    const out = await example("rollback");
    assert.match(out, /^charges before: 3$/m);
    assert.match(out, /^to undo: 3 of 3 effects$/m);
    assert.match(out, /^compensated: 3, failed: 0, done: true$/m);
    assert.match(out, /^ch_3 compensated, ch_2 compensated, ch_1 compensated$/m);
    assert.match(out, /^charges after: 0$/m);
  });

  it("ai-sdk: two tool calls, one invoice", async () => {
    const out = await example("ai-sdk");
    const outputs = [...out.matchAll(/^call_\d (.*)$/gm)].map((m) => m[1]);
    assert.equal(outputs.length, 2);
    assert.equal(outputs[0], outputs[1]);
    assert.match(out, /invoices sent by this run: 1$/m);
  });

  it("openai-agents: two tool calls, one invoice", async () => {
    const out = await example("openai-agents");
    assert.match(out, /^Invoice sent\.$/m);
    assert.match(out, /invoices sent by this run: 1$/m);
  });

  it("langgraph: one refund for two calls, one charge across a crash", async () => {
    const out = await example("langgraph");
    assert.match(out, /^first run: the worker died after charging$/m);
    assert.match(out, /^second run: \{ charge: 'ch_1', order: 'o-1' \}$/m);
    assert.match(out, /refunds made by this run: 1, charges: 1$/m);
  });

  it("docs/TYPESCRIPT.md shows each example verbatim", () => {
    const doc = readFileSync(join(REPO, "docs", "TYPESCRIPT.md"), "utf8");
    const shown = [...doc.matchAll(/<!-- example: (\S+) -->\n```ts\n([\s\S]*?)```/g)];
    const names = shown.map((m) => m[1]);
    assert.deepEqual(names.sort(), [
      "ai-sdk.ts",
      "approvals.ts",
      "claims.ts",
      "langgraph.ts",
      "observe.ts",
      "openai-agents.ts",
      "quickstart.ts",
      "rollback.ts",
      "verify.ts",
    ]);
    for (const [, name, code] of shown) {
      const file = readFileSync(join(PACKAGE, "examples", name as string), "utf8");
      assert.equal(code, file, `docs/TYPESCRIPT.md shows examples/${name} as it is`);
    }
  });
});

