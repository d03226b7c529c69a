"""Snapshots and forks through the E2B SDK, unchanged: create_snapshot (mode="full", the
default: files and running processes; mode="filesystem": files alone), list_snapshots,
Sandbox.create(snapshot_id), delete_snapshot, and fork(count=N): each fork starts from the
source's files and processes and diverges."""

import inspect
import time

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.skipif(
    not hasattr(Sandbox, "create_snapshot"), reason="needs an e2b SDK with snapshots"
)


def test_a_snapshot_makes_new_sandboxes_with_the_files_and_is_listed_and_deleted(sandbox_factory):
    source = sandbox_factory()
    source.commands.run("echo original > note.txt && mkdir -p ~/.config/app && echo cfg > ~/.config/app/x")
    if "mode" in inspect.signature(Sandbox.create_snapshot).parameters:
        snapshot = source.create_snapshot(mode="filesystem")
    else:
        snapshot = source.create_snapshot()
    assert snapshot.snapshot_id.startswith("snap_")
    listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items()
    assert snapshot.snapshot_id in [s.snapshot_id for s in listed]

    # The source goes on, and its later changes are its own.
    source.commands.run("echo changed > note.txt")
    copy = sandbox_factory(snapshot.snapshot_id)
    assert copy.sandbox_id != source.sandbox_id
    assert copy.commands.run("cat note.txt ~/.config/app/x").stdout == "original\ncfg\n"
    assert source.commands.run("cat note.txt").stdout == "changed\n"

    assert Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert not Sandbox.delete_snapshot(snapshot.snapshot_id)
    # Sandboxes made from it keep their own disks.
    assert copy.commands.run("cat note.txt").stdout == "original\n"


# A process whose state is in its memory: a random token drawn once, and a count, written
# to `tick` every 50 ms. A copy that goes on from the snapshot keeps the token and counts on.
TICKER = """
import os, random, time
token, n = random.getrandbits(40), 0
while True:
    n += 1
    with open("tick.tmp", "w") as f:
        f.write(f"{token} {n}")
    os.replace("tick.tmp", "tick")
    time.sleep(0.05)
"""


def start_ticker(sandbox):
    sandbox.files.write("ticker.py", TICKER)
    sandbox.commands.run("python3 ticker.py", background=True)
    for _ in range(100):
        if sandbox.commands.run("test -s tick && echo yes || echo no").stdout == "yes\n":
            return tick(sandbox)
        time.sleep(0.05)
    raise AssertionError("the ticker never ticked")


def tick(sandbox):
    token, n = sandbox.commands.run("cat tick").stdout.split()
    return int(token), int(n)


def counts_on(sandbox, token):
    first = tick(sandbox)
    time.sleep(0.3)
    later = tick(sandbox)
    return first[0] == token and later[0] == token and later[1] > first[1]


def test_a_full_snapshot_carries_running_processes_and_a_filesystem_one_does_not(sandbox_factory):
    source = sandbox_factory()
    token, _ = start_ticker(source)
    full = source.create_snapshot()
    copy = sandbox_factory(full.snapshot_id)
    assert counts_on(copy, token), "the copy's process did not go on from the snapshot"
    assert counts_on(source, token), "the source stopped"
    if "mode" in inspect.signature(Sandbox.create_snapshot).parameters:
        files = source.create_snapshot(mode="filesystem")
        fresh = sandbox_factory(files.snapshot_id)
        assert tick(fresh)[0] == token  # its files are the source's
        assert not counts_on(fresh, token), "a filesystem snapshot carried a process"
        assert "ticker.py" not in fresh.commands.run("ps -eo args").stdout
        Sandbox.delete_snapshot(files.snapshot_id)
    Sandbox.delete_snapshot(full.snapshot_id)


@pytest.mark.skipif(not hasattr(Sandbox, "fork"), reason="needs an e2b SDK with fork")
def test_fork_makes_copies_that_diverge(sandbox_factory):
    source = sandbox_factory()
    source.commands.run("echo base > state.txt")
    token, _ = start_ticker(source)
    forks = source.fork(count=3)
    assert len(forks) == 3
    try:
        for i, fork in enumerate(forks):
            assert isinstance(fork, Sandbox), fork
            assert fork.commands.run("cat state.txt").stdout == "base\n"
            assert counts_on(fork, token), f"fork {i}'s process did not go on"
            fork.commands.run(f"echo fork-{i} > state.txt")
        for i, fork in enumerate(forks):
            assert fork.commands.run("cat state.txt").stdout == f"fork-{i}\n"
        assert source.commands.run("cat state.txt").stdout == "base\n"
        ids = {source.sandbox_id} | {f.sandbox_id for f in forks}
        assert len(ids) == 4
    finally:
        for fork in forks:
            if isinstance(fork, Sandbox):
                fork.kill()


def test_a_webassembly_sandbox_is_refused_with_the_reason(interpreter):
    with pytest.raises(Exception) as refused:
        interpreter.create_snapshot()
    assert "Linux sandboxes" in str(refused.value)
