"""kiln's E2B conformance suite: the official E2B SDKs (PyPI `e2b`, `e2b-code-interpreter`),
unchanged, against a running `kiln serve --e2b-listen`. scripts/e2b-check installs the pinned
SDK versions, starts kiln and sets the SDK's own variables (E2B_API_KEY, E2B_API_URL,
E2B_SANDBOX_URL); these tests use nothing else.

The tests restate the SDKs' upstream behaviours in tests of our own (lifecycle, files,
commands, PTY, code interpreter), sync and async. A test that needs a newer SDK than the one
installed is skipped with that reason; none is skipped for a gap in kiln."""

import os
import uuid

import e2b
import pytest
from packaging.version import Version

SDK = Version(e2b.__version__ if hasattr(e2b, "__version__") else "0")
try:
    from importlib.metadata import version as _dist_version

    SDK = Version(_dist_version("e2b"))
    CI_SDK = Version(_dist_version("e2b-code-interpreter"))
except Exception:  # pragma: no cover - the package metadata is always there
    CI_SDK = Version("0")

# The Linux template E2B calls "base", and the WebAssembly Python code interpreter.
BASE = os.environ.get("KILN_E2B_BASE", "base")
CODE_INTERPRETER = os.environ.get("KILN_E2B_CODE_INTERPRETER", "code-interpreter-v1")


def sdk_at_least(version: str, why: str):
    return pytest.mark.skipif(SDK < Version(version), reason=f"needs e2b >= {version}: {why}")


@pytest.fixture
def test_id():
    return f"kiln_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sandbox_factory(test_id):
    made = []

    def make(template=BASE, **options):
        options.setdefault("metadata", {"sandbox_test_id": test_id})
        sbx = e2b.Sandbox.create(template, **options)
        made.append(sbx)
        return sbx

    yield make
    for sbx in made:
        try:
            sbx.kill()
        except Exception:
            pass


@pytest.fixture
def sandbox(sandbox_factory):
    return sandbox_factory()


@pytest.fixture
def interpreter(test_id):
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(CODE_INTERPRETER, metadata={"sandbox_test_id": test_id})
    yield sbx
    try:
        sbx.kill()
    except Exception:
        pass


@pytest.fixture
async def async_sandbox(test_id):
    sbx = await e2b.AsyncSandbox.create(BASE, metadata={"sandbox_test_id": test_id})
    yield sbx
    try:
        await sbx.kill()
    except Exception:
        pass


@pytest.fixture
async def async_interpreter(test_id):
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create(CODE_INTERPRETER, metadata={"sandbox_test_id": test_id})
    yield sbx
    try:
        await sbx.kill()
    except Exception:
        pass
