/**
 * Where a CPU profile's time went, per call: the samples' self time summed by where the code
 * lives (this package's modules, undici, Node's web streams, node:http…, the garbage collector,
 * idle) and by function, divided by `--calls`.
 *
 *     node dist/bench/profile_summary.js DIR_OR_FILE.cpuprofile --calls 22000 [--top 30]
 *
 * A directory stands for the first `.cpuprofile` in it (what `node --cpu-prof-dir` writes).
 */

import { readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { parseArgs } from "node:util";

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: { calls: { type: "string", default: "1" }, top: { type: "string", default: "30" } },
});
const calls = Number(values.calls);
const top = Number(values.top);

interface CallFrame {
  readonly functionName: string;
  readonly url: string;
  readonly lineNumber: number;
}
interface Profile {
  readonly nodes: ReadonlyArray<{ readonly id: number; readonly callFrame: CallFrame }>;
  readonly samples: readonly number[];
  readonly timeDeltas: readonly number[];
}

let path = positionals[0];
if (path === undefined) throw new Error("give a .cpuprofile, or the directory that holds one");
if (statSync(path).isDirectory()) {
  const file = readdirSync(path).find((name) => name.endsWith(".cpuprofile"));
  if (file === undefined) throw new Error(`no .cpuprofile in ${path}`);
  path = join(path, file);
}
const profile = JSON.parse(readFileSync(path, "utf8")) as Profile;
const frames = new Map(profile.nodes.map((node) => [node.id, node.callFrame]));

/** Where a frame's code lives. */
function place(frame: CallFrame): string {
  const url = frame.url;
  if (url === "") return frame.functionName; // (idle), (garbage collector), (program), natives
  const own = /\/dist\/src\/([^/]+)$/.exec(url);
  if (own) return `onceguard ${own[1]}`;
  if (url.startsWith("node:internal/deps/undici")) return "undici (Node's fetch)";
  if (url.startsWith("node:internal/webstreams") || url.startsWith("node:internal/worker/js_transferable")) return "web streams";
  if (url.startsWith("node:internal/crypto")) return "node:crypto";
  if (/^node:_?http/.test(url)) return "node:http";
  if (url.startsWith("node:")) return "Node, other";
  return url.split("/").pop() ?? url;
}

const byPlace = new Map<string, number>();
const byFunction = new Map<string, number>();
let total = 0;
profile.samples.forEach((id, i) => {
  const frame = frames.get(id);
  const us = profile.timeDeltas[i] ?? 0;
  if (frame === undefined) return;
  total += us;
  const where = place(frame);
  byPlace.set(where, (byPlace.get(where) ?? 0) + us);
  const name = `${frame.functionName || "(anonymous)"} ${where}:${frame.lineNumber + 1}`;
  byFunction.set(name, (byFunction.get(name) ?? 0) + us);
});

const line = (us: number, what: string): string =>
  `${((100 * us) / total).toFixed(1).padStart(6)}% ${(us / calls).toFixed(1).padStart(8)} µs  ${what}`;
console.log(`${path}: ${(total / 1000).toFixed(0)} ms sampled, ${(total / calls).toFixed(1)} µs per call (${calls} calls)`);
for (const [what, us] of [...byPlace].sort((a, b) => b[1] - a[1])) if (us / total >= 0.005) console.log(line(us, what));
console.log("by function (self time):");
for (const [what, us] of [...byFunction].sort((a, b) => b[1] - a[1]).slice(0, top)) console.log(line(us, what));
