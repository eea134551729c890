// Observe mode: put Onceguard in front of an effect without changing what runs. A duplicate call
// still runs, and says what enforcement would have done; once the namespace enforces, it replays.
// Run it next to a server, with an agent key and an admin key:
// ONCEGUARD_URL=http://127.0.0.1:8080 ONCEGUARD_API_KEY=og_… ONCEGUARD_ADMIN_KEY=og_… node dist/examples/observe.js
import { Client, current, once } from "onceguard";

const client = new Client(); // the agent's: $ONCEGUARD_URL and $ONCEGUARD_API_KEY
const admin = new Client({ apiKey: process.env["ONCEGUARD_ADMIN_KEY"] }); // an admin's, to change the settings
const namespace = "examples/observed-emails";
await admin.putSettings({ mode: "observe" }, { namespacePrefix: namespace, why: "see what enforcing would do" });

let sent = 0;
const send = once(
  async (to: string, subject: string) => {
    const { observed } = current(); // set when enforcement would not have let this call run
    if (observed !== null) console.log(`would have been: ${observed.wouldHaveBeen}`);
    sent += 1; // the effect, e.g. await mailer.send(to, subject)
    return { to, subject };
  },
  { client, namespace, name: "send", params: ["to", "subject"] },
);

await send("ada@example.com", "Your invoice");
await send("ada@example.com", "Your invoice"); // a duplicate: it runs, and would have replayed
console.log(`emails sent in observe mode: ${sent}`);

await admin.putSettings({ mode: "enforce" }, { namespacePrefix: namespace, why: "the duplicates were real: enforce" });
await send("ada@example.com", "Your invoice"); // enforced: the stored outcome replays, nothing is sent
console.log(`emails sent in all: ${sent}`);
