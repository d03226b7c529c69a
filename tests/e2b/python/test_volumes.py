"""Named volumes through the E2B SDK, unchanged: Volume.create / list / get_info / destroy,
the volume content API (write_file, read_file, list, make_dir, exists, get_info, remove,
reached with the volume's own token at E2B_VOLUME_API_URL, which scripts/e2b-check points at
kiln's facade), and volume_mounts at Sandbox.create: what one sandbox writes another sees,
the data outlives both, and a volume in use cannot be destroyed."""

import uuid

import e2b
import httpx
import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(e2b, "Volume"), reason="needs an e2b SDK with the Volume API"
)


@pytest.fixture
def volume():
    from e2b import Volume

    vol = Volume.create(f"kiln-{uuid.uuid4().hex[:10]}")
    yield vol
    try:
        Volume.destroy(vol.volume_id)
    except Exception:
        pass


def test_a_volume_is_shared_between_sandboxes_and_outlives_them(sandbox_factory, volume):
    from e2b import Volume

    assert volume.name in [v.name for v in Volume.list()]
    volume.write_file("/seed/input.txt", "from the API")
    assert volume.exists("/seed/input.txt") and not volume.exists("/nothing")

    first = sandbox_factory(volume_mounts={"/mnt/vol": volume})
    assert first.get_info().volume_mounts == [{"name": volume.name, "path": "/mnt/vol"}]
    out = first.commands.run(
        "cat /mnt/vol/seed/input.txt && echo from-first > /mnt/vol/out.txt && id -u"
    )
    # The file the API wrote has no newline; the box's user wrote beside it.
    assert out.stdout == "from the API1000\n"
    # Mounted by name too, in a second sandbox at once.
    second = sandbox_factory(volume_mounts={"/data": volume.name})
    assert second.commands.run("cat /data/out.txt").stdout == "from-first\n"

    # In use: refused, with the sandboxes named.
    with pytest.raises(Exception) as refused:
        Volume.destroy(volume.volume_id)
    assert "mounted by live sandboxes" in str(refused.value)

    first.kill()
    second.kill()
    # The data outlives them, and a new sandbox sees it.
    assert volume.read_file("/out.txt") == "from-first\n"
    third = sandbox_factory(volume_mounts={"/mnt/vol": volume})
    assert third.commands.run("cat /mnt/vol/out.txt").stdout == "from-first\n"
    third.kill()
    assert Volume.destroy(volume.volume_id)
    assert volume.name not in [v.name for v in Volume.list()]


def test_the_content_api_lists_stats_and_removes_and_never_follows_a_planted_link(sandbox_factory, volume):
    volume.make_dir("/a/b")
    volume.write_file("/a/b/c.txt", b"bytes \x00\x01")
    names = {e.path for e in volume.list("/", depth=3)}
    assert {"/a", "/a/b", "/a/b/c.txt"} <= names, names
    info = volume.get_info("/a/b/c.txt")
    assert info.size == 8 and info.uid == 1000 and info.type.value == "file"

    # A sandbox plants a link to a host file in the volume: the API describes it, never
    # reads through it.
    sbx = sandbox_factory(volume_mounts={"/mnt/vol": volume})
    sbx.commands.run("ln -s /etc/passwd /mnt/vol/passwd && ln -s / /mnt/vol/root")
    assert volume.get_info("/passwd").type.value == "symlink"
    with pytest.raises(Exception):
        volume.read_file("/passwd")
    with pytest.raises(Exception):
        volume.list("/root")
    with pytest.raises(Exception):
        volume.write_file("/root/evil.txt", "x")
    assert "evil" not in sbx.commands.run("ls /").stdout

    volume.remove("/a/b/c.txt")
    assert not volume.exists("/a/b/c.txt")


def test_the_content_api_needs_the_volumes_own_token(volume):
    from e2b import Volume

    other = Volume.create(f"kiln-{uuid.uuid4().hex[:10]}")
    try:
        base = f"{e2b.ConnectionConfig().api_url}/volumecontent"
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {other.token}"}]:
            response = httpx.get(
                f"{base}/{volume.volume_id}/dir", params={"path": "/"}, headers=headers
            )
            assert response.status_code == 401, (headers, response.text)
        response = httpx.get(
            f"{base}/{volume.volume_id}/dir",
            params={"path": "/"},
            headers={"Authorization": f"Bearer {volume.token}"},
        )
        assert response.status_code == 200, response.text
    finally:
        Volume.destroy(other.volume_id)


def test_bad_names_and_mount_paths_are_refused_with_a_reason(sandbox_factory, volume):
    from e2b import Volume

    with pytest.raises(Exception) as refused:
        Volume.create("not a name")
    assert "volume name" in str(refused.value)
    for path in ["/proc", "relative", "/etc/x"]:
        with pytest.raises(Exception) as refused:
            sandbox_factory(volume_mounts={path: volume})
        assert "volume mount path" in str(refused.value), path
    with pytest.raises(Exception) as refused:
        sandbox_factory(volume_mounts={"/mnt/x": "no-such-volume"})
    assert "no volume" in str(refused.value)
