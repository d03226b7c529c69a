"""The code interpreter (e2b-code-interpreter): results, state, callbacks, streaming,
errors, execution count, env vars, cwd, display data, charts as PNG, contexts (python and
javascript), interrupts, and cells on a Linux sandbox."""

import base64
import time

import pytest
from e2b.exceptions import TimeoutException


def test_basic(interpreter):
    execution = interpreter.run_code("x = 1; x")
    assert execution.text == "1"
    assert execution.error is None
    assert execution.logs.stdout == [] and execution.logs.stderr == []


def test_print_is_one_whole_line(interpreter):
    execution = interpreter.run_code('print("Hello")')
    assert execution.logs.stdout == ["Hello\n"]


def test_state_persists_between_cells(interpreter):
    interpreter.run_code("counter = 40")
    interpreter.run_code("counter += 2")
    assert interpreter.run_code("counter").text == "42"


def test_callbacks_see_output_results_and_errors(interpreter):
    out, err, results, errors = [], [], [], []
    interpreter.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n1 + 1",
        on_stdout=out.append,
        on_stderr=err.append,
        on_result=results.append,
    )
    assert [m.line for m in out] == ["to out\n"]
    assert [m.line for m in err] == ["to err\n"]
    assert [r.text for r in results] == ["2"]
    interpreter.run_code("raise ValueError('bad')", on_error=errors.append)
    assert errors and errors[0].name == "ValueError" and errors[0].value == "bad"


def test_output_streams_as_it_is_written(interpreter):
    arrivals = []
    interpreter.run_code(
        "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.3)",
        on_stdout=lambda m: arrivals.append(time.monotonic()),
    )
    assert len(arrivals) == 3
    assert arrivals[-1] - arrivals[0] > 0.4, "lines arrive as printed, not all at the end"


def test_errors_have_name_value_and_traceback(interpreter):
    execution = interpreter.run_code("def f():\n    return 1 / 0\nf()")
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "line 2, in f" in execution.error.traceback
    assert "<kiln-e2b>" not in execution.error.traceback
    syntax = interpreter.run_code("def broken(:")
    assert syntax.error.name == "SyntaxError"


def test_execution_count_counts(interpreter):
    first = interpreter.run_code("1").execution_count
    second = interpreter.run_code("2").execution_count
    assert second == first + 1


def test_env_vars_apply_to_one_cell(interpreter):
    assert interpreter.run_code("import os; os.getenv('FOO')", envs={"FOO": "bar"}).text == "bar"
    assert interpreter.run_code("import os; os.getenv('FOO')").text is None


def test_cwd_is_home_user(interpreter):
    assert interpreter.run_code("import os; os.getcwd()").text == "/home/user"
    interpreter.files.write("data.csv", "a,b\n1,2\n")
    assert interpreter.run_code("open('data.csv').read()").text == "a,b\n1,2\n"


def test_display_data_and_rich_formats(interpreter):
    execution = interpreter.run_code(
        "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2]})\ndisplay(df)\ndf"
    )
    assert len(execution.results) == 2
    shown, main = execution.results
    assert not shown.is_main_result and main.is_main_result
    assert "<table" in main.html and "a" in main.text


def test_charts_are_png(interpreter):
    execution = interpreter.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG")
    assert execution.logs.stderr == []


def test_contexts(interpreter):
    ids = {c.id for c in interpreter.list_code_contexts()}
    assert {"python", "javascript"} <= ids
    context = interpreter.create_code_context(cwd="/tmp")
    assert context.cwd == "/tmp" and context.language == "python"
    interpreter.run_code("secret = 7", context=context)
    assert interpreter.run_code("secret", context=context).text == "7"
    assert interpreter.run_code("import os; os.getcwd()", context=context).text == "/tmp"
    assert interpreter.run_code("'secret' in globals()").text == "False"
    interpreter.restart_code_context(context)
    assert interpreter.run_code("'secret' in globals()", context=context).text == "False"
    interpreter.remove_code_context(context)
    assert context.id not in {c.id for c in interpreter.list_code_contexts()}


def test_javascript(interpreter):
    execution = interpreter.run_code("console.log('js'); var n = 40; n + 2", language="javascript")
    assert execution.logs.stdout == ["js\n"]
    assert execution.text == "42"
    assert interpreter.run_code("n * 2", language="js").text == "80"
    failed = interpreter.run_code("null.x", language="javascript")
    assert failed.error.name == "TypeError"


def test_interrupt_and_go_on(interpreter):
    interpreter.run_code("kept = 1")
    with pytest.raises(TimeoutException):
        interpreter.run_code("import time\ntime.sleep(30)", timeout=2)
    after = interpreter.run_code("1 + 1")
    assert after.text == "2"
    # The interrupted context started afresh, and said so.
    assert any("restarted" in line for line in after.logs.stderr)


def test_cells_on_a_linux_sandbox(test_id):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create("base", metadata={"sandbox_test_id": test_id})
    try:
        execution = sbx.run_code("import sys; sys.implementation.name")
        assert execution.text == "cpython"
        assert sbx.run_code("import os; os.getcwd()").text == "/home/user"
        assert sbx.run_code("1/0").error.name == "ZeroDivisionError"
    finally:
        sbx.kill()


def test_json_and_markdown_formats(interpreter):
    execution = interpreter.run_code(
        "class Report:\n"
        "    def _repr_json_(self):\n"
        "        return {'rows': 2, 'ok': True}\n"
        "    def _repr_markdown_(self):\n"
        "        return '**two rows**'\n"
        "Report()"
    )
    result = execution.results[0]
    assert result.json == {"rows": 2, "ok": True}
    assert result.markdown == "**two rows**"
    assert set(result.formats()) >= {"json", "markdown"}


def test_a_long_cell_is_kept_alive(interpreter):
    # The stream carries keepalives every 5 s while the cell runs; the SDK skips them.
    execution = interpreter.run_code("import time\ntime.sleep(6)\n'still here'", timeout=30)
    assert execution.text == "still here"
