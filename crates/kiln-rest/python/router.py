"""Routing and planning. Two planners emit the same plan JSON:

- the conventions planner here (no LLM): plain REST over collections, deterministic;
- an LLM, asked with PROMPT through the host's door (see driver.py).

A plan: {"action", "resource", "id", "criteria", "payload", "response_hints",
"cache": {"generic": bool, "pattern": "GET /members/{id}"},
"code": {"language": "python", "block": "```python\\n...\\n```"}}.
"""

import json

from kiln_rest.store import NAME

ACTIONS = ("list", "read", "create", "replace", "patch", "delete", "search", "options", "index", "error")

PROMPT = """You are the router and planner of a REST service that has no fixed endpoints.
For the HTTP request you are given, infer the CRUD or search action and write Python code that
answers it using only the objects `store` and `ctx`.

Answer with ONLY a JSON object (no prose, no markdown around it):
{"action": "list|read|create|replace|patch|delete|search|options|index|error",
 "resource": "<collection name or null>", "id": "<id from the path or null>",
 "criteria": {<search filters or {}>}, "payload": <the body or null>,
 "response_hints": {<status, headers you intend>},
 "cache": {"generic": true|false, "pattern": "<METHOD /path/with/{params}>"},
 "code": {"language": "python", "block": "```python\\n<code>\\n```"}}

The code block (exactly one fenced python block) runs with these names:
- ctx: dict with method, path, segments (list of decoded path parts), params (values bound from
  your cache pattern, e.g. {"id": "1"}), query (name -> list of values), headers (lower-case
  names), body (parsed JSON or None), body_text, client_ip, tenant.
- store.collection(name) -> collection with get_all(), get(id) -> dict or None,
  insert(obj) -> id (integer ids count up; a client's "id" is kept), replace(id, obj),
  patch(id, changes) (merge; both return the object or None), delete(id) -> bool,
  search(filters) (exact match, or field__contains), count(); store.collections();
  store.sort(items, "name" or "-name"); store.page(items, limit, offset) ->
  {"items", "page": {"limit", "offset", "total"}}.
- BadRequest(message), NotFound(message), Conflict(message): raise them for 400/404/409.
- quote(text): percent-encodes a path segment (for Location headers).
The code must assign REPLY = {"status": <int>, "headers": {<name>: <text>}, "body": <JSON data>}.
Conventions: POST /c/ -> 201 with Location /c/{id} and the created object; GET /c/{id} -> 200
or 404; PUT replaces, PATCH merges; DELETE -> 204 with body None; GET /c/search?f=v -> the
list of matches; GET /c/?limit=&offset=&sort= -> store.page(...); a body that is not a JSON
object where one is needed -> 400.
Rules: import only json, re, math, statistics, uuid, datetime, itertools, typing; never use
open, exec, eval, compile, getattr, type, globals, attributes starting with an underscore,
global/nonlocal, a bare except or except BaseException; never touch the network or files.
Set cache.generic to true when the code works for every request of the same shape, with
cache.pattern naming the shape, e.g. "GET /members/{id}" (code reads ctx["params"]["id"]).
"""


def _code(resource, body):
    return f"RESOURCE = {json.dumps(resource)}\n" + body.strip() + "\n"


def _plan(action, code, pattern=None, resource=None, id=None, criteria=None, payload=None, hints=None):
    return json.dumps({
        "action": action,
        "resource": resource,
        "id": id,
        "criteria": criteria or {},
        "payload": payload,
        "response_hints": hints or {},
        "cache": {"generic": pattern is not None, "pattern": pattern},
        "code": {"language": "python", "block": "```python\n" + code + "```"},
    })


_LIST = '''
q = ctx["query"]
def one(name, default):
    values = q.get(name) or []
    return values[-1] if values else default
try:
    limit = int(one("limit", "50"))
    offset = int(one("offset", "0"))
except ValueError:
    raise BadRequest("limit and offset must be integers")
if not 0 <= limit <= 1000 or offset < 0:
    raise BadRequest("limit must be from 0 to 1000 and offset at least 0")
filters = {k: v for k, v in q.items() if k not in ("limit", "offset", "sort")}
col = store.collection(RESOURCE)
items = col.search(filters) if filters else col.get_all()
sort = one("sort", None)
if sort:
    items = store.sort(items, sort)
REPLY = {"status": 200, "headers": {}, "body": store.page(items, limit, offset)}
'''

_SEARCH = '''
filters = {k: v for k, v in ctx["query"].items() if k not in ("limit", "offset", "sort")}
REPLY = {"status": 200, "headers": {}, "body": store.collection(RESOURCE).search(filters)}
'''

_CREATE = '''
body = ctx["body"]
if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object")
col = store.collection(RESOURCE)
new_id = col.insert(body)
REPLY = {"status": 201, "headers": {"Location": "/" + quote(RESOURCE) + "/" + quote(str(new_id))}, "body": col.get(new_id)}
'''

_READ = '''
item = store.collection(RESOURCE).get(ctx["params"]["id"])
if item is None:
    raise NotFound(RESOURCE + "/" + ctx["params"]["id"] + " does not exist")
REPLY = {"status": 200, "headers": {}, "body": item}
'''

def _update(op):
    """PUT (replace) and PATCH (patch): the same code but for the store's method."""
    return f'''
body = ctx["body"]
if not isinstance(body, dict):
    raise BadRequest("the body must be a JSON object")
item = store.collection(RESOURCE).{op}(ctx["params"]["id"], body)
if item is None:
    raise NotFound(RESOURCE + "/" + ctx["params"]["id"] + " does not exist")
REPLY = {{"status": 200, "headers": {{}}, "body": item}}
'''


_REPLACE = _update("replace")
_PATCH = _update("patch")

_DELETE = '''
if not store.collection(RESOURCE).delete(ctx["params"]["id"]):
    raise NotFound(RESOURCE + "/" + ctx["params"]["id"] + " does not exist")
REPLY = {"status": 204, "headers": {}, "body": None}
'''


def _fixed(status, headers, body):
    return f"REPLY = {{'status': {status}, 'headers': {headers!r}, 'body': {body!r}}}\n"


def _error(status, code, message):
    return _fixed(status, {}, {"error": {"code": code, "message": message}})


COLLECTION_METHODS = "GET, HEAD, POST, OPTIONS"
MEMBER_METHODS = "GET, HEAD, PUT, PATCH, DELETE, OPTIONS"


def conventions_plan(ctx):
    """The plan, as JSON text, for a request under plain REST conventions."""
    method = ctx["method"]
    segs = ctx["segments"]
    read = method in ("GET", "HEAD")
    if not segs:
        if read:
            code = 'REPLY = {"status": 200, "headers": {}, "body": {"collections": store.collections()}}\n'
            return _plan("index", code, f"{method} /")
        if method == "OPTIONS":
            return _plan("options", _fixed(204, {"Allow": "GET, HEAD, OPTIONS"}, None), "OPTIONS /")
        return _plan("error", _fixed(405, {"Allow": "GET, HEAD, OPTIONS"}, {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"{method} / is not supported"}}), f"{method} /")
    resource = segs[0]
    if not NAME.match(resource):
        return _plan("error", _error(400, "BAD_REQUEST", f"{resource!r} is not a collection name (a letter, then letters, digits, _ or -)"), resource=None)
    if len(segs) > 2:
        return _plan("error", _error(404, "NOT_FOUND", "paths have the shape /collection/ or /collection/id"), resource=resource)
    base = f"/{resource}"
    if len(segs) == 1:
        if read:
            return _plan("list", _code(resource, _LIST), f"{method} {base}", resource, criteria=ctx["query"])
        if method == "POST":
            return _plan("create", _code(resource, _CREATE), f"POST {base}", resource, payload=ctx.get("body"), hints={"status": 201})
        if method == "OPTIONS":
            return _plan("options", _fixed(204, {"Allow": COLLECTION_METHODS}, None), f"OPTIONS {base}", resource)
        return _plan("error", _fixed(405, {"Allow": COLLECTION_METHODS}, {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"{method} is not supported on a collection"}}), f"{method} {base}", resource)
    id = segs[1]
    if id == "search":
        if read:
            return _plan("search", _code(resource, _SEARCH), f"{method} {base}/search", resource, criteria=ctx["query"])
        if method == "OPTIONS":
            return _plan("options", _fixed(204, {"Allow": "GET, HEAD, OPTIONS"}, None), f"OPTIONS {base}/search", resource)
        return _plan("error", _fixed(405, {"Allow": "GET, HEAD, OPTIONS"}, {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"{method} is not supported on search"}}), f"{method} {base}/search", resource)
    member = f"{method} {base}/{{id}}"
    bodies = {"GET": _READ, "HEAD": _READ, "PUT": _REPLACE, "PATCH": _PATCH, "DELETE": _DELETE}
    actions = {"GET": "read", "HEAD": "read", "PUT": "replace", "PATCH": "patch", "DELETE": "delete"}
    if method in bodies:
        payload = ctx.get("body") if method in ("PUT", "PATCH") else None
        return _plan(actions[method], _code(resource, bodies[method]), member, resource, id=id, payload=payload)
    if method == "OPTIONS":
        return _plan("options", _fixed(204, {"Allow": MEMBER_METHODS}, None), member, resource, id=id)
    return _plan("error", _fixed(405, {"Allow": MEMBER_METHODS}, {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"{method} is not supported on a member"}}), member, resource, id=id)


def llm_request(ctx, store):
    """What the LLM planner is told about the request: the request itself, the tenant's
    collections and one sample object of the one addressed."""
    body_text = ctx.get("body_text") or json.dumps(ctx.get("body"))
    info = {
        "method": ctx["method"],
        "path": ctx["path"],
        "segments": ctx["segments"],
        "query": ctx["query"],
        "content_type": ctx["headers"].get("content-type"),
        "body": ctx.get("body") if len(body_text) <= 4000 else "(a large body: " + str(len(body_text)) + " bytes)",
        "collections": store.collections(),
    }
    if ctx["segments"] and NAME.match(ctx["segments"][0]):
        items = store.collection(ctx["segments"][0]).get_all()
        info["sample"] = items[0] if items else None
        info["count"] = len(items)
    return json.dumps(info, ensure_ascii=False)
