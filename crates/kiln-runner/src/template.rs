//! LLM prompt-template mode: load a template with `core.state.getDefinitionFileContent`,
//! render it with Jinja2 semantics (minijinja), ask `core.llm.generate`, and check the
//! completion against the template's `outputSchema`.
//!
//! A template file is YAML (JSON is YAML too):
//!
//! ```yaml
//! prompt: "Summarise {{ requestData.text }} in {{ context.taskDetails.words | default(20) }} words"
//! system: You are terse.          # optional, also a template
//! defaults: {model: small, temperature: 0.2}   # optional, merged under the overrides
//! outputSchema: {type: object, required: [summary]}   # optional JSON Schema
//! ```
//!
//! A file that is not a mapping with a `prompt` is itself the prompt template.

use std::sync::atomic::Ordering;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::mcp::tail;
use crate::runner::{Call, Failure, Produced, RunError, Runner};

/// Operations a template may spend rendering (minijinja fuel): guards against loops.
const RENDER_FUEL: u64 = 200_000;

/// A prompt template definition.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(title = "UHLP prompt template")]
pub struct TemplateDef {
    /// The user prompt, a Jinja2 template over `requestData`, `context`, `input` and (in a
    /// workflow) `steps` and `last`.
    pub prompt: String,
    /// An optional system prompt, also a template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// Parameters for `core.llm.generate` (`model`, `temperature`, `maxTokens`…); a request's
    /// `taskDetails.llm` or a step's `overrides` win over them.
    #[serde(default)]
    pub defaults: Map<String, Value>,
    /// A JSON Schema the completion must satisfy; then the completion is parsed as JSON
    /// (a ```json fence is allowed) and the parsed value is the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
}

/// Serves an LLM request: the template is `taskDetails.template`, the overrides
/// `taskDetails.llm`.
pub async fn run_task(runner: &Runner, call: &Call) -> Result<Produced, RunError> {
    let details = call.task_details();
    let name = details.template.ok_or_else(|| {
        Failure::new(
            "INVALID_TASK",
            "llm mode needs context.taskDetails.template",
            Value::Null,
        )
    })?;
    let scope = json!({
        "requestData": call.request_data(),
        "context": call.context(),
        "input": call.request_data(),
    });
    let overrides = details.llm.unwrap_or_default();
    let output = run_template(runner, call, &name, &overrides, scope, None).await?;
    Ok(Produced::Value(output))
}

/// Loads a definition file through MCP; a tool's not-found answer (or an empty one) is
/// `not_found_code`.
pub async fn load_definition(
    runner: &Runner,
    call: &Call,
    path: &str,
    kind: &str,
    not_found_code: &str,
) -> Result<String, RunError> {
    let mut params = call.ids();
    params.insert("path".into(), json!(path));
    params.insert("kind".into(), json!(kind));
    let not_found = || {
        Failure::new(
            not_found_code,
            format!("the {kind} {path:?} does not exist"),
            json!({"path": path}),
        )
    };
    let result = runner
        .mcp(
            call,
            "core.state.getDefinitionFileContent",
            Value::Object(params),
        )
        .await
        .map_err(|error| match error {
            error if error.is_not_found() => RunError::Failed(not_found()),
            error => error.into(),
        })?;
    match result {
        Value::String(text) => Ok(text),
        Value::Object(mut fields) => match fields.remove("content") {
            Some(Value::String(text)) => Ok(text),
            Some(Value::Null) | None => Err(not_found().into()),
            Some(_) => Err(Failure::new(
                "MCP_BAD_REPLY",
                format!("the content of the {kind} {path:?} is not text"),
                json!({"path": path}),
            )
            .into()),
        },
        Value::Null => Err(not_found().into()),
        _ => Err(Failure::new(
            "MCP_BAD_REPLY",
            format!("getDefinitionFileContent answered {path:?} with neither text nor {{content}}"),
            json!({"path": path}),
        )
        .into()),
    }
}

/// Reads a template file.
pub fn parse_template(text: &str) -> Result<TemplateDef, Failure> {
    let value: Option<serde_yaml_ng::Value> = serde_yaml_ng::from_str(text).ok();
    let structured = value
        .as_ref()
        .and_then(serde_yaml_ng::Value::as_mapping)
        .is_some_and(|m| m.contains_key("prompt"));
    if !structured {
        return Ok(TemplateDef {
            prompt: text.to_owned(),
            ..TemplateDef::default()
        });
    }
    serde_yaml_ng::from_str(text).map_err(|e| {
        Failure::new(
            "TEMPLATE_INVALID",
            format!("the template is not valid: {e}"),
            Value::Null,
        )
    })
}

/// Renders a Jinja2 template against a JSON scope.
pub fn render(source: &str, scope: &Value) -> Result<String, Failure> {
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(RENDER_FUEL));
    env.render_str(
        source,
        minijinja::Value::from(minijinja::value::Serde(scope)),
    )
    .map_err(|e| {
        Failure::new(
            "TEMPLATE_RENDER_FAILED",
            format!("the template could not be rendered: {e}"),
            json!({"detail": format!("{e:#}")}),
        )
    })
}

/// Runs a template: load, render, generate, check. `extra_context` is merged into the
/// rendering scope (a workflow's `steps` and `last`).
pub async fn run_template(
    runner: &Runner,
    call: &Call,
    name: &str,
    overrides: &Map<String, Value>,
    scope: Value,
    step: Option<&str>,
) -> Result<Value, RunError> {
    let text = load_definition(runner, call, name, "template", "TEMPLATE_NOT_FOUND").await?;
    let template = parse_template(&text)?;
    let prompt = render(&template.prompt, &scope)?;
    let system = template
        .system
        .as_deref()
        .map(|s| render(s, &scope))
        .transpose()?;
    let mut params = template.defaults.clone();
    params.extend(overrides.clone());
    params.insert("prompt".into(), json!(prompt));
    if let Some(system) = system {
        params.insert("system".into(), json!(system));
    }
    if let Some(schema) = &template.output_schema {
        params.insert("outputSchema".into(), schema.clone());
    }
    params.extend(call.ids());
    params.insert("step".into(), json!(step));
    let answer = runner
        .mcp(call, "core.llm.generate", Value::Object(params))
        .await?;
    let (completion, tokens_in, tokens_out) = read_completion(&answer)?;
    call.tokens_in.fetch_add(tokens_in, Ordering::Relaxed);
    call.tokens_out.fetch_add(tokens_out, Ordering::Relaxed);
    match &template.output_schema {
        None => Ok(json!({"text": completion})),
        Some(schema) => check_structured(schema, &completion).map_err(|problems| {
            Failure::new(
                "OUTPUT_SCHEMA_MISMATCH",
                format!("the completion does not match the template's outputSchema: {problems}"),
                json!({"template": name, "problems": problems, "completion": tail(&completion, 2_000)}),
            )
            .into()
        }),
    }
}

/// The completion text and token counts of a `core.llm.generate` answer: a string, or an
/// object with `text` (or `completion`, `content`) and `usage` (`inputTokens`/
/// `outputTokens`, or the `prompt_tokens`/`completion_tokens` spellings).
fn read_completion(answer: &Value) -> Result<(String, u64, u64), Failure> {
    if let Value::String(text) = answer {
        return Ok((text.clone(), 0, 0));
    }
    let text = ["text", "completion", "content"]
        .iter()
        .find_map(|key| answer.get(key).and_then(Value::as_str))
        .ok_or_else(|| {
            Failure::new(
                "LLM_BAD_REPLY",
                "core.llm.generate answered without text",
                json!({"answer": tail(&answer.to_string(), 500)}),
            )
        })?;
    let usage = answer.get("usage").cloned().unwrap_or(Value::Null);
    let count = |keys: &[&str]| {
        keys.iter()
            .find_map(|key| usage.get(key).and_then(Value::as_u64))
            .unwrap_or(0)
    };
    Ok((
        text.to_owned(),
        count(&[
            "inputTokens",
            "input_tokens",
            "promptTokens",
            "prompt_tokens",
        ]),
        count(&[
            "outputTokens",
            "output_tokens",
            "completionTokens",
            "completion_tokens",
        ]),
    ))
}

pub use kiln_llm::check_structured;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_render_with_jinja_semantics() {
        let scope = json!({"requestData": {"name": "Ada", "items": [1, 2, 3]}});
        let text = render(
            "Hi {{ requestData.name | upper }}: {% for i in requestData.items %}{{ i }}{% if not loop.last %},{% endif %}{% endfor %}{{ missing }}",
            &scope,
        )
        .unwrap();
        assert_eq!(text, "Hi ADA: 1,2,3");
        let error = render("{{ 1 + }}", &scope).unwrap_err();
        assert_eq!(error.code, "TEMPLATE_RENDER_FAILED");
        let error = render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            &scope,
        )
        .unwrap_err();
        assert_eq!(error.code, "TEMPLATE_RENDER_FAILED");
    }

    #[test]
    fn template_files_are_yaml_or_plain_text() {
        let template = parse_template(
            "prompt: 'Hello {{ x }}'\ndefaults: {model: m}\noutputSchema: {type: object}\n",
        )
        .unwrap();
        assert_eq!(template.prompt, "Hello {{ x }}");
        assert_eq!(template.defaults["model"], "m");
        assert_eq!(template.output_schema, Some(json!({"type": "object"})));
        let plain = parse_template("Just say: {{ x }}").unwrap();
        assert_eq!(plain.prompt, "Just say: {{ x }}");
        let bad = parse_template("prompt: [1, 2]").unwrap_err();
        assert_eq!(bad.code, "TEMPLATE_INVALID");
    }

    #[test]
    fn completions_and_usage_are_read() {
        let (text, input, output) = read_completion(
            &json!({"text": "hi", "usage": {"inputTokens": 12, "outputTokens": 3}}),
        )
        .unwrap();
        assert_eq!((text.as_str(), input, output), ("hi", 12, 3));
        assert_eq!(
            read_completion(&json!({"nope": 1})).unwrap_err().code,
            "LLM_BAD_REPLY"
        );
        assert_eq!(
            check_structured(
                &json!({"type": "object", "required": ["a"]}),
                "```json\n{\"a\": 1}\n```"
            ),
            Ok(json!({"a": 1}))
        );
        assert!(check_structured(&json!({"type": "object", "required": ["a"]}), "{}").is_err());
    }
}
