"""kiln's MCP server, driven by the official Python MCP client (PyPI `mcp`) over both
transports: stdio (`kiln mcp`) and streamable HTTP (`/mcp` on `kiln serve`).

Usage: python check.py KILN_BINARY   (run by scripts/mcp-check, which starts nothing else)
"""

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

# What the client raises when the server answers a request with a JSON-RPC error: MCPError
# from mcp 2 on, McpError before.
try:
    from mcp.shared.exceptions import MCPError as ProtocolError
except ImportError:
    from mcp.shared.exceptions import McpError as ProtocolError

KILN = os.path.abspath(sys.argv[1])
EXPECTED_TOOLS = {
    "run_python", "run_javascript", "run_go", "run_bash", "sandbox_create", "session_create", "session_run",
    "session_close", "fork_session", "write_file", "read_file", "list_files",
    "sandbox_processes", "sandbox_signal", "sandbox_restart", "sandbox_pause", "sandbox_resume",
    "sandbox_hibernate", "sandbox_terminal", "sandbox_preview_link", "sandbox_set_network",
    "secret_set", "secret_list", "secret_delete", "volume_create", "volume_list", "volume_delete",
    "sandbox_snapshot", "sandbox_fork",
    "workspace_create", "workspace_list", "workspace_start", "workspace_stop", "workspace_delete",
    "add_service", "run_sql", "enable_preview",
}


def text(result):
    return "".join(block.text for block in result.content if getattr(block, "text", None) is not None)


def data(result):
    return json.loads(text(result))


def check(condition, message):
    if not condition:
        raise AssertionError(message)


async def exercise(client, name):
    tools = await client.list_tools()
    names = {tool.name for tool in tools.tools}
    check(EXPECTED_TOOLS <= names, f"{name}: tools {sorted(names)}")
    run_python = next(t for t in tools.tools if t.name == "run_python")
    schema = run_python.input_schema if hasattr(run_python, "input_schema") else run_python.inputSchema
    check("code" in schema["properties"] and "code" in schema.get("required", []), f"{name}: schema {schema}")

    # One-shot code in both languages.
    result = await client.call_tool("run_python", {"code": "print(6 * 7)"})
    check(not result.is_error and data(result)["stdout"] == "42\n", f"{name}: run_python {text(result)}")
    result = await client.call_tool("run_javascript", {"code": "console.log([1, 2, 3].map(x => x * 2).join(','))"})
    check(data(result)["stdout"] == "2,4,6\n", f"{name}: run_javascript {text(result)}")

    # Go and bash need Linux templates, which this server does not serve: a clear refusal.
    result = await client.call_tool("run_bash", {"code": "echo hi"})
    check(result.is_error and "Linux template" in text(result), f"{name}: run_bash without Linux {text(result)}")

    # Failing code and limits are tool errors the model can read, not protocol errors.
    result = await client.call_tool("run_python", {"code": "1/0"})
    check(result.is_error and "ZeroDivisionError" in data(result)["stderr"], f"{name}: error {text(result)}")
    result = await client.call_tool("run_python", {"code": "while True: pass", "timeout_seconds": 0.5})
    check(result.is_error and data(result)["status"] == "timeout", f"{name}: timeout {text(result)}")
    result = await client.call_tool("run_python", {"code": "1", "timeout_seconds": 9999})
    check(result.is_error and data(result)["error"]["code"] == "INVALID_OPTION", f"{name}: bad timeout {text(result)}")

    # Sessions keep state; files persist in the sandbox's workspace.
    opened = data(await client.call_tool("session_create", {"language": "python"}))
    sandbox, session = opened["sandbox_id"], opened["session_id"]
    await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": session, "code": "import math\nx = math.factorial(5)"})
    result = await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": session, "code": "print(x)"})
    check(data(result)["stdout"] == "120\n", f"{name}: session {text(result)}")
    result = await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "data/in.txt", "content": "héllo"})
    check(not result.is_error, f"{name}: write_file {text(result)}")
    result = await client.call_tool("run_python", {"sandbox_id": sandbox, "code": "open('out.txt', 'w').write(open('data/in.txt').read().upper())"})
    check(not result.is_error, f"{name}: run in sandbox {text(result)}")
    result = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "out.txt"})
    check(text(result) == "HÉLLO", f"{name}: read_file {text(result)}")
    # Issue 16: figures come back as image content, a session cell's value and a DataFrame's
    # HTML under `results`; a binary file is read as a blob resource, byte for byte.
    plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('plot.png')"
    result = await client.call_tool("run_python", {"sandbox_id": sandbox, "code": plot, "timeout_seconds": 120})
    images = [b for b in result.content if getattr(b, "type", None) == "image"]
    check(not result.is_error and len(images) == 1 and images[0].mime_type == "image/png", f"{name}: figure {result.content}")
    check(base64.b64decode(images[0].data).startswith(b"\x89PNG"), f"{name}: figure bytes")
    result = await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": session, "code": "import pandas as pd\npd.DataFrame({'a': [x]})"})
    shown = data(result).get("results", [])
    check(len(shown) == 1 and shown[0]["main"] and "<table" in shown[0]["data"]["text/html"], f"{name}: cell value {text(result)}")
    result = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "plot.png"})
    blobs = [b.resource for b in result.content if getattr(b, "type", None) == "resource"]
    check(len(blobs) == 1 and blobs[0].mime_type == "image/png", f"{name}: binary read_file {result.content}")
    check(base64.b64decode(blobs[0].blob).startswith(b"\x89PNG"), f"{name}: blob bytes")
    # Issue 18: a fork starts with the session's variables; with_workspace, in a sandbox of
    # its own whose files start as the original's.
    forked = data(await client.call_tool("fork_session", {"sandbox_id": sandbox, "session_id": session}))
    check(forked["sandbox_id"] == sandbox and forked["forked_from"] == session, f"{name}: fork_session {forked}")
    result = await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": forked["session_id"], "code": "x += 1\nprint(x)"})
    check(data(result)["stdout"] == "121\n", f"{name}: forked session {text(result)}")
    result = await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": session, "code": "print(x)"})
    check(data(result)["stdout"] == "120\n", f"{name}: the original after a fork {text(result)}")
    await client.call_tool("session_close", {"sandbox_id": sandbox, "session_id": forked["session_id"]})
    forked = data(await client.call_tool("fork_session", {"sandbox_id": sandbox, "session_id": session, "with_workspace": True}))
    check(forked["sandbox_id"] != sandbox, f"{name}: fork_session with_workspace {forked}")
    result = await client.call_tool("session_run", {"sandbox_id": forked["sandbox_id"], "session_id": forked["session_id"], "code": "print(x, open('data/in.txt').read())"})
    check(data(result)["stdout"] == "120 héllo\n", f"{name}: forked workspace {text(result)}")
    await client.call_tool("session_close", {"sandbox_id": forked["sandbox_id"], "session_id": forked["session_id"]})
    result = await client.call_tool("fork_session", {"sandbox_id": sandbox, "session_id": "ses_nope"})
    check(result.is_error and data(result)["error"]["code"] == "SESSION_NOT_FOUND", f"{name}: fork of nothing {text(result)}")
    listing = data(await client.call_tool("list_files", {"sandbox_id": sandbox}))
    check([f["path"] for f in listing["files"]] == ["data", "data/in.txt", "out.txt", "plot.png"], f"{name}: list_files {listing}")
    result = await client.call_tool("session_close", {"sandbox_id": sandbox, "session_id": session})
    check(not result.is_error, f"{name}: session_close {text(result)}")
    result = await client.call_tool("session_run", {"sandbox_id": sandbox, "session_id": session, "code": "print(x)"})
    check(result.is_error and data(result)["error"]["code"] == "SESSION_NOT_FOUND", f"{name}: closed session {text(result)}")

    # Hostile input: traversal, unknown sandbox, malformed arguments.
    result = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": "../../etc/passwd"})
    check(result.is_error and data(result)["error"]["code"] == "INVALID_PATH", f"{name}: traversal {text(result)}")
    result = await client.call_tool("read_file", {"sandbox_id": "sb_nope", "path": "x"})
    check(result.is_error and data(result)["error"]["code"] == "SANDBOX_NOT_FOUND", f"{name}: unknown {text(result)}")
    # A wrong type is refused either as a tool error or as a JSON-RPC error (invalid params);
    # only the latter, from the call itself, is tolerated here: the check stays outside the try
    # so its own AssertionError is never swallowed.
    try:
        result = await client.call_tool("run_python", {"code": 5})
    except ProtocolError as refused:
        result = None
        print(f"mcp-check: {name}: wrong type refused as a protocol error: {refused}")
    if result is not None:
        check(result.is_error, f"{name}: wrong type accepted {text(result)}")
    return sandbox


async def over_stdio():
    with tempfile.TemporaryDirectory() as data_dir:
        params = StdioServerParameters(command=KILN, args=["mcp", "--data-dir", data_dir])
        async with Client(params) as client:
            await exercise(client, "stdio")
    print("mcp-check: stdio ok")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def create_key(data_dir):
    return subprocess.run([KILN, "keys", "create", "--data-dir", data_dir], check=True,
                          capture_output=True, text=True).stdout.strip()


async def over_http():
    with tempfile.TemporaryDirectory() as data_dir:
        alice, bob = create_key(data_dir), create_key(data_dir)
        port = free_port()
        server = subprocess.Popen([KILN, "serve", "--workers", "2", "--listen", f"127.0.0.1:{port}",
                                   "--data-dir", data_dir, "--log-format", "json"],
                                  env={**os.environ, "KILN_LOG": "info,kiln::timing=debug"},
                                  stderr=open(os.path.join(data_dir, "serve.log"), "w"))
        try:
            deadline = time.time() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
            url = f"http://127.0.0.1:{port}/mcp"
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {alice}"})
            try:
                async with Client(streamable_http_client(url, http_client=http)) as client:
                    sandbox = await exercise(client, "http")
            except BaseException:
                # What the server saw, and what ran beside it, for a failure only CI shows.
                sys.stderr.write("mcp-check: the server's log ends:\n")
                with open(os.path.join(data_dir, "serve.log"), errors="replace") as log:
                    sys.stderr.writelines(log.readlines()[-80:])
                ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,time,rss,args", "--sort=-time"],
                                    capture_output=True, text=True).stdout
                sys.stderr.writelines(ps.splitlines(keepends=True)[:25])
                raise
            # Issue 12: links code planted never redirect write_file or read_file (the old
            # server wrote `.<name>.<pid>.tmp` beside the target, following links).
            keys_path = os.path.join(data_dir, "keys.json")
            keys_before = open(keys_path, "rb").read()
            workspace = os.path.join(data_dir, "sandboxes", sandbox, "workspace")
            os.symlink(keys_path, os.path.join(workspace, f".up.txt.{server.pid}.tmp"))
            os.symlink(data_dir, os.path.join(workspace, "d"))
            async with Client(streamable_http_client(url, http_client=create_mcp_http_client(
                    headers={"Authorization": f"Bearer {alice}"}))) as client:
                result = await client.call_tool("write_file", {"sandbox_id": sandbox, "path": "up.txt", "content": "pwned"})
                check(not result.is_error, f"write_file past a planted temporary: {text(result)}")
                for path in ["d/keys.json", f".up.txt.{server.pid}.tmp"]:
                    result = await client.call_tool("write_file", {"sandbox_id": sandbox, "path": path, "content": "pwned"})
                    check(result.is_error and data(result)["error"]["code"] == "INVALID_PATH", f"write_file {path}: {text(result)}")
                    result = await client.call_tool("read_file", {"sandbox_id": sandbox, "path": path})
                    check(result.is_error and data(result)["error"]["code"] == "INVALID_PATH", f"read_file {path}: {text(result)}")
                    check(data_dir not in text(result), f"an error names the data folder: {text(result)}")
            check(open(keys_path, "rb").read() == keys_before, "the key file changed through a planted link")
            # The key's tenant applies: Bob cannot see Alice's sandbox, over MCP or REST.
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {bob}"})
            async with Client(streamable_http_client(url, http_client=http)) as client:
                result = await client.call_tool("list_files", {"sandbox_id": sandbox})
                check(result.is_error and data(result)["error"]["code"] == "SANDBOX_NOT_FOUND", f"tenant leak: {text(result)}")
            request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/sandboxes/{sandbox}",
                                             headers={"Authorization": f"Bearer {alice}"})
            check(json.load(urllib.request.urlopen(request))["containerId"] == sandbox, "REST sees the MCP sandbox")
            # No key: refused before MCP.
            try:
                async with Client(url) as client:
                    await client.list_tools()
                raise AssertionError("an MCP client without a key was served")
            except AssertionError:
                raise
            except BaseException:
                pass
        finally:
            server.terminate()
            server.wait(timeout=30)
    print("mcp-check: streamable HTTP ok")


async def linux_boxes():
    """The box tools on a Linux sandbox (kiln serve --linux, which needs root, as CI runs)."""
    with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as state_dir:
        port = free_port()
        server = subprocess.Popen([KILN, "serve", "--linux", "--no-auth", "--listen", f"127.0.0.1:{port}",
                                   "--data-dir", data_dir],
                                  env={**os.environ, "KILN_STATE_DIR": state_dir},
                                  stderr=open(os.path.join(data_dir, "serve.log"), "w"))
        try:
            deadline = time.time() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.1)
            request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/sandboxes",
                                             data=json.dumps({"template": "linux-python"}).encode(),
                                             headers={"content-type": "application/json"})
            sandbox = json.load(urllib.request.urlopen(request))["containerId"]
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                started = await client.call_tool("run_bash", {"sandbox_id": sandbox, "code":
                    "sleep 300 >/dev/null 2>&1 & python3 -m http.server 8000 >/dev/null 2>&1 & echo started"})
                check(not started.is_error and "started" in text(started), f"run_bash: {text(started)}")
                deadline = time.time() + 10
                while True:
                    seen = data(await client.call_tool("sandbox_processes", {"sandbox_id": sandbox}))
                    if seen["ports"]:
                        break
                    check(time.time() < deadline, f"no port: {seen}")
                    time.sleep(0.1)
                check(seen["state"] == "running", f"state: {seen}")
                check(seen["ports"][0]["port"] == 8000 and seen["ports"][0]["preview"] == f"/preview/{sandbox}/8000/", f"ports: {seen}")
                sleeper = [p["pid"] for p in seen["processes"] if p["argv"] == ["sleep", "300"]]
                check(len(sleeper) == 1, f"processes: {seen}")
                paused = data(await client.call_tool("sandbox_pause", {"sandbox_id": sandbox}))
                check(paused["state"] == "paused", f"pause: {paused}")
                resumed = data(await client.call_tool("sandbox_resume", {"sandbox_id": sandbox}))
                check(resumed["state"] == "running", f"resume: {resumed}")
                sent = data(await client.call_tool("sandbox_signal", {"sandbox_id": sandbox, "pid": sleeper[0], "signal": "KILL"}))
                check(sent == {"signalled": 1}, f"signal: {sent}")
                for bad in [{"pid": 1}, {"pid": 99999}, {"pid": sleeper[0], "signal": "NOPE"}]:
                    result = await client.call_tool("sandbox_signal", {"sandbox_id": sandbox, **bad})
                    check(result.is_error, f"sandbox_signal {bad}: {text(result)}")
                restarted = data(await client.call_tool("sandbox_restart", {"sandbox_id": sandbox}))
                check(restarted["killed"] >= 1, f"restart: {restarted}")
                seen = data(await client.call_tool("sandbox_processes", {"sandbox_id": sandbox}))
                check([p["agent"] for p in seen["processes"]] == [True] and seen["ports"] == [], f"after restart: {seen}")
                slept = data(await client.call_tool("sandbox_hibernate", {"sandbox_id": sandbox}))
                check(slept["state"] == "hibernated" and "checkpointed" in slept["processes"], f"hibernate: {slept}")
                woke = await client.call_tool("run_bash", {"sandbox_id": sandbox, "code": "echo awake"})
                check("awake" in text(woke), f"after hibernation: {text(woke)}")
                # A terminal a person can open: the command typed in, its output, a signed page.
                opened = data(await client.call_tool("sandbox_terminal", {
                    "sandbox_id": sandbox, "command": "echo from-$((6*7)); python3 -m http.server 8001 >/dev/null 2>&1 &",
                    "wait_ms": 1500}))
                check("from-42" in opened["output"] and not opened["exited"], f"terminal: {opened}")
                check(opened["page"].startswith(f"/terminal/{sandbox}/{opened['terminal_id']}/?kiln_preview_token="), f"page: {opened}")
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}{opened['page']}")
                check(page.status == 200 and b"xterm" in page.read(), "the terminal page did not load")
                deadline = time.time() + 10
                while not data(await client.call_tool("sandbox_processes", {"sandbox_id": sandbox}))["ports"]:
                    check(time.time() < deadline, "the terminal's server never listened")
                    time.sleep(0.1)
                link = data(await client.call_tool("sandbox_preview_link", {"sandbox_id": sandbox, "port": 8001}))
                check(link["url"].startswith(f"/preview/{sandbox}/8001/?kiln_preview_token="), f"link: {link}")
                listing = urllib.request.urlopen(f"http://127.0.0.1:{port}{link['url']}")
                check(listing.status == 200 and b"Directory listing" in listing.read(), "the preview link did not reach the server")
                refused = await client.call_tool("sandbox_preview_link", {"sandbox_id": sandbox, "port": 22})
                check(refused.is_error and data(refused)["error"]["code"] == "PORT_NOT_ALLOWED", f"port 22: {text(refused)}")
                wasm = data(await client.call_tool("sandbox_create", {}))["sandbox_id"]
                result = await client.call_tool("sandbox_pause", {"sandbox_id": wasm})
                check(result.is_error and data(result)["error"]["code"] == "UNSUPPORTED", f"a wasm pause: {text(result)}")
                result = await client.call_tool("sandbox_terminal", {"sandbox_id": wasm})
                check(result.is_error and data(result)["error"]["code"] == "UNSUPPORTED", f"a wasm terminal: {text(result)}")
                await issue37_tools(client)
                await issue35_tools(client)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print("mcp-check: Linux box tools ok")


async def issue35_tools(client):
    """A workspace with postgres, as an agent uses it: add a service, run SQL, stop, start."""
    ws = data(await client.call_tool("workspace_create", {"name": "mcp-ws", "services": ["postgres"]}))
    check(ws["services"][0]["host"] == "postgres.workspace.internal", f"workspace_create: {ws}")
    made = data(await client.call_tool("run_sql", {"workspace": "mcp-ws", "query": "create table t (n int)"}))
    check(made["columns"] == [], f"run_sql create: {made}")
    data(await client.call_tool("run_sql", {"workspace": "mcp-ws", "query": "insert into t values (7)"}))
    bad = await client.call_tool("run_sql", {"workspace": "mcp-ws", "query": "select nope from t"})
    check(bad.is_error and "nope" in text(bad), f"a refused statement: {text(bad)}")
    redis = data(await client.call_tool("add_service", {"workspace": "mcp-ws", "service_type": "redis"}))
    check(redis["port"] == 6379, f"add_service: {redis}")
    mongo = await client.call_tool("add_service", {"workspace": "mcp-ws", "service_type": "mongodb"})
    check(mongo.is_error and "MongoDB" in text(mongo), f"mongodb: {text(mongo)}")
    stopped = data(await client.call_tool("workspace_stop", {"workspace": "mcp-ws"}))
    check(stopped["state"] == "stopped", f"workspace_stop: {stopped}")
    started = data(await client.call_tool("workspace_start", {"workspace": "mcp-ws"}))
    check(started["state"] == "running", f"workspace_start: {started}")
    rows = data(await client.call_tool("run_sql", {"workspace": "mcp-ws", "query": "select n from t"}))
    check(rows["rows"] == [{"n": 7}], f"run_sql after a restart: {rows}")
    shown = data(await client.call_tool("enable_preview", {"workspace": "mcp-ws", "preview_type": "static"}))
    check(shown["url"].startswith("/preview/") and shown["preview"]["port"] == 8080, f"enable_preview: {shown}")
    listed = data(await client.call_tool("workspace_list", {}))
    check([w["name"] for w in listed["workspaces"]] == ["mcp-ws"], f"workspace_list: {listed}")
    alone = await client.call_tool("workspace_share", {"workspace": "mcp-ws", "key_id": "key_x", "access": "read"})
    check(alone.is_error and "no API keys" in text(alone), f"workspace_share without keys: {text(alone)}")
    data(await client.call_tool("workspace_delete", {"workspace": "mcp-ws"}))
    print("mcp-check: workspaces, services and run_sql ok")

    # A workflow with people in both roles (no model needed): the stages move with the tools.
    names = data(await client.call_tool("workflow_templates", {}))["templates"]
    check(names == ["database-schema", "fullstack-app", "static-website"], f"workflow_templates: {names}")
    unknown = await client.call_tool("workflow_start", {"template": "mobile-app", "task": "x"})
    check(unknown.is_error and "UNKNOWN_TEMPLATE" in text(unknown), f"an unknown template: {text(unknown)}")
    wf = data(await client.call_tool("workflow_start", {
        "template": "static-website", "task": "a page that says hello",
        "human_creator": True, "human_reviewer": True}))
    check(wf["stage"] == "creation" and wf["roles"]["creator"]["human"], f"workflow_start: {wf}")
    for _ in range(100):
        wf = data(await client.call_tool("workflow_get", {"workflow_id": wf["id"]}))
        if wf["waitingForHuman"]:
            break
        await asyncio.sleep(0.1)
    check(wf["waitingForHuman"] and wf["currentAgent"] == "creator", f"waiting for the creator: {wf}")
    early = await client.call_tool("workflow_submit_review", {"workflow_id": wf["id"], "approved": True})
    check(early.is_error and "NOT_YOUR_TURN" in text(early), f"a review before the work: {text(early)}")
    wf = data(await client.call_tool("workflow_submit_for_review", {"workflow_id": wf["id"], "notes": "done"}))
    check(wf["stage"] == "review" and wf["previewUrl"].startswith("/preview/"), f"submitted: {wf}")
    for _ in range(100):
        wf = data(await client.call_tool("workflow_get", {"workflow_id": wf["id"]}))
        if wf["waitingForHuman"]:
            break
        await asyncio.sleep(0.1)
    wf = data(await client.call_tool("workflow_submit_review", {"workflow_id": wf["id"], "approved": True, "grade": "A"}))
    check(wf["stage"] == "approved" and wf["reviews"][0]["by"].startswith("human:"), f"approved: {wf}")
    actions = [e["action"] for e in wf["history"]]
    check(actions[0] == "started" and actions[-1] == "approved" and "review_submitted" in actions, f"the trail: {actions}")
    done = await client.call_tool("workflow_cancel", {"workflow_id": wf["id"]})
    check(done.is_error and "WORKFLOW_FINISHED" in text(done), f"cancel a finished one: {text(done)}")
    print("mcp-check: workflows ok")


async def issue37_tools(client):
    """Volumes, network rules, secrets, snapshots and forks, as an MCP client uses them."""
    made = data(await client.call_tool("volume_create", {"name": "mcp-vol", "size_mb": 32}))
    check(made["name"] == "mcp-vol" and made["sizeBytes"] == 32 << 20, f"volume_create: {made}")
    listed = data(await client.call_tool("volume_list", {}))
    check([v["name"] for v in listed["volumes"]] == ["mcp-vol"], f"volume_list: {listed}")
    stored = data(await client.call_tool("secret_set", {"name": "mcp-token", "value": "s3cr3t-value"}))
    check(stored["version"] == 1 and "s3cr3t" not in json.dumps(stored), f"secret_set: {stored}")
    stored = data(await client.call_tool("secret_set", {"name": "mcp-token", "value": "s3cr3t-v2"}))
    check(stored["version"] == 2, f"secret_set again: {stored}")
    secrets = data(await client.call_tool("secret_list", {}))
    check([s["name"] for s in secrets["secrets"]] == ["mcp-token"] and "s3cr3t" not in json.dumps(secrets), f"secret_list: {secrets}")
    box = data(await client.call_tool("sandbox_create", {
        "template": "linux-python",
        "network_rules": {"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]},
        "volume_mounts": [{"volume": "mcp-vol", "path": "/mnt/vol"}]}))["sandbox_id"]
    ran = await client.call_tool("run_bash", {"sandbox_id": box, "code":
        "echo kept > /mnt/vol/v.txt && echo ws > w.txt && curl -s http://registry.npmjs.org/"})
    check("denyOut" in text(ran), f"a denied host through MCP's rules: {text(ran)}")
    rules = data(await client.call_tool("sandbox_set_network", {"sandbox_id": box, "network_rules": {"denyOut": ["pypi.org"]}}))
    check(rules["network_rules"] == {"denyOut": ["pypi.org"]}, f"sandbox_set_network: {rules}")
    bad = await client.call_tool("sandbox_set_network", {"sandbox_id": box, "network_rules": {"allowOut": ["not a host"]}})
    check(bad.is_error and "not a destination" in text(bad), f"a bad rule: {text(bad)}")
    in_use = await client.call_tool("volume_delete", {"volume": "mcp-vol"})
    check(in_use.is_error and data(in_use)["error"]["code"] == "VOLUME_IN_USE", f"volume_delete in use: {text(in_use)}")
    snap = data(await client.call_tool("sandbox_snapshot", {"sandbox_id": box, "name": "mcp-snap"}))
    check(snap["id"].startswith("snap_") and snap["sandboxId"] == box, f"sandbox_snapshot: {snap}")
    # Its box ran (a command above): its processes were taken, and the forks restore them.
    check(snap["withProcesses"] is True, f"sandbox_snapshot took no processes: {snap}")
    forks = data(await client.call_tool("sandbox_fork", {"sandbox_id": box, "count": 2}))["forks"]
    check(len(forks) == 2 and all("sandbox_id" in f for f in forks), f"sandbox_fork: {forks}")
    check(all(f["restored_processes"] is True for f in forks), f"sandbox_fork's processes: {forks}")
    for fork in forks:
        seen = await client.call_tool("run_bash", {"sandbox_id": fork["sandbox_id"], "code": "cat w.txt /mnt/vol/v.txt"})
        check(text(seen).count("ws") == 1 and "kept" in text(seen), f"a fork's files: {text(seen)}")
    copy = data(await client.call_tool("sandbox_create", {"snapshot": "mcp-snap"}))
    seen = await client.call_tool("run_bash", {"sandbox_id": copy["sandbox_id"], "code": "cat w.txt"})
    check("ws" in text(seen), f"from a snapshot: {text(seen)}")
    gone = data(await client.call_tool("secret_delete", {"name": "mcp-token"}))
    check(gone == {"deleted": "mcp-token"}, f"secret_delete: {gone}")
    print("mcp-check: volumes, network rules, secrets, snapshots and forks ok")


async def main():
    await over_stdio()
    await over_http()
    await linux_boxes()


if __name__ == "__main__":
    asyncio.run(main())
