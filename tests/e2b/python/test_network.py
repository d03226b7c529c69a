"""Per-sandbox egress rules and secrets through the E2B SDK, unchanged: network={"allow_out",
"deny_out", "rules"} at create, update_network, get_info().network, allow_internet_access, the
Secret API, and kiln's proxy putting a secret into requests to the host a rule names (and
nowhere else: not into the box, not to other hosts).

The far end is an HTTP server these tests start on this host, at the address scripts/e2b-check
lists for the server (KILN_E2B_OWN_IP: the host's own addresses are closed to sandboxes unless
the operator lists them), on a port of its own (reached because the test key may widen the
operator's list to an allow_out entry with a port)."""

import hashlib
import http.server
import inspect
import json
import os
import threading
import uuid

import e2b
import pytest
from e2b import ALL_TRAFFIC, CommandExitException

OWN_IP = os.environ["KILN_E2B_OWN_IP"]


def digest(text):
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with its path and headers, as JSON; `Authorization` as its
    digest, so that no secret comes back into the box in an answer."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        headers = dict(self.headers)
        if "Authorization" in headers:
            headers["Authorization"] = digest(headers["Authorization"])
        body = json.dumps({"path": self.path, "headers": headers}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def echo():
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"{OWN_IP}:{server.server_address[1]}"
    server.shutdown()


def refused(code, out):
    """Whether kiln's proxy refused the request (its answer names why) or no answer came."""
    return code != 0 or out.startswith("kiln: ")


def fetch(sbx, url):
    """What the box's curl gets from `url` (through kiln's proxy): (exit code, output)."""
    try:
        result = sbx.commands.run(f"curl -sS -m 20 {url} 2>&1", timeout=60)
        return result.exit_code, result.stdout
    except CommandExitException as e:
        return e.exit_code, e.stdout + e.stderr


def test_allow_out_and_deny_out_rule_the_box_and_update_network_replaces_them(sandbox_factory, echo):
    sbx = sandbox_factory(network={"allow_out": [echo], "deny_out": [ALL_TRAFFIC]})
    code, out = fetch(sbx, f"http://{echo}/first")
    assert code == 0, out
    assert json.loads(out)["path"] == "/first"
    # What allow_out leaves out is denied, with the rule that denied it.
    code, out = fetch(sbx, "https://pypi.org/simple/")
    assert code != 0 and "403" in out, out
    code, out = fetch(sbx, "http://pypi.org/simple/")
    assert "denyOut" in out and "0.0.0.0/0" in out, out
    info = sbx.get_info()
    assert info.network["allow_out"] == [echo], info.network
    assert info.network["deny_out"] == [ALL_TRAFFIC], info.network

    # The update replaces the rules whole, at once, for the running box.
    sbx.update_network({"deny_out": [echo]})
    code, out = fetch(sbx, f"http://{echo}/second")
    assert refused(code, out), out
    info = sbx.get_info()
    assert info.network["deny_out"] == [echo] and not info.network.get("allow_out"), info.network
    sbx.update_network({"allow_out": [echo], "deny_out": [ALL_TRAFFIC]})
    code, out = fetch(sbx, f"http://{echo}/third")
    assert code == 0 and json.loads(out)["path"] == "/third", out


def test_allow_internet_access_false_denies_all_until_an_update_opens_a_host(sandbox_factory, echo):
    sbx = sandbox_factory(allow_internet_access=False)
    assert sbx.get_info().allow_internet_access is False
    code, out = fetch(sbx, f"http://{echo}/closed")
    assert refused(code, out), out
    sbx.update_network({"allow_out": [echo], "deny_out": [ALL_TRAFFIC]})
    code, out = fetch(sbx, f"http://{echo}/open")
    assert code == 0 and json.loads(out)["path"] == "/open", out


def test_bad_rules_are_refused_with_a_reason(sandbox_factory):
    with pytest.raises(Exception) as refused:
        sandbox_factory(network={"allow_out": ["not a host"]})
    assert "not a destination" in str(refused.value)
    with pytest.raises(Exception) as refused:
        sandbox_factory(network={"deny_out": ["10.0.0.0/8:80"]})
    assert "not a destination" in str(refused.value)


@pytest.mark.skipif(
    not hasattr(e2b.sandbox.sandbox_api, "SandboxEgressProxyOpts"),
    reason="needs an e2b SDK that sends network.egress_proxy",
)
def test_an_egress_proxy_of_the_clients_is_refused_with_a_reason(sandbox_factory):
    with pytest.raises(Exception) as refused:
        sandbox_factory(network={"egress_proxy": {"address": "proxy.example.com:1080"}})
    assert "egressProxy" in str(refused.value)


@pytest.mark.skipif(not hasattr(e2b, "Secret"), reason="needs an e2b SDK with the Secret API")
def test_a_rule_puts_a_secret_into_requests_to_its_host_and_nowhere_else(sandbox_factory, echo):
    from e2b import Secret

    name = f"kiln-{uuid.uuid4().hex[:10]}"
    value = f"sk-{uuid.uuid4().hex}"
    created = Secret.create(name, value, metadata={"test": "network"})
    try:
        assert created.name == name and created.version == 1
        assert Secret.exists(name)
        listed = []
        paginator = Secret.list(limit=50)
        while paginator.has_next:
            listed += paginator.next_items()
        assert name in [s.name for s in listed]
        # The value never comes back out.
        assert value not in repr(Secret.get_info(name)) and value not in repr(listed)

        host = echo.split(":")[0]
        sbx = sandbox_factory(
            network={
                "allow_out": [echo],
                "deny_out": [ALL_TRAFFIC],
                "rules": {host: [{"transform": {"headers": {"Authorization": f"Bearer {Secret.fill(name)}"}}}]},
            },
            envs={"TOKEN": Secret.fill(name)},
        )
        code, out = fetch(sbx, f"http://{echo}/with-rule")
        assert code == 0, out
        assert json.loads(out)["headers"]["Authorization"] == digest(f"Bearer {value}")
        # The box holds the placeholder, never the value: its environment, its processes'
        # environments and command lines, the files it can write.
        seen = sbx.commands.run(
            "env; cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n'; "
            # The value spelt backwards, so that this command's own line lacks it.
            f"grep -rIl -e \"$(printf %s {value[::-1]} | rev)\" /home /root /tmp /var /etc /run /dev/shm 2>/dev/null; true",
            timeout=120,
        ).stdout
        assert value not in seen
        assert Secret.fill(name) in seen
        # A rule follows updates of the secret.
        Secret.update(name, value + "-v2")
        code, out = fetch(sbx, f"http://{echo}/updated")
        assert json.loads(out)["headers"]["Authorization"] == digest(f"Bearer {value}-v2"), out
        # Without the rule the box's own placeholder goes out as it is.
        sbx.update_network({"allow_out": [echo], "deny_out": [ALL_TRAFFIC]})
        code, out = fetch(sbx, f"-H 'Authorization: Bearer {Secret.fill(name)}' http://{echo}/no-rule")
        headers = json.loads(out)["headers"]
        assert headers["Authorization"] == digest(f"Bearer {Secret.fill(name)}"), out
    finally:
        Secret.destroy(name)
    assert not Secret.exists(name)


@pytest.mark.skipif(
    "iam" not in inspect.signature(e2b.Sandbox.create).parameters,
    reason="needs an e2b SDK with workload identity (iam)",
)
def test_workload_identity_tokens_are_refused_with_what_to_use_instead(sandbox_factory):
    from e2b import Secret

    with pytest.raises(Exception) as refused:
        sandbox_factory(iam={"tokens": {"aws": Secret.iam_token(audience="sts.amazonaws.com", token_type="JWT-SVID")}})
    assert "Secret.fill" in str(refused.value)
