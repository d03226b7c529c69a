# kiln's turn: replaces the runtime's `_reactor._run_turn` (what its `turn` export calls for
# each turn's code). Run once where a guest's memory is captured, with `RICH` (the source of
# `rich.py`) in its globals; see `FAST_TURNS_DEF` in `python.rs` for what it does and why.
# Embedded in a raw triple-quoted string: it holds no three single quotes in a row.


def _kiln_fast_turns(rich_source):
    import builtins, sys, linecache, _weakref

    reactor = sys.modules.get("_reactor")
    if getattr(reactor, "_run_turn", None) is None or hasattr(reactor, "_kiln_echo"):
        return
    modules = sys.modules
    code_type = type(_kiln_fast_turns.__code__)
    ref = _weakref.ref
    sources = {}
    kept = 0
    limit = 1 << 18
    compound = ("if", "elif", "else", "for", "while", "try", "except", "finally", "with",
                "def", "class", "async", "match", "case", "@")

    def remember(text, name, codes):
        nonlocal kept
        refs = []
        for c in codes:
            refs.append(ref(c))
            for k in c.co_consts:
                if type(k) is code_type:
                    codes.append(k)
        sources[name] = (text, refs)
        kept += len(text) + 256
        if kept > limit:
            sweep(name)

    def sweep(name):
        nonlocal kept, limit
        for old, (text, refs) in list(sources.items()):
            if old != name and all(r() is None for r in refs):
                del sources[old]
                kept -= len(text) + 256
        limit = max(1 << 18, 2 * kept)

    plain_lines = linecache._getlines_from_code

    def _getlines_from_code(code):
        entry = sources.get(getattr(code, "co_filename", None))
        if entry is None:
            return plain_lines(code)
        return [line + "\n" for line in entry[0].splitlines()]

    def tree_split(text, name):
        # The code but its final expression statement, and that expression (or None).
        import ast
        tree = compile(text, name, "exec", ast.PyCF_ONLY_AST)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), name, "eval")
        return compile(tree, name, "exec"), last

    def echoed(text, name, main):
        code, last = tree_split(text, name)
        remember(text, name, [code] if last is None else [last, code])
        exec(code, main)
        if last is not None:
            sys.displayhook(eval(last, main))

    # Made here, where the memory is captured, so that a one-shot that shows something only
    # calls it (compiling and making it cost a guest's first result about 0.5 ms).
    scope = {}
    exec(compile(rich_source, "<reactor>", "exec"), scope)
    shows = scope["make"]()

    def rich():
        return shows

    def display(*values, **options):
        rich().display(values)

    class Shows:
        # pyplot's loader in a one-shot that may plot: once pyplot has run, `plt.show()`
        # shows open figures as results (as in a notebook), and Agg's warning is silenced.
        def __init__(self, loader):
            self.loader = loader

        def __getattr__(self, attribute):
            return getattr(self.loader, attribute)

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            self.loader.exec_module(module)
            rich().watch()
            rich().patch()

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name != "matplotlib.pyplot":
                return None
            sys.meta_path.remove(self)
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if find is not None else None
                if spec is not None:
                    if spec.loader is not None:
                        spec.loader = Shows(spec.loader)
                    return spec
            return None

    def watch_pyplot():
        if "matplotlib.pyplot" in modules:
            rich().watch()
            rich().patch()
        else:
            sys.meta_path.insert(0, Watch())

    def line_split(text, name, at):
        # The code split where its last statement starts (`at`: that character and its
        # line, which kiln's host found from the source): the code before, and the last
        # statement as an expression; (None, None) where either does not compile so.
        offset, line = at.split(",")
        offset = int(offset)
        try:
            last = compile("\n" * (int(line) - 1) + text[offset:], name, "eval")
            return compile(text[:offset], name, "exec"), last
        except SyntaxError:
            return None, None

    def shown(text, name, main, note):
        # A one-shot whose host's note (its code's last line, `#kiln:rich ...`) says what it
        # may show: its last statement's value (`at=` where it starts, or `tree`: parse it),
        # `display(...)`, matplotlib figures (`plot`). A value comes back as the main result
        # and is not printed, as `python -c` prints none.
        words = note.split()
        if "display" in words:
            builtins.display = display
        plots = "plot" in words
        if plots:
            watch_pyplot()
        code = last = None
        if words and words[0].startswith("at="):
            code, last = line_split(text, name, words[0][3:])
        elif "tree" in words:
            code, last = tree_split(text, name)
        if code is None:
            code = compile(text, name, "exec")
        remember(text, name, [code] if last is None else [last, code])
        try:
            exec(code, main)
            if last is not None:
                value = eval(last, main)
                if value is not None:
                    rich().main(value, repr(value))
        except BaseException:
            if plots and "matplotlib.pyplot" in modules:
                try:
                    rich().after()
                except Exception:
                    pass
            raise
        if plots and "matplotlib.pyplot" in modules:
            rich().after()

    def _run_turn(text, name):
        main = modules["__main__"].__dict__
        if not reactor._kiln_echo:
            at = text.rfind("\n")
            if text.startswith("#kiln:rich ", at + 1):
                shown(text, name, main, text[at + 12:])
                return
            code = compile(text, name, "exec")
            remember(text, name, [code])
            exec(code, main)
            return
        line = text.rstrip()
        if line and "\n" not in line and "\r" not in line and ";" not in line and not line.startswith(compound):
            try:
                code = compile(text, name, "single")
            except SyntaxError:
                code = None
            if code is not None:
                remember(text, name, [code])
                exec(code, main)
                return
        echoed(text, name, main)

    linecache._getlines_from_code = _getlines_from_code
    reactor._kiln_sources = sources
    reactor._kiln_echo = False
    reactor._run_turn = _run_turn


_kiln_fast_turns(RICH)
