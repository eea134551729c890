// A user's mistake: `once` given neither `name` nor `key`. The type error must name `name`
// (scripts/typescript-tests compiles this file and expects exactly that error).
import { Client, once } from "onceguard";

export const send = once(async (to: string) => `sent to ${to}`, {
  client: new Client({ baseUrl: "http://127.0.0.1:9" }),
  namespace: "packed/mail",
});
