/**
 * Compensations: how a completed effect is undone if its run is rolled back. A completion
 * registers one (a name and JSON data), checked here as the server would; a worker
 * (`runCompensations`) later finds the function that undoes it by that name: one it is handed,
 * or one of this process's undo functions (`registerUndo`, in `undo.ts`).
 *
 * @module
 */

import { checkCompensationName } from "./keys.js";
import type { Compensation } from "./models.js";
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
