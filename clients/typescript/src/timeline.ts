// Turns and steps around imported messages, so an imported conversation is a valid log.
//
// compactd accepts an assistant/message only inside an open step of an open turn, and a
// tool/result after the step that made its call. A user message opens a turn (closing the
// previous one once the assistant answered in it); each assistant message is one step; tool
// results, system and developer messages go where they come; finish() closes the open turn
// (reason "imported") unless the caller keeps it open.

import type { SessionEvent } from "./gen/compactd/v1/events_pb.js";
import { stepEnd, stepStart, turnEnd, turnStart } from "./events.js";

export class Timeline {
  readonly events: SessionEvent[] = [];
  private nextTurn: number;
  private turn: number | undefined;
  private steps = 0;

  constructor(firstTurn = 1) {
    this.nextTurn = firstTurn;
  }

  /** A system, developer or tool message, or a log-only event: appended as is. */
  other(event: SessionEvent): void {
    this.events.push(event);
  }

  /** User input: opens a turn (the next one, once the assistant answered in this one). */
  user(event: SessionEvent): void {
    if (this.turn !== undefined && this.steps > 0) {
      this.close("completed");
    }
    if (this.turn === undefined) {
      this.open();
    }
    this.events.push(event);
  }

  /** One model reply: one step of the open turn. */
  assistant(event: SessionEvent): void {
    if (this.turn === undefined) {
      this.open();
    }
    const turn = this.turn as number;
    this.steps += 1;
    this.events.push(stepStart(turn, this.steps), event, stepEnd(turn, this.steps));
  }

  /** Closes the open turn, if any. */
  close(reason: string): void {
    if (this.turn !== undefined) {
      this.events.push(turnEnd(this.turn, reason));
      this.turn = undefined;
    }
  }

  /** Every event, the last turn closed when `closeTurn`. */
  finish(closeTurn: boolean): SessionEvent[] {
    if (closeTurn) {
      this.close("imported");
    }
    return this.events;
  }

  private open(): void {
    this.turn = this.nextTurn;
    this.steps = 0;
    this.nextTurn += 1;
    this.events.push(turnStart(this.turn));
  }
}
