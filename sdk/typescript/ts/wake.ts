// A wait that a native thread ends: the binding's threads call a waker (a napi threadsafe
// function, src/lib.rs `Waker`) that runs on the event loop's thread and resolves the wait
// under way. The subscriber waits so for a poll, the publisher for its staged messages to be
// handed over.

/**
 * One wait at a time for a native thread's signal, with a timer beside it: the timer keeps
 * the event loop alive while the wait lasts (the waker is weak, so that an object nobody
 * waits on can be collected and the process can end) and bounds a wait to `ms`, after which
 * the caller looks again.
 */
export class Wake {
  /** Ends the wait under way; undefined when there is none. */
  #done: (() => void) | undefined;

  /** Ends the wait under way, if any (what the native waker calls). */
  wake(): void {
    this.#done?.();
  }

  /** Resolves when {@link Wake.wake} is called, or after `ms`, whichever comes first. */
  until(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        if (this.#done === done) this.#done = undefined;
        resolve();
      };
      const timer = setTimeout(done, ms);
      this.#done = done;
    });
  }
}

/**
 * The function to give a native object's `setWaker`: it wakes `wakeOf(owner)`. It reaches the
 * owner through a WeakRef: the native side holds the function as a root, and the function must
 * not keep its owner reachable by itself (a subscriber dropped without `close()` must still be
 * collected, and its connection closed).
 */
export function wakerOf<T extends object>(owner: T, wakeOf: (owner: T) => Wake): () => void {
  const self = new WeakRef(owner);
  return () => {
    const o = self.deref();
    if (o !== undefined) wakeOf(o).wake();
  };
}
