"""Routing and planning. Two planners emit the same plan JSON:

- the conventions planner here (no LLM): plain REST over collections, deterministic;
- an LLM, asked with PROMPT through the host's door (see driver.py).

A plan, in seed 000's shape: {"action", "resource", "id", "criteria", "payload",
"response_hints", "code": {"language": "python", "block": "```python\\n...\\n```"}}, plus
kiln's optional "cache": {"generic": bool, "pattern": "GET /members/{id}"}.

A plan never holds the request's body or query: its code reads them from `ctx`, and
`payload` / `criteria` only say where they come from ("ctx.body", {"from": "ctx.query"}).
So a plan stays small whatever the body (any size up to --max-body works the first time),
and a cached plan never carries one client's data into another request.
"""

import json

from kiln_rest.store import NAME

# The seed's actions first ("get" reads one object), then kiln's own ("read" is "get").
ACTIONS = (
    "create", "get", "list", "replace", "patch", "delete", "search",
    "read", "options", "index", "error",
)

PROMPT = """You are the router and planner of a REST service that has no fixed endpoints.
For the HTTP request you are given, infer the CRUD or search action and write Python code that
answers it.

Answer with ONLY a JSON object (no prose, no markdown around it):
{"action": "create|get|list|replace|patch|delete|search",
 "resource": "<collection name>", "id": "<id from the path or null>",
 "criteria": {<search filters>}, "payload": <what is stored, or null>,
 "response_hints": {"status": <int>, "location_id": true|false},
 "code": {"language": "python", "block": "```python\\n<code>\\n```"}}

The code block (exactly one fenced python block) runs with these names:
- store: the collection named by resource, with get_all() -> list, get(id) -> dict or None,
  insert(obj) -> id (sets obj["id"]; integer ids count up from the largest, a string id is
  kept), replace(id, obj), patch(id, delta) (both return the object or None),
  delete(id) -> bool, search(filters) -> list (field equal to value, text without case).
  Ids from the path are text: get("1") finds id 1.
- ctx: dict with method, path, segments (decoded path parts), query (name -> list of values),
  headers (lower-case names, no credentials), body_json (parsed JSON body or None), body_raw
  (the body as text or None), client {"ip"}, session {"id"} (the tenant).
- id (the id from the path or None), resource, payload (= ctx["body_json"]), criteria (the
  query, one value per name).
- safe_open(path, mode): open() for files in the tenant's own folder, relative paths only.
- Imports: json, re, math, statistics, uuid, datetime, itertools, typing, pathlib (pure paths
  only), io (StringIO, BytesIO), os (only os.path.join/basename/dirname/split/splitext/
  normpath, os.sep and such constants: no programs, environment or folder listings).
Result: assign REPLY = {"status": <int>, "headers": {<name>: <text>}, "body": <JSON data>},
or end with `return {...}` (a reply, or just the body). Without a status the reply gets
response_hints.status, else 201 for create, 204 for delete, 200 otherwise. With
response_hints.location_id true, a create answers Location: /<resource>/<new id>.
Typical patterns:
- create: obj = ctx["body_json"]; store.insert(obj); REPLY = {"status": 201, "body": obj}
- get: obj = store.get(id), then REPLY = {"status": 404, "body": {"error": "not found"}}
  when obj is None, else REPLY = {"status": 200, "body": obj}
- list: REPLY = {"status": 200, "body": store.get_all()}
- search: REPLY = {"status": 200, "body": store.search(criteria)}
- replace / patch: obj = store.replace(id, ctx["body_json"]) (or store.patch); 404 when None
- delete: REPLY = {"status": 204 if store.delete(id) else 404, "body": None}

kiln's additions:
- action may also be read (= get), options, index or error; resource may be null.
- Add "cache": {"generic": true|false, "pattern": "<METHOD /path/with/{params}>"}: set
  generic to true when the code works for every request of the same shape, with pattern
  naming the shape, e.g. "GET /members/{id}" (the code reads id or ctx["params"]["id"]).
- ctx also has params (values bound from your cache pattern, e.g. {"id": "1"}), body (=
  body_json), body_text (a body that is not JSON), body_base64 (one that is not text),
  client_ip, tenant, request_id.
- store.collection(name) -> any collection, with the methods above and count();
  store.collections(); store.sort(items, "name" or "-name"); store.page(items, limit,
  offset) -> {"items", "page": {"limit", "offset", "total"}}.
- BadRequest(message), NotFound(message), Conflict(message), UnsupportedMediaType(message):
  raise them for 400/404/409/415 JSON errors.
- quote(text): percent-encodes a path segment (for Location headers).
Conventions: POST /c/ -> 201 with Location /c/{id} and the created object; GET /c/{id} -> 200
or 404; PUT replaces, PATCH merges; DELETE -> 204 with body None; GET /c/search?f=v -> the
list of matches; GET /c/?limit=&offset=&sort= -> store.page(...); a body that is not a JSON
object where one is needed -> 400.
Never copy the request's body, query values or stored data into the plan or its code: the
code reads them from ctx when it runs (the body you are shown may be cut short, the code gets
all of it), and criteria/payload only say where they come from (e.g. {"from": "ctx.query"},
"ctx.body").
Rules: never use open (use safe_open), exec, eval, compile, getattr, type, globals,
attributes starting with an underscore, global/nonlocal, a bare except or except
BaseException; never touch the network.
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

# A body sent as another type than JSON arrives as body_text or body_base64.
_JSON_BODY = '''
body = ctx["body"]
if body is None and (ctx["body_text"] is not None or ctx["body_base64"] is not None):
    raise UnsupportedMediaType("the body must be JSON (Content-Type: application/json)")
'''

_CREATE = _JSON_BODY + '''
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
    return _JSON_BODY + f'''
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


def _error_body(code, message):
    """An error body in kiln rest's shape; the request id is read when the code runs (the
    plan may be cached and answer other requests)."""
    return f"{{'error': {{'code': {code!r}, 'message': {message!r}, 'details': {{}}, 'request_id': ctx['request_id']}}}}"


def _refuse(status, headers, code, message):
    return f"REPLY = {{'status': {status}, 'headers': {headers!r}, 'body': {_error_body(code, message)}}}\n"


def _error(status, code, message):
    return _refuse(status, {}, code, message)


COLLECTION_METHODS = "GET, HEAD, POST, OPTIONS"
# Where a plan's code takes the payload and the filters from (never the values themselves).
FROM_BODY = "ctx.body"
FROM_QUERY = {"from": "ctx.query"}
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
        return _plan("error", _refuse(405, {"Allow": "GET, HEAD, OPTIONS"}, "METHOD_NOT_ALLOWED", f"{method} / is not supported"), f"{method} /")
    resource = segs[0]
    if not NAME.match(resource):
        return _plan("error", _error(400, "BAD_REQUEST", f"{resource!r} is not a collection name (a letter, then letters, digits, _ or -)"), resource=None)
    if len(segs) > 2:
        return _plan("error", _error(404, "NOT_FOUND", "paths have the shape /collection/ or /collection/id"), resource=resource)
    base = f"/{resource}"
    if len(segs) == 1:
        if read:
            return _plan("list", _code(resource, _LIST), f"{method} {base}", resource, criteria=FROM_QUERY)
        if method == "POST":
            return _plan("create", _code(resource, _CREATE), f"POST {base}", resource, payload=FROM_BODY, hints={"status": 201})
        if method == "OPTIONS":
            return _plan("options", _fixed(204, {"Allow": COLLECTION_METHODS}, None), f"OPTIONS {base}", resource)
        return _plan("error", _refuse(405, {"Allow": COLLECTION_METHODS}, "METHOD_NOT_ALLOWED", f"{method} is not supported on a collection"), f"{method} {base}", resource)
    id = segs[1]
    if id == "search":
        if read:
            return _plan("search", _code(resource, _SEARCH), f"{method} {base}/search", resource, criteria=FROM_QUERY)
        if method == "OPTIONS":
            return _plan("options", _fixed(204, {"Allow": "GET, HEAD, OPTIONS"}, None), f"OPTIONS {base}/search", resource)
        return _plan("error", _refuse(405, {"Allow": "GET, HEAD, OPTIONS"}, "METHOD_NOT_ALLOWED", f"{method} is not supported on search"), f"{method} {base}/search", resource)
    member = f"{method} {base}/{{id}}"
    bodies = {"GET": _READ, "HEAD": _READ, "PUT": _REPLACE, "PATCH": _PATCH, "DELETE": _DELETE}
    actions = {"GET": "read", "HEAD": "read", "PUT": "replace", "PATCH": "patch", "DELETE": "delete"}
    if method in bodies:
        payload = FROM_BODY if method in ("PUT", "PATCH") else None
        return _plan(actions[method], _code(resource, bodies[method]), member, resource, id=id, payload=payload)
    if method == "OPTIONS":
        return _plan("options", _fixed(204, {"Allow": MEMBER_METHODS}, None), member, resource, id=id)
    return _plan("error", _refuse(405, {"Allow": MEMBER_METHODS}, "METHOD_NOT_ALLOWED", f"{method} is not supported on a member"), member, resource, id=id)


# What the LLM is shown of one value (the body, a query, a stored object), in characters of
# JSON: enough to infer the request's shape, never so much that a body fills the prompt or
# invites the model to copy it into the plan.
PREVIEW_CHARS = 2000


def preview(value, limit=PREVIEW_CHARS):
    """The value itself when its JSON is short, else the start of its JSON text with a marker
    saying how much was left out and that the code gets all of it from ctx."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if len(text) <= limit:
        return value
    return text[:limit] + f" ...[truncated: {len(text) - limit} more characters not shown; the code reads the whole value from ctx]"


def llm_request(ctx, store):
    """What the LLM planner is told about the request: the request itself (long values cut
    short, see preview), the tenant's collections and one sample object of the one
    addressed."""
    info = {
        "method": ctx["method"],
        "path": ctx["path"],
        "segments": ctx["segments"],
        "query": preview(ctx["query"]),
        "content_type": ctx["headers"].get("content-type"),
        "body": preview(ctx.get("body")),
        "collections": store.collections()[:200],
    }
    if ctx.get("body_text") is not None:
        info["body_text"] = preview(ctx["body_text"])
    if ctx.get("body_base64") is not None:
        info["body_base64"] = f"({len(ctx['body_base64'])} characters of base64, not shown)"
    if ctx["segments"] and NAME.match(ctx["segments"][0]):
        items = store.collection(ctx["segments"][0]).get_all()
        info["sample"] = preview(items[0]) if items else None
        info["count"] = len(items)
    return json.dumps(info, ensure_ascii=False)
