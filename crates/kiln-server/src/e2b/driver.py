# kiln's code-interpreter driver: runs a cell as a notebook would and says its results on
# stdout as marked JSON lines (taken out of the stream by kiln's E2B facade). Defined once
# per session as `__kiln_e2b__`.


def _kiln_e2b_make():
    import sys as _sys
    import ast
    import base64
    import builtins
    import json
    import os
    import traceback
    import warnings

    mark = "\x1ekiln-e2b:"
    formats = (
        ("_repr_html_", "html"),
        ("_repr_markdown_", "markdown"),
        ("_repr_svg_", "svg"),
        ("_repr_png_", "png"),
        ("_repr_jpeg_", "jpeg"),
        ("_repr_pdf_", "pdf"),
        ("_repr_latex_", "latex"),
        ("_repr_json_", "json"),
        ("_repr_javascript_", "javascript"),
    )

    def emit(event):
        for stream in (_sys.stdout, _sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        out = _sys.__stdout__
        out.write(mark + json.dumps(event, default=str) + "\n")
        out.flush()

    def figure_png(figure):
        import io

        buf = io.BytesIO()
        figure.savefig(buf, format="png", bbox_inches="tight")
        return base64.b64encode(buf.getvalue()).decode("ascii")

    def represent(value):
        data = {}
        figure = _sys.modules.get("matplotlib.figure")
        if figure is not None and isinstance(value, figure.Figure):
            data["png"] = figure_png(value)
        for attribute, key in formats:
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
                shown = base64.b64encode(shown).decode("ascii")
            data[key] = shown
        data["text"] = value if isinstance(value, str) else repr(value)
        return data

    def figures():
        pyplot = _sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            result = {"type": "result", "png": figure_png(figure), "text": repr(figure)}
            result["is_main_result"] = False
            emit(result)
        pyplot.close("all")

    def display(*values, **_options):
        for value in values:
            result = represent(value)
            result.update(type="result", is_main_result=False)
            emit(result)

    # matplotlib draws off screen (Agg): open figures are shown as results when a cell
    # ends, and plt.show() shows them at once (it is patched once pyplot is imported).
    warnings.filterwarnings("ignore", message=".*non-interactive, and thus cannot be shown")

    def patch_show():
        pyplot = _sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and getattr(pyplot.show, "__name__", "") != "kiln_show":

            def kiln_show(*args, **kwargs):
                figures()

            pyplot.show = kiln_show

    class Driver:
        count = 0

        def run(self, code, env_json, namespace):
            self.count += 1
            namespace.setdefault("display", display)
            builtins.display = display
            env = json.loads(env_json)
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)
            try:
                patch_show()
                self.cell(code, namespace)
                patch_show()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                emit({"type": "number_of_executions", "execution_count": self.count})

        def cell(self, code, namespace):
            try:
                tree = ast.parse(code, "<cell>", "exec")
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body.pop().value)
                exec(compile(tree, "<cell>", "exec"), namespace)
                value = None
                if last is not None:
                    value = eval(compile(last, "<cell>", "eval"), namespace)
                figures()
                if value is not None:
                    result = represent(value)
                    result.update(type="result", is_main_result=True)
                    emit(result)
            except BaseException as error:
                try:
                    figures()
                except Exception:
                    pass
                frames = traceback.extract_tb(error.__traceback__)
                own = [f for f in frames if f.filename != "<kiln-e2b>"]
                text = "Traceback (most recent call last):\n" if own else ""
                text += "".join(traceback.format_list(own))
                text += "".join(traceback.format_exception_only(type(error), error))
                emit(
                    {
                        "type": "error",
                        "name": type(error).__name__,
                        "value": str(error),
                        "traceback": text,
                    }
                )

    return Driver()


__kiln_e2b__ = _kiln_e2b_make()
del _kiln_e2b_make
