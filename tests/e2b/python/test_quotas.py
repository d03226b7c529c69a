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
