// The kiln console: one page over kiln's own API (/api/v1), nothing of its own on the server.
// The API key lives in this tab's sessionStorage only. Pages by the URL's hash:
// #/sandboxes, #/sandboxes/{id}, #/chat, #/workflows, #/workflows/{id}, #/account, #/login.
import { html, render, useState, useEffect, useRef } from "./preact-htm.js";

const KEY = "kiln.key";
const key = () => sessionStorage.getItem(KEY) || "";

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error && body.error.code;
  }
}

// A request to kiln's API with the key; JSON answers parsed, errors thrown with their words.
async function api(path, { method = "GET", body, raw, headers = {} } = {}) {
  const h = { ...headers };
  if (key()) h.authorization = `Bearer ${key()}`;
  let payload = body;
  if (body !== undefined && !raw) {
    h["content-type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const response = await fetch(path, { method, headers: h, body: payload });
  if (response.status === 401) {
    location.hash = "#/login";
    throw new ApiError(401, await response.json().catch(() => null));
  }
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
  if (response.status === 204) return null;
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response;
}

// Reads a Server-Sent Events response, calling onEvent(name, data) for each event.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) {
        let parsed = data.join("\n");
        try { parsed = JSON.parse(parsed); } catch (_) { /* plain text */ }
        onEvent(name, parsed);
      }
    }
  }
}

async function streamPost(path, body, onEvent) {
  const headers = { "content-type": "application/json", accept: "text/event-stream" };
  if (key()) headers.authorization = `Bearer ${key()}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
  await readEvents(response, onEvent);
}

function useHash() {
  const [hash, setHash] = useState(location.hash || "#/sandboxes");
  useEffect(() => {
    const on = () => setHash(location.hash || "#/sandboxes");
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return hash;
}

function Failure({ error }) {
  if (!error) return null;
  return html`<p class="error" role="alert">${error.code ? `${error.code}: ` : ""}${error.message}</p>`;
}

// ---------------------------------------------------------------- login

function Login() {
  const [value, setValue] = useState("");
  const [error, setError] = useState(null);
  const [open, setOpen] = useState(null);
  useEffect(() => {
    // A server without keys (--no-auth) answers without one.
    fetch("/api/v1/sandboxes?limit=1").then((r) => setOpen(r.ok)).catch(() => setOpen(false));
  }, []);
  const submit = async (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, value.trim());
    try {
      await api("/api/v1/sandboxes?limit=1");
      location.hash = "#/sandboxes";
    } catch (err) {
      sessionStorage.removeItem(KEY);
      setError(err);
    }
  };
  return html`<section aria-labelledby="login-title">
    <h2 id="login-title">Sign in</h2>
    <p class="muted">Your API key stays in this browser tab (session storage); the server keeps nothing of the console's.</p>
    ${open && html`<p>This server has no keys (<code>--no-auth</code>): <a href="#/sandboxes">go on without one</a>.</p>`}
    <form onSubmit=${submit}>
      <label for="api-key">API key</label>
      <input id="api-key" type="password" autocomplete="off" value=${value} onInput=${(e) => setValue(e.target.value)} placeholder="kiln_…" />
      <div class="row" style="margin-top:.5rem"><button class="primary" type="submit">Sign in</button></div>
    </form>
    <${Failure} error=${error} />
  </section>`;
}

// ---------------------------------------------------------------- sandboxes

// What a sandbox may be given at create: [field, label, Linux templates only, decimal].
const RESOURCES = [
  ["memory_mb", "Memory (MiB)", false, false], ["vcpus", "vCPUs", true, true],
  ["disk_mb", "Disk (MiB)", true, false], ["pids", "Processes", true, false],
  ["lifeMinutes", "Life (minutes)", false, false],
];

function Sandboxes() {
  const [list, setList] = useState(null);
  const [templates, setTemplates] = useState([]);
  const [template, setTemplate] = useState("python");
  const [resources, setResources] = useState({});
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const chosen = templates.find((t) => t.id === template);
  const live = chosen && chosen.lifecycle === "live";
  const load = async () => {
    try {
      const page = await api("/api/v1/sandboxes?limit=200");
      setList(page.sandboxes);
      setError(null);
    } catch (err) { setError(err); }
  };
  useEffect(() => {
    load();
    api("/api/v1/templates").then((t) => setTemplates(t.templates)).catch(setError);
  }, []);
  const create = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      const body = { template };
      const asked = {};
      for (const [field, , linuxOnly, decimal] of RESOURCES) {
        const text = (resources[field] || "").trim();
        if (text === "" || (linuxOnly && !live)) continue;
        const value = Number(text);
        if (!(decimal ? value > 0 : Number.isInteger(value) && value > 0)) throw new Error(`${field}: "${text}" is not a ${decimal ? "positive number" : "whole number above 0"}`);
        if (field === "lifeMinutes") body.timeoutMs = value * 60000;
        else asked[field] = value;
      }
      if (Object.keys(asked).length) body.resources = asked;
      const made = await api("/api/v1/sandboxes", { method: "POST", body });
      location.hash = `#/sandboxes/${made.containerId}`;
    } catch (err) { setError(err); }
    setBusy(false);
  };
  const remove = async (id) => {
    try { await api(`/api/v1/sandboxes/${id}`, { method: "DELETE" }); load(); } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="sandboxes-title">
    <h2 id="sandboxes-title">Sandboxes</h2>
    <form class="row" onSubmit=${create}>
      <div><label for="template">Template</label>
        <select id="template" value=${template} onChange=${(e) => setTemplate(e.target.value)}>
          ${templates.map((t) => html`<option value=${t.id}>${t.id} (${t.backend})</option>`)}
        </select></div>
      <button class="primary" type="submit" disabled=${busy}>${busy ? "Creating…" : "Create sandbox"}</button>
    </form>
    <details><summary>Resources (blank: the template's)</summary>
      <div class="quota-fields">${RESOURCES.map(([field, name, linuxOnly]) => html`<div>
        <label for=${`res-${field}`}>${name}</label>
        <input id=${`res-${field}`} type="text" inputmode="decimal" disabled=${linuxOnly && !live} placeholder=${linuxOnly && !live ? "Linux templates" : "template's"}
          value=${resources[field] || ""} onInput=${(e) => setResources({ ...resources, [field]: e.target.value })} /></div>`)}</div>
    </details>
    <${Failure} error=${error} />
    ${list === null ? html`<p class="muted">Loading…</p>` : list.length === 0 ? html`<p class="muted">No sandboxes yet.</p>` : html`
      <table><thead><tr><th scope="col">Sandbox</th><th scope="col">Template</th><th scope="col">Status</th><th scope="col">Runs</th><th scope="col">Created</th><th scope="col"><span class="muted">Actions</span></th></tr></thead>
      <tbody>${list.map((s) => html`<tr>
        <td><a href=${`#/sandboxes/${s.containerId}`}>${s.containerId}</a></td>
        <td>${s.template}</td><td>${s.status}</td>
        <td>${s.resourceUsage ? s.resourceUsage.executions : ""}</td>
        <td>${new Date(s.createdAt).toLocaleString()}</td>
        <td><button type="button" aria-label=${`Delete ${s.containerId}`} onClick=${() => remove(s.containerId)}>Delete</button></td>
      </tr>`)}</tbody></table>`}
  </section>`;
}

function Output({ chunks }) {
  if (!chunks.length) return null;
  return html`<pre class="output" aria-live="polite">${chunks.map((c) => html`<span class=${c.stream}>${c.text}</span>`)}</pre>`;
}

function Run({ sandbox, onRan }) {
  const [code, setCode] = useState('print("hello from kiln")');
  const [language, setLanguage] = useState(sandbox.language || "python");
  const [chunks, setChunks] = useState([]);
  const [result, setResult] = useState(null);
  const [error, setError] = useState(null);
  const [running, setRunning] = useState(false);
  const run = async (e) => {
    e.preventDefault();
    setRunning(true); setChunks([]); setResult(null); setError(null);
    const seen = [];
    try {
      await streamPost(`/api/v1/sandboxes/${sandbox.containerId}/exec/stream`, { code, language }, (name, data) => {
        if (name === "stdout" || name === "stderr") {
          seen.push({ stream: name, text: data.data });
          setChunks([...seen]);
        } else if (name === "result") setResult(data);
        else if (name === "error") setError(new ApiError(0, data));
      });
    } catch (err) { setError(err); }
    setRunning(false);
    onRan();
  };
  return html`<form onSubmit=${run} aria-labelledby="run-title">
    <h3 id="run-title">Run code</h3>
    <label for="language">Language</label>
    <select id="language" value=${language} onChange=${(e) => setLanguage(e.target.value)}>
      ${["python", "javascript", "bash", "go"].map((l) => html`<option value=${l}>${l}</option>`)}
    </select>
    <label for="code">Code</label>
    <textarea id="code" value=${code} onInput=${(e) => setCode(e.target.value)} onKeyDown=${(e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(e); }}></textarea>
    <div class="row"><button class="primary" type="submit" disabled=${running}>${running ? "Running…" : "Run (Ctrl+Enter)"}</button>
      ${result && html`<span class=${result.status === "success" ? "" : "error"} data-testid="run-status">${result.status}, exit ${result.exitCode}, ${Math.round(result.durationMs)} ms</span>`}</div>
    <${Output} chunks=${chunks} />
    <${Failure} error=${error} />
  </form>`;
}

function Files({ id, version, onChange }) {
  const [files, setFiles] = useState(null);
  const [error, setError] = useState(null);
  const [shown, setShown] = useState(null);
  const upload = useRef(null);
  // Only the newest listing is shown: an older one that answers late is dropped.
  const latest = useRef(0);
  const load = async () => {
    const asked = ++latest.current;
    try {
      const listed = (await api(`/api/v1/sandboxes/${id}/files`)).files;
      if (asked === latest.current) setFiles(listed);
    } catch (err) { setError(err); }
  };
  useEffect(() => { load(); }, [id, version]);
  const send = async (e) => {
    e.preventDefault();
    const chosen = upload.current.files;
    try {
      for (const file of chosen) {
        await api(`/api/v1/sandboxes/${id}/files/${encodeURIComponent(file.name)}`, { method: "PUT", body: file, raw: true, headers: { "content-type": "application/octet-stream" } });
      }
      upload.current.value = "";
      onChange();
    } catch (err) { setError(err); }
  };
  const open = async (path) => {
    try {
      const response = await api(`/api/v1/sandboxes/${id}/files/${path.split("/").map(encodeURIComponent).join("/")}`);
      const blob = await response.blob();
      if (blob.size <= 256 * 1024 && !/\.(png|jpe?g|gif|zip|gz|bin)$/i.test(path)) setShown({ path, text: await blob.text(), saved: true });
      else {
        const a = document.createElement("a");
        a.href = URL.createObjectURL(blob); a.download = path.split("/").pop(); a.click();
        setTimeout(() => URL.revokeObjectURL(a.href), 10000);
      }
    } catch (err) { setError(err); }
  };
  const save = async (e) => {
    e.preventDefault();
    try {
      await api(`/api/v1/sandboxes/${id}/files/${shown.path.split("/").map(encodeURIComponent).join("/")}`, { method: "PUT", body: shown.text, raw: true, headers: { "content-type": "application/octet-stream" } });
      setShown({ ...shown, saved: true });
      onChange();
    } catch (err) { setError(err); }
  };
  const remove = async (path) => {
    try { await api(`/api/v1/sandboxes/${id}/files/${path.split("/").map(encodeURIComponent).join("/")}`, { method: "DELETE" }); onChange(); } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="files-title">
    <h3 id="files-title">Files</h3>
    <form class="row" onSubmit=${send}>
      <div><label for="upload">Upload a file</label><input id="upload" type="file" ref=${upload} multiple /></div>
      <button type="submit">Upload</button>
    </form>
    <${Failure} error=${error} />
    ${files === null ? html`<p class="muted">Loading…</p>` : files.length === 0 ? html`<p class="muted">No files.</p>` : html`
    <ul class="tree" aria-label="Files in the workspace">${files.map((f) => html`<li style=${`margin-left:${(f.path.split("/").length - 1) * 1.2}rem`}>
      ${f.kind === "dir" ? html`<span>${f.path.split("/").pop()}/</span>` : html`<button type="button" class="link" onClick=${() => open(f.path)}>${f.path.split("/").pop()}</button>
        <span class="muted"> ${f.size} B </span><button type="button" aria-label=${`Delete ${f.path}`} onClick=${() => remove(f.path)}>×</button>`}
    </li>`)}</ul>`}
    ${shown && html`<form onSubmit=${save}>
      <label for="editor">${shown.path}</label>
      <textarea id="editor" value=${shown.text} onInput=${(e) => setShown({ ...shown, text: e.target.value, saved: false })}></textarea>
      <div class="row"><button type="submit" disabled=${shown.saved}>${shown.saved ? "Saved" : "Save"}</button>
        <button type="button" onClick=${() => setShown(null)}>Close</button></div>
    </form>`}
  </section>`;
}

function History({ id, version, onChange }) {
  const [entries, setEntries] = useState([]);
  const [diff, setDiff] = useState(null);
  const [error, setError] = useState(null);
  const latest = useRef(0);
  useEffect(() => {
    const asked = ++latest.current;
    api(`/api/v1/sandboxes/${id}/history?limit=50`)
      .then((h) => { if (asked === latest.current) setEntries(h.history); })
      .catch(setError);
  }, [id, version]);
  const rollback = async (entry) => {
    try {
      await api(`/api/v1/sandboxes/${id}/rollback`, { method: "POST", body: { executionId: entry.id } });
      onChange();
    } catch (err) { setError(err); }
  };
  const show = async (entry, index) => {
    const before = entries[index + 1];
    if (!before) return setDiff({ id: entry.id, text: "(the first state)" });
    try {
      const d = await api(`/api/v1/sandboxes/${id}/diff`, { method: "POST", body: { fromExecId: before.id, toExecId: entry.id } });
      setDiff({ id: entry.id, text: Object.values(d.diff).join("\n") || "(no file changed)" });
    } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="history-title">
    <h3 id="history-title">History</h3>
    <${Failure} error=${error} />
    <ol>${entries.map((e, i) => html`<li><button type="button" onClick=${() => show(e, i)}>${e.message || e.id}</button> <span class="muted">${e.files.length} file(s)</span>
      ${i > 0 && html` <button type="button" aria-label=${`Roll back to ${e.message || e.id}`} onClick=${() => rollback(e)}>Roll back here</button>`}</li>`)}</ol>
    ${diff && html`<pre aria-label="Diff">${diff.text}</pre>`}
  </section>`;
}

// A terminal in a Linux sandbox's box, on its own page (a signed link, opened without an
// opener so the page never sees this tab's key).
function Terminal({ id, capable }) {
  const [error, setError] = useState(null);
  const [link, setLink] = useState(null);
  const open = async () => {
    try {
      const terminal = await api(`/api/v1/sandboxes/${id}/terminals`, { method: "POST", body: {} });
      const made = await api(`/api/v1/sandboxes/${id}/terminals/${terminal.terminalId}/links`, { method: "POST", body: {} });
      setLink(made.url);
      window.open(made.url, "_blank", "noopener");
    } catch (err) { setError(err); }
  };
  if (!capable) return null;
  return html`<div class="row"><button type="button" onClick=${open}>Open a terminal</button>
    ${link && html`<a href=${link} target="_blank" rel="noopener">the terminal's page</a>`}</div>
    <${Failure} error=${error} />`;
}

// A Linux sandbox's box: its processes (with a signal to end one) and the ports it listens
// on, each with a preview link (signed, opened without an opener).
function Box({ id, capable, version }) {
  const [processes, setProcesses] = useState(null);
  const [ports, setPorts] = useState([]);
  const [error, setError] = useState(null);
  const load = async () => {
    try {
      setProcesses((await api(`/api/v1/sandboxes/${id}/processes`)).processes);
      setPorts((await api(`/api/v1/sandboxes/${id}/ports`)).ports);
    } catch (err) { setError(err); }
  };
  useEffect(() => { if (capable) load(); }, [capable, id, version]);
  if (!capable) return null;
  const end = async (pid) => {
    try {
      await api(`/api/v1/sandboxes/${id}/processes/${pid}/signal`, { method: "POST", body: { signal: "TERM" } });
      setTimeout(load, 300);
    } catch (err) { setError(err); }
  };
  const preview = async (port) => {
    try {
      const link = await api(`/api/v1/sandboxes/${id}/previews`, { method: "POST", body: { port } });
      window.open(link.url, "_blank", "noopener");
    } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="box-title">
    <h3 id="box-title">Processes and ports</h3>
    <button type="button" onClick=${load}>Refresh</button>
    <${Failure} error=${error} />
    ${processes && html`<table aria-label="Processes"><thead><tr><th scope="col">pid</th><th scope="col">command</th><th scope="col">memory</th><th scope="col"><span class="muted">end</span></th></tr></thead>
      <tbody>${processes.filter((p) => !p.agent).map((p) => html`<tr><td>${p.pid}</td><td>${(p.argv.length ? p.argv : [p.name]).join(" ")}</td>
        <td>${Math.round(p.memoryBytes / 1048576)} MiB</td><td><button type="button" aria-label=${`End process ${p.pid}`} onClick=${() => end(p.pid)}>End</button></td></tr>`)}</tbody></table>`}
    <ul aria-label="Ports">${ports.map((p) => html`<li>${p.port} (${p.name || "?"})
      ${p.reachable ? html` <button type="button" onClick=${() => preview(p.port)}>Preview port ${p.port}</button>` : html` <span class="muted">listens on ${p.address} only</span>`}</li>`)}</ul>
  </section>`;
}

function Sandbox({ id }) {
  const [sandbox, setSandbox] = useState(null);
  const [error, setError] = useState(null);
  const [version, setVersion] = useState(0);
  // What its template can do (terminals, processes), read once.
  const [capabilities, setCapabilities] = useState({});
  useEffect(() => { api(`/api/v1/sandboxes/${id}`).then(setSandbox).catch(setError); }, [id, version]);
  const template = sandbox && sandbox.template;
  useEffect(() => {
    if (!template) return;
    api("/api/v1/templates").then((t) => {
      const mine = t.templates.find((x) => x.id === template);
      setCapabilities((mine && mine.capabilities) || {});
    }).catch(() => setCapabilities({}));
  }, [template]);
  if (error) return html`<${Failure} error=${error} />`;
  if (!sandbox) return html`<p class="muted">Loading…</p>`;
  return html`<section aria-labelledby="sandbox-title">
    <p><a href="#/sandboxes">← Sandboxes</a></p>
    <h2 id="sandbox-title">${sandbox.containerId}</h2>
    <p class="muted">${sandbox.templateDescription || sandbox.template} · ${sandbox.status} · expires ${new Date(sandbox.expiresAt).toLocaleString()}</p>
    <p class="muted" data-testid="resources">${sandbox.resources
      ? `${sandbox.resources.vcpus} vCPU · ${sandbox.resources.memory_mb} MiB memory · ${sandbox.resources.disk_mb} MiB disk · ${sandbox.resources.pids} processes`
      : `${Math.round(sandbox.resourceUsage.memoryLimitBytes / 1048576)} MiB memory per run`} · ${sandbox.resourceUsage.executions} run(s)</p>
    <${Terminal} id=${id} capable=${Boolean(capabilities.terminals)} />
    <div class="grid">
      <${Run} sandbox=${sandbox} onRan=${() => setVersion((v) => v + 1)} />
      <div><${Box} id=${id} capable=${Boolean(capabilities.processes)} version=${version} />
        <${Files} id=${id} version=${version} onChange=${() => setVersion((v) => v + 1)} /><${History} id=${id} version=${version} onChange=${() => setVersion((v) => v + 1)} /></div>
    </div>
  </section>`;
}

// ---------------------------------------------------------------- chat

function Display({ result }) {
  const data = result.data || {};
  if (data["image/png"]) return html`<img alt="A figure the code made" src=${`data:image/png;base64,${data["image/png"]}`} />`;
  if (data["text/html"]) return html`<div class="html-result" dangerouslySetInnerHTML=${{ __html: data["text/html"] }}></div>`;
  return html`<pre>${data["text/plain"] || JSON.stringify(data)}</pre>`;
}

function Chat() {
  const [messages, setMessages] = useState([]);
  const [items, setItems] = useState([]);
  const [text, setText] = useState("");
  const [sandbox, setSandbox] = useState(null);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const send = async (e) => {
    e.preventDefault();
    if (!text.trim()) return;
    const asked = [...messages, { role: "user", content: text }];
    const shown = [...items, { kind: "user", text }];
    setItems(shown); setText(""); setBusy(true); setError(null);
    let answer = { kind: "assistant", text: "" };
    const tools = new Map();
    const now = [...shown, answer];
    const redraw = () => setItems([...now]);
    try {
      await streamPost("/api/v1/chat", { messages: asked, sandbox: sandbox || undefined }, (name, data) => {
        if (name === "sandbox") setSandbox(data.sandbox_id);
        else if (name === "text_delta") { answer.text += data.text; redraw(); }
        else if (name === "tool_call_start") {
          const tool = { kind: "tool", id: data.id, name: data.name, args: "", out: [], displays: [], result: null };
          tools.set(data.id, tool); now.push(tool);
          answer = { kind: "assistant", text: "" }; now.push(answer); redraw();
        } else if (name === "tool_call_arguments") { const t = tools.get(data.id); if (t) t.args += data.delta; redraw(); }
        else if (name === "stdout" || name === "stderr") { const t = tools.get(data.id); if (t) t.out.push({ stream: name, text: data.data }); redraw(); }
        else if (name === "display") { const t = tools.get(data.id); if (t) t.displays.push(data.result); redraw(); }
        else if (name === "tool_result") { const t = tools.get(data.id); if (t) t.result = data; redraw(); }
        else if (name === "final") setMessages(data.messages);
        else if (name === "error") setError(new ApiError(0, { error: data }));
      });
    } catch (err) { setError(err); }
    setBusy(false);
  };
  return html`<section aria-labelledby="chat-title">
    <h2 id="chat-title">Chat</h2>
    <p class="muted">A model that runs code in a sandbox${sandbox ? html` (<a href=${`#/sandboxes/${sandbox}`}>${sandbox}</a>)` : ""}.</p>
    <div class="chat-log" aria-live="polite">${items.filter((i) => i.kind !== "assistant" || i.text).map((i) =>
      i.kind === "tool" ? html`<div class="bubble tool"><details><summary>${i.name}${i.result ? (i.result.is_error ? " (error)" : " ✓") : " …"}</summary>
          <pre>${i.args}</pre>${i.result && html`<pre class="muted">${i.result.result}</pre>`}</details>
          <${Output} chunks=${i.out} />${i.displays.map((d) => html`<${Display} result=${d} />`)}</div>`
        : html`<div class=${`bubble ${i.kind}`}>${i.text}</div>`)}</div>
    <form onSubmit=${send} style="margin-top:1rem">
      <label for="message">Message</label>
      <textarea id="message" value=${text} onInput=${(e) => setText(e.target.value)} onKeyDown=${(e) => { if (e.key === "Enter" && !e.shiftKey) send(e); }}></textarea>
      <div class="row"><button class="primary" type="submit" disabled=${busy}>${busy ? "Working…" : "Send"}</button>
        <button type="button" onClick=${() => { setMessages([]); setItems([]); setSandbox(null); }}>New chat</button></div>
    </form>
    <${Failure} error=${error} />
  </section>`;
}

// ---------------------------------------------------------------- workflows

function Workflows() {
  const [list, setList] = useState([]);
  const [templates, setTemplates] = useState([]);
  const [template, setTemplate] = useState("static-website");
  const [task, setTask] = useState("");
  const [humanCreator, setHumanCreator] = useState(false);
  const [humanReviewer, setHumanReviewer] = useState(false);
  const [error, setError] = useState(null);
  const [busy, setBusy] = useState(false);
  const load = () => api("/api/v1/workflows").then((w) => setList(w.workflows)).catch(setError);
  useEffect(() => {
    load();
    api("/api/v1/workflow-templates").then((t) => setTemplates(t.templates)).catch(setError);
  }, []);
  const start = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      const roles = { creator: { human: humanCreator }, reviewer: { human: humanReviewer } };
      const made = await api("/api/v1/workflows", { method: "POST", body: { template, task, roles } });
      location.hash = `#/workflows/${made.id}`;
    } catch (err) { setError(err); }
    setBusy(false);
  };
  return html`<section aria-labelledby="workflows-title">
    <h2 id="workflows-title">Workflows</h2>
    <form onSubmit=${start}>
      <label for="wf-template">Template</label>
      <select id="wf-template" value=${template} onChange=${(e) => setTemplate(e.target.value)}>${templates.map((t) => html`<option value=${t.name}>${t.name}</option>`)}</select>
      <label for="wf-task">Task</label>
      <textarea id="wf-task" value=${task} onInput=${(e) => setTask(e.target.value)}></textarea>
      <div class="row">
        <label><input type="checkbox" checked=${humanCreator} onChange=${(e) => setHumanCreator(e.target.checked)} /> I play the creator</label>
        <label><input type="checkbox" checked=${humanReviewer} onChange=${(e) => setHumanReviewer(e.target.checked)} /> I play the reviewer</label>
      </div>
      <button class="primary" type="submit" disabled=${busy}>${busy ? "Starting…" : "Start"}</button>
    </form>
    <${Failure} error=${error} />
    <table><thead><tr><th scope="col">Workflow</th><th scope="col">Template</th><th scope="col">Stage</th><th scope="col">Round</th><th scope="col">Preview</th></tr></thead>
    <tbody>${list.map((w) => html`<tr><td><a href=${`#/workflows/${w.id}`}>${w.id}</a></td>
      <td>${w.template}</td><td>${w.stage}${w.reason ? html` <span class="muted">(${w.reason})</span>` : ""}</td><td>${w.round}/${w.maxRounds}</td>
      <td>${w.previewUrl ? html`<a href=${w.previewUrl} target="_blank" rel="noopener">open</a>` : ""}</td></tr>`)}</tbody></table>
  </section>`;
}

// A person's turn: the creator hands over, the reviewer approves or asks for changes.
function HumanTurn({ workflow, onDone }) {
  const [notes, setNotes] = useState("");
  const [approved, setApproved] = useState(true);
  const [grade, setGrade] = useState("");
  const [feedback, setFeedback] = useState("");
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    try {
      if (workflow.currentAgent === "creator") {
        await api(`/api/v1/workflows/${workflow.id}/submit`, { method: "POST", body: { notes } });
      } else {
        await api(`/api/v1/workflows/${workflow.id}/review`, { method: "POST", body: { approved, grade: grade || null, feedback } });
      }
      onDone();
    } catch (err) { setError(err); }
  };
  if (workflow.currentAgent === "creator") {
    return html`<form onSubmit=${submit} aria-label="Your turn as the creator">
      <h3>Your turn: the creator's</h3>
      <p class="muted">Work in the workspace (its sandbox: <a href=${`#/sandboxes/${workflow.sandboxId}`}>${workflow.sandboxId}</a>), then hand over.</p>
      <label for="wf-notes">Notes for the reviewer</label>
      <textarea id="wf-notes" value=${notes} onInput=${(e) => setNotes(e.target.value)}></textarea>
      <button class="primary" type="submit">Submit for review</button>
      <${Failure} error=${error} />
    </form>`;
  }
  return html`<form onSubmit=${submit} aria-label="Your turn as the reviewer">
    <h3>Your turn: the reviewer's</h3>
    <label><input type="checkbox" checked=${approved} onChange=${(e) => setApproved(e.target.checked)} /> Approve</label>
    <label for="wf-grade">Grade</label>
    <input id="wf-grade" type="text" value=${grade} onInput=${(e) => setGrade(e.target.value)} />
    <label for="wf-feedback">Feedback</label>
    <textarea id="wf-feedback" value=${feedback} onInput=${(e) => setFeedback(e.target.value)}></textarea>
    <button class="primary" type="submit">Submit review</button>
    <${Failure} error=${error} />
  </form>`;
}

function Workflow({ id }) {
  const [workflow, setWorkflow] = useState(null);
  const [events, setEvents] = useState([]);
  const [activity, setActivity] = useState("");
  const [error, setError] = useState(null);
  const load = () => api(`/api/v1/workflows/${id}`).then(setWorkflow).catch(setError);
  useEffect(() => {
    load();
    // The trail, then each new event as it happens, until the workflow ends.
    const headers = key() ? { authorization: `Bearer ${key()}` } : {};
    const seen = [];
    const stop = new AbortController();
    fetch(`/api/v1/workflows/${id}/events`, { headers, signal: stop.signal })
      .then((response) => readEvents(response, (name, data) => {
        if (name === "workflow") {
          seen.push(data);
          setEvents([...seen]);
          load();
        } else if (name === "agent" && data.event && data.event.type === "tool_call_start") {
          setActivity(`${data.role}: ${data.event.name}`);
        }
      }))
      .catch((err) => { if (err.name !== "AbortError") setError(err); });
    return () => stop.abort();
  }, [id]);
  if (error) return html`<${Failure} error=${error} />`;
  if (!workflow) return html`<p class="muted">Loading…</p>`;
  const finished = workflow.stage === "approved" || workflow.stage === "rejected";
  const cancel = async () => {
    try { setWorkflow(await api(`/api/v1/workflows/${id}/cancel`, { method: "POST" })); } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="workflow-title">
    <p><a href="#/workflows">← Workflows</a></p>
    <h2 id="workflow-title">${workflow.id}</h2>
    <p><strong data-testid="wf-stage">${workflow.stage}</strong> · round ${workflow.round} of ${workflow.maxRounds}
      ${workflow.currentAgent ? ` · the ${workflow.currentAgent}'s turn${workflow.waitingForHuman ? " (a person's)" : ""}` : ""}
      ${workflow.reason ? html` · <span class="muted">${workflow.reason}</span>` : ""}</p>
    <p class="muted">${workflow.template}: ${workflow.task} · workspace <a href=${`#/sandboxes/${workflow.sandboxId}`}>${workflow.workspace}</a>
      ${workflow.previewUrl ? html` · <a href=${workflow.previewUrl} target="_blank" rel="noopener">preview</a>` : ""}</p>
    ${!finished && !workflow.waitingForHuman && activity && html`<p class="muted" aria-live="polite">Working: ${activity}</p>`}
    ${workflow.waitingForHuman && html`<${HumanTurn} workflow=${workflow} onDone=${load} />`}
    ${!finished && html`<button type="button" onClick=${cancel}>Cancel the workflow</button>`}
    <h3>Reviews</h3>
    ${workflow.reviews.length === 0 ? html`<p class="muted">None yet.</p>` : html`<ol>${workflow.reviews.map((r) => html`<li>
      Round ${r.round}: ${r.approved ? "approved" : "changes asked"}${r.grade ? `, grade ${r.grade}` : ""} (${r.by}) — ${r.feedback}
      ${r.suggestions.length ? html`<ul>${r.suggestions.map((x) => html`<li>${x}</li>`)}</ul>` : ""}
      ${r.modifiedFiles.length ? html`<p class="muted">Changed: ${r.modifiedFiles.join(", ")}</p>` : ""}</li>`)}</ol>`}
    <h3>Timeline</h3>
    <ol aria-label="Timeline" aria-live="polite">${events.map((e) => html`<li><span class="muted">${new Date(e.timestamp).toLocaleTimeString()}</span> ${e.agent} <strong>${e.action}</strong></li>`)}</ol>
  </section>`;
}

// ---------------------------------------------------------------- account: quotas, usage; keys for an admin key

const QUOTAS = [
  ["sandboxes", "Sandboxes"], ["sessions", "Sessions"], ["sessionMemoryBytes", "Session memory", true],
  ["executions", "Executions at once"], ["workspaceBytes", "Workspace storage", true], ["volumes", "Volumes"],
];
const EDITABLE = [...QUOTAS, ["pausedBoxes", "Paused boxes"], ["cpuWeight", "CPU weight"]];

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${Number.isInteger(n) ? n : n.toFixed(1)} ${units[i]}`;
}

// Bytes as a size parseSize reads back exactly: 2GiB, 768MiB, 1000.
function sizeText(n) {
  for (const [unit, shift] of [["TiB", 40], ["GiB", 30], ["MiB", 20], ["KiB", 10]]) {
    if (n >= 2 ** shift && n % 2 ** shift === 0) return `${n / 2 ** shift}${unit}`;
  }
  return String(n);
}

// "2GiB", "512 MiB", "1000": a number of bytes (as `kiln keys create --max-…` reads them).
function parseSize(text) {
  const m = /^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$/i.exec(text);
  if (!m) throw new Error(`"${text}" is not a size such as 512MiB or 2GiB`);
  const shift = { "": 0, b: 0, k: 10, kb: 10, kib: 10, m: 20, mb: 20, mib: 20, g: 30, gb: 30, gib: 30, t: 40, tb: 40, tib: 40 }[(m[2] || "").toLowerCase()];
  return Number(m[1]) * 2 ** shift;
}

function Usage({ quotas, usage, label }) {
  return html`<table aria-label=${label}><thead><tr><th scope="col">Quota</th><th scope="col">In use</th><th scope="col">Limit</th><th scope="col"><span class="muted">Share</span></th></tr></thead>
    <tbody>${QUOTAS.map(([field, name, isBytes]) => {
      const show = (n) => (isBytes ? bytes(n) : String(n));
      return html`<tr><th scope="row">${name}</th><td>${show(usage[field])}</td><td>${show(quotas[field])}</td>
        <td><meter aria-label=${`${name} used`} min="0" max=${quotas[field] || 1} value=${usage[field]} high=${(quotas[field] || 1) * 0.8}></meter></td></tr>`;
    })}</tbody></table>`;
}

// The key's own quotas as a form, as typed: blank is the server's.
function QuotaFields({ prefix, texts, onInput }) {
  return html`<div class="quota-fields">${EDITABLE.map(([field, name, isBytes]) => html`<div>
    <label for=${`${prefix}-${field}`}>${name}</label>
    <input id=${`${prefix}-${field}`} type="text" inputmode=${isBytes ? "text" : "numeric"} placeholder="server's"
      value=${texts[field] || ""} onInput=${(e) => onInput({ ...texts, [field]: e.target.value })} /></div>`)}</div>`;
}

// A key's own quotas as the form shows them.
function quotaTexts(quotas) {
  const texts = {};
  for (const [field, , isBytes] of EDITABLE) {
    if (quotas[field] !== undefined) texts[field] = isBytes ? sizeText(quotas[field]) : String(quotas[field]);
  }
  return texts;
}

// The form's quotas as the API takes them; throws, naming the field, at a bad one.
function parseQuotas(texts) {
  const quotas = {};
  for (const [field, name, isBytes] of EDITABLE) {
    const text = (texts[field] || "").trim();
    if (text === "") continue;
    if (isBytes) {
      try { quotas[field] = parseSize(text); } catch (err) { throw new Error(`${name}: ${err.message}`); }
    } else if (/^\d+$/.test(text)) quotas[field] = Number(text);
    else throw new Error(`${name}: "${text}" is not a whole number`);
  }
  return quotas;
}

function KeyRow({ k, onChange, onError }) {
  const [editing, setEditing] = useState(false);
  const [confirming, setConfirming] = useState(false);
  const [texts, setTexts] = useState(() => quotaTexts(k.quotas));
  const [problem, setProblem] = useState(null);
  const save = async (e) => {
    e.preventDefault();
    let quotas;
    try { quotas = parseQuotas(texts); setProblem(null); } catch (err) { return setProblem(err); }
    try { await api(`/api/v1/keys/${k.id}`, { method: "PATCH", body: { quotas } }); setEditing(false); onChange(); } catch (err) { onError(err); }
  };
  const revoke = async () => {
    try { await api(`/api/v1/keys/${k.id}`, { method: "DELETE" }); onChange(); } catch (err) { onError(err); setConfirming(false); }
  };
  const own = Object.entries(k.quotas).map(([f, v]) => `${f} ${/Bytes$/.test(f) ? bytes(v) : v}`).join(", ");
  return html`<tr>
    <td><code>${k.id}</code></td><td>${k.name}</td><td>${k.tenant}</td><td>${k.admin ? "admin" : ""}</td>
    <td>${own || html`<span class="muted">the server's</span>`}
      ${editing && html`<form onSubmit=${save} aria-label=${`Quotas of ${k.id}`}>
        <${QuotaFields} prefix=${k.id} texts=${texts} onInput=${setTexts} />
        <${Failure} error=${problem} />
        <div class="row"><button class="primary" type="submit">Save quotas</button><button type="button" onClick=${() => setEditing(false)}>Close</button></div>
      </form>`}</td>
    <td><div class="row">
      ${!editing && html`<button type="button" aria-label=${`Edit the quotas of ${k.id}`} onClick=${() => setEditing(true)}>Quotas</button>`}
      ${confirming ? html`<button type="button" class="danger" aria-label=${`Really revoke ${k.id}`} onClick=${revoke}>Really revoke</button>
          <button type="button" onClick=${() => setConfirming(false)}>Keep</button>`
        : html`<button type="button" aria-label=${`Revoke ${k.id}`} onClick=${() => setConfirming(true)}>Revoke</button>`}
    </div></td>
  </tr>`;
}

function Keys() {
  const [keys, setKeys] = useState(null);
  const [tenants, setTenants] = useState(null);
  const [error, setError] = useState(null);
  const [made, setMade] = useState(null);
  const [name, setName] = useState("");
  const [tenant, setTenant] = useState("");
  const [admin, setAdmin] = useState(false);
  const [texts, setTexts] = useState({});
  const load = async () => {
    try {
      setKeys((await api("/api/v1/keys")).keys);
      setTenants(await api("/api/v1/tenants"));
      setError(null);
    } catch (err) { setError(err); }
  };
  useEffect(() => { load(); }, []);
  const create = async (e) => {
    e.preventDefault();
    try {
      const body = { name, admin, quotas: parseQuotas(texts) };
      if (tenant.trim()) body.tenant = tenant.trim();
      setMade(await api("/api/v1/keys", { method: "POST", body }));
      setName(""); setTenant(""); setAdmin(false); setTexts({});
      load();
    } catch (err) { setError(err); }
  };
  return html`<section aria-labelledby="keys-title">
    <h2 id="keys-title">Keys</h2>
    <${Failure} error=${error} />
    <form onSubmit=${create} aria-label="Make a key">
      <h3>Make a key</h3>
      <div class="row">
        <div><label for="key-name">Name</label><input id="key-name" type="text" value=${name} maxlength="128" onInput=${(e) => setName(e.target.value)} /></div>
        <div><label for="key-tenant">Tenant</label><input id="key-tenant" type="text" value=${tenant} placeholder="a new one" onInput=${(e) => setTenant(e.target.value)} /></div>
        <div><label class="inline"><input type="checkbox" checked=${admin} onChange=${(e) => setAdmin(e.target.checked)} /> Admin key</label></div>
      </div>
      <details><summary>Its own quotas (blank: the server's)</summary><${QuotaFields} prefix="new" texts=${texts} onInput=${setTexts} /></details>
      <button class="primary" type="submit">Make key</button>
    </form>
    ${made && html`<div class="notice" role="status">
      <p>Key <code>${made.id}</code> for tenant <strong>${made.tenant}</strong>. Copy it now: only its hash is kept, it cannot be shown again.</p>
      <label for="made-key">The new key</label>
      <div class="row"><input id="made-key" type="text" readonly value=${made.key} onFocus=${(e) => e.target.select()} />
        <button type="button" onClick=${() => navigator.clipboard && navigator.clipboard.writeText(made.key).catch(() => {})}>Copy</button>
        <button type="button" onClick=${() => setMade(null)}>Done</button></div>
    </div>`}
    ${keys && html`<table aria-label="Keys"><thead><tr><th scope="col">Id</th><th scope="col">Name</th><th scope="col">Tenant</th><th scope="col">Role</th><th scope="col">Own quotas</th><th scope="col"><span class="muted">Actions</span></th></tr></thead>
      <tbody>${keys.map((k) => html`<${KeyRow} key=${k.id + JSON.stringify(k.quotas)} k=${k} onChange=${load} onError=${setError} />`)}</tbody></table>`}
    ${tenants && html`<h3>Tenants</h3>
      <table aria-label="Tenants"><thead><tr><th scope="col">Tenant</th><th scope="col">Keys</th><th scope="col">Sandboxes</th><th scope="col">Sessions</th><th scope="col">Session memory</th><th scope="col">Storage</th></tr></thead>
      <tbody>${tenants.tenants.map((t) => html`<tr><td>${t.tenant}</td><td>${t.keys.length}</td><td>${t.usage.sandboxes}</td><td>${t.usage.sessions}</td><td>${bytes(t.usage.sessionMemoryBytes)}</td><td>${bytes(t.usage.workspaceBytes)}</td></tr>`)}</tbody></table>
      <p class="muted">The server's quotas for a key without its own: ${tenants.defaultQuotas.sandboxes} sandboxes, ${tenants.defaultQuotas.sessions} sessions, ${bytes(tenants.defaultQuotas.sessionMemoryBytes)} of session memory, ${tenants.defaultQuotas.executions} executions at once, ${bytes(tenants.defaultQuotas.workspaceBytes)} of storage.</p>`}
  </section>`;
}

function Account() {
  const [me, setMe] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => { api("/api/v1/me").then(setMe).catch(setError); }, []);
  if (error) return html`<${Failure} error=${error} />`;
  if (!me) return html`<p class="muted">Loading…</p>`;
  return html`<section aria-labelledby="account-title">
    <h2 id="account-title">Account</h2>
    <p>${me.auth ? html`Key <code>${me.keyId}</code>${me.name ? ` (${me.name})` : ""}${me.admin ? ", an admin key," : ""} for tenant <strong>${me.tenant}</strong>.`
      : html`This server runs without keys (<code>--no-auth</code>): one tenant, <strong>${me.tenant}</strong>, with the machine's capacity. Keys are made with <code>kiln keys create</code>.`}</p>
    <h3>Usage and quotas</h3>
    <${Usage} quotas=${me.quotas} usage=${me.usage} label="Usage and quotas" />
  </section>
  ${me.admin && html`<${Keys} />`}`;
}

// ---------------------------------------------------------------- shell

// Whether this server asks for keys (`/api/v1/me` answers without one under --no-auth).
function useKeysOff() {
  const [off, setOff] = useState(false);
  useEffect(() => {
    fetch("/api/v1/me", { headers: key() ? { authorization: `Bearer ${key()}` } : {} })
      .then((r) => (r.ok ? r.json() : null))
      .then((me) => setOff(Boolean(me && me.auth === false)))
      .catch(() => {});
  }, []);
  return off;
}

function App() {
  const hash = useHash();
  const keysOff = useKeysOff();
  const [, page, id] = hash.split("/");
  const link = (to, label) => html`<a href=${to} aria-current=${hash.startsWith(to) ? "page" : undefined}>${label}</a>`;
  let body;
  if (page === "login") body = html`<${Login} />`;
  else if (page === "sandboxes" && id) body = html`<${Sandbox} id=${decodeURIComponent(id)} />`;
  else if (page === "chat") body = html`<${Chat} />`;
  else if (page === "workflows" && id) body = html`<${Workflow} id=${decodeURIComponent(id)} />`;
  else if (page === "workflows") body = html`<${Workflows} />`;
  else if (page === "account") body = html`<${Account} />`;
  else body = html`<${Sandboxes} />`;
  return html`<header><h1>kiln</h1>
      <nav aria-label="Pages">${link("#/sandboxes", "Sandboxes")}${link("#/chat", "Chat")}${link("#/workflows", "Workflows")}${link("#/account", "Account")}</nav>
      <span style="margin-left:auto">${keysOff ? html`<span class="muted">no keys (--no-auth)</span>`
        : key() ? html`<button type="button" onClick=${() => { sessionStorage.removeItem(KEY); location.hash = "#/login"; }}>Sign out</button>` : html`<a href="#/login">Sign in</a>`}</span>
    </header>
    <main>${body}</main>`;
}

render(html`<${App} />`, document.getElementById("app"));
