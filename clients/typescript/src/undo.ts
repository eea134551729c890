/**
 * This process's undo functions, by compensation name: registered by `once(…, { undo })`,
 * `guarded(…, { undo })` and {@link registerUndo}, found by a compensation worker
 * (`runCompensations`) when no handler it was handed has the task's name.
 *
 * @module
 */

import type { Attempt } from "./guard.js";
import { checkCompensationName } from "./keys.js";
import type { AcquiredCompensation } from "./models.js";

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
