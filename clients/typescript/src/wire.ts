/**
 * How values cross the wire: durations, timestamps, request bodies, and the exact text of a
 * stored result inside an answer. No I/O.
 *
 * @module
 */

/**
 * A duration as the API takes it: seconds (a number), or the server's own spelling (`"500ms"`,
 * `"30s"`, `"2m"`, `"24h"`, `"7d"`).
 */
export type Duration = number | string;

const UNITS: Record<string, number> = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 };
const DURATION_TEXT = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$/;

/** A duration in seconds. */
export function durationSeconds(value: Duration): number {
  if (typeof value === "number") {
    if (!Number.isFinite(value) || value < 0) throw new RangeError(`not a duration: ${value}`);
    return value;
  }
  const match = DURATION_TEXT.exec(value);
  if (match === null) {
    throw new RangeError(`not a duration: ${JSON.stringify(value)} (use e.g. "500ms", "30s", "2m", "24h", "7d")`);
  }
  return Number(match[1]) * (UNITS[match[2] as string] as number);
}

/** The server's spelling of a duration: whole seconds as `"30s"`, anything else in ms. */
export function formatDuration(value: Duration): string {
  if (typeof value === "string") {
    durationSeconds(value); // refuse a typo here rather than as a 400 later
    return value.trim();
  }
  const millis = Math.round(durationSeconds(value) * 1000);
  return millis % 1000 === 0 ? `${millis / 1000}s` : `${millis}ms`;
}

/** A server timestamp (RFC 3339) as a `Date`. */
export function parseTime(text: unknown): Date {
  const date = new Date(String(text));
  if (Number.isNaN(date.getTime())) throw new TypeError(`not a timestamp: ${JSON.stringify(text)}`);
  return date;
}

/** {@link parseTime} for a field that may be absent or `null`. */
export function parseOptionalTime(text: unknown): Date | null {
  return text === null || text === undefined ? null : parseTime(text);
}

/** An RFC 3339 timestamp in UTC. */
export function formatTime(value: Date | string): string {
  return typeof value === "string" ? value : value.toISOString();
}

/** JSON text sent exactly as given, e.g. a result whose stored bytes must be known. */
export class RawJson {
  readonly text: string;
  constructor(text: string | Uint8Array) {
    this.text = typeof text === "string" ? text : new TextDecoder().decode(text);
  }
}

/** The client's JSON text of a value: compact; refuses what is not JSON. */
export function dumps(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value); // most fields: no replacer to call
  const text = JSON.stringify(value, (_key, v: unknown) => {
    if (typeof v === "number" && !Number.isFinite(v)) throw new TypeError(`${v} is not a JSON number`);
    if (typeof v === "bigint") return Number(v);
    return v;
  });
  if (text === undefined) throw new TypeError(`a ${typeof value} is not JSON`);
  return text;
}

/**
 * A request body: the members whose value is not `undefined` (a `null` is sent as `null`);
 * `RawJson` values spliced in verbatim.
 */
export function body(fields: Record<string, unknown>): string {
  const parts: string[] = [];
  for (const [name, value] of Object.entries(fields)) {
    if (value === undefined) continue;
    parts.push(JSON.stringify(name) + ":" + (value instanceof RawJson ? value.text : dumps(value)));
  }
  return "{" + parts.join(",") + "}";
}

const ENCODER = new TextEncoder();

/** The UTF-8 bytes of `text`. */
export function utf8(text: string): Uint8Array {
  return ENCODER.encode(text);
}

/** Bytes from base64. */
export function fromBase64(text: string): Uint8Array {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}

/** Base64 of bytes. */
export function toBase64(bytes: Uint8Array): string {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

// -- where a value lies in a JSON text --------------------------------------------------------
//
// JSON.parse gives values, not their text; a stored result must replay byte for byte, so its
// text is cut out of the answer where the server wrote it (verbatim).

function skipWhitespace(s: string, i: number): number {
  while (i < s.length) {
    const c = s.charCodeAt(i);
    if (c !== 0x20 && c !== 0x09 && c !== 0x0a && c !== 0x0d) break;
    i++;
  }
  return i;
}

function skipString(s: string, i: number): number {
  // s[i] is the opening quote
  i++;
  while (i < s.length) {
    const c = s.charCodeAt(i);
    if (c === 0x5c) i += 2;
    else if (c === 0x22) return i + 1;
    else i++;
  }
  throw new SyntaxError("unterminated JSON string");
}

/** The end of the JSON value starting at `s[i]` (no validation beyond the structure). */
function skipValue(s: string, i: number): number {
  i = skipWhitespace(s, i);
  const c = s[i];
  if (c === '"') return skipString(s, i);
  if (c === "{" || c === "[") {
    let depth = 0;
    while (i < s.length) {
      const d = s[i];
      if (d === '"') {
        i = skipString(s, i);
        continue;
      }
      if (d === "{" || d === "[") depth++;
      else if (d === "}" || d === "]") {
        depth--;
        if (depth === 0) return i + 1;
      }
      i++;
    }
    throw new SyntaxError("unterminated JSON container");
  }
  while (i < s.length && !",}] \t\n\r".includes(s[i] as string)) i++;
  return i;
}

/** Where each member's value of the JSON object starting at `s[i]` lies in `s`. */
export function memberSpans(s: string, i = 0): Map<string, [number, number]> {
  i = skipWhitespace(s, i);
  if (s[i] !== "{") throw new SyntaxError("not a JSON object");
  const spans = new Map<string, [number, number]>();
  i = skipWhitespace(s, i + 1);
  if (s[i] === "}") return spans;
  for (;;) {
    if (s[i] !== '"') throw new SyntaxError("expected a member name");
    const end = skipString(s, i);
    const name = JSON.parse(s.slice(i, end)) as string;
    i = skipWhitespace(s, end);
    if (s[i] !== ":") throw new SyntaxError("expected ':'");
    const start = skipWhitespace(s, i + 1);
    const stop = skipValue(s, start);
    spans.set(name, [start, stop]);
    i = skipWhitespace(s, stop);
    if (s[i] === ",") {
      i = skipWhitespace(s, i + 1);
      continue;
    }
    if (s[i] === "}") return spans;
    throw new SyntaxError("expected ',' or '}'");
  }
}

/** Where each element of the JSON array starting at `s[i]` lies in `s`. */
export function elementSpans(s: string, i = 0): Array<[number, number]> {
  i = skipWhitespace(s, i);
  if (s[i] !== "[") throw new SyntaxError("not a JSON array");
  const spans: Array<[number, number]> = [];
  i = skipWhitespace(s, i + 1);
  if (s[i] === "]") return spans;
  for (;;) {
    const stop = skipValue(s, i);
    spans.push([i, stop]);
    i = skipWhitespace(s, stop);
    if (s[i] === ",") {
      i = skipWhitespace(s, i + 1);
      continue;
    }
    if (s[i] === "]") return spans;
    throw new SyntaxError("expected ',' or ']'");
  }
}

/** The exact text of the value at `path` (object members) in the JSON `text`, if there is one. */
export function rawMember(text: string, ...path: string[]): string | undefined {
  let start = 0;
  let end = text.length;
  for (const name of path) {
    const span = memberSpans(text, start).get(name);
    if (span === undefined) return undefined;
    [start, end] = span;
  }
  return text.slice(start, end);
}

/** An environment variable, where the runtime has them (Node, Bun, Deno), else `undefined`. */
export function env(name: string): string | undefined {
  const g = globalThis as {
    process?: { env?: Record<string, string | undefined> };
    Deno?: { env?: { get(name: string): string | undefined } };
  };
  try {
    const value = g.process?.env?.[name] ?? g.Deno?.env?.get(name);
    return value === "" ? undefined : value;
  } catch {
    return undefined; // Deno without --allow-env
  }
}
