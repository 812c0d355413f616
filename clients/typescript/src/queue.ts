/**
 * An async queue: producers push, one consumer iterates; end() or fail() closes it. It holds
 * whatever is pushed: a producer that must stay bounded watches `size` and `onTake`.
 */
export class AsyncQueue<T> implements AsyncIterableIterator<T> {
  private items: T[] = [];
  private waiters: Array<{ resolve: (r: IteratorResult<T>) => void; reject: (e: unknown) => void }> = [];
  private done = false;
  private error: unknown = undefined;
  private onReturn?: () => void;
  private onTake?: () => void;

  /** `onReturn`: the consumer stopped (`return()`, a `break`); `onTake`: it took an item. */
  constructor(onReturn?: () => void, onTake?: () => void) {
    this.onReturn = onReturn;
    this.onTake = onTake;
  }

  /** Items pushed and not yet taken. */
  get size(): number {
    return this.items.length;
  }

  push(item: T): void {
    if (this.done) return;
    const w = this.waiters.shift();
    if (w) w.resolve({ value: item, done: false });
    else this.items.push(item);
  }

  end(): void {
    if (this.done) return;
    this.done = true;
    for (const w of this.waiters.splice(0)) w.resolve({ value: undefined, done: true });
  }

  fail(err: unknown): void {
    if (this.done) return;
    this.done = true;
    this.error = err;
    for (const w of this.waiters.splice(0)) w.reject(err);
  }

  get closed(): boolean {
    return this.done;
  }

  next(): Promise<IteratorResult<T>> {
    if (this.items.length > 0) {
      const value = this.items.shift()!;
      this.onTake?.();
      return Promise.resolve({ value, done: false });
    }
    if (this.done) {
      if (this.error !== undefined) {
        const e = this.error;
        this.error = undefined; // thrown once, then the iterator just ends
        return Promise.reject(e);
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
  }

  return(): Promise<IteratorResult<T>> {
    if (!this.done) {
      this.items = [];
      this.end();
      this.onReturn?.();
    }
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<T> {
    return this;
  }
}
