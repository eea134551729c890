// A project of a user's: it installed the packed tarball (`npm install onceguard-*.tgz`) and
// compiles against its declarations with `skipLibCheck: false`.
import { Client, RecoveryNeedsVerifyError, deriveKey, once, type Approval, type Settings } from "onceguard";
import pkg from "onceguard/package.json" with { type: "json" };

const client = new Client({ baseUrl: "http://127.0.0.1:9", apiKey: "og_unused" });
const send = once(async (to: string) => `sent to ${to}`, { client, namespace: "packed/mail", name: "send", params: ["to"] });
const settings: Settings = { recovery: "ask", enforcePercent: 10 };
const pending: Approval | undefined = undefined;
console.log(
  JSON.stringify({
    name: pkg.name,
    key: await deriveKey("send", "v1", { to: "ops" }),
    once: typeof send,
    error: RecoveryNeedsVerifyError.name,
    settings,
    pending: pending ?? null,
  }),
);
