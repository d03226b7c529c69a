//! Issue 32 §3: rich results (a final expression's value, `display(...)`, matplotlib
//! figures) in every Python execution of code, one-shot or session, and a session's value
//! no longer printed on stdout too. Each test failed on the main the issue was filed
//! against.

use serde_json::{Value, json};

use crate::common::serve::*;

/// The run's results (none: an empty list).
fn results(ran: &Value) -> Vec<Value> {
    ran["results"].as_array().cloned().unwrap_or_default()
}

fn is_png(result: &Value) -> bool {
    result["data"]["image/png"]
        .as_str()
        .is_some_and(|png| png.starts_with("iVBORw0KGgo"))
}

#[test]
fn issue32_a_one_shot_exec_returns_its_value_figures_and_displays() -> TestResult {
    let server = start(Options::default())?;
    let id = server.new_sandbox("python")?;

    // Before: no PNG came back from `plt.show()` without Agg's warning on stderr.
    let (status, plot) = server.exec(
        &id,
        json!({"code": "import matplotlib.pyplot as plt\nplt.plot([1,2])\nplt.show()"}),
    )?;
    assert_eq!(
        (status, plot["status"].as_str()),
        (200, Some("success")),
        "{plot}"
    );
    let shown = results(&plot);
    assert_eq!(shown.len(), 1, "{plot}");
    assert!(is_png(&shown[0]) && shown[0]["main"] == false, "{plot}");
    assert_eq!(plot["stderr"], "", "{plot}");

    // Before: no result, as `python -c`; now the value is the main result, still not
    // printed.
    let (_, value) = server.exec(&id, json!({"code": "x = 6\nx * 7"}))?;
    assert_eq!(value["stdout"], "", "{value}");
    assert_eq!(
        results(&value),
        [json!({"main": true, "data": {"text/plain": "42"}})],
        "{value}"
    );

    // Before: a NameError.
    let (_, displayed) = server.exec(&id, json!({"code": "display({'a': 1})"}))?;
    assert_eq!(displayed["status"], "success", "{displayed}");
    assert_eq!(
        results(&displayed),
        [json!({"main": false, "data": {"text/plain": "{'a': 1}"}})],
        "{displayed}"
    );

    // Code that shows nothing is as it was.
    let (_, printed) = server.exec(&id, json!({"code": "print(1)"}))?;
    assert_eq!(printed["stdout"], "1\n", "{printed}");
    assert!(printed.get("results").is_none(), "{printed}");

    // Seed 003's exec of a script: `plt.show()` shows its figure, without the warning.
    let (status, ran) = server.call(
        "POST",
        "/api/sandbox/exec",
        Some(json!({"containerId": id, "command": ["python", "plot.py"], "files": {
            "plot.py": "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])\nplt.show()\n"
        }})),
    )?;
    assert_eq!(status, 200, "{ran}");
    let shown = results(&ran);
    assert!(shown.len() == 1 && is_png(&shown[0]), "{ran}");
    assert!(
        !ran["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("non-interactive"),
        "{ran}"
    );
    Ok(())
}

#[test]
fn issue32_a_session_value_is_a_result_not_a_line_of_stdout() -> TestResult {
    let server = start(Options::default())?;
    let id = server.new_sandbox("python")?;
    let (status, session) = server.call(
        "POST",
        &format!("/api/v1/sandboxes/{id}/sessions"),
        Some(json!({})),
    )?;
    assert_eq!(status, 201, "{session}");
    let sid = session["sessionId"].as_str().ok_or("no sessionId")?;
    // Before: stdout was "2\n" besides the result (E2B's `run_code` prints nothing).
    let (_, turn) = server.exec(&id, json!({"code": "1 + 1", "sessionId": sid}))?;
    assert_eq!(turn["stdout"], "", "{turn}");
    assert_eq!(
        results(&turn),
        [json!({"main": true, "data": {"text/plain": "2"}})],
        "{turn}"
    );
    Ok(())
}

/// `kiln exec` stays `python -c`: a final value is neither printed nor mentioned (the JSON
/// result has it).
#[test]
fn issue32_kiln_exec_stays_python_c_with_a_final_value() -> TestResult {
    let out = kiln().args(["exec", "-c", "x = 6\nx * 7"]).output()?;
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8(out.stdout)?,
            String::from_utf8(out.stderr)?
        ),
        (Some(0), String::new(), String::new())
    );
    let out = kiln()
        .args(["exec", "--json", "-c", "x = 6\nx * 7"])
        .output()?;
    let ran: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(ran["stdout"], "", "{ran}");
    assert_eq!(
        results(&ran),
        [json!({"main": true, "data": {"text/plain": "42"}})],
        "{ran}"
    );
    Ok(())
}
