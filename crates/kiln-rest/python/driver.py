"""The driver kiln loads into each tenant's session: one call per request step.

- handle(ctx, "conventions"): plan with the conventions planner and run the plan, one turn.
- plan(ctx): ask the LLM through the host's door (granted to this turn alone) for a plan,
  check it, and report it; the host then calls execute() in a turn with the door shut.
- execute(ctx, code, pattern, meta): check and run a plan's code (a fresh plan, or one from
  the plan cache) and report its reply: the REPLY it assigned or the value it returned.

`meta` is what the plan said beside its code that its run needs: the action, the resource
`store` is bound to, and the response hints honoured (status, location_id).

Each call prints one line, MARK + JSON, which the host reads; whatever the plan's code prints
is captured and never mixed into it.
"""

import base64
import contextlib
import io
import json
import re
import sys
import traceback

from kiln_rest import http_response, router, safety, store as store_mod

MARK = "\x1ekiln-rest:"
MAX_PLAN_CHARS = 64_000
REQUIRED = ("action", "resource", "id", "criteria", "payload", "response_hints", "code")
FENCE = re.compile(r"```[ \t]*(?:python|py)[ \t]*\r?\n(.*?)```", re.DOTALL)

STORE = None
TENANT = None
SAFE_OPEN = None


def init(root, tenant):
    global STORE, TENANT, SAFE_OPEN
    STORE = store_mod.ResourceStore(root)
    TENANT = tenant
    SAFE_OPEN = store_mod.tenant_opener(root)


class PlanError(Exception):
    def __init__(self, code, message, status=502):
        super().__init__(message)
        self.code = code
        self.status = status


def _emit(answer):
    sys.stdout.write(MARK + json.dumps(answer, ensure_ascii=False, separators=(",", ":")) + "\n")


def _fail(status, code, message, **extra):
    answer = {"ok": False, "status": status, "code": code, "message": message}
    answer.update(extra)
    _emit(answer)


def parse_plan(text):
    """The plan and its code, checked; raises PlanError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise PlanError("PLAN_INVALID", "the planner gave an empty answer")
    if len(text) > MAX_PLAN_CHARS:
        raise PlanError("PLAN_INVALID", f"the plan is longer than {MAX_PLAN_CHARS} characters")
    text = text.strip()
    fenced = re.fullmatch(r"```(?:json)?[ \t]*\r?\n(.*)\r?\n```", text, re.DOTALL)
    if fenced:
        text = fenced.group(1)
    try:
        plan = json.loads(text)
    except ValueError as e:
        raise PlanError("PLAN_INVALID", f"the plan is not valid JSON: {e}") from None
    if not isinstance(plan, dict):
        raise PlanError("PLAN_INVALID", "the plan must be a JSON object")
    missing = [k for k in REQUIRED if k not in plan]
    if missing:
        raise PlanError("PLAN_INVALID", f"the plan lacks {', '.join(missing)}")
    if plan["action"] not in router.ACTIONS:
        raise PlanError("PLAN_INVALID", f"the plan's action {plan['action']!r} is not one of {', '.join(router.ACTIONS)}")
    if plan["resource"] is not None and not isinstance(plan["resource"], str):
        raise PlanError("PLAN_INVALID", "the plan's resource must be text or null")
    if not isinstance(plan["criteria"] or {}, dict) or not isinstance(plan["response_hints"] or {}, dict):
        raise PlanError("PLAN_INVALID", "the plan's criteria and response_hints must be objects (or null)")
    code = plan["code"]
    if not isinstance(code, dict) or code.get("language", "python") not in ("python", "py") or not isinstance(code.get("block"), str):
        raise PlanError("PLAN_INVALID", 'the plan\'s code must be {"language": "python", "block": "```python ... ```"}')
    blocks = FENCE.findall(code["block"])
    if len(blocks) != 1 or code["block"].count("```") != 2:
        raise PlanError("PLAN_INVALID", f"the plan's code must hold exactly one fenced python block (found {len(blocks)})")
    cache = plan.get("cache") or {}
    if not isinstance(cache, dict):
        raise PlanError("PLAN_INVALID", "the plan's cache must be an object")
    generic = cache.get("generic") is True
    pattern = cache.get("pattern")
    if generic and not isinstance(pattern, str):
        raise PlanError("PLAN_INVALID", "a generic plan must give its cache pattern")
    return plan, blocks[0], (pattern if generic else None)


DEFAULT_STATUS = {"create": 201, "delete": 204}


def plan_meta(plan):
    """What of the plan its code's run needs: action, resource and the response hints
    honoured (a status from 100 to 599; location_id when true or a value)."""
    hints = plan.get("response_hints") or {}
    kept = {}
    status = hints.get("status")
    if isinstance(status, str) and status.isdigit():
        status = int(status)
    if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599:
        kept["status"] = status
    location = hints.get("location_id")
    if location is True or (isinstance(location, (str, int)) and not isinstance(location, bool) and location != ""):
        kept["location_id"] = location
    return {"action": plan["action"], "resource": plan["resource"], "hints": kept}


def _hints(meta):
    hints = meta.get("hints")
    return hints if isinstance(hints, dict) else {}


def _default_status(meta):
    return _hints(meta).get("status") or DEFAULT_STATUS.get(meta.get("action"), 200)


def bind(pattern, segments):
    """The values a pattern's {params} take in this path ({} when it does not fit)."""
    if not pattern:
        return {}
    parts = pattern.split(" ", 1)
    if len(parts) != 2:
        return {}
    shape = [p for p in parts[1].split("/") if p]
    if len(shape) != len(segments):
        return {}
    params = {}
    for want, got in zip(shape, segments):
        if want.startswith("{") and want.endswith("}"):
            params[want[1:-1]] = got
        elif want != got:
            return {}
    return params


def _quote(text):
    out = []
    for byte in str(text).encode():
        ch = chr(byte)
        if ch.isascii() and (ch.isalnum() or ch in "-._~"):
            out.append(ch)
        else:
            out.append("%%%02X" % byte)
    return "".join(out)


def _where(error):
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename == "<plan>":
            return f" (line {frame.lineno} of the plan's code)"
    return ""


def context(ctx_text):
    """The request's context as the plan's code sees it. The host sends the body once, as
    `body_raw` (text) or `body_base64` (bytes that are not UTF-8), with `body_is_json`;
    here it becomes body / body_json (parsed JSON), body_text (text that is not JSON) and
    body_raw (the body as text)."""
    ctx = json.loads(ctx_text)
    raw, encoded = ctx.get("body_raw"), ctx.get("body_base64")
    is_json = ctx.pop("body_is_json", False)
    body = json.loads(raw) if is_json and raw is not None else None
    ctx["body"] = ctx["body_json"] = body
    ctx["body_text"] = None if is_json else raw
    ctx["body_base64"] = encoded
    if raw is None and encoded is not None:
        ctx["body_raw"] = base64.b64decode(encoded).decode("utf-8", "replace")
    else:
        ctx["body_raw"] = raw
    return ctx


def _path_id(ctx, resource):
    """The id a request names: the pattern's {id}, else the segment after the resource."""
    if "id" in ctx["params"]:
        return ctx["params"]["id"]
    segments = ctx["segments"]
    if resource in segments:
        at = segments.index(resource) + 1
        if at < len(segments):
            return segments[at]
    return None


def _names(ctx, meta, bound):
    """The globals a plan's code runs with."""
    query = {k: (v[0] if len(v) == 1 else v) for k, v in ctx["query"].items() if k not in ("limit", "offset", "sort")}
    return {
        "store": bound,
        "ctx": ctx,
        "safe_open": SAFE_OPEN,
        "resource": meta.get("resource"),
        "id": _path_id(ctx, meta.get("resource")),
        "payload": ctx["body_json"],
        "criteria": query,
        "BadRequest": store_mod.BadRequest,
        "NotFound": store_mod.NotFound,
        "Conflict": store_mod.Conflict,
        "UnsupportedMediaType": store_mod.UnsupportedMediaType,
        "quote": _quote,
    }


def _located(reply, meta, bound):
    """A create whose hints ask for it gets `Location: /<resource>/<id>` (the id the code
    inserted, else the body's id, else the hint's own value), unless the code set one."""
    location = _hints(meta).get("location_id")
    resource = meta.get("resource")
    if meta.get("action") != "create" or location is None or not isinstance(resource, str):
        return reply
    if any(name.lower() == "location" for name in reply["headers"]):
        return reply
    body = reply["body"]
    new_id = bound._inserted
    if new_id is None and isinstance(body, dict):
        new_id = body.get("id")
    if new_id is None and location is not True:
        new_id = location
    if new_id is not None:
        reply["headers"]["Location"] = "/" + _quote(resource) + "/" + _quote(new_id)
    return reply


def _run(ctx, code, pattern, meta):
    """Checks and runs the code; the answer to emit."""
    meta = meta or {}
    ctx["params"] = bind(pattern, ctx["segments"])
    try:
        compiled = safety.prepare(code)
    except safety.Unsafe as e:
        return {"ok": False, "status": 502, "code": "PLAN_UNSAFE", "message": f"the plan's code was refused, nothing ran: {e}"}
    bound = store_mod.BoundStore(STORE, meta.get("resource"))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            scope = safety.run(compiled, _names(ctx, meta, bound))
    except store_mod.HttpError as e:
        return {"ok": True, "reply": http_response.error(e.status, e.code, e.message, e.details, ctx.get("request_id"))}
    except store_mod.PolicyError as e:
        return {"ok": False, "status": 403, "code": "POLICY_VIOLATION", "message": str(e)}
    except Exception as e:
        return {"ok": False, "status": 500, "code": "CODE_FAILED", "message": f"{type(e).__name__}: {e}{_where(e)}"}
    except BaseException as e:
        return {"ok": False, "status": 500, "code": "CODE_FAILED", "message": f"the code stopped: {type(e).__name__}"}
    result = scope.get(safety.RETURNED)
    if result is None:
        if "REPLY" not in scope:
            return {"ok": False, "status": 500, "code": "NO_REPLY", "message": "the plan's code did not assign REPLY (or return a reply)"}
        result = scope["REPLY"]
    try:
        reply = http_response.normalize(result, _default_status(meta))
    except http_response.BadReply as e:
        return {"ok": False, "status": 500, "code": "BAD_REPLY", "message": str(e)}
    return {"ok": True, "reply": _located(reply, meta, bound)}


def _described(plan, code, pattern):
    """The plan as the host keeps it (and the plan cache stores it)."""
    return {"action": plan["action"], "resource": plan["resource"], "pattern": pattern, "code": code, "meta": plan_meta(plan)}


def handle(ctx_text, planner):
    """Plans with the conventions planner and runs the plan."""
    ctx = context(ctx_text)
    try:
        plan, code, pattern = parse_plan(router.conventions_plan(ctx))
    except PlanError as e:
        return _fail(e.status, e.code, str(e))
    # _run checks the code (PLAN_UNSAFE, nothing run) before it runs it.
    answer = _run(ctx, code, pattern, plan_meta(plan))
    answer["plan"] = _described(plan, code, pattern)
    _emit(answer)


def plan(ctx_text):
    """Asks the LLM for a plan through the door and checks it; nothing of it runs here."""
    ctx = context(ctx_text)
    usage = None
    try:
        text, usage = _ask_llm(ctx)
        plan, code, pattern = parse_plan(text)
        try:
            safety.prepare(code)
        except safety.Unsafe as e:
            raise PlanError("PLAN_UNSAFE", f"the plan's code was refused, nothing ran: {e}") from None
    except PlanError as e:
        return _fail(e.status, e.code, str(e), usage=usage)
    _emit({"ok": True, "plan": _described(plan, code, pattern), "usage": usage})


def execute(ctx_text, code, pattern, meta_text=None):
    """Runs a plan's code (checked again: a cached plan is checked every time it runs)."""
    meta = json.loads(meta_text) if meta_text else None
    _emit(_run(context(ctx_text), code, pattern, meta if isinstance(meta, dict) else None))


def _ask_llm(ctx):
    import _host

    frame = json.dumps({"op": "llm.complete", "system": router.PROMPT, "user": router.llm_request(ctx, STORE)})
    try:
        raw = _host.call(frame.encode())
    except ConnectionRefusedError:
        raise PlanError("PLANNER_UNAVAILABLE", "the LLM capability is not granted to this step", 500) from None
    except OSError as e:
        raise PlanError("LLM_FAILED", f"the host could not reach the LLM: {e}") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        raise PlanError("LLM_FAILED", "the host's answer is not JSON") from None
    if not answer.get("ok"):
        raise PlanError("LLM_FAILED", f"the LLM failed: {answer.get('error')}")
    return answer.get("text", ""), answer.get("usage")
