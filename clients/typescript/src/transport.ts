/**
 * How one request crosses the wire: a {@link Transport} sends it and reads the whole answer.
 *
 * - Over a `fetch` ({@link fetchTransport}): the one a client is given, or the platform's.
 * - On Node, while the platform's `fetch` is in place, over `node:http` and `node:https` with
 *   their global agents, which keep connections alive (Node 20's default): {@link nodeTransport}.
 *   Node's `fetch` builds a `Request`, a `Response` and web streams around every exchange; a
 *   replay's claim cost about 300 µs more through it than through `node:http` on the same
 *   connection (docs/PERFORMANCE.md, the TypeScript client). A `fetch` put in place of the
 *   platform's (a test double, an interceptor) is used as it is.
 *
 * Both reject with the signal's reason when it aborts, and with the platform's error when the
 * exchange fails (its `code`, e.g. `ECONNREFUSED`, says whether the request left; see
 * `notSent`).
 *
 * @module
 */

/** An answer's headers, by lower-case name. */
export interface AnswerHeaders {
  get(name: string): string | null;
}

/** An answer as read: its status, headers and whole text. */
export interface Answer {
  readonly status: number;
  readonly headers: AnswerHeaders;
  readonly text: string;
}

/** One request, whole. */
export interface Exchange {
  readonly method: string;
  readonly url: string;
  readonly headers: Readonly<Record<string, string>>;
  readonly body: string | undefined;
  /** Aborts the exchange: the transport rejects with its reason. */
  readonly signal: AbortSignal;
}

/** Sends one request and reads its whole answer. */
export type Transport = (exchange: Exchange) => Promise<Answer>;

/** A {@link Transport} over `fetchImpl`. */
export function fetchTransport(fetchImpl: typeof fetch): Transport {
  return async ({ method, url, headers, body, signal }) => {
    const init: RequestInit = { method, headers, signal };
    if (body !== undefined) init.body = body;
    const response = await fetchImpl(url, init);
    const text = await response.text();
    return { status: response.status, headers: response.headers, text };
  };
}

/** The platform's `fetch` as this module found it. */
const PLATFORM_FETCH: typeof fetch | undefined = (globalThis as { fetch?: typeof fetch }).fetch;

/** The platform's `fetch`, called as it is when the call is made (so that a replacement is seen). */
const platformFetch = fetchTransport((input, init) => fetch(input, init));

// -- node:http ---------------------------------------------------------------------------------
//
// The few parts of node:http this module uses, typed here: the package is compiled without
// Node's types, and loads node:http only on Node.

interface NodeResponse {
  readonly statusCode?: number;
  readonly headers: Readonly<Record<string, string | string[] | undefined>>;
  setEncoding(encoding: "utf8"): void;
  on(event: "data", listener: (chunk: string) => void): unknown;
  on(event: "end" | "close", listener: () => void): unknown;
  on(event: "error", listener: (error: Error) => void): unknown;
}

interface NodeRequest {
  on(event: "error", listener: (error: Error) => void): unknown;
  end(body?: string): unknown;
  destroy(error?: Error): unknown;
}

type NodeRequestFunction = (
  url: string,
  options: { readonly method: string; readonly headers: Readonly<Record<string, string>> },
  onResponse: (response: NodeResponse) => void,
) => NodeRequest;

/** `node:http`'s and `node:https`'s `request`. */
interface NodeHttp {
  readonly http: NodeRequestFunction;
  readonly https: NodeRequestFunction;
}

let nodeHttp: NodeHttp | null | undefined;
let loadingNodeHttp: Promise<NodeHttp | null> | undefined;

/** Whether this is Node itself (Bun and Deno, which also have `process`, keep their `fetch`). */
function isNode(): boolean {
  const g = globalThis as { process?: { versions?: { node?: string } }; Bun?: unknown; Deno?: unknown };
  return typeof g.process?.versions?.node === "string" && g.Bun === undefined && g.Deno === undefined;
}

/** `node:http` and `node:https` on Node, else `null`; loaded once. */
function loadNodeHttp(): Promise<NodeHttp | null> {
  loadingNodeHttp ??= (async (): Promise<NodeHttp | null> => {
    if (!isNode()) return (nodeHttp = null);
    const [httpSpecifier, httpsSpecifier] = ["node:http", "node:https"];
    try {
      const [http, https] = (await Promise.all([import(httpSpecifier), import(httpsSpecifier)])) as Array<{ request: NodeRequestFunction }>;
      nodeHttp = { http: (http as { request: NodeRequestFunction }).request, https: (https as { request: NodeRequestFunction }).request };
    } catch {
      nodeHttp = null;
    }
    return nodeHttp;
  })();
  return loadingNodeHttp;
}

function headersOf(response: NodeResponse): AnswerHeaders {
  return {
    get(name: string): string | null {
      const value = response.headers[name.toLowerCase()];
      if (value === undefined) return null;
      return Array.isArray(value) ? value.join(", ") : value;
    },
  };
}

/** A {@link Transport} over `node:http` / `node:https` (`http` and `https`: their `request`). */
export function nodeTransport({ http, https }: NodeHttp): Transport {
  return ({ method, url, headers, body, signal }) =>
    new Promise<Answer>((resolve, reject) => {
      if (signal.aborted) {
        reject(signal.reason);
        return;
      }
      let settled = false;
      const settle = (error: unknown, answer?: Answer): void => {
        if (settled) return;
        settled = true;
        signal.removeEventListener("abort", onAbort);
        if (answer === undefined) reject(error);
        else resolve(answer);
      };
      const send = url.startsWith("https:") ? https : http;
      const request = send(url, { method, headers }, (response) => {
        let text = "";
        let ended = false;
        response.setEncoding("utf8");
        response.on("data", (chunk) => {
          text += chunk;
        });
        response.on("end", () => {
          ended = true;
          settle(undefined, { status: response.statusCode ?? 0, headers: headersOf(response), text });
        });
        response.on("error", (error) => settle(error));
        response.on("close", () => {
          if (!ended) settle(Object.assign(new Error("the connection closed before the answer ended"), { code: "ECONNRESET" }));
        });
      });
      const onAbort = (): void => {
        settle(signal.reason);
        request.destroy();
      };
      signal.addEventListener("abort", onAbort, { once: true });
      request.on("error", (error) => settle(error));
      request.end(body);
    });
}

let node: Transport | undefined;

/**
 * The transport of a client given no `fetch`: `node:http` on Node while the platform's `fetch`
 * is in place, else the platform's `fetch`. A promise only until `node:http` is loaded.
 */
export function defaultTransport(): Transport | Promise<Transport> {
  if (globalThis.fetch !== PLATFORM_FETCH || nodeHttp === null) return platformFetch;
  if (node !== undefined) return node;
  return loadNodeHttp().then((loaded) => (loaded === null ? platformFetch : (node ??= nodeTransport(loaded))));
}
