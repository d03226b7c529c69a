"""Files through envd: write and read (text, bytes, streams, several at once, gzip), list
with depth, exists, make_dir, remove, rename, entry details, signed URLs, and the refusals."""

import gzip
import io

import httpx
import pytest
from e2b.exceptions import FileNotFoundException, InvalidArgumentException, SandboxException
from e2b.sandbox.filesystem.filesystem import FileType




def test_write_then_read_text_and_bytes(sandbox):
    info = sandbox.files.write("hello.txt", "Hello, world")
    assert info.path == "/home/user/hello.txt" and info.name == "hello.txt"
    assert sandbox.files.read("hello.txt") == "Hello, world"
    assert sandbox.files.read("/home/user/hello.txt") == "Hello, world"
    data = bytes(range(256)) * 10
    sandbox.files.write("bin/data.bin", data)
    assert bytes(sandbox.files.read("bin/data.bin", format="bytes")) == data


def test_written_files_are_seen_by_commands_and_the_other_way(sandbox):
    sandbox.files.write("from_api.txt", "api")
    assert sandbox.commands.run("cat /home/user/from_api.txt").stdout == "api"
    sandbox.commands.run("echo -n shell > made_by_shell.txt")
    assert sandbox.files.read("made_by_shell.txt") == "shell"


def test_writing_overwrites_and_makes_folders(sandbox):
    sandbox.files.write("a/b/c.txt", "one")
    sandbox.files.write("a/b/c.txt", "two")
    assert sandbox.files.read("a/b/c.txt") == "two"
    assert sandbox.files.get_info("a/b").type == FileType.DIR


def test_write_files_writes_several(sandbox):
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    written = sandbox.files.write_files(
        [WriteEntry(path="m/one.txt", data="1"), WriteEntry(path="/home/user/m/two.txt", data=b"2")]
    )
    assert sorted(w.path for w in written) == ["/home/user/m/one.txt", "/home/user/m/two.txt"]
    assert sandbox.files.read("m/two.txt") == "2"


def test_a_file_object_is_streamed_up(sandbox):
    sandbox.files.write("streamed.bin", io.BytesIO(b"x" * 200_000))
    assert len(sandbox.files.read("streamed.bin", format="bytes")) == 200_000


def test_gzip_both_ways(sandbox):
    text = "compress me " * 1000
    sandbox.files.write("zipped.txt", text, gzip=True)
    assert sandbox.files.read("zipped.txt") == text
    assert sandbox.files.read("zipped.txt", gzip=True) == text


def test_read_of_a_missing_file_is_file_not_found(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("missing.txt")


def test_list_exists_and_entry_details(sandbox):
    sandbox.files.write("d/x.txt", "12345")
    sandbox.files.make_dir("d/sub")
    sandbox.files.write("d/sub/deep.txt", "1")
    names = [e.name for e in sandbox.files.list("d")]
    assert names == ["sub", "x.txt"]
    deep = [e.path for e in sandbox.files.list("d", depth=2)]
    assert deep == ["/home/user/d/sub", "/home/user/d/sub/deep.txt", "/home/user/d/x.txt"]
    entry = next(e for e in sandbox.files.list("d") if e.name == "x.txt")
    assert entry.type == FileType.FILE and entry.size == 5
    assert entry.permissions == "-rw-r--r--" and entry.mode == 0o644
    assert entry.owner == "user"
    folder = sandbox.files.get_info("d/sub")
    assert folder.type == FileType.DIR and folder.permissions.startswith("d")
    assert sandbox.files.exists("d/x.txt")
    assert not sandbox.files.exists("d/nope.txt")


def test_make_dir_says_whether_it_made_one(sandbox):
    assert sandbox.files.make_dir("new/nested/dir") is True
    assert sandbox.files.make_dir("new/nested/dir") is False
    assert sandbox.files.get_info("new/nested/dir").type == FileType.DIR


def test_remove_a_file_and_a_folder(sandbox):
    sandbox.files.write("gone/a.txt", "a")
    sandbox.files.remove("gone/a.txt")
    assert not sandbox.files.exists("gone/a.txt")
    sandbox.files.write("gone/b/c.txt", "c")
    sandbox.files.remove("gone")
    assert not sandbox.files.exists("gone")


def test_rename_moves_files_and_folders(sandbox):
    sandbox.files.write("old.txt", "content")
    moved = sandbox.files.rename("old.txt", "new/place.txt")
    assert moved.path == "/home/user/new/place.txt"
    assert sandbox.files.read("new/place.txt") == "content"
    assert not sandbox.files.exists("old.txt")
    with pytest.raises((FileNotFoundException, SandboxException)):
        sandbox.files.rename("not-there.txt", "x.txt")


def test_a_planted_symlink_is_described_not_followed(sandbox):
    sandbox.commands.run("ln -s /etc/passwd link")
    entry = sandbox.files.get_info("link")
    # Older SDKs have no SYMLINK file type (they show such an entry with none).
    assert entry.type == getattr(FileType, "SYMLINK", None)
    assert entry.symlink_target == "/etc/passwd" if hasattr(entry, "symlink_target") else True
    # Reading through a link the guest planted is refused: the host's file is never served.
    try:
        content = sandbox.files.read("link")
    except Exception as refused:
        content = None
        assert "link" in str(refused).lower()
    assert content is None


def test_paths_outside_home_are_refused(sandbox):
    with pytest.raises(Exception) as raised:
        sandbox.files.read("/etc/passwd")
    assert "outside /home/user" in str(raised.value)
    with pytest.raises(Exception):
        sandbox.files.write("../../etc/evil", "x")


def test_signed_urls_work_and_unsigned_ones_do_not(sandbox):
    sandbox.files.write("shared.txt", "for the browser")
    url = sandbox.download_url("shared.txt")
    assert "signature=" in url
    response = httpx.get(url)
    assert response.status_code == 200 and response.text == "for the browser"
    tampered = url.replace("shared.txt", "other.txt")
    assert httpx.get(tampered).status_code in (401, 404, 502)
    up = sandbox.upload_url("uploaded.txt")
    response = httpx.post(up, files={"file": ("uploaded.txt", b"via url")})
    assert response.status_code == 200, response.text
    assert sandbox.files.read("uploaded.txt") == "via url"


def test_an_expired_signature_is_refused(sandbox):
    sandbox.files.write("soon.txt", "x")
    url = sandbox.download_url("soon.txt", use_signature_expiration=1)
    import time

    time.sleep(2.2)
    assert httpx.get(url).status_code != 200


def test_requests_without_the_token_are_refused(sandbox):
    import os

    url = os.environ["E2B_SANDBOX_URL"] + "/files"
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    response = httpx.get(url, params={"path": "x"}, headers=headers)
    assert response.status_code == 401
    response = httpx.get(url, params={"path": "x"}, headers={**headers, "X-Access-Token": "nope"})
    assert response.status_code == 401


def test_an_unknown_sandbox_answers_502_not_found():
    import os

    url = os.environ["E2B_SANDBOX_URL"] + "/health"
    response = httpx.get(url, headers={"E2b-Sandbox-Id": "ffffffffffffffffffffffff", "E2b-Sandbox-Port": "49983"})
    assert response.status_code == 502
    assert "was not found" in response.json()["message"]


def test_oversized_and_malformed_uploads_are_refused(sandbox):
    import os

    url = os.environ["E2B_SANDBOX_URL"] + "/files"
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token,
    }
    bomb = gzip.compress(b"\0" * (70 << 20))
    response = httpx.post(
        url,
        params={"path": "bomb.bin"},
        content=bomb,
        headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert response.status_code == 413
    assert not sandbox.files.exists("bomb.bin")
    response = httpx.post(url, content=b"--x\r\nbroken", headers={**headers, "Content-Type": "multipart/form-data; boundary=x"})
    assert response.status_code == 400
    response = httpx.post(
        url,
        content=b"not gzip",
        params={"path": "bad.gz"},
        headers={**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert response.status_code == 400


def test_watch_dir_sees_writes_and_removes(sandbox):
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    sandbox.files.make_dir("watched")
    handle = sandbox.files.watch_dir("watched")
    sandbox.files.write("watched/new.txt", "content")
    sandbox.commands.run("echo more >> /home/user/watched/new.txt; touch /home/user/watched/other")
    events = handle.get_new_events()
    said = {(e.name, e.type) for e in events}
    assert ("new.txt", FilesystemEventType.CREATE) in said
    assert ("new.txt", FilesystemEventType.WRITE) in said
    assert ("other", FilesystemEventType.CREATE) in said
    sandbox.files.remove("watched/new.txt")
    assert ("new.txt", FilesystemEventType.REMOVE) in {(e.name, e.type) for e in handle.get_new_events()}
    assert handle.get_new_events() == []
    handle.stop()


def test_watch_dir_recursive_and_a_missing_folder(sandbox):
    from e2b.exceptions import NotFoundException
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

    sandbox.files.make_dir("tree/sub")
    handle = sandbox.files.watch_dir("tree", recursive=True)
    sandbox.files.write("tree/sub/deep.txt", "x")
    assert ("sub/deep.txt", FilesystemEventType.CREATE) in {(e.name, e.type) for e in handle.get_new_events()}
    handle.stop()
    with pytest.raises((NotFoundException, SandboxException)):
        sandbox.files.watch_dir("no-such-folder")


def test_unicode_names_and_content(sandbox):
    name = "dünne Luft/日本語 file.txt"
    sandbox.files.write(name, "Grüße, 世界 ✓")
    assert sandbox.files.read(name) == "Grüße, 世界 ✓"
    assert "日本語 file.txt" in [e.name for e in sandbox.files.list("dünne Luft")]
    assert sandbox.commands.run(f"cat '/home/user/{name}'").stdout == "Grüße, 世界 ✓"
