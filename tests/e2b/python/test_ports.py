"""A server in a Linux sandbox's box, reached through the facade by the host name the SDK's
get_host(port) answers ({port}-{id}.{domain}): public by default, as on E2B, or with the
sandbox's traffic token when it was made with allow_public_traffic=False."""

import os
import time

import httpx


FACADE = os.environ["E2B_API_URL"]


def get(host, path="/index.html", headers=None):
    return httpx.get(FACADE + path, headers={"Host": host, **(headers or {})}, timeout=10)


def serve(sbx, text):
    sbx.commands.run(f"echo {text} > index.html")
    sbx.commands.run("python3 -m http.server 8000", background=True)


def wait_for(host, headers=None):
    deadline = time.time() + 15
    while True:
        response = get(host, headers=headers)
        if response.status_code == 200:
            return response
        assert time.time() < deadline, f"{response.status_code} {response.text}"
        time.sleep(0.1)


def test_get_host_reaches_a_server_in_the_box(sandbox):
    serve(sandbox, "hello-from-8000")
    host = sandbox.get_host(8000)
    assert host == f"8000-{sandbox.sandbox_id}.{os.environ['KILN_E2B_DOMAIN_UNDER_TEST']}"
    assert wait_for(host).text == "hello-from-8000\n"
    # Nothing on another port: a clear 502; a privileged port: 400; an unknown sandbox: 502.
    assert get(sandbox.get_host(8001)).status_code == 502
    assert get(sandbox.get_host(80)).status_code == 400
    assert get(host.replace(sandbox.sandbox_id, "0" * 24)).status_code == 502


def test_a_private_sandbox_needs_its_traffic_token(sandbox_factory):
    sbx = sandbox_factory(network={"allow_public_traffic": False})
    serve(sbx, "private")
    host = sbx.get_host(8000)
    token = sbx.traffic_access_token
    assert token
    assert wait_for(host, headers={"e2b-traffic-access-token": token}).text == "private\n"
    assert get(host).status_code == 401
    assert get(host, headers={"e2b-traffic-access-token": "x" * len(token)}).status_code == 401
