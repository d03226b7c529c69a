"""Snapshots and forks through the E2B SDK, unchanged: create_snapshot (files only: kiln's
snapshots are E2B's mode="filesystem"), list_snapshots, Sandbox.create(snapshot_id),
delete_snapshot, and fork(count=N): each fork starts from the source's files and diverges."""

import inspect

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


@pytest.mark.skipif(
    "mode" not in inspect.signature(Sandbox.create_snapshot).parameters,
    reason="needs an e2b SDK whose create_snapshot takes a mode",
)
def test_asking_for_a_memory_snapshot_is_refused_with_the_reason(sandbox):
    with pytest.raises(Exception) as refused:
        sandbox.create_snapshot(mode="full")
    assert "filesystem" in str(refused.value)


@pytest.mark.skipif(not hasattr(Sandbox, "fork"), reason="needs an e2b SDK with fork")
def test_fork_makes_copies_that_diverge(sandbox_factory):
    source = sandbox_factory()
    source.commands.run("echo base > state.txt")
    forks = source.fork(count=3)
    assert len(forks) == 3
    try:
        for i, fork in enumerate(forks):
            assert isinstance(fork, Sandbox), fork
            assert fork.commands.run("cat state.txt").stdout == "base\n"
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
