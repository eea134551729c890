/**
 * Compensations: how a completed effect is undone if its run is rolled back. A completion
 * registers one (a name and JSON data); a worker (`runCompensations`) later finds the function
 * that undoes it by that name: one it is handed, or one of this process's undo functions,
 * registered here by `once(…, { undo })` and {@link registerUndo}.
 *
 * @module
 */

import type { Attempt } from "./guard.js";
import { checkCompensationName } from "./keys.js";
import type { AcquiredCompensation, Compensation } from "./models.js";
import { dumps, utf8 } from "./wire.js";

/** The most bytes a compensation's data may take, serialized. */
export const MAX_COMPENSATION_DATA = 16 * 1024;

/**
 * `compensation` with its data as sent (`null` if absent), or a `RangeError` where the server
 * would refuse it: a name of 1 to 128 printable ASCII characters, data of at most 16 KiB
 * serialized.
 */
export function checkCompensation(compensation: Compensation): Compensation {
  const name = checkCompensationName(compensation.name);
  const data = compensation.data === undefined ? null : compensation.data;
  const size = utf8(dumps(data)).length;
  if (size > MAX_COMPENSATION_DATA) {
    throw new RangeError(
      `the data of compensation ${JSON.stringify(name)} is ${size} bytes serialized, more than ${MAX_COMPENSATION_DATA}: keep only what the undo needs (undoData)`,
    );
  }
  return { name, data };
}

/** What an undo function is told besides its compensation's data. */
export interface UndoContext {
  /** The run being rolled back. */
  readonly run: string;
  /**
   * The task: the `effect` to undo, its `compensation`, and `recovery` when an earlier worker
   * took it and did not finish (the undo may have happened: check before undoing again).
   */
  readonly task: AcquiredCompensation;
  /** The attempt holding the task (also {@link current}()): `fence`, `checkpoint()`, `signal`. */
  readonly attempt: Attempt;
}

/**
 * Undo an effect, from its compensation's `data`. Its value completes the task (stored as
 * JSON). It throws as a function guarded by `once` does: {@link Permanent} (or a class in the
 * worker's `permanent`) fails the task for good, kept and shown; {@link OutcomeUnknown} reports
 * the outcome unknown, and the next worker recovers the task; any other error releases it, to
 * be run again.
 */
export type Undo = (data: never, context: UndoContext) => unknown;

/** This process's undo functions, by compensation name. */
const UNDO_FUNCTIONS = new Map<string, Undo>();

/**
 * Register `undo` under `name` (default: the function's own name) for this process's
 * compensation workers; returns the name. Registering the same function again, or a function of
 * the same source (a closure made again), replaces it; another function under a registered
 * name throws a `RangeError`: give one of them another name.
 */
export function registerUndo(undo: Undo, name?: string): string {
  if (typeof undo !== "function") throw new TypeError("an undo is a function of the compensation's data");
  const as = name ?? undo.name;
  if (as === "") throw new RangeError("the undo function has no name: name it (async function refundCharge(…)) or give its name");
  checkCompensationName(as);
  const known = UNDO_FUNCTIONS.get(as);
  if (known !== undefined && known !== undo && String(known) !== String(undo)) {
    throw new RangeError(`another undo function is registered as ${JSON.stringify(as)}: give this one another name`);
  }
  UNDO_FUNCTIONS.set(as, undo);
  return as;
}

/** The undo function registered under `name` in this process, if any. */
export function registeredUndo(name: string): Undo | undefined {
  return UNDO_FUNCTIONS.get(name);
}
