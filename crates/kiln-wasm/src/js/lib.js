// kiln's JavaScript library, compiled by the prelude on first use: Node's util.inspect and
// util.format as console.log prints them (depth 2, 80 columns, arrays grouped in columns),
// the rest of console, and process. Written after Node's documented output; kept apart from
// the prelude so a program that logs only strings and numbers never compiles it.
(function (env) {
  "use strict";
  const EXEC_PATH = "/usr/local/bin/node";
  const BREAK = 80;
  const IDENT = /^[a-zA-Z_][a-zA-Z_0-9]*$/;
  const ESCAPE = /[\x00-\x1f\x27\x5c\x7f-\x9f]/;
  const ESCAPE_ALL = /[\x00-\x1f\x27\x5c\x7f-\x9f]/g;
  const ESCAPE_NO_QUOTE = /[\x00-\x1f\x5c\x7f-\x9f]/;
  const ESCAPE_NO_QUOTE_ALL = /[\x00-\x1f\x5c\x7f-\x9f]/g;
  const hex = (c) => "\\x" + c.toString(16).toUpperCase().padStart(2, "0");
  const META = { 8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r", 39: "\\'", 92: "\\\\" };
  const escapeChar = (ch) => META[ch.charCodeAt(0)] || hex(ch.charCodeAt(0));

  function quote(s) {
    let q = "'", test = ESCAPE, all = ESCAPE_ALL;
    if (s.includes("'")) {
      if (!s.includes('"')) q = '"';
      else if (!s.includes("`") && !s.includes("${")) q = "`";
      if (q !== "'") {
        test = ESCAPE_NO_QUOTE;
        all = ESCAPE_NO_QUOTE_ALL;
      }
    }
    if (test.test(s)) s = s.replace(all, escapeChar);
    return q + s + q;
  }

  const num = (n) => (n === 0 && 1 / n < 0 ? "-0" : String(n));

  function primitive(v, ctx) {
    switch (typeof v) {
      case "string":
        if (v.length > 16 && v.length > BREAK - ctx.indent - 4) {
          return v
            .split(/(?<=\n)/)
            .map(quote)
            .join(" +\n" + " ".repeat(ctx.indent + 2));
        }
        return quote(v);
      case "number":
        return num(v);
      case "bigint":
        return v + "n";
      case "symbol":
        return v.toString();
      default:
        return String(v);
    }
  }

  function constructorName(v) {
    let o = v;
    while (o !== null && o !== undefined) {
      const d = Object.getOwnPropertyDescriptor(o, "constructor");
      if (d && typeof d.value === "function" && d.value.name !== "" && v instanceof d.value) {
        return d.value.name;
      }
      o = Object.getPrototypeOf(o);
    }
    return Object.getPrototypeOf(v) === null ? null : "Object";
  }

  function prefix(ctor, tag, fallback, size = "") {
    if (ctor === null) {
      if (tag !== "" && fallback !== tag) return `[${fallback}${size}: null prototype] [${tag}] `;
      return `[${fallback}${size}: null prototype] `;
    }
    if (tag !== "" && ctor !== tag) return `${ctor}${size} [${tag}] `;
    return `${ctor}${size} `;
  }

  const isIndex = (k) => String(k >>> 0) === k && k >>> 0 !== 4294967295;

  // Enumerable own keys then symbols; with showHidden (%o), every own key.
  function ownKeys(v, skipIndices, ctx) {
    let keys = ctx.showHidden ? Object.getOwnPropertyNames(v) : Object.keys(v);
    if (skipIndices) keys = keys.filter((k) => !isIndex(k));
    for (const s of Object.getOwnPropertySymbols(v)) {
      if (ctx.showHidden || Object.prototype.propertyIsEnumerable.call(v, s)) keys.push(s);
    }
    return keys;
  }

  function functionBase(v, ctor, tag) {
    const src = Function.prototype.toString.call(v);
    if (src.startsWith("class") && src.endsWith("}")) {
      const name = (Object.prototype.hasOwnProperty.call(v, "name") && v.name) || "(anonymous)";
      let base = `class ${name}`;
      if (ctor !== "Function" && ctor !== null) base += ` [${ctor}]`;
      if (tag !== "" && ctor !== tag) base += ` [${tag}]`;
      if (ctor !== null) {
        const sup = Object.getPrototypeOf(v).name;
        if (sup) base += ` extends ${sup}`;
      } else {
        base += " extends [null prototype]";
      }
      return `[${base}]`;
    }
    let type = "Function";
    const kind = Object.getPrototypeOf(v);
    const kindName = kind && kind.constructor && kind.constructor.name;
    if (kindName === "GeneratorFunction") type = "GeneratorFunction";
    else if (kindName === "AsyncFunction") type = "AsyncFunction";
    else if (kindName === "AsyncGeneratorFunction") type = "AsyncGeneratorFunction";
    let base = `[${type}`;
    if (ctor === null) base += " (null prototype)";
    base += v.name === "" || typeof v.name !== "string" ? " (anonymous)" : `: ${v.name}`;
    base += "]";
    if (ctor !== type && ctor !== null && ctor !== "Function") base += ` ${ctor}`;
    if (tag !== "" && ctor !== tag) base += ` [${tag}]`;
    return base;
  }

  function errorBase(e, keys, ctx) {
    const name = e.name != null ? String(e.name) : "Error";
    const message = e.message != null ? String(e.message) : "";
    const head = message ? `${name}: ${message}` : name;
    // QuickJS's stack holds only the "    at" lines; Node's starts with the message.
    let stack = typeof e.stack === "string" ? e.stack.replace(/\n+$/, "") : "";
    if (!stack.startsWith(head)) stack = stack ? `${head}\n${stack}` : head;
    for (const k of ["name", "message", "stack"]) {
      const at = keys.indexOf(k);
      if (at !== -1 && typeof e[k] === "string" && stack.includes(e[k])) keys.splice(at, 1);
    }
    if ("cause" in e && !keys.includes("cause")) keys.push("cause");
    if (Array.isArray(e.errors) && !keys.includes("errors")) keys.push("errors");
    if (!stack.includes("\n    at")) stack = `[${stack}]`;
    if (ctx.indent !== 0) stack = stack.replaceAll("\n", "\n" + " ".repeat(ctx.indent));
    return stack;
  }

  const TYPED = Object.getPrototypeOf(Uint8Array);

  function boxed(v) {
    for (const [T, name] of [
      [Number, "Number"],
      [String, "String"],
      [Boolean, "Boolean"],
      [BigInt, "BigInt"],
      [Symbol, "Symbol"],
    ]) {
      try {
        const p = T.prototype.valueOf.call(v);
        return [name, p];
      } catch {
        // not this kind
      }
    }
    return null;
  }

  function value(v, depth, ctx) {
    if ((typeof v !== "object" || v === null) && typeof v !== "function") return primitive(v, ctx);
    if (ctx.seen.includes(v)) {
      let index = ctx.circular.get(v);
      if (index === undefined) {
        index = ctx.circular.size + 1;
        ctx.circular.set(v, index);
      }
      return `[Circular *${index}]`;
    }
    return raw(v, depth, ctx);
  }

  function raw(v, depth, ctx) {
    const ctor = constructorName(v);
    let tag = v[Symbol.toStringTag];
    // An own enumerable tag is printed as a key already.
    if (typeof tag !== "string" || Object.prototype.propertyIsEnumerable.call(v, Symbol.toStringTag)) tag = "";
    let keys;
    let base = "";
    let braces;
    let items = () => [];
    let arrayLike = false;
    if (Array.isArray(v)) {
      keys = ownKeys(v, true, ctx);
      const p = ctor !== "Array" || tag !== "" ? prefix(ctor, tag, "Array", `(${v.length})`) : "";
      braces = [`${p}[`, "]"];
      if (v.length === 0 && keys.length === 0) return `${braces[0]}]`;
      arrayLike = true;
      items = () => arrayItems(v, depth, ctx);
    } else if (v instanceof Set) {
      keys = ownKeys(v, false, ctx);
      const p = prefix(ctor, tag, "Set", `(${v.size})`);
      if (v.size === 0 && keys.length === 0) return `${p}{}`;
      braces = [`${p}{`, "}"];
      items = () => nested(ctx, () => [...v].map((x) => value(x, depth, ctx)));
    } else if (v instanceof Map) {
      keys = ownKeys(v, false, ctx);
      const p = prefix(ctor, tag, "Map", `(${v.size})`);
      if (v.size === 0 && keys.length === 0) return `${p}{}`;
      braces = [`${p}{`, "}"];
      items = () =>
        nested(ctx, () =>
          [...v].map(([k, x]) => `${value(k, depth, ctx)} => ${value(x, depth, ctx)}`)
        );
    } else if (v instanceof TYPED) {
      keys = ownKeys(v, true, ctx);
      const fallback = Object.getPrototypeOf(v)[Symbol.toStringTag];
      const p = prefix(ctor, tag === fallback ? "" : tag, fallback, `(${v.length})`);
      braces = [`${p}[`, "]"];
      if (v.length === 0 && keys.length === 0) return `${braces[0]}]`;
      arrayLike = true;
      items = () => {
        const shown = Math.min(v.length, 100);
        const out = [];
        for (let i = 0; i < shown; i++) out.push(typeof v[i] === "bigint" ? v[i] + "n" : num(v[i]));
        if (v.length > shown) out.push(more(v.length - shown));
        return out;
      };
    } else {
      keys = ownKeys(v, false, ctx);
      braces = ["{", "}"];
      const box = boxed(v);
      if (ctor === "Object") {
        if (tag !== "") braces[0] = `${prefix(ctor, tag, "Object")}{`;
        if (keys.length === 0) return `${braces[0]}}`;
      } else if (typeof v === "function") {
        base = functionBase(v, ctor, tag);
        if (keys.length === 0) return base;
      } else if (v instanceof RegExp) {
        base = RegExp.prototype.toString.call(v);
        const p = prefix(ctor, tag, "RegExp");
        if (p !== "RegExp ") base = p + base;
        if (keys.length === 0 || depth > ctx.depth) return base;
      } else if (v instanceof Date) {
        const t = Date.prototype.getTime.call(v);
        base = Number.isNaN(t) ? "Invalid Date" : Date.prototype.toISOString.call(v);
        const p = prefix(ctor, tag, "Date");
        if (p !== "Date ") base = p + base;
        if (keys.length === 0) return base;
      } else if (v instanceof Error) {
        base = errorBase(v, keys, ctx);
        if (keys.length === 0) return base;
      } else if (v instanceof ArrayBuffer) {
        const bytes = [...new Uint8Array(v, 0, Math.min(v.byteLength, 50))].map((b) =>
          b.toString(16).padStart(2, "0")
        );
        const rest = v.byteLength > 50 ? ` ... ${v.byteLength - 50} more byte${v.byteLength > 51 ? "s" : ""}` : "";
        braces[0] = `${prefix(ctor, tag, "ArrayBuffer")}{`;
        items = () => [`[Uint8Contents]: <${bytes.join(" ")}${rest}>`, `byteLength: ${v.byteLength}`];
      } else if (v instanceof Promise) {
        braces[0] = `${prefix(ctor, tag, "Promise")}{`;
        // QuickJS offers no way to read a promise's state from JavaScript.
        items = () => ["<unknown>"];
      } else if (v instanceof WeakMap || v instanceof WeakSet) {
        braces[0] = `${prefix(ctor, tag, v instanceof WeakMap ? "WeakMap" : "WeakSet")}{`;
        items = () => ["<items unknown>"];
      } else if (box !== null) {
        const [kind, p] = box;
        base = `[${kind}`;
        if (kind !== ctor) base += ctor === null ? " (null prototype)" : ` (${ctor})`;
        base += `: ${primitive(p, { indent: 0 })}]`;
        if (tag !== "" && tag !== ctor) base += ` [${tag}]`;
        if (kind === "String") keys = keys.filter((k) => !isIndex(k));
        if (keys.length === 0) return base;
      } else {
        if (keys.length === 0) return `${prefix(ctor, tag, "Object")}{}`;
        braces[0] = `${prefix(ctor, tag, "Object")}{`;
      }
    }
    if (depth > ctx.depth) {
      const name = prefix(ctor, tag, "Object").slice(0, -1);
      return ctor !== null ? `[${name}]` : name;
    }
    depth += 1;
    ctx.seen.push(v);
    ctx.current = depth;
    const output = items();
    for (const k of keys) output.push(property(v, k, depth, ctx));
    const ref = ctx.circular.get(v);
    if (ref !== undefined) base = base === "" ? `<ref *${ref}>` : `<ref *${ref}> ${base}`;
    ctx.seen.pop();
    return reduce(ctx, output, base, braces, arrayLike, depth, v);
  }

  function nested(ctx, f) {
    ctx.indent += 2;
    try {
      return f();
    } finally {
      ctx.indent -= 2;
    }
  }

  const more = (n) => `... ${n} more item${n > 1 ? "s" : ""}`;
  const empty = (n) => `<${n} empty item${n > 1 ? "s" : ""}>`;

  function arrayItems(v, depth, ctx) {
    const out = [];
    const limit = Math.min(100, v.length);
    let i = 0;
    for (; i < v.length && out.length < limit; i++) {
      if (!Object.prototype.hasOwnProperty.call(v, i)) {
        let j = i;
        while (j < v.length && !Object.prototype.hasOwnProperty.call(v, j)) j++;
        out.push(empty(j - i));
        i = j - 1;
        continue;
      }
      out.push(nested(ctx, () => value(v[i], depth, ctx)));
    }
    if (i < v.length) out.push(more(v.length - i));
    return out;
  }

  function property(v, key, depth, ctx) {
    const d = Object.getOwnPropertyDescriptor(v, key) || { value: v[key], enumerable: true };
    let str;
    if (d.value !== undefined) {
      str = nested(ctx, () => value(d.value, depth, ctx));
    } else if (d.get !== undefined) {
      str = d.set !== undefined ? "[Getter/Setter]" : "[Getter]";
    } else if (d.set !== undefined) {
      str = "[Setter]";
    } else {
      str = "undefined";
    }
    let name;
    if (typeof key === "symbol") name = `[${key.toString()}]`;
    else if (key === "__proto__") name = "['__proto__']";
    else if (d.enumerable === false) name = `[${key}]`;
    else if (IDENT.test(key)) name = key;
    else name = quote(key);
    return `${name}: ${str}`;
  }

  function group(ctx, output, v) {
    let total = 0;
    let maxLen = 0;
    let count = output.length;
    if (Array.isArray(v) || v instanceof TYPED) {
      if (v.length > 100 && count > 0) count--;
    }
    const lens = [];
    for (let i = 0; i < count; i++) {
      const len = output[i].length;
      lens.push(len);
      total += len + 2;
      if (maxLen < len) maxLen = len;
    }
    const actualMax = maxLen + 2;
    if (actualMax * 3 + ctx.indent < BREAK && (total / actualMax > 5 || maxLen <= 6)) {
      const bias = Math.sqrt(actualMax - total / output.length);
      const biasedMax = Math.max(actualMax - 3 - bias, 1);
      const columns = Math.min(
        Math.round(Math.sqrt(2.5 * biasedMax * count) / biasedMax),
        Math.floor((BREAK - ctx.indent) / actualMax),
        // Node's bound: compact (3) times four.
        12
      );
      if (columns <= 1) return output;
      const widths = [];
      for (let i = 0; i < columns; i++) {
        let w = 0;
        for (let j = i; j < output.length; j += columns) if (lens[j] > w) w = lens[j];
        widths.push(w + 2);
      }
      let numeric = true;
      for (let i = 0; i < output.length; i++) {
        if (typeof v[i] !== "number" && typeof v[i] !== "bigint") {
          numeric = false;
          break;
        }
      }
      const rows = [];
      for (let i = 0; i < count; i += columns) {
        const max = Math.min(i + columns, count);
        let row = "";
        let j = i;
        for (; j < max - 1; j++) {
          const cell = output[j] + ", ";
          row += numeric ? cell.padStart(widths[j - i]) : cell.padEnd(widths[j - i]);
        }
        row += numeric ? output[j].padStart(widths[j - i] - 2) : output[j];
        rows.push(row);
      }
      if (count < output.length) rows.push(output[count]);
      return rows;
    }
    return output;
  }

  function fits(output, start, base) {
    let total = output.length + start;
    if (total + output.length > BREAK) return false;
    for (const s of output) {
      total += s.length;
      if (total > BREAK) return false;
    }
    return base === "" || !base.includes("\n");
  }

  function reduce(ctx, output, base, braces, arrayLike, depth, v) {
    const entries = output.length;
    if (arrayLike && entries > 6) output = group(ctx, output, v);
    if (ctx.current - depth < 3 && entries === output.length) {
      const start = output.length + ctx.indent + braces[0].length + base.length + 10;
      if (fits(output, start, base)) {
        const joined = output.join(", ");
        if (!joined.includes("\n")) {
          return `${base ? `${base} ` : ""}${braces[0]} ${joined} ${braces[1]}`;
        }
      }
    }
    const indent = "\n" + " ".repeat(ctx.indent);
    return `${base ? `${base} ` : ""}${braces[0]}${indent}  ${output.join(`,${indent}  `)}${indent}${braces[1]}`;
  }

  function inspect(v, options) {
    const depth = options && options.depth !== undefined ? options.depth : 2;
    const ctx = {
      depth: depth === null ? Infinity : depth,
      showHidden: !!(options && options.showHidden),
      indent: 0,
      seen: [],
      circular: new Map(),
      current: 0,
    };
    return value(v, 0, ctx);
  }

  // Whether `v`'s toString is a builtin one (then %s inspects it, as Node does).
  const builtinToString = (v) => {
    if (typeof v.toString !== "function") return true;
    if (Object.prototype.hasOwnProperty.call(v, "toString")) return false;
    let p = v;
    do p = Object.getPrototypeOf(p);
    while (p !== null && !Object.prototype.hasOwnProperty.call(p, "toString"));
    const d = p && Object.getOwnPropertyDescriptor(p, "constructor");
    return !!d && typeof d.value === "function" && globalThis[d.value.name] === d.value;
  };

  function format(args) {
    const first = args[0];
    let a = 0;
    let str = "";
    let join = "";
    if (typeof first === "string") {
      if (args.length === 1) return first;
      let last = 0;
      for (let i = 0; i < first.length - 1; i++) {
        if (first.charCodeAt(i) !== 37) continue;
        const c = first[++i];
        if (a + 1 !== args.length) {
          let s;
          switch (c) {
            case "s": {
              const x = args[++a];
              if (typeof x === "number") s = num(x);
              else if (typeof x === "bigint") s = x + "n";
              else if (typeof x !== "object" || x === null || !builtinToString(x)) s = String(x);
              else s = inspect(x, { depth: 0 });
              break;
            }
            case "j":
              try {
                s = JSON.stringify(args[++a]);
              } catch {
                s = "[Circular]";
              }
              break;
            case "d": {
              const x = args[++a];
              s = typeof x === "bigint" ? x + "n" : typeof x === "symbol" ? "NaN" : num(Number(x));
              break;
            }
            case "i": {
              const x = args[++a];
              s = typeof x === "bigint" ? x + "n" : typeof x === "symbol" ? "NaN" : num(parseInt(x));
              break;
            }
            case "f": {
              const x = args[++a];
              s = typeof x === "symbol" ? "NaN" : num(parseFloat(x));
              break;
            }
            case "O":
              s = inspect(args[++a]);
              break;
            case "o":
              s = inspect(args[++a], { depth: 4, showHidden: true });
              break;
            case "c":
              a++;
              s = "";
              break;
            case "%":
              str += first.slice(last, i);
              last = i + 1;
              continue;
            default:
              continue;
          }
          if (last !== i - 1) str += first.slice(last, i - 1);
          str += s;
          last = i + 1;
        } else if (c === "%") {
          str += first.slice(last, i);
          last = i + 1;
        }
      }
      if (last !== 0) {
        a++;
        join = " ";
        if (last < first.length) str += first.slice(last);
      }
    }
    for (; a < args.length; a++) {
      const v = args[a];
      str += join + (typeof v === "string" ? v : inspect(v));
      join = " ";
    }
    return str;
  }

  // console beyond log/error (the prelude's), and group indentation.
  let indent = "";
  const out = (text) => env.print(indent ? indent + text.replaceAll("\n", "\n" + indent) : text);
  const err = (text) => env.err(indent ? indent + text.replaceAll("\n", "\n" + indent) : text);
  const counts = new Map();
  const timers = new Map();
  const elapsed = (label) => {
    const ms = performance.now() - timers.get(label);
    return ms >= 1000 ? `${(ms / 1000).toFixed(3)}s` : `${ms.toFixed(3)}ms`;
  };
  const regroup = () => {
    const log = (...a) => out(format(a));
    const error = (...a) => err(format(a));
    Object.assign(console, { log, info: log, debug: log, error, warn: error });
  };
  const extras = {
    dir: (v, options) => out(inspect(v, options)),
    dirxml: (...a) => out(format(a)),
    table: (data, columns) => out(table(data, columns)),
    assert: (ok, ...a) => {
      if (!ok) err(a.length ? format([`Assertion failed: ${a[0]}`, ...a.slice(1)]) : "Assertion failed");
    },
    trace: (...a) => {
      const stack = (new Error().stack || "").replace(/\n+$/, "").split("\n").slice(1).join("\n");
      err(`Trace${a.length ? ": " + format(a) : ""}${stack ? "\n" + stack : ""}`);
    },
    count: (label = "default") => {
      const n = (counts.get(`${label}`) || 0) + 1;
      counts.set(`${label}`, n);
      out(`${label}: ${n}`);
    },
    countReset: (label = "default") => counts.delete(`${label}`),
    time: (label = "default") => timers.set(`${label}`, performance.now()),
    timeLog: (label = "default", ...a) => {
      if (!timers.has(`${label}`)) return err(`Warning: No such label '${label}' for console.timeLog()`);
      out(format([`${label}: ${elapsed(`${label}`)}`, ...a]));
    },
    timeEnd: (label = "default") => {
      if (!timers.has(`${label}`)) return err(`Warning: No such label '${label}' for console.timeEnd()`);
      out(`${label}: ${elapsed(`${label}`)}`);
      timers.delete(`${label}`);
    },
    group: (...a) => {
      if (a.length) out(format(a));
      indent += "  ";
      regroup();
    },
    groupCollapsed: (...a) => extras.group(...a),
    groupEnd: () => {
      indent = indent.slice(2);
      regroup();
    },
  };

  function table(data, only) {
    if (data === null || typeof data !== "object") return format([data]);
    const cell = (v) => (v === undefined ? "" : typeof v === "string" ? quote(v) : inspect(v, { depth: 0 }));
    const rows = [];
    const columns = [];
    let values = false;
    const entries = data instanceof Map ? [...data] : Object.entries(data);
    for (const [key, row] of entries) {
      const line = { key: String(key), cells: {} };
      if (row !== null && typeof row === "object") {
        for (const [k, v] of Object.entries(row)) {
          if (only && !only.includes(k)) continue;
          if (!columns.includes(k)) columns.push(k);
          line.cells[k] = cell(v);
        }
      } else {
        values = true;
        line.value = cell(row);
      }
      rows.push(line);
    }
    const head = [data instanceof Map ? "(iteration index)" : "(index)", ...(only || columns)];
    if (values) head.push("Values");
    const body = rows.map((r) => [r.key, ...(only || columns).map((c) => r.cells[c] || ""), ...(values ? [r.value || ""] : [])]);
    const widths = head.map((h, i) => Math.max(h.length, ...body.map((b) => b[i].length)) + 2);
    const line = (l, m, r) => l + widths.map((w) => "\u2500".repeat(w)).join(m) + r;
    const text = (cells) => "\u2502" + cells.map((c, i) => " " + c.padEnd(widths[i] - 1)).join("\u2502") + "\u2502";
    return [line("\u250c", "\u252c", "\u2510"), text(head), line("\u251c", "\u253c", "\u2524"), ...body.map(text), line("\u2514", "\u2534", "\u2518")].join("\n");
  }

  const stream = (file, fd) => ({
    fd,
    isTTY: false,
    write(chunk, encoding, done) {
      if (typeof chunk === "string") file.puts(chunk);
      else if (ArrayBuffer.isView(chunk)) file.write(chunk.buffer, chunk.byteOffset, chunk.byteLength);
      else throw new TypeError('The "chunk" argument must be of type string or an instance of Buffer or Uint8Array');
      file.flush();
      const callback = typeof encoding === "function" ? encoding : done;
      if (typeof callback === "function") queueMicrotask(callback);
      return true;
    },
    on() {
      return this;
    },
    once() {
      return this;
    },
  });

  function process() {
    const started = performance.now();
    const hrtime = (prev) => {
      const ns = BigInt(Math.round(performance.now() * 1e6));
      const t = [Number(ns / 1000000000n), Number(ns % 1000000000n)];
      if (!prev) return t;
      let [s, n] = [t[0] - prev[0], t[1] - prev[1]];
      if (n < 0) {
        s -= 1;
        n += 1e9;
      }
      return [s, n];
    };
    hrtime.bigint = () => BigInt(Math.round(performance.now() * 1e6));
    const self = {
      title: "node",
      // A program file and its arguments, as the launcher of `node FILE ARG...` leaves them.
      argv: [EXEC_PATH, ...(globalThis[Symbol.for("kiln.argv")] || [])],
      argv0: "node",
      execPath: EXEC_PATH,
      execArgv: [],
      env: std.getenviron(),
      platform: "wasi",
      arch: "wasm32",
      pid: 1,
      ppid: 0,
      exitCode: undefined,
      versions: { quickjs: "0.17.0" },
      release: { name: "quickjs-ng" },
      stdout: stream(std.out, 1),
      stderr: stream(std.err, 2),
      exit(code) {
        const c = code === undefined ? self.exitCode : code;
        std.exit(c === undefined || c === null ? 0 : Number(c) | 0);
      },
      cwd: () => os.getcwd()[0],
      chdir(dir) {
        const e = os.chdir(String(dir));
        if (e) throw new Error(`ENOENT: no such file or directory, chdir '${dir}'`);
      },
      nextTick: (f, ...a) => queueMicrotask(() => f(...a)),
      hrtime,
      uptime: () => (performance.now() - started) / 1000,
      memoryUsage: () => ({ rss: 0, heapTotal: 0, heapUsed: 0, external: 0, arrayBuffers: 0 }),
      emitWarning: (w) => env.err(`Warning: ${w}`),
      on: () => self,
      once: () => self,
      off: () => self,
      addListener: () => self,
      removeListener: () => self,
      removeAllListeners: () => self,
      emit: () => false,
      listeners: () => [],
    };
    return self;
  }

  return { inspect, format, console: extras, process };
})
