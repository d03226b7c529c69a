"""The async SDK (AsyncSandbox) over the same facade: lifecycle, files, commands, code."""

import pytest
from e2b import AsyncSandbox, CommandExitException


async def test_async_lifecycle(async_sandbox):
    assert await async_sandbox.is_running()
    info = await async_sandbox.get_info()
    assert info.sandbox_id == async_sandbox.sandbox_id
    await async_sandbox.set_timeout(120)
    again = await AsyncSandbox.connect(async_sandbox.sandbox_id)
    assert (await again.commands.run("echo again")).stdout == "again\n"


async def test_async_files(async_sandbox):
    await async_sandbox.files.write("async.txt", "from asyncio")
    assert await async_sandbox.files.read("async.txt") == "from asyncio"
    assert [e.name for e in await async_sandbox.files.list(".")] == ["async.txt"]
    assert await async_sandbox.files.make_dir("dir") is True
    await async_sandbox.files.remove("async.txt")
    assert not await async_sandbox.files.exists("async.txt")


async def test_async_commands(async_sandbox):
    result = await async_sandbox.commands.run("echo $X", envs={"X": "async"})
    assert result.stdout == "async\n"
    with pytest.raises(CommandExitException):
        await async_sandbox.commands.run("false")
    handle = await async_sandbox.commands.run("sleep 60", background=True)
    assert await async_sandbox.commands.kill(handle.pid)


async def test_async_code(async_interpreter):
    execution = await async_interpreter.run_code("y = 20\ny * 2 + 2")
    assert execution.text == "42"
    lines = []
    await async_interpreter.run_code("print('streamed')", on_stdout=lambda m: lines.append(m.line))
    assert lines == ["streamed\n"]
    failed = await async_interpreter.run_code("undefined_name")
    assert failed.error.name == "NameError"


async def test_async_watch_dir_streams_events(async_sandbox):
    import asyncio

    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    await async_sandbox.files.make_dir("live")
    seen = []
    handle = await async_sandbox.files.watch_dir("live", on_event=seen.append)
    await async_sandbox.files.write("live/a.txt", "a")
    for _ in range(50):
        if any(e.name == "a.txt" and e.type == FilesystemEventType.CREATE for e in seen):
            break
        await asyncio.sleep(0.1)
    await handle.stop()
    assert any(e.name == "a.txt" and e.type == FilesystemEventType.CREATE for e in seen)
