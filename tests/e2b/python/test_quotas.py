"""The facade honours each key's own quotas (issue 32): work inside a sandbox (code contexts,
cells, commands, files) counts against the quotas of the key that created it, not the
server's defaults. scripts/e2b-check creates a key limited to two sessions and passes it as
KILN_E2B_LIMITED_KEY."""

import os

import pytest


def limited_key():
    key = os.environ.get("KILN_E2B_LIMITED_KEY")
    assert key, "scripts/e2b-check sets KILN_E2B_LIMITED_KEY (a key with --max-sessions 2)"
    return key


def test_a_key_limited_to_two_sessions_gets_a_clear_error_on_its_third_context(test_id):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(
        os.environ.get("KILN_E2B_CODE_INTERPRETER", "code-interpreter-v1"),
        api_key=limited_key(),
        metadata={"sandbox_test_id": test_id},
    )
    try:
        first = sbx.create_code_context()
        second = sbx.create_code_context()
        with pytest.raises(Exception) as refused:
            sbx.create_code_context()
        said = str(refused.value)
        assert "sessions quota" in said and "it is 2" in said, said
        # The two it holds still work, and closing one makes room again.
        assert sbx.run_code("1 + 1", context=first).text == "2"
        sbx.remove_code_context(second)
        third = sbx.create_code_context()
        assert sbx.run_code("6 * 7", context=third).text == "42"
    finally:
        sbx.kill()


def test_a_key_over_its_rate_limit_gets_429_on_envd_and_interpreter_routes(monkeypatch, tmp_path):
    """Only the control plane was rate limited: a sandbox's envd and code-interpreter routes
    ran every request whatever the key's limit. A server of its own with one request a
    second (bursts of two) per key."""
    import socket
    import subprocess
    import time
    import urllib.request

    from e2b_code_interpreter import Sandbox

    kiln = os.environ.get("KILN_BIN")
    assert kiln, "scripts/e2b-check sets KILN_BIN (the kiln under test)"
    key = subprocess.run(
        [kiln, "keys", "create", "--name", "rated", "--data-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    api, e2b_port = free_port(), free_port()
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [kiln, "serve", "--data-dir", str(tmp_path), "--listen", f"127.0.0.1:{api}",
             "--e2b-listen", f"127.0.0.1:{e2b_port}", "--rate-limit", "1", "--log-format", "json"],
            stdin=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        url = f"http://127.0.0.1:{e2b_port}"
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except Exception:
                assert time.time() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.1)
        monkeypatch.setenv("E2B_API_URL", url)
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        sbx = Sandbox.create(
            os.environ.get("KILN_E2B_CODE_INTERPRETER", "code-interpreter-v1"),
            api_key="e2b_" + key.removeprefix("kiln_"),
        )

        def limited(call):
            said = []
            for n in range(8):
                try:
                    call(n)
                except Exception as e:  # the SDKs raise their own kinds for a 429
                    said.append(f"{type(e).__name__}: {e}")
            return said

        time.sleep(3)
        envd = limited(lambda n: sbx.files.write(f"n{n}.txt", "x"))
        # Every refusal is the rate limit's (the SDKs word a 429 their own ways).
        def rate_limited(said):
            return any(mark in said for mark in ("429", "RateLimit", "Rate limit", "RATE_LIMITED"))

        assert envd and all(rate_limited(s) for s in envd), "\n".join(envd)
        assert len(envd) < 8, "every request was refused"
        time.sleep(3)
        interpreter = limited(lambda n: sbx.run_code(f"{n} + 1"))
        assert interpreter and all(rate_limited(s) for s in interpreter), "\n".join(interpreter)
        assert len(interpreter) < 8, "every request was refused"
    finally:
        server.terminate()
        server.wait(timeout=30)
