//! The OpenAPI description `kiln rest` serves at `/openapi.json`.

use serde_json::{Value, json};

use crate::CONVENTIONS_LABEL;

/// The OpenAPI description: one catch-all operation per method, and the fixed routes.
pub fn openapi_spec() -> &'static Value {
    static SPEC: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| {
        let error = json!({"$ref": "#/components/schemas/Error"});
        let operation = |method: &str, summary: &str, example: Value| {
            json!({
                "operationId": format!("rest_{method}"),
                "summary": summary,
                "description": "No endpoint is declared: the planner (an LLM, or the offline conventions planner) reads the request and writes Python code that answers it over the tenant's JSON collections. The headers X-Kiln-Planner and X-Kiln-Plan-Cache say who planned it and whether a cached plan answered.",
                "parameters": [
                    {"name": "path", "in": "path", "required": true, "schema": {"type": "string"}, "description": "Any path, e.g. members/ or members/1 or members/search", "example": "members/1"},
                    {"name": "X-Session-ID", "in": "header", "required": false, "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": "The tenant; without it, the tenant is derived from the bearer token (or is `public`)."}
                ],
                "responses": {
                    "default": {"description": "Whatever the plan answers, e.g. 201 with Location for a create, 200, 204, 404", "content": {"application/json": {"example": example}}},
                    "400": {"description": "Malformed JSON body, bad path or X-Session-ID", "content": {"application/json": {"schema": error}}},
                    "401": {"description": "AUTH_TOKEN is set and the bearer token is missing or wrong", "content": {"application/json": {"schema": error}}},
                    "405": {"description": "A method the catch-all does not serve (TRACE, ...); the Allow header lists those it does", "content": {"application/json": {"schema": error}}},
                    "413": {"description": "The body is too large", "content": {"application/json": {"schema": error}}},
                    "415": {"description": "A body that is not JSON where a JSON object is needed", "content": {"application/json": {"schema": error}}},
                    "429": {"description": "TOO_MANY_NEW_TENANTS: this client address created its new tenants for the minute (see Retry-After); its existing tenants keep working", "content": {"application/json": {"schema": error}}},
                    "503": {"description": "TOO_MANY_SESSIONS: every live tenant session is busy (see Retry-After)", "content": {"application/json": {"schema": error}}},
                    "502": {"description": "The planner's answer was invalid (PLAN_INVALID), unsafe (PLAN_UNSAFE) or the LLM failed (LLM_FAILED), or the result was too large", "content": {"application/json": {"schema": error}}},
                    "504": {"description": "The code ran past the per-request deadline", "content": {"application/json": {"schema": error}}}
                }
            })
        };
        let body = json!({"required": false, "content": {"application/json": {"schema": {}, "example": {"name": "Hartmann", "city": "Bonn"}}}});
        let mut post = operation("post", "Create (POST /members/ → 201 + Location)", json!({"id": 1, "name": "Hartmann"}));
        post["requestBody"] = body.clone();
        let mut put = operation("put", "Replace (PUT /members/1)", json!({"id": 1, "name": "Hartmann"}));
        put["requestBody"] = body.clone();
        let mut patch = operation("patch", "Merge (PATCH /members/1)", json!({"id": 1, "name": "Hartmann", "city": "Köln"}));
        patch["requestBody"] = body;
        json!({
            "openapi": "3.1.0",
            "info": {
                "title": "kiln rest",
                "version": env!("CARGO_PKG_VERSION"),
                "description": "A REST service with no fixed endpoints. Every method on every path reaches one catch-all handler; a planner turns the request into a JSON plan with Python code, the code is checked against an allowlist and runs in the tenant's WebAssembly sandbox over its JSON collections (`/data/<tenant>/<collection>.json`).\n\nConventions (what the offline planner does, and what the LLM planner is asked to do):\n- POST /members/ → 201, Location: /members/{id}, the created object\n- GET /members/1 → 200 or 404; PUT replaces, PATCH merges, DELETE → 204\n- GET /members/search?name=hartmann → the matching list (field__contains for parts)\n- GET /members/?limit=10&offset=20&sort=name → {items, page: {limit, offset, total}}\n\nTenants: X-Session-ID, or derived from the bearer token. Fixed routes: /healthz, /docs, /redoc, /openapi.json."
            },
            "paths": {
                "/{path}": {
                    "get": operation("get", "Read, list or search (GET /members/1, /members/?limit=10, /members/search?name=x)", json!({"items": [{"id": 1, "name": "Hartmann"}], "page": {"limit": 10, "offset": 0, "total": 1}})),
                    "post": post,
                    "put": put,
                    "patch": patch,
                    "delete": operation("delete", "Delete (DELETE /members/1 → 204)", Value::Null),
                    "options": operation("options", "Allowed methods", Value::Null),
                    "head": operation("head", "As GET, without a body", Value::Null)
                },
                "/healthz": {"get": {"operationId": "healthz", "summary": "200 when requests can be served; planner and plan-cache hit rate", "responses": {"200": {"description": "Ready", "content": {"application/json": {"example": {"status": "ok", "planner": CONVENTIONS_LABEL, "plan_cache": {"hits": 9, "misses": 1, "hit_rate": 0.9}}}}}, "503": {"description": "No executor worker"}}}}
            },
            "components": {
                "schemas": {
                    "Error": {
                        "type": "object",
                        "required": ["error"],
                        "description": "kiln's one error envelope (kiln serve, kiln rest and kiln runner answer it)",
                        "properties": {"error": {
                            "type": "object",
                            "required": ["code", "message", "details", "request_id"],
                            "properties": {
                                "code": {"type": "string", "description": "Stable, e.g. BODY_TOO_LARGE", "example": "NOT_FOUND"},
                                "message": {"type": "string", "description": "One line for people", "example": "members/7 does not exist"},
                                "details": {"type": "object", "description": "For programs; often empty"},
                                "request_id": {"type": "string", "description": "The caller's X-Request-ID, else one kiln rest made; also sent as X-Request-ID", "example": "rest-66a1f0c2-7"}
                            }
                        }}
                    }
                },
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "Only when kiln rest runs with AUTH_TOKEN"}}
            }
        })
    })
}

#[cfg(test)]
mod tests {
    /// Issue 16: the docs pages showed `/data//.json`, markdown having taken `<tenant>` and
    /// `<collection>` for HTML tags; in a code span they show as written.
    #[test]
    fn the_data_path_shows_its_placeholders() {
        let description = super::openapi_spec()["info"]["description"]
            .as_str()
            .unwrap_or_default();
        assert!(
            description.contains("(`/data/<tenant>/<collection>.json`)"),
            "{description}"
        );
        let outside_code: String = description.split('`').step_by(2).collect();
        assert!(!outside_code.contains('<'), "{outside_code}");
    }
}
