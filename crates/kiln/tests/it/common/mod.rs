//! Helpers shared by the integration tests.

use std::process::{Command, Stdio};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Whether the Linux tests are skipped (`KILN_SKIP_LINUX=1`), said loudly so a skipped test
/// never passes for a run one (libtest names the thread after the test; scripts/test and
/// .ci/run refuse KILN_SKIP_LINUX).
pub fn skip_linux() -> bool {
    let skip = std::env::var("KILN_SKIP_LINUX").is_ok_and(|v| v == "1");
    if skip {
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        eprintln!("SKIPPED (KILN_SKIP_LINUX=1): {test}");
    }
    skip
}

pub fn chromium() -> Res<&'static str> {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return Ok(name);
        }
    }
    Err("no headless browser: install chromium (scripts/ensure-deps does)".into())
}

/// The page's DOM after its scripts ran (headless Chromium).
pub fn rendered(url: &str) -> Res<String> {
    let profile = tempfile::tempdir()?;
    let output = Command::new(chromium()?)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=15000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

pub mod serve;
