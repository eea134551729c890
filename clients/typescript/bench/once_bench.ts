/**
 * The per-call overhead of `once`, measured in one run: the undecorated function, a bare
 * `fetch` of one claim to the server (acquiring a new key, and answering a replay: the floors
 * of a guarded call), and `once` on first execution (claim + complete, with and without the
 * heartbeat) and on replay.
 *
 *     npm run bench                                   # starts its own `onceguard serve` (memory store)
 *     npm run bench -- --url http://127.0.0.1:8080 --api-key og_…   # or a running server
 *     npm run bench -- --calls 2000
 *
 * Prints calls/s, mean, p50 and p99 per variant, and each variant's time over the bare fetch.
 * The replay of `once`, a bare `fetch` of the same claim (the same body, to the same key) and
 * the same request through `node:http` (the client's transport on Node) take turns in rounds of
 * 100 calls, so that all see the same machine; the last line says the figures and the
 * differences. The defaults (5,000 calls after 1,000 warm-up calls) leave the
 * JIT compiler time to settle: a few hundred calls measure code that is still interpreted.
 */

import { request } from "node:http";
import { parseArgs } from "node:util";
import { Client, deriveKey, once } from "onceguard";
import { Server } from "../test/server.js";

const { values } = parseArgs({
  options: {
    url: { type: "string" },
    "api-key": { type: "string" },
    calls: { type: "string", default: "5000" },
    warmup: { type: "string", default: "1000" },
  },
});
const calls = Number(values.calls);
const warmup = Number(values.warmup);

interface Figures {
  readonly name: string;
  readonly perSecond: number;
  readonly meanUs: number;
  readonly p50Us: number;
  readonly p99Us: number;
}

/** The figures of `times` (µs per call), `totalUs` the wall time they took. */
function figures(name: string, times: Float64Array, totalUs: number): Figures {
  const n = times.length;
  const sorted = [...times].sort((a, b) => a - b);
  const at = (q: number): number => sorted[Math.min(n - 1, Math.floor(q * n))] as number;
  return { name, perSecond: (n / totalUs) * 1e6, meanUs: totalUs / n, p50Us: at(0.5), p99Us: at(0.99) };
}

/** Time `n` sequential calls of `call(i)` (after `warmup` untimed ones). */
async function measure(name: string, call: (i: number) => Promise<unknown>, n = calls): Promise<Figures> {
  for (let i = 0; i < warmup; i++) await call(-1 - i);
  const times = new Float64Array(n);
  const start = process.hrtime.bigint();
  for (let i = 0; i < n; i++) {
    const t0 = process.hrtime.bigint();
    await call(i);
    times[i] = Number(process.hrtime.bigint() - t0) / 1000;
  }
  return figures(name, times, Number(process.hrtime.bigint() - start) / 1000);
}

/**
 * Time `n` sequential calls of each variant (after `warmup` untimed ones of each), the variants
 * taking turns in rounds of 100 calls; a variant's mean is the sum of its calls' times.
 */
async function measureTogether(variants: ReadonlyArray<readonly [string, (i: number) => Promise<unknown>]>, n = calls): Promise<Figures[]> {
  for (const [, call] of variants) for (let i = 0; i < warmup; i++) await call(-1 - i);
  const times = variants.map(() => new Float64Array(n));
  for (let from = 0; from < n; from += 100) {
    for (const [v, [, call]] of variants.entries()) {
      const own = times[v] as Float64Array;
      for (let i = from; i < Math.min(n, from + 100); i++) {
        const t0 = process.hrtime.bigint();
        await call(i);
        own[i] = Number(process.hrtime.bigint() - t0) / 1000;
      }
    }
  }
  return variants.map(([name], v) => {
    const own = times[v] as Float64Array;
    return figures(name, own, own.reduce((a, b) => a + b, 0));
  });
}

async function main(): Promise<void> {
  let server: Server | undefined;
  let url = values.url;
  let apiKey = values["api-key"];
  if (url === undefined) {
    server = new Server();
    await server.start();
    url = server.url;
    apiKey = server.adminKey;
  }
  try {
    const client = new Client({ baseUrl: url, apiKey: apiKey ?? "" });
    const run = `${process.pid}-${Date.now()}`;
    const namespace = `bench/once-${run}`;
    const effect = async (order: number, amount: number): Promise<{ refund: string; amount: number }> => ({ refund: `re_${order}`, amount });

    const results: Figures[] = [];
    results.push(await measure("undecorated call", (i) => effect(i, 25)));

    const headers = { authorization: `Bearer ${apiKey ?? ""}`, "content-type": "application/json" };
    results.push(
      await measure("bare fetch (one claim)", async (i) => {
        const response = await fetch(`${url}/v1/claims`, {
          method: "POST",
          headers,
          body: JSON.stringify({ namespace: `${namespace}/bare`, key: `k${i}`, request: { order: i, amount: 25 } }),
        });
        await response.text();
      }),
    );

    const first = once(effect, { client, namespace: `${namespace}/first`, name: "refund", params: ["order", "amount"] });
    results.push(await measure("once, first execution", (i) => first(i, 25)));
    const noBeat = once(effect, { client, namespace: `${namespace}/nobeat`, name: "refund", params: ["order", "amount"], heartbeat: false });
    results.push(await measure("once, first execution, no heartbeat", (i) => noBeat(i, 25)));
    // A replay, and a bare fetch of the same claim: the body `once` sends (its default lease and
    // wait included) for the same keys, which `first` completed above; and the same request
    // through node:http and its global keep-alive agent, the client's transport on Node.
    const keys = await Promise.all(Array.from({ length: 100 }, (_, order) => deriveKey("refund", "v1", { order, amount: 25 })));
    const replayBody = (i: number): string => {
      const order = Math.abs(i) % 100;
      return JSON.stringify({ namespace: `${namespace}/first`, key: keys[order], request: { order, amount: 25 }, lease: "30s", wait: "10s" });
    };
    const replays = await measureTogether([
      ["once, replay", (i) => first(Math.abs(i) % 100, 25)],
      [
        "bare fetch (one claim, a replay)",
        async (i) => {
          const response = await fetch(`${url}/v1/claims`, { method: "POST", headers, body: replayBody(i) });
          const text = await response.text();
          if (response.status !== 200) throw new Error(`a bare replay answered ${response.status}: ${text}`);
        },
      ],
      [
        "bare node:http (one claim, a replay)",
        (i) =>
          new Promise<void>((resolve, reject) => {
            const sent = request(`${url}/v1/claims`, { method: "POST", headers }, (response) => {
              response.resume();
              response.on("end", () =>
                response.statusCode === 200 ? resolve() : reject(new Error(`a bare replay answered ${response.statusCode}`)),
              );
              response.on("error", reject);
            });
            sent.on("error", reject);
            sent.end(replayBody(i));
          }),
      ],
    ]);
    results.push(...replays);

    // The client's own work, without the network: the same calls answered by a canned `fetch`.
    const canned = (text: string, status: number) => async (): Promise<Response> =>
      new Response(text, { status, headers: { "content-type": "application/json" } });
    const now = new Date().toISOString();
    const acquiredText = `{"outcome":"acquired","fence":1,"attempt":1,"lease_expires_at":"${now}","recovery":null}`;
    const recordText =
      `{"namespace":"n","key":"k","state":"completed","stuck":false,"fingerprint":"sha256:00","fence":1,"attempt":1,"run":null,` +
      `"lease_expires_at":null,"unknown":null,"completed_at":"${now}","created_at":"${now}","updated_at":"${now}","expires_at":"${now}","checkpoints":[]}`;
    const replayText =
      `{"outcome":"replay","fence":1,"attempt":1,"completed_at":"${now}","status":"success","content_type":"application/json",` +
      `"result":{"refund":"re_1","amount":25},"cost":null}`;
    const offline = (answer: (url: string) => Promise<Response>): Client =>
      new Client({ baseUrl: "http://offline.invalid", apiKey: "og_x_y", fetch: ((input: string) => answer(String(input))) as typeof fetch });
    const acquiredAnswer = canned(acquiredText, 201);
    const recordAnswer = canned(recordText, 200);
    const firstOffline = once(effect, {
      client: offline((u) => (u.endsWith("/v1/claims") ? acquiredAnswer() : recordAnswer())),
      namespace,
      name: "refund",
      params: ["order", "amount"],
    });
    results.push(await measure("once, first execution, client work only", (i) => firstOffline(i, 25)));
    const replayAnswer = canned(replayText, 200);
    const replayOffline = once(effect, { client: offline(() => replayAnswer()), namespace, name: "refund", params: ["order", "amount"] });
    results.push(await measure("once, replay, client work only", (i) => replayOffline(i, 25)));

    const bare = results[1] as Figures;
    console.log(`once benchmark: ${calls} sequential calls per variant (after ${warmup} warm-up calls), server ${url}`);
    console.log(["variant".padEnd(38), "calls/s".padStart(10), "mean µs".padStart(10), "p50 µs".padStart(10), "p99 µs".padStart(10), "× bare fetch".padStart(13)].join(""));
    for (const r of results) {
      console.log(
        [
          r.name.padEnd(38),
          r.perSecond.toFixed(0).padStart(10),
          r.meanUs.toFixed(1).padStart(10),
          r.p50Us.toFixed(1).padStart(10),
          r.p99Us.toFixed(1).padStart(10),
          (r.meanUs / bare.meanUs).toFixed(2).padStart(13),
        ].join(""),
      );
    }
    const [, , firstRun, , replay, bareReplay, nodeReplay, firstClient, replayClient] = results as [
      Figures, Figures, Figures, Figures, Figures, Figures, Figures, Figures, Figures,
    ];
    const signed = (us: number): string => `${us >= 0 ? "+" : "−"}${Math.abs(us).toFixed(0)} µs`;
    console.log(`once over the bare fetch: first execution ${signed(firstRun.meanUs - bare.meanUs)} (claim + complete: two round trips)`);
    console.log(
      `the client's own work per call (no network): first execution ${firstClient.meanUs.toFixed(0)} µs, replay ${replayClient.meanUs.toFixed(0)} µs`,
    );
    console.log(
      `replay, taking turns: once ${replay.meanUs.toFixed(0)} µs (p50 ${replay.p50Us.toFixed(0)}), ` +
        `bare fetch of the same claim ${bareReplay.meanUs.toFixed(0)} µs (p50 ${bareReplay.p50Us.toFixed(0)}): ` +
        `once adds ${signed(replay.meanUs - bareReplay.meanUs)} (p50 ${signed(replay.p50Us - bareReplay.p50Us)}); ` +
        `over a bare node:http request of it (${nodeReplay.meanUs.toFixed(0)} µs, p50 ${nodeReplay.p50Us.toFixed(0)}) ` +
        `${signed(replay.meanUs - nodeReplay.meanUs)} (p50 ${signed(replay.p50Us - nodeReplay.p50Us)})`,
    );
  } finally {
    await server?.cleanup();
  }
}

await main();
