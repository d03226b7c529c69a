// Runs in every fresh JavaScript guest before the program, so it stays small (each closure
// it makes costs every one-shot): QuickJS's std and os as globals, console for strings and
// numbers, and stand-ins that compile the rest the first time a program needs it, from
// read-only files: lib.js (Node's formatting, the rest of console, process) and timers.js.
// kiln compiles this module to bytecode once per process.
import * as std from "qjs:std";
import * as os from "qjs:os";
import * as bjson from "qjs:bjson";

const g = globalThis;
g.std = std;
g.os = os;
g.bjson = bjson;
const print = console.log;
const err = (text) => std.err.puts(text + "\n");
const compile = (name) => std.loadScript("/usr/local/lib/kiln/" + name);
let lib;
let proc;
const load = () => lib || (lib = compile("lib.js")({ print, err }));

// Strings, numbers and booleans print as they are; anything else goes through lib.js.
const plain = (a) => {
  for (const v of a) {
    const t = typeof v;
    if (t === "object" ? v !== null : t === "function" || t === "symbol" || t === "bigint" || (v === 0 && 1 / v < 0)) {
      return false;
    }
  }
  return a.length < 2 || typeof a[0] !== "string" || !a[0].includes("%");
};
const log = (...a) => (plain(a) ? print(...a) : print(load().format(a)));
const error = (...a) => err(plain(a) ? a.map(String).join(" ") : load().format(a));
Object.assign(console, { log, info: log, debug: log, error, warn: error });
// console.table and the rest come from lib.js when first asked for.
Object.setPrototypeOf(console, new Proxy({}, { get: (_, name) => load().console[name] }));
Object.defineProperty(g, "process", {
  configurable: true,
  get: () => proc || (proc = load().process()),
  set: (v) => (proc = v),
});

// Timers: timers.js replaces these stand-ins on first use.
let timers;
for (const name of ["setTimeout", "setInterval", "setImmediate", "clearTimeout", "clearInterval", "clearImmediate"]) {
  g[name] = (...a) => ((timers ||= compile("timers.js")({ err, load })), g[name](...a));
}

// The host runs the event loop: it runs promise jobs until none is left, then calls
// step(), then fire() or sleeps, and again. step()'s promise settles once QuickJS has
// checked for unhandled rejections (it does so when the job queue is empty, before it runs
// its own timers, of which sleepAsync(0)'s is due at once), with the milliseconds until the
// next timer is due, or -1 when none is left.
const next = () => {
  const delay = timers ? timers.delay() : -1;
  if (delay < 0) {
    std.out.flush();
    const code = proc && proc.exitCode;
    if (code) std.exit(Number(code) | 0);
  }
  return delay;
};
g[Symbol.for("kiln")] = {
  step: () => os.sleepAsync(0).then(next),
  fire: () => timers.fire(),
  // A session's turn: the next timer's delay, without the check (which would end it).
  delay: () => (timers ? timers.delay() : -1),
};
