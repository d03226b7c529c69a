//! JIT (interpreter) mode: a function of a script on the shared volume, run in a fresh kiln
//! sandbox with the volume mounted read-only at `/app`.
//!
//! The sandbox runs a small wrapper (Python or JavaScript by the script's extension) that
//! reads `{script, source, function, marker, requestData, context}` from stdin, runs the
//! script's source, calls `function(requestData, context)` and writes the JSON result on a
//! line starting with a per-request random marker, so whatever else the script prints
//! cannot be mistaken for (or forge) the result.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::path::{Component, Path};
use std::sync::atomic::Ordering;

use kiln_core::{ExecRequest, ExecResult, Language, Limits, Mount, Outcome};
use serde_json::{Value, json};

use crate::mcp::tail;
use crate::runner::{Call, Failure, InternalError, Produced, RunError, Runner};

/// Where the shared volume appears inside the sandbox.
pub const GUEST_ROOT: &str = "/app";
/// The function called when a task names none.
pub const DEFAULT_FUNCTION: &str = "handler";
/// The largest script the runner loads.
const MAX_SCRIPT_BYTES: usize = 4 << 20;
/// Bytes of stdout a script may write, its result included.
const STDOUT_BYTES: u64 = 8 << 20;
/// Bytes of stderr kept in a failure's details.
const STDERR_TAIL_BYTES: usize = 2_000;

const PYTHON_WRAPPER: &str = r#"
import sys, json
def _uhlp_main():
    payload = json.loads(sys.stdin.read())
    marker = payload["marker"]
    def report(kind, value):
        sys.stdout.flush()
        sys.stdout.write("\n" + marker + kind + json.dumps(value) + "\n")
        sys.stdout.flush()
    path = payload["script"]
    folder = path.rsplit("/", 1)[0]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    namespace = {"__name__": "uhlp_script", "__file__": path}
    exec(compile(payload["source"], path, "exec"), namespace)
    function = namespace.get(payload["function"])
    if not callable(function):
        report("E", {"code": "FUNCTION_NOT_FOUND", "message": "%s defines no function %s" % (path, payload["function"])})
        return
    result = function(payload["requestData"], payload["context"])
    try:
        text = json.dumps(result)
    except (TypeError, ValueError) as error:
        report("E", {"code": "BAD_OUTPUT", "message": "the result is not JSON: %s" % error})
        return
    sys.stdout.flush()
    sys.stdout.write("\n" + marker + "R" + text + "\n")
    sys.stdout.flush()
_uhlp_main()
del _uhlp_main
"#;

const JAVASCRIPT_WRAPPER: &str = r#"
(function () {
  var payload = JSON.parse(std.in.readAsString());
  var marker = payload.marker;
  function report(kind, value) {
    std.out.flush();
    std.out.puts("\n" + marker + kind + JSON.stringify(value) + "\n");
    std.out.flush();
  }
  std.evalScript(payload.source);
  var fn = globalThis[payload["function"]];
  if (typeof fn !== "function") {
    report("E", {code: "FUNCTION_NOT_FOUND", message: payload.script + " defines no function " + payload["function"]});
    return;
  }
  var text = JSON.stringify(fn(payload.requestData, payload.context));
  if (text === undefined) {
    report("E", {code: "BAD_OUTPUT", message: "the result is not JSON (undefined or a function)"});
    return;
  }
  report("R", JSON.parse(text));
})();
"#;

/// Serves a JIT request: the script is `taskDetails.script`, else `componentId`.
pub async fn run_task(runner: &Runner, call: &Call) -> Result<Produced, RunError> {
    let details = call.task_details();
    let script = details
        .script
        .or_else(|| call.request.context.component_id.clone())
        .ok_or_else(|| {
            Failure::new(
                "INVALID_TASK",
                "no script named: set context.taskDetails.script or context.componentId",
                Value::Null,
            )
        })?;
    let output = run_function(
        runner,
        call,
        &script,
        details.function.as_deref(),
        details.timeout_ms,
        call.request_data(),
    )
    .await?;
    Ok(Produced::Value(output))
}

/// Runs `function` (default [`DEFAULT_FUNCTION`]) of `script` with `input` as its first
/// argument and the request's context as its second, and returns its JSON result.
pub async fn run_function(
    runner: &Runner,
    call: &Call,
    script: &str,
    function: Option<&str>,
    timeout_ms: Option<u64>,
    input: Value,
) -> Result<Value, RunError> {
    let root = runner.config.scripts.as_deref().ok_or_else(|| {
        Failure::new(
            "SCRIPT_NOT_FOUND",
            format!("no shared volume is configured (--scripts / UHLP_SHARED_VOLUME), so {script:?} cannot be found"),
            json!({"script": script}),
        )
    })?;
    let (relative, language) = resolve_script(root, script)?;
    let function = function.unwrap_or(DEFAULT_FUNCTION);
    if !is_identifier(function) {
        return Err(Failure::new(
            "FUNCTION_NOT_FOUND",
            format!("{function:?} is not a function name"),
            json!({"script": script, "function": function}),
        )
        .into());
    }
    // The host reads the script (it resolved the path already): the sandbox's first file
    // access costs milliseconds, and most scripts then need none. The volume is still
    // mounted for imports and data files.
    let source = read_source(root, &relative, script).await?;
    let marker = marker();
    let guest_path = format!("{GUEST_ROOT}/{relative}");
    let payload = json!({
        "script": guest_path,
        "source": source,
        "function": function,
        "marker": marker,
        "requestData": input,
        "context": call.context(),
    });
    let wrapper = match language {
        Language::Python => PYTHON_WRAPPER,
        Language::JavaScript => JAVASCRIPT_WRAPPER,
        other => {
            return Err(Failure::new(
                "SCRIPT_NOT_FOUND",
                format!("{other} scripts are not run by the runner; use .py or .js"),
                json!({"script": script}),
            )
            .into());
        }
    };
    let mut request = ExecRequest::new(language, wrapper);
    request.stdin = payload.to_string().into_bytes();
    request.mounts = vec![Mount {
        host: root.to_path_buf(),
        guest: GUEST_ROOT.to_owned(),
        writable: false,
    }];
    request.limits = Limits {
        timeout_ms: timeout_ms
            .unwrap_or(runner.config.timeout_ms)
            .clamp(1, runner.config.timeout_ms),
        memory_bytes: runner.config.memory_bytes,
        stdout_bytes: STDOUT_BYTES,
        ..Limits::default()
    };
    let limits = request.limits.clone();
    let result = runner
        .executors
        .run_once(request)
        .await
        .map_err(|e| RunError::Internal(InternalError::Executor(e)))?;
    call.sandbox_us
        .fetch_add(result.duration_us, Ordering::Relaxed);
    read_result(&result, &limits, &marker, script).map_err(RunError::Failed)
}

/// Reads a script's source (at most [`MAX_SCRIPT_BYTES`], UTF-8) at `relative` (resolved by
/// [`resolve_script`], so it holds no links) under the volume `root`. The read goes through
/// [`kiln_workspace`]: a link or fifo swapped in since is refused, never followed or opened.
async fn read_source(root: &Path, relative: &str, script: &str) -> Result<String, Failure> {
    let failed = |why: String| {
        Failure::new(
            "SCRIPT_NOT_FOUND",
            format!("{script} cannot be read: {why}"),
            json!({"script": script}),
        )
    };
    let (root, relative) = (root.to_path_buf(), relative.to_owned());
    let bytes = tokio::task::spawn_blocking(move || {
        let root = root.canonicalize().map_err(|e| e.to_string())?;
        let tree = kiln_workspace::Tree::open(&root, None).map_err(|e| e.to_string())?;
        let rel = kiln_workspace::RelPath::parse(&relative).map_err(|e| e.to_string())?;
        let (file, meta) = tree.open_file(&rel).map_err(|e| e.to_string())?;
        if meta.size > MAX_SCRIPT_BYTES as u64 {
            return Err(format!("it is larger than {MAX_SCRIPT_BYTES} bytes"));
        }
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(
            &mut std::io::Read::take(file, MAX_SCRIPT_BYTES as u64 + 1),
            &mut bytes,
        )
        .map_err(|e| e.to_string())?;
        Ok(bytes)
    })
    .await
    .map_err(|e| failed(e.to_string()))?
    .map_err(failed)?;
    if bytes.len() > MAX_SCRIPT_BYTES {
        return Err(failed(format!(
            "it is larger than {MAX_SCRIPT_BYTES} bytes"
        )));
    }
    String::from_utf8(bytes).map_err(|_| failed("it is not UTF-8 text".to_owned()))
}

/// Reads the wrapper's report from a finished sandbox.
fn read_result(
    result: &ExecResult,
    limits: &Limits,
    marker: &str,
    script: &str,
) -> Result<Value, Failure> {
    let stderr = result.stderr_text();
    let details = |extra: Value| {
        let mut details = json!({
            "script": script,
            "exitCode": result.exit_code,
            "stderrTail": tail(&stderr, STDERR_TAIL_BYTES),
        });
        if let (Value::Object(details), Value::Object(extra)) = (&mut details, extra) {
            details.extend(extra);
        }
        details
    };
    let code = match result.outcome {
        Outcome::TimedOut => Some("TIMEOUT"),
        Outcome::MemoryLimit => Some("MEMORY_LIMIT"),
        Outcome::Crashed { .. } => Some("SANDBOX_CRASHED"),
        Outcome::FuelExhausted => Some("FUEL_EXHAUSTED"),
        Outcome::Completed | Outcome::OutputTruncated => None,
    };
    if let Some(code) = code {
        let reason = result.outcome.reason(limits).unwrap_or_default();
        return Err(Failure::new(
            code,
            format!("{script}: {reason}"),
            details(Value::Null),
        ));
    }
    let stdout = result.stdout_text();
    let report = stdout
        .rfind(&format!("\n{marker}"))
        .map(|at| &stdout[at + 1 + marker.len()..])
        .and_then(|rest| rest.split_once('\n').map(|(line, _)| line));
    if result.exit_code != 0 {
        return Err(Failure::new(
            "SCRIPT_FAILED",
            format!("{script} failed with exit code {}", result.exit_code),
            details(Value::Null),
        ));
    }
    let Some(report) = report else {
        let message = if result.stdout_truncated {
            format!(
                "{script} printed more than {} bytes, so its result was lost",
                limits.stdout_bytes
            )
        } else {
            format!("{script} ended without a result")
        };
        return Err(Failure::new(
            "BAD_OUTPUT",
            message,
            details(json!({"stdoutTail": tail(&stdout, STDERR_TAIL_BYTES)})),
        ));
    };
    read_report(report, script, details)
}

/// The wrapper's report line (after the marker): `R` and the result, or `E` and the
/// script's error; `details` gives a failure's details.
fn read_report(
    report: &str,
    script: &str,
    details: impl Fn(Value) -> Value,
) -> Result<Value, Failure> {
    let (kind, text) = report.split_at(report.len().min(1));
    let parsed: Result<Value, _> = serde_json::from_str(text);
    match (kind, parsed) {
        ("R", Ok(value)) => Ok(value),
        ("E", Ok(error)) => {
            let code = error["code"].as_str().unwrap_or("SCRIPT_FAILED");
            let message = error["message"].as_str().unwrap_or_default();
            Err(Failure::new(code, message, details(Value::Null)))
        }
        (_, parsed) => Err(Failure::new(
            "BAD_OUTPUT",
            format!(
                "{script}: the result could not be read ({})",
                parsed
                    .err()
                    .map_or("bad marker".to_owned(), |e| e.to_string())
            ),
            details(json!({"output": tail(text, STDERR_TAIL_BYTES)})),
        )),
    }
}

/// A marker no script can guess: 128 random bits.
fn marker() -> String {
    let a = RandomState::new().hash_one(std::time::Instant::now());
    let b = RandomState::new().hash_one(std::thread::current().id());
    format!("@@uhlp-result-{a:016x}{b:016x}@@")
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
        && name.len() <= 128
}

/// Finds a script under `root`: `name` itself when it ends in `.py`/`.js`/`.mjs`, else
/// `name.py` then `name.js`. Names with `..`, an absolute path, a backslash or odd
/// characters are refused, and so is a file that resolves outside `root` (a symlink).
pub fn resolve_script(root: &Path, name: &str) -> Result<(String, Language), Failure> {
    let refuse = |why: &str| {
        Failure::new(
            "INVALID_SCRIPT_NAME",
            format!("the script name {name:?} is refused: {why}"),
            json!({"script": name}),
        )
    };
    if name.is_empty() || name.len() > 512 {
        return Err(refuse("it must have 1 to 512 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '-' | '.'))
    {
        return Err(refuse(
            "only letters, digits, '/', '_', '-' and '.' are allowed",
        ));
    }
    let path = Path::new(name);
    if !path.components().all(|c| matches!(c, Component::Normal(_))) || name.ends_with('/') {
        return Err(refuse("it must be a relative path without '..' or '.'"));
    }
    // Scripts are Python or JavaScript (what the runner's sandboxes run).
    let language_of = |p: &Path| Language::from_path(p).filter(|l| l.is_wasm());
    let candidates: Vec<String> = match language_of(path) {
        Some(_) => vec![name.to_owned()],
        None => vec![format!("{name}.py"), format!("{name}.js")],
    };
    let canonical_root = root.canonicalize().map_err(|e| {
        Failure::new(
            "SCRIPT_NOT_FOUND",
            format!("the shared volume {} cannot be read: {e}", root.display()),
            json!({"script": name}),
        )
    })?;
    for candidate in &candidates {
        let Ok(file) = root.join(candidate).canonicalize() else {
            continue;
        };
        if !file.starts_with(&canonical_root) {
            return Err(refuse("it resolves outside the shared volume"));
        }
        if !file.is_file() {
            continue;
        }
        let Some(language) = language_of(&file) else {
            continue;
        };
        // The guest sees the volume, not the host's resolved path: use the resolved
        // location relative to the volume so a link inside the volume still works.
        let relative = file
            .strip_prefix(&canonical_root)
            .map_err(|_| refuse("it resolves outside the shared volume"))?;
        let relative = relative.to_str().ok_or_else(|| refuse("not UTF-8"))?;
        return Ok((relative.to_owned(), language));
    }
    Err(Failure::new(
        "SCRIPT_NOT_FOUND",
        format!("no script {name:?} on the shared volume"),
        json!({"script": name, "tried": candidates}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_names_resolve_inside_the_volume_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("orders")).unwrap();
        std::fs::write(dir.path().join("orders/create.py"), "").unwrap();
        std::fs::write(dir.path().join("hello.js"), "").unwrap();
        let resolve = |name: &str| resolve_script(dir.path(), name);
        assert_eq!(
            resolve("orders/create").unwrap(),
            ("orders/create.py".to_owned(), Language::Python)
        );
        assert_eq!(
            resolve("hello").unwrap(),
            ("hello.js".to_owned(), Language::JavaScript)
        );
        for hostile in [
            "../etc/passwd",
            "/etc/passwd",
            "orders/../../x",
            "./hello",
            "a\\b",
            "",
            "x\0y",
        ] {
            assert_eq!(
                resolve(hostile).unwrap_err().code,
                "INVALID_SCRIPT_NAME",
                "{hostile}"
            );
        }
        assert_eq!(resolve("missing").unwrap_err().code, "SCRIPT_NOT_FOUND");
        assert_eq!(resolve("orders").unwrap_err().code, "SCRIPT_NOT_FOUND");
    }

    #[test]
    fn symlinks_out_of_the_volume_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.py"), "").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret.py"), dir.path().join("s.py"))
            .unwrap();
        assert_eq!(
            resolve_script(dir.path(), "s").unwrap_err().code,
            "INVALID_SCRIPT_NAME"
        );
    }

    #[test]
    fn function_names_are_identifiers() {
        assert!(is_identifier("handler"));
        assert!(is_identifier("_main2"));
        assert!(!is_identifier("os.system"));
        assert!(!is_identifier("1x"));
        assert!(!is_identifier(""));
    }
}
