/**
 * One way of replaying a claim, many times in a row, to be profiled: `once`'s replay, or a bare
 * request of the same claim (the body `once` sends) through `fetch` or through `node:http`. One
 * way per process, so that a CPU profile holds nothing else:
 *
 *     node --cpu-prof --cpu-prof-dir=/tmp/p-once dist/bench/replay_profile.js --way once
 *     node --cpu-prof --cpu-prof-dir=/tmp/p-fetch dist/bench/replay_profile.js --way fetch
 *     node dist/bench/profile_summary.js /tmp/p-once --calls 22000     # warm-up + timed calls
 *
 * Starts its own `onceguard serve` (memory store; `$ONCEGUARD_BIN`), completes 100 keys, then
 * makes `--warmup` and `--calls` sequential replays of them and prints the timed calls' mean.
 */

import { request } from "node:http";
import { parseArgs } from "node:util";
import { Client, deriveKey, once } from "onceguard";
import { Server } from "../test/server.js";

const { values } = parseArgs({
  options: {
    way: { type: "string", default: "once" },
    calls: { type: "string", default: "20000" },
    warmup: { type: "string", default: "2000" },
  },
});
const calls = Number(values.calls);
const warmup = Number(values.warmup);

const server = new Server();
await server.start();
try {
  const apiKey = server.adminKey;
  const client = new Client({ baseUrl: server.url, apiKey });
  const namespace = `bench/replay-profile-${process.pid}`;
  const refund = once(async (order: number, amount: number) => ({ refund: `re_${order}`, amount }), {
    client,
    namespace,
    name: "refund",
    params: ["order", "amount"],
  });
  for (let order = 0; order < 100; order++) await refund(order, 25);
  const keys = await Promise.all(Array.from({ length: 100 }, (_, order) => deriveKey("refund", "v1", { order, amount: 25 })));
  const headers = { authorization: `Bearer ${apiKey}`, "content-type": "application/json" };
  const url = `${server.url}/v1/claims`;
  const body = (order: number): string =>
    JSON.stringify({ namespace, key: keys[order], request: { order, amount: 25 }, lease: "30s", wait: "10s" });
  const ways: Record<string, (order: number) => Promise<unknown>> = {
    once: (order) => refund(order, 25),
    fetch: async (order) => (await fetch(url, { method: "POST", headers, body: body(order) })).text(),
    "node-http": (order) =>
      new Promise<void>((resolve, reject) => {
        const sent = request(url, { method: "POST", headers }, (response) => {
          response.resume();
          response.on("end", resolve);
          response.on("error", reject);
        });
        sent.on("error", reject);
        sent.end(body(order));
      }),
  };
  const replay = ways[values.way ?? "once"];
  if (replay === undefined) throw new Error(`--way is one of ${Object.keys(ways).join(", ")}`);
  for (let i = 0; i < warmup; i++) await replay(i % 100);
  const started = performance.now();
  for (let i = 0; i < calls; i++) await replay(i % 100);
  console.log(`${values.way}: ${calls} replays, ${(((performance.now() - started) * 1000) / calls).toFixed(1)} µs each`);
} finally {
  await server.cleanup();
}
