// The client's claim answers, one by one: claim, do the effect, complete with the fence.
import { Client } from "onceguard";

const client = new Client();
const namespace = "examples/tickets";
const key = `ticket-${new Date().toISOString().slice(0, 10)}`;

const answer = await client.claim(namespace, key, { request: { alert: 42 }, lease: "30s", wait: "5s" });
switch (answer.outcome) {
  case "acquired": {
    const ticket = { ticket: "T-1", fence: answer.fence }; // the effect, with the fence downstream
    const done = await client.complete(namespace, key, answer.fence, ticket);
    console.log(done.outcome === "applied" ? "opened" : `not stored: ${done.reason}`, ticket);
    break;
  }
  case "replay":
    console.log("replayed", answer.result); // answer.raw: the stored bytes, exactly
    break;
  case "in_flight":
    console.log(`someone holds it; retry in ${answer.retryAfter}s`);
    break;
  case "mismatch":
    console.log("the key was used with another request");
    break;
  case "denied":
    console.log(`refused by a ${answer.kind}`, answer.reason); // kind "approval": an approver said no
    break;
  case "pending_approval":
    console.log(`a person must approve ${answer.approval.id} first; claim again in ${answer.retryAfter}s`);
    break;
  case "proceed": // the namespace is in observe mode: do the effect, nothing is held
    console.log(`proceeding; enforcement would have answered ${answer.wouldHaveBeen}`);
    break;
}
