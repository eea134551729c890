// A charge whose first attempt timed out after the request was sent: the next call is a
// recovery, whose `verify` asks the payment system, finds the charge, and stores it as the
// outcome (reconciled) without charging again.
// Run it next to a server: ONCEGUARD_URL=http://127.0.0.1:8080 ONCEGUARD_API_KEY=og_… node dist/examples/verify.js
import { Client, OutcomeUnknown, current, deriveKey, happened, once } from "onceguard";

const client = new Client();
const namespace = "examples/reconciled-charges";

// Stands in for the payment system: it keeps each charge under the caller's reference.
const payments = new Map<string, { charge: string; amount: number }>();
let timeouts = 0;

const charge = once(
  async (order: string, amount: number) => {
    const attempt = current();
    const reference = `pay-${order}`;
    await attempt.checkpoint("sending", { reference }); // what a recovery needs to ask about it
    payments.set(reference, { charge: `ch_${payments.size + 1}`, amount }); // the charge goes through…
    if (timeouts++ === 0) throw new OutcomeUnknown("the payment API timed out after the request was sent"); // …the answer is lost
    return payments.get(reference);
  },
  {
    client,
    namespace,
    name: "charge",
    params: ["order", "amount"],
    // Called on a recovery only, before the function: did the earlier attempt's charge happen?
    verify: async ({ checkpoint }) => {
      const reference = (checkpoint?.data as { reference?: string } | undefined)?.reference;
      const found = reference === undefined ? undefined : payments.get(reference);
      return found === undefined ? undefined : happened(found); // undefined: it did not, so charge
    },
  },
);

await charge("o-1", 25).catch((error: Error) => console.log("first attempt:", error.message));
console.log("second attempt:", await charge("o-1", 25)); // verify found it: stored, not charged again
const record = await client.getRecord(namespace, await deriveKey("charge", "v1", { order: "o-1", amount: 25 }));
console.log(`reconciled: ${record?.reconciled}, charges made: ${payments.size}`);
