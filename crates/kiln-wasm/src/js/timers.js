// Node's timers, compiled by the prelude the first time a program asks for one; they
// replace the prelude's stand-ins on globalThis. They are kept here, in order, and the host
// sleeps until the next is due (QuickJS's own timers fire only between promise jobs, not
// after all of them as Node's do). A callback that throws ends the program with exit code
// 1, as in Node.
(function (env) {
  "use strict";
  const g = globalThis;
  // Pending timers by due time, then by creation; each { id, due, interval, f, a, ref }.
  const queue = [];
  const byId = new Map();
  let next = 0;
  class Timeout {
    constructor(id) {
      this.id = id;
    }
    ref() {
      const t = byId.get(this.id);
      if (t) t.ref = true;
      return this;
    }
    unref() {
      const t = byId.get(this.id);
      if (t) t.ref = false;
      return this;
    }
    hasRef() {
      const t = byId.get(this.id);
      return !!t && t.ref;
    }
    refresh() {
      const t = byId.get(this.id);
      if (t) {
        remove(t);
        t.due = performance.now() + t.ms;
        insert(t);
      }
      return this;
    }
    [Symbol.toPrimitive]() {
      return this.id;
    }
  }
  const insert = (t) => {
    let lo = 0;
    let hi = queue.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (queue[mid].due <= t.due) lo = mid + 1;
      else hi = mid;
    }
    queue.splice(lo, 0, t);
    byId.set(t.id, t);
  };
  const remove = (t) => {
    const at = queue.indexOf(t);
    if (at !== -1) queue.splice(at, 1);
    byId.delete(t.id);
  };
  const start = (f, ms, a, repeat) => {
    if (typeof f !== "function") {
      throw new TypeError(
        `The "callback" argument must be of type function. Received ${f === null ? "null" : typeof f}`
      );
    }
    ms = +ms;
    // Node's bounds: anything else waits 1 ms.
    if (!(ms >= 1 && ms <= 2147483647)) ms = 1;
    const timeout = new Timeout(++next);
    const due = performance.now() + ms;
    insert({ id: timeout.id, due, ms, interval: repeat, f, a, ref: true, timeout });
    return timeout;
  };
  const stop = (handle) => {
    const id = handle !== null && typeof handle === "object" ? handle.id : handle;
    const t = byId.get(id);
    if (t) remove(t);
  };
  g.setTimeout = (f, ms, ...a) => start(f, ms, a, false);
  g.setInterval = (f, ms, ...a) => start(f, ms, a, true);
  // Node runs immediates after the timers already due: as a 1 ms timer, queued after them.
  g.setImmediate = (f, ...a) => start(f, 1, a, false);
  g.clearTimeout = g.clearInterval = g.clearImmediate = stop;
  return {
    // Milliseconds until the next timer is due; -1 when only unreferenced ones are left.
    delay() {
      if (!queue.some((t) => t.ref)) return -1;
      return Math.max(0, Math.ceil(queue[0].due - performance.now()));
    },
    // Runs the next timer's callback (the host calls it once it is due).
    fire() {
      const t = queue[0];
      if (!t) return;
      if (t.interval) {
        remove(t);
        t.due = performance.now() + t.ms;
        insert(t);
      } else {
        remove(t);
      }
      try {
        t.f.apply(t.timeout, t.a);
      } catch (e) {
        env.err(env.load().inspect(e));
        std.exit(1);
      }
    },
  };
})
