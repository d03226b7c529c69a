"""Sandbox lifecycle through the control plane: create, info, metadata, timeouts, connect,
list (filters and pages), metrics, kill, and the errors E2B's SDK turns into exceptions."""

import datetime
import os

import e2b
import pytest
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from conftest import BASE, CODE_INTERPRETER, sdk_at_least


def test_create_answers_a_running_sandbox_with_its_token(sandbox):
    assert sandbox.sandbox_id
    assert sandbox.is_running()
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id
    assert info.template_id == BASE
    assert info.state.value == "running"
    assert info.cpu_count >= 1 and info.memory_mb >= 64
    # Every kiln sandbox is secured: sandbox-plane traffic needs its own token.
    assert sandbox._envd_access_token


def test_metadata_is_kept_and_listed(sandbox_factory, test_id):
    sbx = sandbox_factory(metadata={"sandbox_test_id": test_id, "owner": "kiln"})
    info = sbx.get_info()
    assert info.metadata == {"sandbox_test_id": test_id, "owner": "kiln"}


def test_sandbox_env_vars_reach_commands(sandbox_factory):
    sbx = sandbox_factory(envs={"KILN_FROM_CREATE": "yes"})
    assert sbx.commands.run("echo $KILN_FROM_CREATE").stdout == "yes\n"


def test_set_timeout_moves_the_end(sandbox):
    before = sandbox.get_info().end_at
    sandbox.set_timeout(600)
    after = sandbox.get_info().end_at
    now = datetime.datetime.now(datetime.timezone.utc)
    assert after > before
    assert datetime.timedelta(seconds=590) < after - now <= datetime.timedelta(seconds=601)
    sandbox.set_timeout(20)
    assert sandbox.get_info().end_at - now <= datetime.timedelta(seconds=21)


def test_a_sandbox_ends_at_its_timeout(sandbox_factory):
    import time

    sbx = sandbox_factory(timeout=2)
    assert sbx.is_running()
    time.sleep(3.5)
    assert not sbx.is_running()


def test_kill_ends_it_and_a_second_kill_says_false(sandbox_factory):
    sbx = sandbox_factory()
    sbx.kill()
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_a_killed_sandbox_is_not_found(sandbox_factory):
    sbx = sandbox_factory()
    sbx.kill()
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(Exception) as raised:
        sbx.commands.run("echo hi")
    assert "not found" in str(raised.value).lower() or "not running" in str(raised.value).lower()


def test_connect_extends_but_never_shortens(sandbox):
    end = sandbox.get_info().end_at
    again = Sandbox.connect(sandbox.sandbox_id, timeout=10)
    assert again.get_info().end_at == end
    again = Sandbox.connect(sandbox.sandbox_id, timeout=900)
    assert again.get_info().end_at > end
    assert again.commands.run("echo connected").stdout == "connected\n"


def test_connect_to_an_unknown_sandbox_fails():
    with pytest.raises((NotFoundException, SandboxException)):
        Sandbox.connect("0123456789abcdef01234567")


def test_list_filters_by_metadata_and_pages(sandbox_factory, test_id):
    made = {sandbox_factory(metadata={"sandbox_test_id": test_id, "n": str(i)}).sandbox_id for i in range(3)}
    from e2b import SandboxQuery

    query = SandboxQuery(metadata={"sandbox_test_id": test_id})
    listed = Sandbox.list(query=query).next_items()
    assert {s.sandbox_id for s in listed} == made
    one = Sandbox.list(query=SandboxQuery(metadata={"sandbox_test_id": test_id, "n": "1"})).next_items()
    assert len(one) == 1 and one[0].metadata["n"] == "1"
    pages = Sandbox.list(query=query, limit=2)
    seen = []
    while pages.has_next:
        seen.extend(s.sandbox_id for s in pages.next_items())
    assert len(seen) == 3 and set(seen) == made


def test_list_by_state_paused_is_empty(sandbox, test_id):
    from e2b import SandboxQuery, SandboxState

    query = SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.PAUSED])
    assert Sandbox.list(query=query).next_items() == []


@sdk_at_least("2.3.0", "sandbox metrics")
def test_metrics_are_real_figures(sandbox):
    sandbox.commands.run("head -c 3000000 /dev/urandom > blob.bin")
    metrics = sandbox.get_metrics()
    assert metrics, "one sample at least"
    sample = metrics[-1]
    assert sample.cpu_count >= 1
    assert sample.mem_total > 0 and 0 < sample.mem_used <= sample.mem_total
    assert sample.disk_total > 0 and sample.disk_used >= 3_000_000


def test_a_bad_key_is_an_authentication_error():
    with pytest.raises(AuthenticationException):
        Sandbox.create(BASE, api_key="e2b_" + "0" * 48)


def test_an_unknown_template_is_refused():
    with pytest.raises(SandboxException) as raised:
        Sandbox.create("no-such-template-here")
    assert "not found" in str(raised.value)


def test_the_code_interpreter_template_is_webassembly_python(sandbox_factory):
    sbx = sandbox_factory(CODE_INTERPRETER)
    assert sbx.get_info().template_id == CODE_INTERPRETER
    assert sbx.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"


def pause(sbx):
    if hasattr(sbx, "pause"):
        return sbx.pause()
    return sbx.beta_pause()


def test_pause_freezes_the_box_and_connect_resumes_it(sandbox, test_id):
    import time

    from e2b import SandboxQuery, SandboxState

    sandbox.commands.run(
        "i=0; while :; do i=$((i+1)); echo $i > count.txt; sleep 0.05; done", background=True
    )
    time.sleep(0.5)
    pause(sandbox)
    assert sandbox.get_info().state.value == "paused"
    query = SandboxQuery(metadata={"sandbox_test_id": test_id}, state=[SandboxState.PAUSED])
    assert [s.sandbox_id for s in Sandbox.list(query=query).next_items()] == [sandbox.sandbox_id]
    # Frozen: the counter (read from the host's side of the workspace) stands still.
    before = sandbox.files.read("count.txt")
    time.sleep(0.6)
    assert sandbox.files.read("count.txt") == before
    # Pausing again is no error (kiln answers 409, which the SDK takes as "already paused").
    pause(sandbox)
    assert sandbox.get_info().state.value == "paused"
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.get_info().state.value == "running"
    deadline = time.time() + 5
    while sandbox.files.read("count.txt") == before:
        assert time.time() < deadline, "the counter did not go on after connect"
        time.sleep(0.05)
    assert resumed.commands.run("echo awake").stdout == "awake\n"


def test_pausing_a_webassembly_sandbox_is_refused_plainly(sandbox_factory):
    sbx = sandbox_factory(CODE_INTERPRETER)
    with pytest.raises(Exception) as raised:
        pause(sbx)
    assert "pauses Linux sandboxes only" in str(raised.value)




def test_a_timeout_with_on_timeout_pause_pauses_it_and_connect_resumes_it(sandbox_factory):
    import time

    sbx = sandbox_factory(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": False})
    sbx.commands.run("sleep 600", background=True)
    deadline = time.time() + 20
    while sbx.get_info().state.value != "paused":
        assert time.time() < deadline, "the timeout did not pause it"
        time.sleep(0.2)
    info = sbx.get_info()
    # Newer SDKs read the sandbox's lifecycle back.
    if getattr(info, "lifecycle", None) is not None:
        assert info.lifecycle["on_timeout"] == "pause"
        assert info.lifecycle["auto_resume"] is False
    # auto_resume False: a command does not wake it.
    with pytest.raises(Exception) as refused:
        sbx.commands.run("echo hi")
    assert "autoResume" in str(refused.value) or "paused" in str(refused.value)
    assert sbx.get_info().state.value == "paused"
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert resumed.get_info().state.value == "running"
    assert "sleep 600" in resumed.commands.run("pgrep -a sleep").stdout


def test_on_timeout_pause_is_refused_for_a_webassembly_sandbox():
    with pytest.raises(Exception) as refused:
        Sandbox.create(CODE_INTERPRETER, timeout=30, lifecycle={"on_timeout": "pause"})
    assert "WebAssembly" in str(refused.value)
