//! Workflow mode: a YAML definition loaded with `core.state.getDefinitionFileContent`, run
//! step by step (`jit`, `llm`, `mcp`, `control`) from `startAt` to a step with `end: true`,
//! following `transitions`; a step budget stops cycles. See docs/runner.md for the format.
//!
//! In `full` execution (the default) the whole workflow runs in one request and the terminal
//! step's output is the result. In `step` execution each request runs one step, keeps the
//! state with `core.state.setRuntimeValue` / `getRuntimeValue`, and answers `workflowStep`
//! until the terminal step, whose output is the result.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::mcp::Level;
use crate::protocol::{WorkflowExecution, WorkflowInfo, WorkflowStepData};
use crate::runner::{Call, Failure, Produced, RunError, Runner};

/// Operations one expression may spend (minijinja fuel).
const EXPRESSION_FUEL: u64 = 100_000;
/// The most steps any workflow may run, whatever it asks for.
pub const HARD_MAX_STEPS: u32 = 1_000;

/// A workflow definition.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(title = "UHLP workflow")]
pub struct WorkflowDef {
    /// A name for reports; default the definition file's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The first step.
    pub start_at: String,
    /// Steps one run may take (cycles are allowed, this bounds them). Default and most: the
    /// runner's `--max-workflow-steps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u32>,
    /// The steps by name.
    pub steps: BTreeMap<String, StepDef>,
}

/// What a step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// Run `function` of `script` in a sandbox with the mapped input.
    Jit,
    /// Render `template` and ask the LLM (`overrides` win over the template's defaults).
    Llm,
    /// Call the MCP tool `tool` with the mapped input as its params.
    Mcp,
    /// Do nothing but map and branch; the output is the mapped input, else the last output.
    Control,
}

/// One step.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StepDef {
    /// `jit`, `llm`, `mcp` or `control`.
    #[serde(rename = "type")]
    pub kind: StepKind,
    /// jit: the script on the shared volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<String>,
    /// jit: the function (default `handler`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    /// jit: the sandbox deadline in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// llm: the template's definition file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// llm: parameters for `core.llm.generate` over the template's defaults.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub overrides: Map<String, Value>,
    /// mcp: the tool to call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The step's input, by name: a string is an expression (Jinja2 expression syntax)
    /// over `requestData`, `context`, `input`, `steps` (outputs by step name), `last` and
    /// `error`; any other YAML value is taken as it is. Without it a jit or llm step gets
    /// `requestData`, an mcp step `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_mapping: Option<Map<String, Value>>,
    /// Where to go on success when no condition holds (same as `transitions.onSuccess`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// Where to go next.
    #[serde(default)]
    pub transitions: Transitions,
    /// Whether the workflow ends after this step succeeds; its output is the result.
    #[serde(default)]
    pub end: bool,
}

/// Where a step goes next.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Transitions {
    /// On success, when no condition holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_success: Option<String>,
    /// On failure (the failure is then in `error`); without it a failure ends the workflow
    /// with an error result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<String>,
    /// Checked in order after a success; the first that holds wins.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A conditional transition.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// An expression over the scope plus `output` (this step's output); truthy means go.
    pub when: String,
    /// The step to go to.
    pub next: String,
}

/// What a workflow run carries from step to step (kept through MCP in step mode).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct State {
    /// Outputs by step name (the latest run of each).
    steps: Map<String, Value>,
    /// The last step's output.
    last: Value,
    /// The last failure that was handled by an `onFailure` transition.
    error: Value,
    /// Steps run so far.
    executed: u32,
    /// The step to run next (step mode).
    next: Option<String>,
    /// The names of the steps run, oldest first (at most the last 50).
    trail: Vec<String>,
}

/// Parses and checks a workflow definition.
pub fn parse_workflow(text: &str) -> Result<WorkflowDef, Failure> {
    let invalid = |message: String| Failure::new("WORKFLOW_INVALID", message, Value::Null);
    let def: WorkflowDef = serde_yaml_ng::from_str(text)
        .map_err(|e| invalid(format!("the workflow is not valid: {e}")))?;
    let known = |name: &str, from: &str| {
        if def.steps.contains_key(name) {
            Ok(())
        } else {
            Err(invalid(format!("{from} names an unknown step {name:?}")))
        }
    };
    known(&def.start_at, "startAt")?;
    for (name, step) in &def.steps {
        let targets = [
            &step.next,
            &step.transitions.on_success,
            &step.transitions.on_failure,
        ];
        for target in targets.into_iter().flatten() {
            known(target, &format!("step {name:?}"))?;
        }
        for condition in &step.transitions.conditions {
            known(&condition.next, &format!("step {name:?}"))?;
        }
        let needs = match step.kind {
            StepKind::Jit => step.script.is_none().then_some("script"),
            StepKind::Llm => step.template.is_none().then_some("template"),
            StepKind::Mcp => step.tool.is_none().then_some("tool"),
            StepKind::Control => None,
        };
        if let Some(field) = needs {
            return Err(invalid(format!("step {name:?} needs a {field}")));
        }
        let leaves = step.next.is_some()
            || step.transitions.on_success.is_some()
            || !step.transitions.conditions.is_empty();
        if !step.end && !leaves {
            return Err(invalid(format!(
                "step {name:?} has no transition on success and is not an end"
            )));
        }
    }
    Ok(def)
}

/// Evaluates an expression against a scope.
fn eval(expression: &str, scope: &Value) -> Result<Value, Failure> {
    let failed = |e: minijinja::Error| {
        Failure::new(
            "WORKFLOW_EXPRESSION_FAILED",
            format!("the expression {expression:?} failed: {e}"),
            json!({"expression": expression}),
        )
    };
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(EXPRESSION_FUEL));
    let compiled = env.compile_expression(expression).map_err(failed)?;
    let value = compiled
        .eval(minijinja::Value::from(minijinja::value::Serde(scope)))
        .map_err(failed)?;
    if value.is_undefined() {
        return Ok(Value::Null);
    }
    serde_json::to_value(&value).map_err(|e| {
        Failure::new(
            "WORKFLOW_EXPRESSION_FAILED",
            format!("the expression {expression:?} gave a value that is not JSON: {e}"),
            json!({"expression": expression}),
        )
    })
}

fn truthy(expression: &str, scope: &Value) -> Result<bool, Failure> {
    Ok(match eval(expression, scope)? {
        Value::Null => false,
        Value::Bool(b) => b,
        Value::Number(n) => n.as_f64().is_some_and(|n| n != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    })
}

fn scope(call: &Call, state: &State) -> Value {
    let request_data = call.request_data();
    json!({
        "requestData": request_data,
        "input": request_data,
        "context": call.context(),
        "steps": state.steps,
        "last": state.last,
        "error": state.error,
    })
}

fn map_input(step: &StepDef, scope: &Value) -> Result<Option<Value>, Failure> {
    let Some(mapping) = &step.input_mapping else {
        return Ok(None);
    };
    let mut input = Map::new();
    for (name, source) in mapping {
        let value = match source {
            Value::String(expression) => eval(expression, scope)?,
            literal => literal.clone(),
        };
        input.insert(name.clone(), value);
    }
    Ok(Some(Value::Object(input)))
}

async fn run_step(
    runner: &Runner,
    call: &Call,
    name: &str,
    step: &StepDef,
    state: &State,
) -> Result<Value, RunError> {
    let scope = scope(call, state);
    let input = map_input(step, &scope)?;
    match step.kind {
        StepKind::Jit => {
            let script = step.script.as_deref().unwrap_or_default();
            let input = input.unwrap_or_else(|| call.request_data());
            crate::jit::run_function(
                runner,
                call,
                script,
                step.function.as_deref(),
                step.timeout_ms,
                input,
            )
            .await
        }
        StepKind::Llm => {
            let mut scope = scope;
            if let Some(input) = input {
                scope["input"] = input;
            }
            let template = step.template.as_deref().unwrap_or_default();
            crate::template::run_template(
                runner,
                call,
                template,
                &step.overrides,
                scope,
                Some(name),
            )
            .await
        }
        StepKind::Mcp => {
            let tool = step.tool.as_deref().unwrap_or_default();
            let params = input.unwrap_or_else(|| json!({}));
            Ok(runner.mcp(call, tool, params).await?)
        }
        StepKind::Control => Ok(input.unwrap_or_else(|| state.last.clone())),
    }
}

/// Where a step that succeeded goes: `None` at an end.
fn next_on_success(
    call: &Call,
    name: &str,
    step: &StepDef,
    state: &State,
    output: &Value,
) -> Result<Option<String>, Failure> {
    if step.end {
        return Ok(None);
    }
    let mut scope = scope(call, state);
    scope["output"] = output.clone();
    for condition in &step.transitions.conditions {
        if truthy(&condition.when, &scope)? {
            return Ok(Some(condition.next.clone()));
        }
    }
    match step.transitions.on_success.as_ref().or(step.next.as_ref()) {
        Some(next) => Ok(Some(next.clone())),
        None => Err(Failure::new(
            "WORKFLOW_INVALID",
            format!("step {name:?} succeeded but no condition held and it has no onSuccess"),
            json!({"step": name}),
        )),
    }
}

/// What one step came to.
enum Advance {
    /// The workflow ended with this output.
    Finished(Value),
    /// Go on with this step; `failed` when the failure transition was taken.
    Next { next: String, failed: bool },
}

/// Runs one step and records it in `state`.
async fn advance(
    runner: &Runner,
    call: &Call,
    def: &WorkflowDef,
    name: &str,
    state: &mut State,
) -> Result<Advance, RunError> {
    let budget = def
        .max_steps
        .unwrap_or(runner.config.max_workflow_steps)
        .min(runner.config.max_workflow_steps)
        .min(HARD_MAX_STEPS);
    if state.executed >= budget {
        return Err(Failure::new(
            "STEP_BUDGET_EXCEEDED",
            format!("the workflow ran {budget} steps without reaching an end (a cycle?)"),
            json!({"maxSteps": budget, "trail": state.trail, "nextStep": name}),
        )
        .into());
    }
    let step = def.steps.get(name).ok_or_else(|| {
        Failure::new(
            "WORKFLOW_INVALID",
            format!("there is no step {name:?}"),
            json!({"step": name}),
        )
    })?;
    state.executed += 1;
    state.trail.push(name.to_owned());
    if state.trail.len() > 50 {
        state.trail.remove(0);
    }
    call.steps.fetch_add(1, Ordering::Relaxed);
    runner.log(
        call,
        Level::Info,
        format!("workflow step {name} started"),
        Some(name),
    );
    match run_step(runner, call, name, step, state).await {
        Ok(output) => {
            let next = next_on_success(call, name, step, state, &output)?;
            state.steps.insert(name.to_owned(), output.clone());
            state.last = output.clone();
            Ok(match next {
                None => Advance::Finished(output),
                Some(next) => Advance::Next {
                    next,
                    failed: false,
                },
            })
        }
        Err(RunError::Failed(failure)) => {
            runner.log(
                call,
                Level::Warn,
                format!("workflow step {name} failed: {}", failure.message),
                Some(name),
            );
            on_failure(name, step, state, failure)
        }
        Err(internal) => Err(internal),
    }
}

/// A failed step: its failure transition, or the workflow's failure.
fn on_failure(
    name: &str,
    step: &StepDef,
    state: &mut State,
    failure: Failure,
) -> Result<Advance, RunError> {
    match &step.transitions.on_failure {
        Some(next) => {
            state.error = json!({"step": name, "code": failure.code,
                "message": failure.message, "details": failure.details});
            state.last = state.error.clone();
            Ok(Advance::Next {
                next: next.clone(),
                failed: true,
            })
        }
        None => {
            let mut details = json!({"step": name});
            details["cause"] = failure.details;
            Err(Failure::new(
                &failure.code,
                format!("workflow step {name:?} failed: {}", failure.message),
                details,
            )
            .into())
        }
    }
}

/// Serves a workflow request.
pub async fn run_task(runner: &Runner, call: &Call) -> Result<Produced, RunError> {
    let context = &call.request.context;
    let info = context.workflow_info.clone().unwrap_or_default();
    let path = context
        .task_details
        .as_ref()
        .and_then(|d| d.workflow.clone())
        .or(info.definition.clone())
        .ok_or_else(|| {
            Failure::new(
                "INVALID_TASK",
                "workflow mode needs context.taskDetails.workflow or context.workflowInfo.definition",
                Value::Null,
            )
        })?;
    let text =
        crate::template::load_definition(runner, call, &path, "workflow", "WORKFLOW_NOT_FOUND")
            .await?;
    let def = parse_workflow(&text)?;
    let workflow_id = def.id.clone().unwrap_or_else(|| path.clone());
    if info.execution != Some(WorkflowExecution::Step) {
        let mut state = State::default();
        let mut current = def.start_at.clone();
        loop {
            match advance(runner, call, &def, &current, &mut state).await? {
                Advance::Finished(output) => return Ok(Produced::Value(output)),
                Advance::Next { next, .. } => current = next,
            }
        }
    }
    one_step(runner, call, &def, &info, workflow_id).await
}

/// Step mode: one step per request, the workflow's state kept in the framework between
/// requests (`core.state.getRuntimeValue` / `setRuntimeValue`).
async fn one_step(
    runner: &Runner,
    call: &Call,
    def: &WorkflowDef,
    info: &WorkflowInfo,
    workflow_id: String,
) -> Result<Produced, RunError> {
    let instance = info
        .instance_id
        .clone()
        .unwrap_or_else(|| call.request.request_id.clone());
    let key = format!("workflow:{workflow_id}:{instance}");
    let mut params = call.ids();
    params.insert("key".into(), json!(key));
    let stored = runner
        .mcp(
            call,
            "core.state.getRuntimeValue",
            Value::Object(params.clone()),
        )
        .await?;
    let mut state: State = match stored {
        Value::Null => State::default(),
        stored => serde_json::from_value(stored).map_err(|e| {
            Failure::new(
                "WORKFLOW_STATE_INVALID",
                format!("the stored state of {key:?} cannot be read: {e}"),
                json!({"key": key}),
            )
        })?,
    };
    let current = info
        .current_step
        .clone()
        .or(state.next.clone())
        .unwrap_or_else(|| def.start_at.clone());
    let advanced = advance(runner, call, def, &current, &mut state).await?;
    let (produced, next) = match advanced {
        Advance::Finished(output) => (Produced::Value(output), None),
        Advance::Next { next, failed } => {
            let report = WorkflowStepData {
                workflow_id,
                instance_id: instance,
                step: current.clone(),
                status: if failed { "failed" } else { "succeeded" }.to_owned(),
                output: state.last.clone(),
                next_step: next.clone(),
                steps_executed: state.executed,
            };
            (Produced::Step(report), Some(next))
        }
    };
    state.next = next;
    params.insert(
        "value".into(),
        serde_json::to_value(&state).unwrap_or_default(),
    );
    runner
        .mcp(call, "core.state.setRuntimeValue", Value::Object(params))
        .await?;
    Ok(produced)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BRANCHY: &str = r#"
id: demo
startAt: check
steps:
  check:
    type: jit
    script: check.py
    inputMapping:
      amount: requestData.amount
      fixed: 3
    transitions:
      conditions:
        - when: output.big
          next: review
      onSuccess: done
      onFailure: done
  review:
    type: mcp
    tool: custom.echo
    next: done
  done:
    type: control
    end: true
"#;

    #[test]
    fn a_valid_workflow_parses() {
        let def = parse_workflow(BRANCHY).unwrap();
        assert_eq!(def.start_at, "check");
        assert_eq!(def.steps["check"].transitions.conditions[0].next, "review");
        assert_eq!(
            def.steps["check"].input_mapping.as_ref().unwrap()["fixed"],
            3
        );
    }

    #[test]
    fn broken_workflows_are_refused_with_the_reason() {
        let cases = [
            (
                "startAt: nowhere\nsteps: {}",
                "startAt names an unknown step",
            ),
            (
                "startAt: a\nsteps:\n  a: {type: jit, end: true}",
                "needs a script",
            ),
            (
                "startAt: a\nsteps:\n  a: {type: control}",
                "no transition on success",
            ),
            (
                "startAt: a\nsteps:\n  a: {type: control, next: b}",
                "unknown step \"b\"",
            ),
            (
                "startAt: a\nsteps:\n  a: {type: shell, end: true}",
                "unknown variant",
            ),
        ];
        for (text, why) in cases {
            let error = parse_workflow(text).unwrap_err();
            assert_eq!(error.code, "WORKFLOW_INVALID");
            assert!(error.message.contains(why), "{why}: {}", error.message);
        }
    }

    #[test]
    fn expressions_read_the_scope() {
        let scope = json!({"requestData": {"amount": 120}, "steps": {"a": {"ok": true}}});
        assert_eq!(eval("requestData.amount * 2", &scope).unwrap(), json!(240));
        assert_eq!(eval("steps.a.ok", &scope).unwrap(), json!(true));
        assert_eq!(eval("steps.b", &scope).unwrap(), Value::Null);
        assert!(truthy("requestData.amount > 100", &scope).unwrap());
        assert!(!truthy("steps.missing", &scope).unwrap());
        assert_eq!(
            eval("1 +", &scope).unwrap_err().code,
            "WORKFLOW_EXPRESSION_FAILED"
        );
    }
}
