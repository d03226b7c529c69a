//! `kiln bench --only interactive`: a Linux sandbox through a real `kiln serve --linux`
//! (this binary, no keys): a terminal keystroke's echo over its WebSocket, a preview's first
//! byte of a small page from `python3 -m http.server` and a large file's rate, pause and
//! resume, and hibernation and the first command after it, through the API, each as a client
//! sees it.

use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::bench::{Report, micros, summary};
use crate::bench_child::LinuxServer;

pub(crate) fn run(n: usize, report: &mut Report) -> anyhow::Result<()> {
    // SAFETY: geteuid(2) takes no arguments, touches no memory of ours and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        report.insert(
            "interactive".into(),
            json!({"skipped": "Linux boxes need kiln to run as root"}),
        );
        return Ok(());
    }
    let linux = LinuxServer::start(Duration::from_secs(60))?;
    let base = linux.base().to_owned();
    let agent = linux.agent.clone();
    let post = |path: &str, body: Value| linux.post(path, body);
    let created = post("/api/v1/sandboxes", json!({"template": "linux-python"}))?;
    let id = created["containerId"]
        .as_str()
        .context("no sandbox id")?
        .to_string();
    post(
        &format!("/api/v1/sandboxes/{id}/exec"),
        json!({"command": ["sh", "-c",
            "echo hello > small.html; head -c 67108864 /dev/zero > big.bin; python3 -m http.server 8000 >/dev/null 2>&1 &"]}),
    )?;

    // A keystroke's echo: one character typed, until the shell's echo of it comes back.
    let terminal = post(&format!("/api/v1/sandboxes/{id}/terminals"), json!({}))?;
    let tid = terminal["terminalId"].as_str().context("no terminal")?;
    let url = format!("{base}/api/v1/sandboxes/{id}/terminals/{tid}?offset=999999999")
        .replace("http://", "ws://");
    let (mut socket, _) = tungstenite::connect(url.as_str())?;
    let read_until = |socket: &mut tungstenite::WebSocket<_>, byte: u8| -> anyhow::Result<()> {
        loop {
            if let tungstenite::Message::Binary(data) = socket.read()?
                && data.contains(&byte)
            {
                return Ok(());
            }
        }
    };
    // The shell's first answer, read whole, so no old output is taken for an echo.
    socket.send(tungstenite::Message::Binary(
        b"echo $((40+2))ready\r".to_vec().into(),
    ))?;
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("42ready") {
        if let tungstenite::Message::Binary(data) = socket.read()? {
            seen.extend_from_slice(&data);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut echoes = Vec::new();
    for i in 0..n.clamp(20, 300) + 5 {
        // Letters in turn, the line cleared now and then (Ctrl-U), so each echo is new.
        let key = b'a' + (i % 26) as u8;
        let t = Instant::now();
        socket.send(tungstenite::Message::Binary(vec![key].into()))?;
        read_until(&mut socket, key)?;
        if i >= 5 {
            echoes.push(micros(t.elapsed()));
        }
        if i % 40 == 39 {
            socket.send(tungstenite::Message::Binary(vec![0x15].into()))?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    report.insert("interactive_terminal_echo".into(), summary(echoes));
    drop(socket);

    // Previews, through kiln's HTTP layer and the agent's connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent
        .get(&format!("{base}/preview/{id}/8000/small.html"))
        .call()
        .is_err()
    {
        anyhow::ensure!(Instant::now() < deadline, "the box's server never answered");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut first = Vec::new();
    for i in 0..n.clamp(20, 300) + 5 {
        let t = Instant::now();
        let response = agent
            .get(&format!("{base}/preview/{id}/8000/small.html"))
            .call()?;
        let mut body = Vec::new();
        response.into_reader().read_to_end(&mut body)?;
        anyhow::ensure!(body == b"hello\n", "the page came back as {body:?}");
        if i >= 5 {
            first.push(micros(t.elapsed()));
        }
    }
    report.insert("interactive_preview_small_page".into(), summary(first));
    let mut rates = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let response = agent
            .get(&format!("{base}/preview/{id}/8000/big.bin"))
            .call()?;
        let mut reader = response.into_reader();
        let (mut total, mut buf) = (0usize, vec![0u8; 256 << 10]);
        loop {
            let got = reader.read(&mut buf)?;
            if got == 0 {
                break;
            }
            total += got;
        }
        anyhow::ensure!(total == 64 << 20, "the file came back with {total} bytes");
        rates.push(total as f64 / t.elapsed().as_secs_f64() / 1e6);
    }
    rates.sort_by(f64::total_cmp);
    report.insert(
        "interactive_preview_large_file".into(),
        json!({"mib": 64, "median_mb_s": (rates[rates.len() / 2] * 10.0).round() / 10.0}),
    );

    // Pause and resume as the API answers them (the box runs the dev server).
    let (mut pauses, mut resumes) = (Vec::new(), Vec::new());
    for i in 0..n.clamp(20, 200) + 3 {
        let t = Instant::now();
        let paused = post(&format!("/api/v1/sandboxes/{id}/pause"), json!({}))?;
        let took = t.elapsed();
        anyhow::ensure!(paused["state"] == "paused", "{paused}");
        let t = Instant::now();
        let resumed = post(&format!("/api/v1/sandboxes/{id}/resume"), json!({}))?;
        anyhow::ensure!(resumed["state"] == "running", "{resumed}");
        if i >= 3 {
            pauses.push(micros(took));
            resumes.push(micros(t.elapsed()));
        }
    }
    report.insert("interactive_pause".into(), summary(pauses));
    report.insert("interactive_resume".into(), summary(resumes));

    // Hibernation (the box checkpointed with CRIU where it can, and closed; its files kept)
    // and the first command after it, which restores the box from its checkpoint (or starts
    // one from the files). The dev server still answering after it says which happened.
    // A process holding 100 MiB of memory it wrote, for the checkpoint to carry.
    post(
        &format!("/api/v1/sandboxes/{id}/exec"),
        json!({"command": ["sh", "-c",
            "python3 -c 'import time; x = b\"k\" * (100 << 20); time.sleep(86400)' >/dev/null 2>&1 &"]}),
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let (mut sleeps, mut wakes) = (Vec::new(), Vec::new());
    let mut said = String::new();
    for _ in 0..10 {
        let t = Instant::now();
        let slept = post(&format!("/api/v1/sandboxes/{id}/hibernate"), json!({}))?;
        anyhow::ensure!(slept["state"] == "hibernated", "{slept}");
        sleeps.push(micros(t.elapsed()));
        said = slept["processes"].as_str().unwrap_or_default().to_string();
        let t = Instant::now();
        let ran = post(
            &format!("/api/v1/sandboxes/{id}/exec"),
            json!({"command": ["cat", "small.html"]}),
        )?;
        anyhow::ensure!(ran["stdout"] == "hello\n", "{ran}");
        wakes.push(micros(t.elapsed()));
    }
    let served = agent
        .get(&format!("{base}/preview/{id}/8000/small.html"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok());
    report.insert(
        "interactive_hibernation".into(),
        json!({
            "said": said,
            "dev_server_survived": served.as_deref() == Some("hello\n"),
        }),
    );
    report.insert("interactive_hibernate".into(), summary(sleeps));
    report.insert(
        "interactive_first_command_after_hibernation".into(),
        summary(wakes),
    );
    drop(linux);
    Ok(())
}
