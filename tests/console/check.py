"""Drives kiln's web console (/console) in headless Chromium through Playwright: a real
`kiln serve` with keys, the real page, the system's Chromium. A chat turn's model is a small
scripted server speaking OpenAI's chat-completions protocol (streamed), here in test code:
it stands in for a paid provider, nothing else.

Checked: every page loads without console errors or failed requests; signing in with a key
(and a wrong key refused); a sandbox created from the page runs code whose output shows; a
file uploaded shows in the tree and opens; the history shows the run; a chat turn streams
its tokens and shows the matplotlib figure its code drew; a narrow screen; the keyboard
(Ctrl+Enter runs). Screenshots of each page go to target/console-screenshots/.

Usage: tests/console/check.py path/to/kiln
"""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from playwright.sync_api import expect, sync_playwright

KILN = os.path.abspath(sys.argv[1])
SHOTS = os.path.abspath("target/console-screenshots")


def check(ok, what):
    if not ok:
        raise SystemExit(f"console-check: FAILED: {what}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIGURE = ("import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
          "plt.plot([1, 4, 9, 16])\nplt.title('squares')\nplt.show()\nprint('drew it')")
SCRIPT = [
    {"tool": ("call_1", "execute_code", {"language": "python", "code": FIGURE})},
    {"text": "Here is the plot of the first four squares."},
]


class Model(http.server.BaseHTTPRequestHandler):
    """OpenAI's streamed chat completions, answering SCRIPT in order."""
    script = list(SCRIPT)
    requests = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Model.requests.append(body)
        step = Model.script.pop(0) if Model.script else {"text": "(the script is over)"}
        chunks = []

        def chunk(delta, finish=None):
            chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        if "text" in step:
            chunk({"role": "assistant", "content": ""})
            for word in step["text"].split(" "):
                chunk({"content": word + " "})
            chunk({}, "stop")
        else:
            call_id, name, args = step["tool"]
            chunk({"role": "assistant", "content": None})
            chunk({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": json.dumps(args)}}]})
            chunk({}, "tool_calls")
        tail = ('data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"fake","choices":[],'
                '"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\ndata: [DONE]\n\n')
        # Sent as it is made, a word every quarter second and no length: the console must
        # show the answer growing, not all at once at the end.
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.flush()
            if "text" in step:
                time.sleep(0.25)
        self.wfile.write(tail.encode())
        self.wfile.flush()


def main():
    os.makedirs(SHOTS, exist_ok=True)
    model = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Model)
    threading.Thread(target=model.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as scratch:
        # Boxes' roots are mounted from the state folder, which runc must be able to reach.
        os.chmod(scratch, 0o755)
        data_dir = os.path.join(scratch, "data")
        key = subprocess.run([KILN, "keys", "create", "--name", "console", "--data-dir", data_dir],
                             check=True, capture_output=True, text=True).stdout.strip()
        admin = subprocess.run([KILN, "keys", "create", "--admin", "--name", "operator", "--data-dir", data_dir],
                               check=True, capture_output=True, text=True).stdout.strip()
        port = free_port()
        env = dict(os.environ, KILN_LLM_MODEL="openai-compatible:fake",
                   KILN_LLM_BASE_URL=f"http://127.0.0.1:{model.server_address[1]}/v1",
                   KILN_STATE_DIR=os.path.join(scratch, "state"))
        log = open(os.path.join(scratch, "serve.log"), "w")
        server = subprocess.Popen([KILN, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", data_dir],
                                  env=env, stdout=subprocess.DEVNULL, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(base + "/healthz")
                    break
                except OSError:
                    time.sleep(0.05)
            run(base, key)
            keys_page(base, admin)
        except BaseException:
            log.flush()
            with open(log.name, errors="replace") as f:
                print(f.read()[-4000:], file=sys.stderr)
            raise
        finally:
            server.terminate()
            server.wait(timeout=30)
        # Under --no-auth the console asks for no key.
        port = free_port()
        server = subprocess.Popen([KILN, "serve", "--no-auth", "--linux", "--listen", f"127.0.0.1:{port}",
                                   "--data-dir", os.path.join(scratch, "open")],
                                  env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz")
                    break
                except OSError:
                    time.sleep(0.05)
            without_keys(f"http://127.0.0.1:{port}")
        finally:
            server.terminate()
            server.wait(timeout=30)
    print("console-check: passed")


def without_keys(base):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page()
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(base + "/console")
        expect(page.get_by_role("heading", name="Sandboxes")).to_be_visible()
        # No keys to sign in with: the header says so instead of offering a sign-in.
        expect(page.get_by_text("no keys (--no-auth)")).to_be_visible()
        expect(page.get_by_role("link", name="Sign in")).to_have_count(0)
        # A Linux sandbox: its code runs in the box, and it has a terminal.
        page.get_by_label("Template").select_option("linux-python")
        # Its resources, asked at create: the box has them.
        page.get_by_text("Resources (blank: the template's)").click()
        page.get_by_label("Memory (MiB)").fill("384")
        page.get_by_label("vCPUs").fill("0.5")
        page.get_by_label("Processes").fill("256")
        page.get_by_role("button", name="Create sandbox").click()
        expect(page.get_by_test_id("resources")).to_contain_text("0.5 vCPU · 384 MiB memory · 1024 MiB disk · 256 processes")
        with urllib.request.urlopen(f"{base}/api/v1/sandboxes/{sandbox_id(page)}") as r:
            made = json.load(r)["resources"]
            check(made == {"vcpus": 0.5, "memory_mb": 384, "disk_mb": 1024, "pids": 256}, f"the box's resources: {made}")
        page.get_by_role("button", name="Run (Ctrl+Enter)").click()
        expect(page.locator("pre.output")).to_have_text("hello from kiln\n", timeout=30000)
        with page.context.expect_page() as opened:
            page.get_by_role("button", name="Open a terminal").click()
        terminal = opened.value
        terminal.wait_for_load_state()
        check("/terminal/" in terminal.url, f"the terminal's page: {terminal.url}")
        check(terminal.evaluate("window.opener") is None, "the terminal page has no opener")
        # A session in it: what is typed runs in the box, and its output comes back.
        terminal.wait_for_function("window.kiln && window.kiln.state.writer", timeout=30000)
        terminal.locator("#term").click()
        terminal.keyboard.type("echo console-$((6*7)) in $PWD\n")
        screen = """() => { const b = window.kiln.term.buffer.active; const lines = [];
            for (let i = 0; i < b.length; i++) lines.push(b.getLine(i).translateToString(true));
            return lines.join("\\n"); }"""
        terminal.wait_for_function(f"({screen})().includes('console-42 in /workspace')", timeout=30000)
        terminal.screenshot(path=f"{SHOTS}/terminal.png")
        terminal.close()
        # A server in the box: its process and port show; the port's preview opens; End stops it.
        page.get_by_label("Language").select_option("bash")
        page.get_by_label("Code", exact=True).fill("mkdir -p site && echo '<h1>served</h1>' > site/index.html && cd site && (setsid python3 -m http.server 8000 >/dev/null 2>&1 &) && sleep 1 && echo started")
        page.get_by_role("button", name="Run (Ctrl+Enter)").click()
        expect(page.locator("pre.output")).to_have_text("started\n", timeout=30000)
        page.get_by_role("button", name="Refresh").click()
        expect(page.get_by_role("table", name="Processes")).to_contain_text("http.server 8000")
        with page.context.expect_page() as opened:
            page.get_by_role("button", name="Preview port 8000").click()
        served = opened.value
        served.wait_for_load_state()
        expect(served.get_by_role("heading", name="served")).to_be_visible()
        served.close()
        page.screenshot(path=f"{SHOTS}/linux-sandbox.png", full_page=True)
        pid = page.get_by_role("table", name="Processes").locator("tr", has_text="http.server").locator("td").first.inner_text()
        page.get_by_role("button", name=f"End process {pid}").click()
        for _ in range(50):
            if "http.server 8000" not in page.get_by_role("table", name="Processes").inner_text():
                break
            time.sleep(0.2)
            page.get_by_role("button", name="Refresh").click()
        expect(page.get_by_role("table", name="Processes")).not_to_contain_text("http.server 8000")

        # A workflow played by the person at the console, both roles, to its approval.
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Workflows").click()
        page.get_by_label("Template").select_option("static-website")
        page.get_by_label("Task").fill("A page that says hello")
        page.get_by_label("I play the creator").check()
        page.get_by_label("I play the reviewer").check()
        page.get_by_role("button", name="Start").click()
        expect(page.get_by_role("heading", name="Your turn: the creator's")).to_be_visible(timeout=60000)
        page.get_by_label("Notes for the reviewer").fill("the first page")
        page.get_by_role("button", name="Submit for review").click()
        expect(page.get_by_role("heading", name="Your turn: the reviewer's")).to_be_visible()
        expect(page.get_by_role("link", name="preview")).to_be_visible()
        page.get_by_label("Grade").fill("A")
        page.get_by_label("Feedback").fill("clear and short")
        page.get_by_role("button", name="Submit review").click()
        expect(page.get_by_test_id("wf-stage")).to_have_text("approved")
        timeline = page.get_by_role("list", name="Timeline")
        expect(timeline).to_contain_text("submitted_for_review")
        expect(timeline).to_contain_text("approved")
        expect(page.get_by_text("grade A")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/workflow.png", full_page=True)
        # The one tenant's account: the machine's capacity, no keys to manage.
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Account").click()
        expect(page.get_by_text("This server runs without keys")).to_be_visible()
        expect(page.get_by_role("table", name="Usage and quotas").get_by_role("row", name="Sandboxes")).to_contain_text("10000")
        check(not problems, f"console errors without keys: {problems}")
        browser.close()


def run(base, key):
    # The page itself needs no key; it is served with a policy that allows no other origin.
    with urllib.request.urlopen(base + "/console/") as r:
        policy = r.headers["content-security-policy"]
        check("script-src 'self'" in policy and "frame-ancestors 'none'" in policy, f"policy: {policy}")
    try:
        urllib.request.urlopen(base + "/console/assets/nothing.js")
        check(False, "an unknown asset answered")
    except urllib.error.HTTPError as e:
        check(e.code == 404, f"an unknown asset: {e.code}")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" and "401" not in m.text else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))

        # Signed out: the API answers 401 and the page asks for a key.
        page.goto(base + "/console")
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/login.png")
        page.get_by_label("API key").fill("kiln_wrong")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("alert")).to_contain_text("UNAUTHORIZED")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("heading", name="Sandboxes")).to_be_visible()
        expect(page.get_by_text("No sandboxes yet.")).to_be_visible()
        problems.clear()  # the 401s above were the point

        # A sandbox: create, run code, see its output.
        page.get_by_label("Template").select_option("python")
        page.get_by_text("Resources (blank: the template's)").click()
        expect(page.get_by_label("vCPUs")).to_be_disabled()
        page.get_by_label("Memory (MiB)").fill("lots")
        page.get_by_role("button", name="Create sandbox").click()
        expect(page.get_by_role("alert")).to_contain_text('memory_mb: "lots" is not a whole number')
        page.get_by_label("Memory (MiB)").fill("256")
        page.get_by_role("button", name="Create sandbox").click()
        expect(page.get_by_role("heading", name="Run code")).to_be_visible()
        expect(page.get_by_test_id("resources")).to_contain_text("256 MiB memory per run")
        page.get_by_label("Code", exact=True).fill("import sys\nfor i in range(3):\n    print('line', i)\nprint('oops', file=sys.stderr)")
        page.get_by_role("button", name="Run (Ctrl+Enter)").click()
        output = page.locator("pre.output")
        expect(output).to_contain_text("line 0\nline 1\nline 2")
        expect(output.locator(".stderr")).to_have_text("oops\n")
        expect(page.get_by_test_id("run-status")).to_contain_text("success, exit 0")
        # The keyboard: Ctrl+Enter runs.
        page.get_by_label("Code", exact=True).fill("open('made.txt', 'w').write('made by code')\nprint('again')")
        page.get_by_label("Code", exact=True).press("Control+Enter")
        expect(output).to_have_text("again\n")
        tree = page.get_by_role("list", name="Files in the workspace")
        expect(tree).to_contain_text("made.txt")

        # Upload a file; it shows in the tree and opens.
        page.get_by_label("Upload a file").set_input_files(files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"uploaded from the console\n"}])
        page.get_by_role("button", name="Upload", exact=True).click()
        expect(tree).to_contain_text("notes.txt")
        tree.get_by_role("button", name="notes.txt", exact=True).click()
        editor = page.get_by_label("notes.txt", exact=True)
        expect(editor).to_have_value("uploaded from the console\n")
        # Edited and saved: the API has the new bytes, and the history the change.
        editor.fill("edited in the console\n")
        page.get_by_role("button", name="Save").click()
        expect(page.get_by_role("button", name="Saved")).to_be_disabled()
        request = urllib.request.Request(f"{base}/api/v1/sandboxes/{sandbox_id(page)}/files/notes.txt",
                                         headers={"authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request) as r:
            check(r.read() == b"edited in the console\n", "the saved file")
        # The history lists the run and the upload.
        history = page.get_by_role("heading", name="History").locator("..")
        expect(history).to_contain_text("upload notes.txt")
        # Rolled back to before the upload: notes.txt is gone from the tree.
        history.get_by_role("button", name="Roll back to python open('made.txt', 'w').write('made by code')").click()
        expect(history).to_contain_text("rollback to")
        expect(tree).not_to_contain_text("notes.txt")
        expect(tree).to_contain_text("made.txt")
        page.screenshot(path=f"{SHOTS}/sandbox.png", full_page=True)

        # The list shows it; a narrow screen still works.
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Sandboxes").click()
        expect(page.locator("table")).to_contain_text("python")
        page.screenshot(path=f"{SHOTS}/sandboxes.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        expect(page.get_by_role("button", name="Create sandbox")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/sandboxes-narrow.png", full_page=True)
        page.set_viewport_size({"width": 1280, "height": 900})

        # Chat: the model's code runs, its figure shows, its answer streams in.
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Chat").click()
        page.get_by_label("Message").fill("Plot the first four squares.")
        # Every state the chat log passes through, to prove the answer arrives word by word.
        page.evaluate("""() => {
            const log = document.querySelector('.chat-log');
            window.seenLog = [];
            window.seenObserver = new MutationObserver(() => window.seenLog.push(log.textContent));
            window.seenObserver.observe(log, {childList: true, subtree: true, characterData: true});
        }""")
        page.get_by_role("button", name="Send").click()
        figure = page.get_by_role("img", name="A figure the code made")
        expect(figure).to_be_visible(timeout=60000)
        check(figure.evaluate("img => img.naturalWidth") > 100, "the figure is an image")
        expect(page.locator(".chat-log")).to_contain_text("drew it")
        expect(page.locator(".chat-log")).to_contain_text("Here is the plot of the first four squares.")
        expect(page.get_by_role("button", name="Send")).to_be_enabled()
        seen = page.evaluate("window.seenObserver.disconnect(), window.seenLog")
        partial = [t for t in seen if "Here is" in t and "plot of the first four squares" not in t]
        check(len(partial) >= 3, f"the answer did not stream in word by word: {len(partial)} partial states of {[t[-60:] for t in seen[-8:]]}")
        page.screenshot(path=f"{SHOTS}/chat.png", full_page=True)
        check(len(Model.requests) == 2, f"the model was asked {len(Model.requests)} times")
        check(any(t["function"]["name"] == "execute_code" for t in Model.requests[0].get("tools", [])),
              "execute_code was offered")

        # Workflows: the page lists the templates (a run needs a Linux server).
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Workflows").click()
        expect(page.get_by_label("Template")).to_contain_text("database-schema")
        page.screenshot(path=f"{SHOTS}/workflows.png", full_page=True)

        # Account: the key's quotas and what it holds; no keys for a plain key.
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Account").click()
        usage = page.get_by_role("table", name="Usage and quotas")
        expect(usage.get_by_role("row", name="Sandboxes")).to_contain_text("1000")
        check(usage.get_by_role("row", name="Sandboxes").locator("td").first.inner_text() in ("1", "2"),
              "the sandboxes in use")
        expect(page.get_by_role("heading", name="Keys")).to_have_count(0)

        # Signing out forgets the key.
        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        check(page.evaluate("sessionStorage.getItem('kiln.key')") is None, "the key was forgotten")
        problems = [p for p in problems if "401" not in p and "Unauthorized" not in p]
        check(not problems, f"console errors: {problems}")
        browser.close()


def keys_page(base, admin):
    """An admin key's Account page: make a key with its own quota, which works at once and
    holds; change the quota; revoke the key."""
    def me(key):
        request = urllib.request.Request(base + "/api/v1/me", headers={"authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            return {"status": e.code}

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(base + "/console#/login")
        page.get_by_label("API key").fill(admin)
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("heading", name="Sandboxes")).to_be_visible()
        page.get_by_role("navigation", name="Pages").get_by_role("link", name="Account").click()
        expect(page.get_by_text("an admin key")).to_be_visible()
        keys = page.get_by_role("table", name="Keys")
        expect(keys).to_contain_text("operator")
        expect(keys).to_contain_text("console")
        expect(page.get_by_role("table", name="Tenants")).to_be_visible()

        # Make a key for a team with a quota of 2 sandboxes and 768MiB of session memory.
        page.get_by_label("Name", exact=True).fill("team")
        page.get_by_label("Tenant", exact=True).fill("team-a")
        page.get_by_text("Its own quotas").click()
        page.locator("#new-sandboxes").fill("2")
        page.locator("#new-sessionMemoryBytes").fill("768MiB")
        page.get_by_role("button", name="Make key").click()
        made = page.get_by_label("The new key")
        expect(made).to_have_value(re.compile(r"^kiln_[0-9a-f]{48}$"))
        new_key = made.input_value()
        mine = me(new_key)
        check(mine.get("tenant") == "team-a" and mine["quotas"]["sandboxes"] == 2
              and mine["quotas"]["sessionMemoryBytes"] == 768 << 20, f"the new key: {mine}")
        row = keys.get_by_role("row").filter(has_text="team-a")
        expect(row).to_contain_text("sandboxes 2")
        page.screenshot(path=f"{SHOTS}/keys.png", full_page=True)

        # A bad size is refused in the form, before any request.
        key_id = mine["keyId"]
        row.get_by_role("button", name=f"Edit the quotas of {key_id}").click()
        field = page.locator(f"#{key_id}-sandboxes")
        expect(field).to_have_value("2")
        expect(page.locator(f"#{key_id}-sessionMemoryBytes")).to_have_value("768MiB")
        page.locator(f"#{key_id}-workspaceBytes").fill("lots")
        page.get_by_role("button", name="Save quotas").click()
        expect(page.get_by_role("alert")).to_contain_text('Workspace storage: "lots" is not a size')
        check(me(new_key)["quotas"]["sandboxes"] == 2, "nothing was sent")
        page.locator(f"#{key_id}-workspaceBytes").fill("")
        field.fill("5")
        page.get_by_role("button", name="Save quotas").click()
        expect(row).to_contain_text("sandboxes 5")
        check(me(new_key)["quotas"]["sandboxes"] == 5, "the changed quota holds at once")

        # Revoke asks again, then the key stops.
        row.get_by_role("button", name=f"Revoke {key_id}").click()
        row.get_by_role("button", name=f"Really revoke {key_id}").click()
        expect(keys).not_to_contain_text("team-a")
        check(me(new_key) == {"status": 401}, "a revoked key stops")
        # The last admin key stays, with the server's reason.
        page.get_by_role("row").filter(has_text="operator").get_by_role("button", name=re.compile("^Revoke ")).click()
        page.get_by_role("row").filter(has_text="operator").get_by_role("button", name=re.compile("^Really revoke ")).click()
        expect(page.get_by_role("alert")).to_contain_text("LAST_ADMIN_KEY")
        page.set_viewport_size({"width": 390, "height": 844})
        expect(page.get_by_role("button", name="Make key")).to_be_visible()
        page.set_viewport_size({"width": 1280, "height": 900})
        page.screenshot(path=f"{SHOTS}/account.png", full_page=True)
        problems = [p for p in problems if "409" not in p]
        check(not problems, f"console errors on the keys page: {problems}")
        browser.close()


def sandbox_id(page):
    return page.get_by_role("heading", level=2).inner_text().strip()


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        for folder in os.environ.get("PATH", "").split(os.pathsep):
            path = os.path.join(folder, name)
            if os.access(path, os.X_OK):
                return path
    raise SystemExit("console-check: no Chromium (scripts/ensure-deps installs it)")


if __name__ == "__main__":
    main()
