# kiln's rich results for Python guests: a cell's final value, `display(...)` and matplotlib
# figures go to the host as frames through `_host.call` (b"kiln:display " + JSON of
# {"main": bool, "data": {mime: text}}). Run once as a session's first turn; defines
# `__kiln_rich__`. Kept free of non-ASCII text: one-shots carry `figures` inline.


def _kiln_rich_make():
    import builtins
    import json
    import sys
    import warnings

    import _host

    forms = (
        ("_repr_html_", "text/html"),
        ("_repr_markdown_", "text/markdown"),
        ("_repr_svg_", "image/svg+xml"),
        ("_repr_png_", "image/png"),
        ("_repr_jpeg_", "image/jpeg"),
        ("_repr_latex_", "text/latex"),
        ("_repr_json_", "application/json"),
    )

    def send(data, main):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        frame = json.dumps({"main": main, "data": data}).encode()
        try:
            _host.call(b"kiln:display " + frame)
        except OSError:
            sys.stderr.write(
                "kiln: a result was not kept: one run keeps at most 64 results and 16 MiB "
                "of them, and one result is at most 4 MiB\n"
            )

    def png(figure):
        import base64
        import io

        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def represent(value):
        data = {"text/plain": repr(value)}
        figure = sys.modules.get("matplotlib.figure")
        if figure is not None and isinstance(value, figure.Figure):
            data["image/png"] = png(value)
        for attribute, mime in forms:
            try:
                method = getattr(type(value), attribute, None)
                shown = method(value) if callable(method) else None
            except Exception:
                shown = None
            if isinstance(shown, tuple):
                shown = shown[0]
            if shown is None:
                continue
            if isinstance(shown, bytes):
                import base64

                shown = base64.b64encode(shown).decode("ascii")
            elif not isinstance(shown, str):
                shown = json.dumps(shown, default=str)
            data[mime] = shown
        return data

    def figures():
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            send({"image/png": png(figure), "text/plain": repr(figure)}, False)
        pyplot.close("all")

    def kiln_rich_show(*args, **kwargs):
        figures()

    def display(*values, **options):
        for value in values:
            send(represent(value), False)

    def hook(value):
        # As CPython's own hook does (echo the repr, keep the value in `_`), and the value
        # as a result.
        if value is None:
            return
        builtins._ = None
        text = repr(value)
        sys.stdout.write(text + "\n")
        builtins._ = value
        data = represent(value)
        data["text/plain"] = text
        send(data, True)

    class Watch:
        # Tells the host once pyplot is imported, so it shows open figures after each turn.
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib.pyplot":
                try:
                    sys.meta_path.remove(self)
                    _host.call(b"kiln:figures")
                except Exception:
                    pass
            return None

    class Rich:
        def after(self):
            pyplot = sys.modules.get("matplotlib.pyplot")
            if pyplot is not None and pyplot.show is not kiln_rich_show:
                pyplot.show = kiln_rich_show
            figures()

    sys.displayhook = hook
    if not hasattr(builtins, "display"):
        builtins.display = display
    if "matplotlib.pyplot" in sys.modules:
        _host.call(b"kiln:figures")
    else:
        sys.meta_path.insert(0, Watch())
    warnings.filterwarnings("ignore", message=".*non-interactive, and thus cannot be shown")
    return Rich()


__kiln_rich__ = _kiln_rich_make()
del _kiln_rich_make
