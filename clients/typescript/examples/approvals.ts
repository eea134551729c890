// A refund that needs a person's approval: the agent's first call is refused until an approver
// decides, nothing is done meanwhile, and once approved the refund runs, once.
// Run it next to a server, with an agent key and an admin key:
// ONCEGUARD_URL=http://127.0.0.1:8080 ONCEGUARD_API_KEY=og_… ONCEGUARD_ADMIN_KEY=og_… node dist/examples/approvals.js
import { AwaitingApprovalError, Client, once } from "onceguard";

const client = new Client(); // the agent's: $ONCEGUARD_URL and $ONCEGUARD_API_KEY
const admin = new Client({ apiKey: process.env["ONCEGUARD_ADMIN_KEY"] }); // an approver's (admin role)
const namespace = "examples/approved-refunds";
await admin.putSettings({ approvalRequired: true, approvalExpiry: "4h" }, { namespacePrefix: namespace, why: "refunds need a person" });

let refunds = 0;
const refund = once(
  async (order: number, amount: number) => {
    refunds += 1; // the effect, e.g. await payments.refund(order, amount)
    return { refund: `re_${order}`, amount };
  },
  {
    client,
    namespace,
    name: "refund",
    params: ["order", "amount"],
    wait: null, // answer at once; `waitForApproval: "5m"` would wait for the decision instead
    summary: (order, amount) => `refund ${amount} EUR on order ${order}`, // what the approver reads
  },
);

try {
  console.log("refunded", await refund(1234, 25)); // the key was approved and completed on an earlier run
} catch (error) {
  if (!(error instanceof AwaitingApprovalError)) throw error;
  console.log(`awaiting approval ${error.approval.id}: ${error.approval.summary}`); // nothing was done

  // The approver lists what waits for a decision, and approves it (or denies it: admin.deny).
  for await (const approval of admin.iterApprovals({ state: "pending" })) {
    if (approval.namespace === namespace) await admin.approve(approval.id, { why: "order 1234 was damaged in transit" });
  }
  console.log("refunded", await refund(1234, 25)); // the same call, again: approved, so it runs
}
console.log("refunded again", await refund(1234, 25)); // a retry replays: no second refund
console.log(`refunds made by this run: ${refunds}`);
