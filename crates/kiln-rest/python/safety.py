"""What a plan's code may do, checked on its syntax tree before it runs, and the narrow
namespace it runs in. This is a second wall: the sandbox itself is the first (no network, no
files beyond the tenant's folder, bounded time and memory)."""

import ast
import builtins

ALLOWED_IMPORTS = ("json", "re", "math", "statistics", "uuid", "datetime", "itertools", "typing")

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
}

FORBIDDEN_CALLS = frozenset({
    "exec", "eval", "compile", "__import__", "open", "globals", "locals", "vars", "getattr",
    "setattr", "delattr", "breakpoint", "input", "help", "exit", "quit", "dir", "type",
    "object", "super", "memoryview", "classmethod", "staticmethod", "property",
})

# Attribute names that reach interpreter internals without a leading underscore.
FORBIDDEN_ATTRS = frozenset({"format", "format_map", "mro"})
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


def check(code):
    """Raises Unsafe naming the first rule the code breaks (with its line)."""
    try:
        tree = ast.parse(code, "<plan>", "exec")
    except SyntaxError as e:
        raise Unsafe(f"the code does not parse: {e.msg} (line {e.lineno})") from None
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")

        def bad(why):
            raise Unsafe(f"line {line}: {why}")

        if isinstance(node, ast.Import):
            for alias in node.names:
                if _root(alias.name) not in ALLOWED_IMPORTS:
                    bad(f"import of {alias.name!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})")
                if "." in alias.name:
                    bad(f"import of the submodule {alias.name!r} is not allowed")
        elif isinstance(node, ast.ImportFrom):
            if node.level or not node.module or _root(node.module) not in ALLOWED_IMPORTS or "." in node.module:
                bad(f"import from {node.module!r} is not allowed (allowed: {', '.join(ALLOWED_IMPORTS)})")
            for alias in node.names:
                if alias.name == "*":
                    bad("a star import is not allowed")
                if alias.name.startswith("_"):
                    bad(f"importing the private name {alias.name!r} is not allowed")
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
        real = __import__(name)
        names = _CURATED.get(name) or [n for n in dir(real) if not n.startswith("_")]
        values = {}
        for n in names:
            value = getattr(real, n, None)
            if value is None or type(value) is type(ast):
                continue
            values[n] = value
        found = _MODULES[name] = _Module(name, values)
    return found


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or _root(name) not in ALLOWED_IMPORTS or "." in name:
        raise ImportError(f"import of {name!r} is not allowed")
    return _safe_module(name)


_BUILTINS = {n: getattr(builtins, n) for n in SAFE_BUILTINS if hasattr(builtins, n)}
_BUILTINS["__import__"] = _guarded_import
_BUILTINS["__build_class__"] = builtins.__build_class__


_COMPILED = {}


def prepare(code):
    """Checks the code and compiles it, once per distinct text in this session."""
    found = _COMPILED.get(code)
    if found is None:
        tree = check(code)
        if len(_COMPILED) >= 256:
            _COMPILED.clear()
        found = _COMPILED[code] = compile(tree, "<plan>", "exec")
    return found


def run(compiled, names):
    """Runs prepared code with `names` as its only globals; returns those globals."""
    scope = dict(names)
    scope["__builtins__"] = dict(_BUILTINS)
    scope["__name__"] = "plan"
    exec(compiled, scope)
    return scope
