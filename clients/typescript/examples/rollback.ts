// Rolling a run back: each charge registers how to undo it; an admin rolls the agent's run back;
// a worker refunds every charge, newest first, each once however many workers there are.
// Run it next to a server, with an agent key and an admin key:
// ONCEGUARD_URL=http://127.0.0.1:8080 ONCEGUARD_API_KEY=og_… ONCEGUARD_ADMIN_KEY=og_… node dist/examples/rollback.js
import { Client, once, runCompensations, type UndoContext } from "onceguard";

const client = new Client(); // the agent's: $ONCEGUARD_URL and $ONCEGUARD_API_KEY
const admin = new Client({ apiKey: process.env["ONCEGUARD_ADMIN_KEY"] }); // an admin's, to roll back
const namespace = "examples/rolled-back-charges";
const run = `agent-run-${Date.now()}`;

// Stands in for the payment system.
const charges = new Map<string, number>();

// The undo, registered under its own name ("refundCharge") when `once` is made below: a worker
// finds it there (a worker in another process imports the same module, or is handed it).
async function refundCharge(data: { charge: string }, context: UndoContext) {
  charges.delete(data.charge); // e.g. await payments.refund(data.charge)
  return { refunded: data.charge, recovered: context.task.recovery !== null };
}

const charge = once(
  async (customer: string, amount: number) => {
    const id = `ch_${charges.size + 1}`;
    charges.set(id, amount); // the effect, e.g. await payments.charge(customer, amount)
    return { charge: id, customer, amount };
  },
  {
    client,
    namespace,
    name: "charge",
    params: ["customer", "amount"],
    run,
    undo: refundCharge,
    undoData: (result) => ({ charge: result.charge }), // what the undo needs (default: the whole result)
  },
);

for (const customer of ["c_1", "c_2", "c_3"]) await charge(customer, 100);
console.log(`charges before: ${charges.size}`);

const rollback = await admin.rollback(run, "the agent charged the wrong customers"); // the run's new claims are refused
console.log(`to undo: ${rollback.pending} of ${rollback.effects} effects`);

const summary = await runCompensations(client, run, { idleTimeoutMs: 5_000 });
console.log(`compensated: ${summary.compensated}, failed: ${summary.failed}, done: ${summary.done}`);
const status = await client.rollbackStatus(run);
console.log(status?.tasks.map((task) => `${(task.compensation.data as { charge: string }).charge} ${task.state}`).join(", "));
console.log(`charges after: ${charges.size}`);
