"""Turns the REPLY a plan's code assigned into the response kiln sends, checking its shape."""

import json
import re

TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
# Headers kiln sets itself; a plan cannot set them.
RESERVED = frozenset({
    "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
    "trailer", "proxy-authenticate", "proxy-authorization", "set-cookie", "x-request-id",
    "x-kiln-planner", "x-kiln-plan-cache", "date", "server",
})


class BadReply(Exception):
    pass


REPLY_KEYS = frozenset({"status", "headers", "body"})
# Statuses whose response has no body.
NO_BODY = frozenset({204, 205, 304})


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_reply(value):
    """Whether the code's result is a reply ({status, headers, body}) rather than a body: it
    has an integer status, or only reply keys with a body or headers among them."""
    if not isinstance(value, dict):
        return False
    if _is_int(value.get("status")):
        return True
    keys = set(value)
    return bool(keys) and keys <= REPLY_KEYS and bool(keys & {"body", "headers"})


def normalize(reply, default_status=200):
    """{status, headers, body} as kiln sends it; raises BadReply saying what is wrong. A
    result that is not a reply is the body, sent with `default_status`."""
    if not is_reply(reply):
        reply = {"status": default_status, "headers": {}, "body": reply}
    unknown = set(reply) - REPLY_KEYS
    if unknown:
        raise BadReply(f"REPLY has unknown keys: {', '.join(sorted(map(str, unknown)))}")
    status = reply.get("status", default_status)
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise BadReply(f"REPLY status must be an integer from 100 to 599, not {status!r}")
    headers = reply.get("headers") or {}
    if not isinstance(headers, dict):
        raise BadReply("REPLY headers must be an object of names to text")
    clean = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not TOKEN.match(name):
            raise BadReply(f"REPLY header name {name!r} is not valid")
        if name.lower() in RESERVED:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise BadReply(f"REPLY header {name} must be text")
        value = str(value)
        if any(c in value for c in "\r\n\0") or len(value) > 8192:
            raise BadReply(f"REPLY header {name} holds a line break or is too long")
        clean[name] = value
    body = None if status in NO_BODY else reply.get("body")
    if isinstance(body, (bytes, bytearray)):
        raise BadReply("REPLY body must be JSON data or text, not bytes")
    try:
        json.dumps(body)
    except (TypeError, ValueError) as e:
        raise BadReply(f"REPLY body is not JSON data: {e}") from None
    return {"status": status, "headers": clean, "body": body}


def error(status, code, message, details=None, request_id=None):
    """kiln's error envelope: `details` is always an object (a value that is not one is
    `{"value": ...}`)."""
    if details is None:
        details = {}
    elif not isinstance(details, dict):
        details = {"value": details}
    body = {"error": {"code": code, "message": message, "details": details}}
    if request_id is not None:
        body["error"]["request_id"] = request_id
    return {"status": status, "headers": {}, "body": body}
