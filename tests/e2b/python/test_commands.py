"""Commands and PTYs through envd's process service, on a Linux template: output, exit codes,
environment, working folder, stdin, background processes, list, connect, kill, timeouts,
terminals; and commands on the WebAssembly code interpreter."""

import time

import pytest
from e2b import CommandExitException
from e2b.exceptions import TimeoutException

from conftest import CODE_INTERPRETER, sdk_at_least


def test_echo_and_exit_codes(sandbox):
    result = sandbox.commands.run("echo hi")
    assert result.stdout == "hi\n" and result.stderr == "" and result.exit_code == 0
    with pytest.raises(CommandExitException) as raised:
        sandbox.commands.run("echo oops >&2; exit 3")
    assert raised.value.exit_code == 3
    assert raised.value.stderr == "oops\n"


def test_real_programs_run(sandbox):
    assert sandbox.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
    assert sandbox.commands.run("printf '%s-%s' a b").stdout == "a-b"
    assert sandbox.commands.run("whoami").stdout == "user\n"


def test_env_vars_and_cwd(sandbox):
    result = sandbox.commands.run("echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert result.stdout == "bar\n/tmp\n"
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    code = "import os; print(os.environ['FOO'])"
    assert sandbox.commands.run(f'python3 -c "{code}"', envs={"FOO": "scoped"}).stdout == "scoped\n"


def test_output_callbacks_stream(sandbox):
    seen = []
    sandbox.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_stdin_is_sent_and_closed(sandbox):
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "hello stdin\n")
    if hasattr(sandbox.commands, "close_stdin"):
        sandbox.commands.close_stdin(handle.pid)
        assert handle.wait().stdout == "hello stdin\n"
    else:
        sandbox.commands.kill(handle.pid)


def test_background_processes_are_listed_connected_and_killed(sandbox):
    handle = sandbox.commands.run("sleep 60", background=True)
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    listed = next(p for p in sandbox.commands.list() if p.pid == handle.pid)
    assert listed.cmd == "/bin/bash"
    again = sandbox.commands.connect(handle.pid)
    assert again.pid == handle.pid
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(handle.pid) is False


def test_a_background_command_is_waited_for(sandbox):
    handle = sandbox.commands.run("sleep 0.3; echo done", background=True)
    assert handle.wait().stdout == "done\n"


def test_a_command_that_outlives_its_timeout_times_out(sandbox):
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - started < 10


def test_processes_die_with_their_sandbox(sandbox_factory):
    sbx = sandbox_factory()
    sbx.commands.run("sleep 300", background=True)
    sbx.kill()
    assert not sbx.is_running()


def test_a_missing_program_is_exit_127(sandbox):
    with pytest.raises(CommandExitException) as raised:
        sandbox.commands.run("no-such-program-here")
    assert raised.value.exit_code == 127


def test_pty_runs_an_interactive_shell(sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(terminal.pid, b"stty size; echo pty-$((40+2)); exit\n")
    out = []
    terminal.wait(on_pty=out.append)
    text = b"".join(out).decode(errors="replace")
    assert "pty-42" in text
    assert "30 100" in text


def test_pty_kill(sandbox):
    from e2b.sandbox.commands.command_handle import PtySize

    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    assert sandbox.pty.kill(terminal.pid) is True


def test_commands_on_the_webassembly_code_interpreter(sandbox_factory):
    sbx = sandbox_factory(CODE_INTERPRETER)
    assert sbx.commands.run("python3 -c 'import sys; print(sys.version_info[0])'").stdout == "3\n"
    sbx.files.write("script.py", "import sys\nprint('args', sys.argv[1:])\n")
    assert sbx.commands.run("python script.py a b").stdout == "args ['a', 'b']\n"
    with pytest.raises(CommandExitException) as raised:
        sbx.commands.run("ls -la")
    assert raised.value.exit_code == 127
    assert "no shell" in raised.value.stderr


def test_running_as_another_user_is_refused(sandbox):
    with pytest.raises(Exception) as raised:
        sandbox.commands.run("whoami", user="root")
    assert "not supported" in str(raised.value)
    assert sandbox.commands.run("whoami", user="user").stdout == "user\n"
    with pytest.raises(Exception):
        sandbox.files.read("x", user="root")
