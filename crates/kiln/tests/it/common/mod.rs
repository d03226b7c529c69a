//! Helpers shared by the integration tests.

use std::process::{Command, Stdio};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

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
