//! `/mcp` in the API description. It is rmcp's streamable HTTP transport, not a handler of
//! ours, so it is described here by hand: rmcp answers its own refusals in plain text; the key
//! check, the body limit, the rate limit and another tenant's session are kiln's gate, in
//! kiln's envelope. scripts/mcp-check drives it with the official MCP client;
//! scripts/api-check leaves it out.

use serde_json::{Value, json};

use super::ERROR_EXAMPLES;

/// Adds the `/mcp` path and its tag to the description.
pub(super) fn describe(spec: &mut Value) {
    spec["paths"]["/mcp"] = json!({"post": post(), "get": get(), "delete": delete()});
    if let Some(tags) = spec["tags"].as_array_mut() {
        tags.push(json!({
            "name": "mcp",
            "description": "MCP (Model Context Protocol) over streamable HTTP, for MCP clients: the tools of `kiln mcp`, with the key's tenant."
        }));
    }
}

const EVENTS: &str = "Server-Sent Events: each `data:` line one JSON-RPC message";

fn post() -> Value {
    with_refusals(json!({
        "tags": ["mcp"],
        "operationId": "post_mcp",
        "summary": "Send MCP messages (JSON-RPC 2.0)",
        "description": "MCP's streamable HTTP transport, with the tools of `kiln mcp` (`run_python`, `run_javascript`, `sandbox_create`, the session and file tools; `run_go` and `run_bash` with `--linux`). Start with `initialize`; its answer's `Mcp-Session-Id` header names the session, which belongs to the key's tenant. `Accept` must admit both `application/json` and `text/event-stream`.",
        "parameters": [session(false)],
        "requestBody": {"required": true, "content": {"application/json": {
            "schema": {"type": "object"},
            "example": {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
        }}},
        "responses": {
            "200": {"description": format!("A request's answer, as {EVENTS}"), "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "202": {"description": "A notification or a response, accepted"},
            "406": text("`Accept` does not admit both `application/json` and `text/event-stream`"),
            "413": envelope("413", "The body is larger than 32 MiB"),
            "415": text("The body is not `application/json`, or not JSON")
        }
    }))
}

fn get() -> Value {
    with_refusals(json!({
        "tags": ["mcp"],
        "operationId": "get_mcp",
        "summary": "Receive the session's server messages",
        "description": format!("The session's stream of messages the server starts, as {EVENTS}."),
        "parameters": [session(true)],
        "responses": {
            "200": {"description": EVENTS, "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "406": text("`Accept` does not admit `text/event-stream`")
        }
    }))
}

fn delete() -> Value {
    with_refusals(json!({
        "tags": ["mcp"],
        "operationId": "delete_mcp",
        "summary": "End the session",
        "parameters": [session(true)],
        "responses": {"202": {"description": "The session has ended"}}
    }))
}

/// The answers every `/mcp` operation may give besides its own, and the key it needs.
fn with_refusals(mut operation: Value) -> Value {
    let responses = &mut operation["responses"];
    responses["400"] =
        text("No `Mcp-Session-Id` where the session needs one, or not a JSON-RPC message");
    responses["401"] = envelope("401", "No API key, or one that is unknown or revoked");
    responses["403"] = text(
        "A `Host` this server does not answer to (DNS-rebinding protection; `kiln serve --public-host` adds names)",
    );
    responses["404"] = json!({
        "description": "No such MCP session: it ended (plain text, from rmcp), or another key's tenant opened it (`SESSION_NOT_FOUND`)",
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorBody"},
                "example": {"error": {"code": "SESSION_NOT_FOUND", "message": "no MCP session 0e69f1ae-0754-4289-955e-96d6bc6d2f48 for this key", "details": {}}}
            }
        }
    });
    responses["429"] = envelope("429", "Too many requests for this key (see `Retry-After`)");
    operation["security"] = json!([{"bearer": []}]);
    operation
}

/// rmcp's own answer: plain text.
fn text(description: &str) -> Value {
    json!({"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}})
}

/// kiln's gate's answer, in the envelope, with the example of its status.
fn envelope(status: &str, description: &str) -> Value {
    let (_, code, message) = ERROR_EXAMPLES
        .iter()
        .find(|(s, ..)| *s == status)
        .copied()
        .unwrap_or_default();
    json!({"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorBody"},
        "example": {"error": {"code": code, "message": message, "details": {}}}
    }}})
}

fn session(required: bool) -> Value {
    json!({
        "name": "Mcp-Session-Id",
        "in": "header",
        "required": required,
        "schema": {"type": "string"},
        "description": "The session, as the `initialize` answer named it; every request after `initialize` sends it"
    })
}
