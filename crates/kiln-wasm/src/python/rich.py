# kiln's rich results for Python: a cell's final value, `display(...)` and matplotlib
# figures go to the host as frames through `_host.call` (b"kiln:display " + JSON of
# {"main": bool, "data": {mime: text}}). A session compiles this the first time it shows
# something (see `rich_setup.py`), a one-shot too (see `turns.py`). `make()` returns what
# they call.


def make():
    import json
    import sys

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

    def represent(value, text=None):
        data = {"text/plain": repr(value) if text is None else text}
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

    class Rich:
        def main(self, value, text):
            send(represent(value, text), True)

        def display(self, values):
            for value in values:
                send(represent(value), False)

        def watch(self):
            # matplotlib draws off screen (Agg): say nothing of it, and have the host show
            # open figures after each turn.
            import warnings

            warnings.filterwarnings(
                "ignore", message=".*non-interactive, and thus cannot be shown"
            )
            _host.call(b"kiln:figures")

        def patch(self):
            # `plt.show()` shows the open figures as results at once, and closes them.
            pyplot = sys.modules.get("matplotlib.pyplot")
            if pyplot is not None and pyplot.show is not kiln_rich_show:
                pyplot.show = kiln_rich_show

        def after(self):
            self.patch()
            figures()

    return Rich()
