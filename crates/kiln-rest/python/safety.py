"""What a plan's code may do, checked on its syntax tree before it runs, and the narrow
namespace it runs in. This is a second wall: the sandbox itself is the first (no network, no
files beyond the tenant's folder, bounded time and memory)."""

import ast
import builtins

ALLOWED_IMPORTS = (
    "json", "re", "math", "statistics", "uuid", "datetime", "itertools", "typing", "pathlib",
    "os", "io",
)
# What `import` may name: the allowed modules, and os.path.
IMPORTABLE = ALLOWED_IMPORTS + ("os.path",)
# Modules whose every use is checked on the syntax tree too: `os.system(...)` is refused
# before anything runs, not only when the code reaches it.
GUARDED = ("os", "os.path", "io", "pathlib")

# What each allowed module offers generated code: public names only, never a module.
_CURATED = {
    "json": ("loads", "dumps", "JSONDecodeError"),
    "re": (
        "compile", "match", "fullmatch", "search", "findall", "finditer", "sub", "subn",
        "split", "escape", "error", "Pattern", "Match", "IGNORECASE", "I", "MULTILINE", "M",
        "DOTALL", "S", "VERBOSE", "X", "ASCII", "A",
    ),
    "uuid": ("UUID", "uuid3", "uuid4", "uuid5", "NAMESPACE_DNS", "NAMESPACE_URL", "NAMESPACE_OID", "NAMESPACE_X500"),
    "typing": (
        "Any", "Dict", "List", "Optional", "Tuple", "Union", "Set", "FrozenSet", "Iterable",
        "Iterator", "Mapping", "MutableMapping", "Sequence", "Callable", "Literal", "cast",
    ),
    # Guarded os: path arithmetic and constants; nothing that runs a program, reads the
    # environment, lists or changes files (files go through safe_open).
    "os": ("sep", "linesep", "curdir", "pardir", "extsep", "fspath", "urandom", "path"),
    "os.path": (
        "join", "basename", "dirname", "split", "splitext", "normpath", "normcase", "isabs",
        "commonpath", "commonprefix", "sep", "extsep", "curdir", "pardir",
    ),
    # In-memory streams only (io.open and io.FileIO would open files).
    "io": ("StringIO", "BytesIO", "SEEK_SET", "SEEK_CUR", "SEEK_END", "UnsupportedOperation"),
    # Pure paths only: Path reads and writes files.
    "pathlib": ("PurePath", "PurePosixPath"),
}

FORBIDDEN_CALLS = frozenset({
    "exec", "eval", "compile", "__import__", "open", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "breakpoint", "input", "help", "exit", "quit", "dir", "type",
    "object", "super", "memoryview", "classmethod", "staticmethod", "property",
})

# Attribute names that reach interpreter internals without a leading underscore; `parser`
# is a pure path's os.path module (posixpath, whose `os` is the real os).
FORBIDDEN_ATTRS = frozenset({"format", "format_map", "mro", "parser"})
FORBIDDEN_ATTR_PREFIXES = ("_", "gi_", "cr_", "ag_", "f_", "tb_", "co_")

SAFE_BUILTINS = (
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float",
    "frozenset", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max",
    "min", "next", "pow", "print", "range", "repr", "reversed", "round", "set", "slice",
    "sorted", "str", "sum", "tuple", "zip", "chr", "ord", "callable", "hash", "bytes",
    "Exception", "ValueError", "TypeError", "KeyError", "IndexError", "LookupError",
    "ArithmeticError", "ZeroDivisionError", "AttributeError", "RuntimeError",
    "StopIteration", "NotImplementedError", "True", "False", "None",
)


class Unsafe(Exception):
    """The code breaks a rule; nothing of it ran."""


def _root(name):
    return name.split(".", 1)[0]


def _offered(module):
    return _CURATED.get(module, ())


def _check_import(node, bad):
    if isinstance(node, ast.Import):
        for alias in node.names:
            if _root(alias.name) not in ALLOWED_IMPORTS:
                bad(f"import of {alias.name!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})")
            if alias.name not in IMPORTABLE:
                bad(f"import of the submodule {alias.name!r} is not allowed")
        return
    if node.level or not node.module or node.module not in IMPORTABLE:
        bad(f"import from {node.module!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})")
    for alias in node.names:
        if alias.name == "*":
            bad("a star import is not allowed")
        if alias.name.startswith("_"):
            bad(f"importing the private name {alias.name!r} is not allowed")
        offered = _offered(node.module)
        if offered and alias.name not in offered:
            bad(f"{node.module}.{alias.name} is not allowed ({node.module} offers only: {', '.join(offered)})")


def _module_names(tree):
    """The names the code binds to guarded modules by importing them: {"os": "os", ...}."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[_root(alias.name)] = _root(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in GUARDED:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return {k: v for k, v in names.items() if v in GUARDED}


def _guarded_module(node, modules):
    """The guarded module an expression names (`os`, `os.path`), or None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _guarded_module(node.value, modules)
        if parent and f"{parent}.{node.attr}" in GUARDED:
            return f"{parent}.{node.attr}"
    return None


def _check_node(node, bad, modules):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        _check_import(node, bad)
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        bad("global and nonlocal are not allowed")
    elif isinstance(node, ast.Name):
        if node.id.startswith("__"):
            bad(f"the name {node.id!r} is not allowed")
        if node.id in FORBIDDEN_CALLS:
            bad(f"{node.id!r} is not allowed")
    elif isinstance(node, ast.Attribute):
        attr = node.attr
        if attr in FORBIDDEN_ATTRS or attr.startswith(FORBIDDEN_ATTR_PREFIXES):
            bad(f"access to the attribute {attr!r} is not allowed")
        module = _guarded_module(node.value, modules)
        if module and attr not in _offered(module):
            bad(f"{module}.{attr} is not allowed ({module} offers only: {', '.join(_offered(module))})")
    elif isinstance(node, ast.MatchClass):
        for attr in node.kwd_attrs:
            if attr.startswith(FORBIDDEN_ATTR_PREFIXES) or attr in FORBIDDEN_ATTRS:
                bad(f"matching on the attribute {attr!r} is not allowed")
    elif isinstance(node, ast.ExceptHandler):
        if node.type is None:
            bad("a bare except is not allowed (it would swallow policy errors)")
        names = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        for n in names:
            if isinstance(n, ast.Name) and n.id in ("BaseException", "PolicyError", "SystemExit", "KeyboardInterrupt", "GeneratorExit"):
                bad(f"catching {n.id} is not allowed")
    elif isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)):
        bad("async code is not allowed")
    elif isinstance(node, ast.alias) and node.asname and node.asname.startswith("__"):
        bad(f"the name {node.asname!r} is not allowed")


def check(code):
    """Raises Unsafe naming the first rule the code breaks (with its line)."""
    try:
        tree = ast.parse(code, "<plan>", "exec")
    except SyntaxError as e:
        raise Unsafe(f"the code does not parse: {e.msg} (line {e.lineno})") from None
    modules = _module_names(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")

        def bad(why):
            raise Unsafe(f"line {line}: {why}")

        _check_node(node, bad, modules)
    return tree


class _Module:
    """What generated code sees of an allowed module."""

    def __init__(self, name, values):
        self._name = name
        for key, value in values.items():
            setattr(self, key, value)

    def __repr__(self):
        return f"<module {self._name!r} (kiln)>"


_MODULES = {}


def _safe_module(name):
    found = _MODULES.get(name)
    if found is None:
        real = __import__(name, fromlist=["_"]) if "." in name else __import__(name)
        # A module's own API: its curated names, else what it declares public (`__all__`),
        # else its public names. Not everything it imported: statistics imports
        # collections.namedtuple, which calls eval (plan_gate, the gate's fuzzer, found it).
        names = (
            _CURATED.get(name)
            or getattr(real, "__all__", None)
            or [n for n in dir(real) if not n.startswith("_")]
        )
        values = {}
        for n in names:
            if f"{name}.{n}" in _CURATED:
                values[n] = _safe_module(f"{name}.{n}")
                continue
            value = getattr(real, n, None)
            if value is None or type(value) is type(ast):
                continue
            values[n] = value
        found = _MODULES[name] = _Module(name, values)
    return found


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or name not in IMPORTABLE:
        raise ImportError(f"import of {name!r} is not allowed")
    if "." in name and not fromlist:
        # `import os.path` binds `os`.
        return _safe_module(_root(name))
    return _safe_module(name)


_BUILTINS = {n: getattr(builtins, n) for n in SAFE_BUILTINS if hasattr(builtins, n)}
_BUILTINS["__import__"] = _guarded_import
_BUILTINS["__build_class__"] = builtins.__build_class__


_COMPILED = {}

# Where the value of a top-level `return` lands (a name the code itself cannot write).
RETURNED = "__kiln_returned"
_WRAPPER = f"def __kiln_plan():\n    global REPLY\n{RETURNED} = __kiln_plan()\n"


def _returns_at_top(tree):
    """Whether the code has a `return` outside any function of its own."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def _wrapped(tree):
    """Code that ends with `return {...}` runs as the body of a function (REPLY, when it
    assigns one, stays global); the returned value lands in RETURNED."""
    wrapper = ast.parse(_WRAPPER, "<plan>", "exec")
    wrapper.body[0].body.extend(tree.body)
    return wrapper


def prepare(code):
    """Checks the code and compiles it, once per distinct text in this session."""
    found = _COMPILED.get(code)
    if found is None:
        tree = check(code)
        if _returns_at_top(tree):
            tree = _wrapped(tree)
        try:
            compiled = compile(tree, "<plan>", "exec")
        except SyntaxError as e:
            raise Unsafe(f"the code does not compile: {e.msg} (line {e.lineno})") from None
        if len(_COMPILED) >= 256:
            _COMPILED.clear()
        found = _COMPILED[code] = compiled
    return found


def run(compiled, names):
    """Runs prepared code with `names` as its only globals; returns those globals."""
    scope = dict(names)
    scope["__builtins__"] = dict(_BUILTINS)
    scope["__name__"] = "plan"
    exec(compiled, scope)
    return scope
