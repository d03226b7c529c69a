# kiln's rich results for Python sessions, set up before a session's first turn. What runs
# here is kept small (a session that never shows anything pays little memory for it): a
# display hook, `display`, and a watch for pyplot's import. The rest (`python/rich.py`) is
# compiled the first time a result is shown. Defines `__kiln_rich__`, which returns it.


def _kiln_rich_setup(source):
    import builtins
    import sys

    loaded = []

    def rich():
        if not loaded:
            scope = {}
            exec(source, scope)
            loaded.append(scope["make"]())
        return loaded[0]

    def hook(value):
        # As CPython's own hook does (keep the value in `_`), but the value is the cell's
        # main result instead of a line on stdout, as in a notebook.
        if value is None:
            return
        builtins._ = None
        text = repr(value)
        builtins._ = value
        rich().main(value, text)

    def display(*values, **options):
        rich().display(values)

    class Watch:
        # Tells the host once pyplot is imported, so it shows open figures after each turn.
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib.pyplot":
                sys.meta_path.remove(self)
                rich().watch()
            return None

    sys.displayhook = hook
    if not hasattr(builtins, "display"):
        builtins.display = display
    if "matplotlib.pyplot" in sys.modules:
        rich().watch()
    else:
        sys.meta_path.insert(0, Watch())
    return rich
