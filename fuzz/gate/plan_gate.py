"""plan_gate: a differential fuzzer of `kiln rest`'s syntax-tree gate (safety.py).

It runs inside a kiln Python sandbox, on the same interpreter plans run on, with kiln_rest's
own modules loaded from /gate as `kiln rest` loads them. It writes random plans from a
grammar of what plans are made of and what escapes are made of (attribute chains, calls,
imports, classes, exception handlers, match patterns, f-strings, decorators, lambdas,
comprehensions) over a vocabulary that grows with the attribute names of every value the
plans reach. Each plan goes to the gate; each plan the gate lets through runs in the plan's
namespace (`safety.run` with the driver's own names: a real store and safe_open over a real
tenant folder), watched.

Invariant (the differential): a plan that passes the gate reaches no refused capability.
Watched while it runs:
- every audit event (sys.addaudithook): plan code raises none, except opening, listing
  and changing files inside the tenant's folder (safe_open and the store), `builtins.id`,
  the standard library loading a module of its own lazily (the plan is not given it),
  typing compiling (never running) a string type argument into a forward reference, and
  CPython reporting an exception raised in a plan's `__del__`;
- every call of a builtin the gate refuses by name (sys.setprofile `c_call`): exec, eval,
  compile, __import__ (kiln's guarded import is not it), open, getattr, setattr, vars, ...;
- what the plan leaves in its namespace and returns: never a real module, frame, code
  object, traceback, the builtins the gate refuses, `type` or `object`.

It is not coverage-guided (libFuzzer cannot see inside Python): novelty is new types of
values reached, which keeps a plan in the pool to grow from.

Settings (environment): PLAN_GATE_SECONDS (default 60), PLAN_GATE_SEED (default: random,
printed), PLAN_GATE_CORPUS (a folder of seed plans, *.py, each run first).
Prints one JSON line per finding (`{"finding": ...}`) and a summary line at the end; exits 1
when anything was found.
"""

import builtins
import contextlib
import io
import json
import os
import random
import sys
import time
import types
import warnings

warnings.simplefilter("ignore", SyntaxWarning)

GATE = os.environ.get("PLAN_GATE_DIR", "/gate")
ROOT = os.environ.get("PLAN_GATE_ROOT", "/workspace/tenant")


def load_kiln_rest():
    """kiln_rest's modules, loaded as `kiln rest`'s first turn loads them."""
    pkg = types.ModuleType("kiln_rest")
    pkg.__path__ = []
    sys.modules["kiln_rest"] = pkg
    for name in ("store", "safety", "http_response", "router", "driver"):
        module = types.ModuleType(f"kiln_rest.{name}")
        module.__file__ = f"<kiln>/kiln_rest/{name}.py"
        module.__package__ = "kiln_rest"
        sys.modules[module.__name__] = module
        with open(f"{GATE}/{name}.py") as f:
            exec(compile(f.read(), module.__file__, "exec"), module.__dict__)
        setattr(pkg, name, module)
    return pkg


kiln_rest = load_kiln_rest()
safety = kiln_rest.safety
driver = kiln_rest.driver
store_mod = kiln_rest.store
os.makedirs(ROOT, exist_ok=True)
driver.init(ROOT, "fuzz")
REAL_ROOT = os.path.realpath(ROOT)

# Every allowed module imported now, so a plan's import finds it loaded (the import itself
# raises no audit event then, as in a session that has served requests).
for _name in safety.IMPORTABLE:
    safety._safe_module(_name)

# ------------------------------------------------------------------ the watch

REFUSED_BUILTINS = {
    id(getattr(builtins, n)): n
    for n in safety.FORBIDDEN_CALLS
    if hasattr(builtins, n) and isinstance(getattr(builtins, n), types.BuiltinFunctionType)
}
REFUSED_OBJECTS = {id(getattr(builtins, n)): n for n in safety.FORBIDDEN_CALLS if hasattr(builtins, n)}
REFUSED_OBJECTS[id(builtins)] = "the builtins module"
# Events that touch a path: allowed inside the tenant's folder.
PATH_EVENTS = {"open": 0, "os.listdir": 0, "os.scandir": 0, "os.mkdir": 0, "os.rename": 0,
               "os.replace": 0, "os.remove": 0, "os.rmdir": 0, "os.chmod": 0, "os.utime": 0}

armed = False
violations = []
# The plan's own code object: safety.run's exec of it is the one exec allowed.
running = None


def inside(path):
    if isinstance(path, int):
        return False
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    full = os.path.realpath(os.path.join(REAL_ROOT, path))
    return full == REAL_ROOT or full.startswith(REAL_ROOT + "/")


lazy_imports = set()
# Events that hand a plan nothing: id() (the standard library hashes objects by it), and
# CPython reporting an exception a plan's __del__ raised (sys.unraisablehook).
BENIGN_EVENTS = {"builtins.id", "sys.unraisablehook"}
# Set when the watch's own line budget stopped a plan: CPython then drops the trace
# function, which raises sys.settrace (the watch's doing, not the plan's).
budget_spent = False


def forward_reference(frame):
    """typing compiles (never runs) a string type argument into a forward reference
    (`typing.List['x']`). Running it is ForwardRef.evaluate, and no forward reference is
    within a plan's reach (`__args__` is refused, typing offers no get_args): holding one is
    a finding of its own (see BAD_TYPES)."""
    return frame is not None and frame.f_code.co_filename.endswith("/annotationlib.py")


def importing():
    """The module the import machinery is loading for code above it, if it is: (name, the
    code that asked for it)."""
    frame = sys._getframe(2)
    machinery = False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib"):
            machinery = True
        elif machinery:
            return name
        frame = frame.f_back
    return None


def audit(event, args):
    global armed
    if not armed:
        return
    if event == "exec" and args and args[0] is running:
        return
    if event in BENIGN_EVENTS or (event == "sys.settrace" and budget_spent):
        return
    if event in PATH_EVENTS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes))]
        if paths and all(inside(p) for p in paths):
            return
    armed = False
    try:
        # The standard library importing a module of its own, lazily (random imports
        # hashlib when first seeded with text): the plan is not given the module, and its
        # own imports go through kiln's guarded import, never this way.
        if event == "compile" and forward_reference(sys._getframe(1)):
            return
        asker = importing()
        if asker is not None and asker not in ("<plan>",) and not asker.startswith("<kiln>"):
            if event == "import":
                lazy_imports.add(args[0])
            return
        violations.append(f"audit event {event} {args!r:.200}")
    finally:
        armed = True


sys.addaudithook(audit)


# Refused whoever calls them (stdlib code that evaluates or opens is a way around the gate);
# the others (getattr, setattr, vars...) only when plan code itself calls them, as the
# standard library uses them on its own names.
DANGEROUS = {"exec", "eval", "compile", "__import__", "open", "breakpoint", "input", "help", "exit", "quit"}


def profile(frame, event, arg):
    global armed
    if event != "c_call" or not armed:
        return
    armed = False  # what the watch itself does raises events too (id, frame.f_code)
    try:
        name = REFUSED_BUILTINS.get(id(arg))
        if name is None:
            return
        caller = frame.f_code.co_filename
        if caller.startswith(("<kiln>/", "<frozen importlib")):
            return  # kiln's guarded import, safe_open's open; a module being loaded
        if name == "compile" and forward_reference(frame):
            return
        if caller == "<plan>" or name in DANGEROUS:
            violations.append(f"called the refused builtin {name} from {caller}:{frame.f_code.co_name}")
    finally:
        armed = True


BAD_TYPES = (types.ModuleType, types.FrameType, types.CodeType, types.TracebackType)
try:
    import annotationlib
    BAD_TYPES += (annotationlib.ForwardRef,)
except ImportError:
    pass


def captured(value, depth=0, seen=None):
    """A refused object the plan kept, or None."""
    seen = seen if seen is not None else set()
    if id(value) in seen or depth > 4:
        return None
    seen.add(id(value))
    if id(value) in REFUSED_OBJECTS:
        return REFUSED_OBJECTS[id(value)]
    if value is type or value is object:
        return value.__name__
    if isinstance(value, BAD_TYPES) and not isinstance(value, safety._Module):
        return f"a {type(value).__name__}"
    if isinstance(value, types.FunctionType) and not value.__code__.co_filename.startswith(("<plan>", "<kiln>")):
        # A Python function of a module the plan was not offered (namedtuple's helpers...).
        module = value.__module__ or "?"
        if module.split(".")[0] not in safety.ALLOWED_IMPORTS and module not in ("functools", "collections", "enum", "fractions", "_pydatetime", "_pydecimal", "posixpath", "genericpath"):
            return f"the function {module}.{value.__qualname__}"
    if isinstance(value, dict):
        items = list(value.values())[:64]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)[:64]
    else:
        return None
    for item in items:
        found = captured(item, depth + 1, seen)
        if found:
            return found
    return None


# ------------------------------------------------------------------ the grammar

NAMES = ["x", "y", "z", "a", "b", "item", "e", "s", "m", "C", "D", "f", "g", "it"]
GIVEN = ["store", "ctx", "safe_open", "resource", "id", "payload", "criteria", "BadRequest",
         "NotFound", "Conflict", "UnsupportedMediaType", "quote", "REPLY"]
BUILTIN_NAMES = [n for n in safety.SAFE_BUILTINS if n not in ("True", "False", "None")]
REFUSED_NAMES = sorted(safety.FORBIDDEN_CALLS) + ["__builtins__", "__import__", "__loader__", "__spec__"]
ATTRS = {
    # Escape material: the gate must refuse each wherever it appears.
    "__class__", "__base__", "__bases__", "__mro__", "__subclasses__", "__globals__",
    "__builtins__", "__dict__", "__code__", "__closure__", "__func__", "__self__",
    "__getattribute__", "__reduce_ex__", "__init__", "__module__", "__traceback__",
    "__context__", "__cause__", "__loader__", "__spec__", "__wrapped__", "__call__",
    "gi_frame", "gi_code", "cr_frame", "ag_frame", "f_globals", "f_back", "f_builtins",
    "f_locals", "tb_frame", "tb_next", "co_consts", "format", "format_map", "mro", "parser",
    # Plain names plans use and objects have.
    "get", "items", "keys", "values", "append", "copy", "join", "split", "strip", "lower",
    "upper", "replace", "startswith", "encode", "decode", "real", "args", "with_traceback",
    "copy_with", "send", "throw", "close", "read", "write", "buffer", "raw", "fileno",
    "name", "mode", "detach", "reconfigure", "collection", "collections", "insert",
    "get_all", "search", "patch", "delete", "count", "message", "details", "status", "code",
    "group", "groups", "pattern", "sub", "fromhex", "hex", "bytes", "int", "urn", "path",
    "parents", "parts", "with_name", "joinpath", "as_posix", "tzinfo", "utcoffset",
    "fromisoformat", "isoformat", "strftime", "named", "namedtuple", "register", "cache",
    "partial", "reduce", "groupby", "attrgetter", "methodcaller", "setdefault", "update",
}
MODULES = list(safety.IMPORTABLE) + ["sys", "builtins", "subprocess", "importlib", "ctypes", "gc",
                                     "posixpath", "operator", "functools", "collections",
                                     "string", "inspect", "types", "codecs", "pickle", "marshal",
                                     "os.path", "json.decoder", "re._parser", "io.open"]
STRINGS = ["'__class__'", "'__globals__'", "'os'", "'system'", "'id'", "'x'", "'{0.__class__}'",
           "'{0.__init__.__globals__}'", "'%s'", "'a,b'", "'members'", "'../x'", "'.kiln'",
           "'data.txt'", "'/etc/passwd'", "'w'", "'r'", "'rb'", "''", "'\\x00'", "'é'",
           "'__import__'", "'eval'", "'1+1'", "'x y'", "'ab'", "'__builtins__'"]


class Gen:
    def __init__(self, rng, vocabulary, offered):
        self.r = rng
        self.vocab = vocabulary
        # module -> the names kiln's module object offers (what `import M` gives a plan).
        self.offered = offered
        # Names this plan bound by importing.
        self.bound = []
        # A clean plan uses no refused material (no underscore names or attributes, no
        # refused builtins, allowed imports only): it passes the gate, so it runs, and what
        # it reaches is what a plan can reach.
        self.clean = False

    def pick(self, seq):
        return self.r.choice(seq)

    def name(self):
        if self.bound and self.r.random() < 0.3:
            return self.pick(self.bound)
        roll = self.r.random()
        if roll < 0.45:
            return self.pick(NAMES)
        if roll < 0.7:
            return self.pick(GIVEN)
        if roll < 0.95 or self.clean:
            return self.pick(BUILTIN_NAMES)
        return self.pick(REFUSED_NAMES)

    def attr(self):
        if self.clean:
            for _ in range(8):
                name = self.pick(self.vocab) if self.vocab else "get"
                if not name.startswith(safety.FORBIDDEN_ATTR_PREFIXES) and name not in safety.FORBIDDEN_ATTRS:
                    return name
            return "get"
        if self.r.random() < 0.6 and self.vocab:
            return self.pick(self.vocab)
        return self.pick(sorted(ATTRS))

    def atom(self):
        roll = self.r.random()
        if roll < 0.35:
            return self.name()
        if roll < 0.5:
            return self.pick(STRINGS)
        if roll < 0.6:
            return str(self.r.choice([0, 1, 2, 3, -1, 255, 10**6]))
        if roll < 0.68:
            return self.pick(["[]", "{}", "()", "(1, 2)", "[1, 'a']", "{'a': 1}", "None", "True", "b'ab'", "...", "set()"])
        if roll < 0.74:
            return "(lambda *a, **k: a)"
        if roll < 0.8:
            return "(i for i in range(3))"
        if roll < 0.86:
            return f"f'{{{self.name()}!r}}'"
        return self.name()

    def arg(self):
        roll = self.r.random()
        if roll < 0.5:
            return self.pick(STRINGS)
        if roll < 0.7:
            return self.pick(["0", "1", "3", "[]", "()", "[1, 2]", "{}", "None", "b'x'", "2.5"])
        return self.expr(2)

    def expr(self, depth=0):
        if depth > 3:
            return self.atom()
        roll = self.r.random()
        if roll < 0.3:
            return f"{self.expr(depth + 1)}.{self.attr()}"
        if roll < 0.5:
            args = ", ".join(self.expr(depth + 1) for _ in range(self.r.randint(0, 2)))
            if self.r.random() < 0.15:
                args = (args + ", " if args else "") + f"{self.pick(['key', 'default', 'cls', 'object_hook', 'file', 'sep', 'encoding', 'mode', 'start', 'module', 'rename', 'defaults'])}={self.expr(depth + 1)}"
            return f"{self.expr(depth + 1)}({args})"
        if roll < 0.6:
            return f"{self.expr(depth + 1)}[{self.expr(depth + 1)}]"
        if roll < 0.66:
            return f"[{self.expr(depth + 1)} for {self.pick(NAMES)} in {self.expr(depth + 1)}]"
        if roll < 0.7:
            return f"({self.expr(depth + 1)} {self.pick(['+', '%', '*', 'or', 'and', '==', '|', 'if x else'])} {self.expr(depth + 1)})"
        if roll < 0.74:
            return f"f'{{{self.expr(depth + 1)}:{{{self.expr(depth + 1)}}}}}'"
        if roll < 0.78:
            return f"(lambda {self.pick(NAMES)}={self.expr(depth + 1)}: {self.expr(depth + 1)})"
        if roll < 0.8:
            return f"({self.pick(NAMES)} := {self.expr(depth + 1)})"
        return self.atom()

    def stmt(self, depth=0, indent=""):
        roll = self.r.random()
        inner = indent + "    "
        if roll < 0.25 or depth > 2:
            target = self.pick(NAMES + ["REPLY"])
            return f"{indent}{target} = {self.expr()}"
        if roll < 0.35:
            return f"{indent}{self.expr()}"
        if roll < 0.45:
            # A call of what an allowed module offers, with arguments of any kind.
            module = self.pick(sorted(self.offered))
            offered = self.offered[module]
            if not offered:
                return f"{indent}import {module}"
            alias = self.pick(NAMES)
            self.bound.append(alias)
            args = ", ".join(self.arg() for _ in range(self.r.randint(0, 3)))
            call = f"{alias}.{self.pick(offered)}"
            if self.r.random() < 0.7:
                call += f"({args})"
            return f"{indent}import {module} as {alias}\n{indent}{self.pick(NAMES)} = {call}"
        if roll < 0.52:
            module = self.pick(list(safety.IMPORTABLE) if self.clean else MODULES)
            form = self.r.random()
            if form < 0.4:
                self.bound.append(module.split(".")[0])
                return f"{indent}import {module}"
            if form < 0.6:
                alias = self.pick(NAMES)
                self.bound.append(alias)
                return f"{indent}import {module} as {alias}"
            attr = self.attr()
            self.bound.append(attr)
            return f"{indent}from {module} import {attr}"
        if roll < 0.52:
            return f"{indent}for {self.pick(NAMES)} in {self.expr()}:\n{self.stmt(depth + 1, inner)}"
        if roll < 0.6:
            return (f"{indent}try:\n{self.stmt(depth + 1, inner)}\n"
                    f"{indent}except {self.pick(['Exception', 'ValueError', 'TypeError', 'AttributeError', '(KeyError, IndexError)', 'BadRequest'])} as e:\n"
                    f"{self.stmt(depth + 1, inner)}")
        if roll < 0.68:
            base = self.pick(["", "(Exception)", "(dict)", "(str)", "(BadRequest)", f"({self.expr()})", "(metaclass=" + self.expr() + ")"])
            method = self.pick(["__init__", "__getattr__", "__eq__", "__hash__", "__del__", "__init_subclass__",
                                "__set_name__", "__class_getitem__", "__format__", "__index__", "__iter__", "run", "__repr__"])
            return (f"{indent}class {self.pick(['C', 'D'])}{base}:\n"
                    f"{inner}def {method}(self, *a, **k):\n{self.stmt(depth + 1, inner + '    ')}\n"
                    f"{inner}{inner}return {self.expr()}")
        if roll < 0.74:
            return (f"{indent}def {self.pick(['f', 'g'])}({self.pick(NAMES)}={self.expr()}):\n"
                    f"{self.stmt(depth + 1, inner)}\n{inner}return {self.expr()}")
        if roll < 0.78:
            return (f"{indent}@{self.expr()}\n{indent}def {self.pick(['f', 'g'])}():\n"
                    f"{inner}return {self.expr()}")
        if roll < 0.83:
            return (f"{indent}match {self.expr()}:\n"
                    f"{inner}case {self.pick(['str', 'C', 'dict', 'object', 'int'])}({self.attr()}={self.pick(NAMES)}):\n"
                    f"{self.stmt(depth + 1, inner + '    ')}")
        if roll < 0.87:
            return f"{indent}with {self.expr()} as {self.pick(NAMES)}:\n{self.stmt(depth + 1, inner)}"
        if roll < 0.9:
            return f"{indent}del {self.pick(NAMES)}"
        if roll < 0.93 and not self.clean:
            return f"{indent}{self.pick(['global', 'nonlocal'])} {self.pick(NAMES)}"
        if roll < 0.96:
            return f"{indent}raise {self.expr()}"
        return f"{indent}return {self.expr()}"

    def program(self):
        self.bound = []
        self.clean = self.r.random() < 0.5
        return "\n".join(self.stmt() for _ in range(self.r.randint(1, 6))) + "\n"


# ------------------------------------------------------------------ the loop

LINE_BUDGET = 20_000


def run_plan(code, stats):
    """Gate `code`; run it if it passes. Returns what it reached (for novelty)."""
    global armed
    try:
        compiled = safety.prepare(code)
    except safety.Unsafe:
        stats["refused"] += 1
        return None
    except (RecursionError, MemoryError, ValueError):
        stats["refused"] += 1
        return None
    stats["passed"] += 1
    lines = [0]

    def tracer(frame, event, arg):
        global budget_spent
        lines[0] += 1
        if lines[0] > LINE_BUDGET:
            budget_spent = True
            raise TimeoutError("the fuzzer's line budget")
        return tracer

    names = driver._names(
        {"segments": ["members", "1"], "query": {}, "body_json": {"id": 1, "name": "a"},
         "params": {}, "request_id": "req"},
        {"action": "list", "resource": "members"},
        store_mod.BoundStore(driver.STORE, "members"),
    )
    del violations[:]
    scope = None
    global running, budget_spent
    running = compiled
    budget_spent = False
    printed = io.StringIO()
    sys.settrace(tracer)
    sys.setprofile(profile)
    armed = True
    try:
        with contextlib.redirect_stdout(printed):
            scope = safety.run(compiled, names)
    except BaseException as e:  # noqa: B036 — a plan may raise anything, PolicyError included
        if isinstance(e, KeyboardInterrupt):
            raise
        stats["raised"] += 1
        scope = {"error": e}
    finally:
        armed = False
        sys.setprofile(None)
        sys.settrace(None)
    found = list(violations)
    kept = captured({k: v for k, v in (scope or {}).items() if k not in names or k == "REPLY"})
    if kept:
        found.append(f"the plan kept {kept}")
    if found:
        return ("finding", found)
    reached = set()
    for value in (scope or {}).values():
        reached.add(type(value).__qualname__)
    return ("ran", reached, scope)


def harvest(scope, vocabulary, seen_vocab):
    """Attribute names of what a plan reached (outside the watch)."""
    for value in list((scope or {}).values())[:32]:
        try:
            names = dir(value)
        except Exception:
            continue
        for n in names:
            if isinstance(n, str) and n not in seen_vocab and len(seen_vocab) < 5000:
                seen_vocab.add(n)
                vocabulary.append(n)


def self_check():
    """The watch sees what it is for: code the gate would refuse, run past it, is caught."""
    global armed, running
    names = {"safe_open": driver.SAFE_OPEN}
    for code in ("eval('1')", "open('/etc/hostname')", "x = getattr(1, 'real')",
                 "import sys as s", "x = ().__class__.__base__"):
        compiled = compile(code, "<plan>", "exec")
        del violations[:]
        running = compiled
        scope = {"__builtins__": builtins.__dict__, **names}
        sys.setprofile(profile)
        armed = True
        try:
            exec(compiled, scope)
        except Exception:
            pass
        finally:
            armed = False
            sys.setprofile(None)
        scope.pop("__builtins__")
        if not violations and not captured(scope):
            print(json.dumps({"error": f"the watch missed {code!r}"}), flush=True)
            sys.exit(2)


def main():
    self_check()
    seconds = float(os.environ.get("PLAN_GATE_SECONDS", "60"))
    seed = int(os.environ.get("PLAN_GATE_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    vocabulary, seen_vocab = [], set()
    for name in safety.IMPORTABLE:
        harvest({"m": safety._safe_module(name)}, vocabulary, seen_vocab)
    offered = {name: sorted(n for n in vars(safety._safe_module(name)) if not n.startswith("_"))
               for name in safety.IMPORTABLE}
    gen = Gen(rng, vocabulary, offered)
    pool, reached_types = [], set()
    stats = {"plans": 0, "refused": 0, "passed": 0, "raised": 0, "findings": 0, "pool": 0}
    findings = []
    seeds = []
    corpus = os.environ.get("PLAN_GATE_CORPUS")
    if corpus and os.path.isdir(corpus):
        for entry in sorted(os.listdir(corpus)):
            if entry.endswith(".py"):
                with open(os.path.join(corpus, entry)) as f:
                    seeds.append(f.read())
    start = time.monotonic()
    while seeds or time.monotonic() - start < seconds:
        if seeds:
            code = seeds.pop(0)
        elif pool and rng.random() < 0.5:
            code = rng.choice(pool) + gen.program()
        else:
            code = gen.program()
        stats["plans"] += 1
        result = run_plan(code, stats)
        if result is None:
            continue
        if result[0] == "finding":
            stats["findings"] += 1
            if len(findings) < 20:
                findings.append(code)
                print(json.dumps({"finding": result[1][:5], "plan": code}), flush=True)
            continue
        _, reached, scope = result
        new = reached - reached_types
        if new:
            reached_types |= new
            if len(pool) < 2000 and len(code) < 4000:
                pool.append(code)
            harvest(scope, vocabulary, seen_vocab)
    elapsed = time.monotonic() - start
    stats["pool"] = len(pool)
    stats.update(lazy_imports=sorted(lazy_imports), seed=seed, seconds=round(elapsed, 1), plans_per_second=round(stats["plans"] / max(elapsed, 1e-9)),
                 vocabulary=len(vocabulary), reached_types=len(reached_types))
    print(json.dumps({"summary": stats}), flush=True)
    return 1 if findings else 0


sys.exit(main())
