// The one-minute example: a refund that happens once, however often it is called.
// Run it next to a server: ONCEGUARD_URL=http://127.0.0.1:8080 ONCEGUARD_API_KEY=og_… node dist/examples/quickstart.js
import { Client, current, once } from "onceguard";

const client = new Client(); // $ONCEGUARD_URL and $ONCEGUARD_API_KEY

let refunds = 0;
const refund = once(
  async (order: number, amount: number) => {
    const { fence } = current(); // hand the fence downstream, so that it can refuse a stale writer
    refunds += 1; // the effect, e.g. await payments.refund(order, amount, { fence })
    return { refund: `re_${order}`, amount, fence };
  },
  { client, namespace: "examples/payments", name: "refund", version: "v1", params: ["order", "amount"] },
);

const first = await refund(1234, 25); // claims the key, runs the function, stores its result
const again = await refund(1234, 25); // a retry: replays the stored result, no second refund
console.log(JSON.stringify(first) === JSON.stringify(again) ? "same result" : "different results", first);
console.log(`refunds made by this run: ${refunds}`); // 1 the first time you run it, 0 after: the key replays
