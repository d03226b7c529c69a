"""How the facade tells planes and sandboxes apart: SDK headers, E2B_DOMAIN-style host
names (`{port}-{id}.{domain}`), and hostile or malformed sandbox-plane requests."""

import json
import os
import struct

import httpx

BASE_URL = os.environ["E2B_SANDBOX_URL"]
DOMAIN = os.environ.get("KILN_E2B_DOMAIN_UNDER_TEST")


def headers(sbx, port=49983):
    return {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": str(port),
        "X-Access-Token": sbx._envd_access_token,
    }


def test_host_names_route_like_headers(sandbox):
    assert DOMAIN, "scripts/e2b-check starts kiln with --e2b-domain"
    sandbox.files.write("by-host.txt", "routed by Host")
    host = f"49983-{sandbox.sandbox_id}.{DOMAIN}"
    response = httpx.get(
        BASE_URL + "/files",
        params={"path": "by-host.txt"},
        headers={"Host": host, "X-Access-Token": sandbox._envd_access_token},
    )
    assert response.status_code == 200 and response.text == "routed by Host"
    jupyter = httpx.get(BASE_URL + "/health", headers={"Host": f"49999-{sandbox.sandbox_id}.{DOMAIN}"})
    assert jupyter.status_code == 200 and jupyter.text == "OK"


def test_another_sandboxs_token_does_not_open_this_one(sandbox_factory):
    one, two = sandbox_factory(), sandbox_factory()
    one.files.write("mine.txt", "one's")
    response = httpx.get(
        BASE_URL + "/files",
        params={"path": "mine.txt"},
        headers={**headers(one), "X-Access-Token": two._envd_access_token},
    )
    assert response.status_code == 401


def test_malformed_connect_messages_are_refused(sandbox):
    url = BASE_URL + "/filesystem.Filesystem/Stat"
    for body in [b"{", b"[]", b'{"path": 7}']:
        response = httpx.post(url, content=body, headers={**headers(sandbox), "Content-Type": "application/json"})
        assert response.status_code == 400, body
        assert response.json()["code"] == "invalid_argument"
    unknown = httpx.post(
        BASE_URL + "/filesystem.Filesystem/Nope", content=b"{}", headers={**headers(sandbox), "Content-Type": "application/json"}
    )
    assert unknown.status_code == 501


def test_a_stream_call_with_a_lying_envelope_ends_with_an_error(sandbox):
    url = BASE_URL + "/process.Process/Start"
    message = json.dumps({"process": {"cmd": "/bin/echo", "args": ["x"]}}).encode()
    lying = b"\x00" + struct.pack(">I", len(message) + 100) + message
    response = httpx.post(url, content=lying, headers={**headers(sandbox), "Content-Type": "application/connect+json"})
    assert response.status_code == 200
    flags = response.content[0]
    assert flags == 2 and b"invalid_argument" in response.content
    huge = b"\x00" + struct.pack(">I", 1 << 30)
    response = httpx.post(url, content=huge, headers={**headers(sandbox), "Content-Type": "application/connect+json"})
    assert b"resource_exhausted" in response.content


def test_control_plane_errors_are_e2b_shaped():
    api = os.environ["E2B_API_URL"]
    response = httpx.get(api + "/sandboxes/nope", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
    assert response.status_code == 404
    body = response.json()
    assert body["code"] == 404 and "not found" in body["message"]
    response = httpx.post(api + "/v2/sandboxes", content=b"{", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
    assert response.status_code == 400
    response = httpx.post(
        api + "/v2/sandboxes",
        json={"templateID": "base", "timeout": 10**9},
        headers={"X-API-KEY": os.environ["E2B_API_KEY"]},
    )
    assert response.status_code == 400 and "timeout" in response.json()["message"]
    response = httpx.post(
        api + "/v2/sandboxes",
        json={"templateID": "base", "metadata": {"k" * 300: "v"}},
        headers={"X-API-KEY": os.environ["E2B_API_KEY"]},
    )
    assert response.status_code == 400
