//! A kiln server process a bench starts (this binary: `serve`, `rest` or `runner`), on a
//! free local port, killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::bail;

pub(crate) struct Spawned {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// The folder the bench gave it (data, scripts, its log); removed with it.
    _dir: tempfile::TempDir,
}

impl Drop for Spawned {
    /// Stopped with SIGTERM (a server closes its boxes and sessions), killed if it has not
    /// ended in 10 s.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill sends a signal to the child's pid, which this bench started and has
            // not reaped (try_wait said it still runs).
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Runs this binary with what `configure` adds (the subcommand first, then its flags and
/// environment) plus `--listen 127.0.0.1:PORT`, its stderr to `dir/<name>.log`, and waits
/// (two minutes at most) until `ready` (a path such as `/healthz`) answers 2xx.
pub(crate) fn spawn(
    name: &str,
    dir: tempfile::TempDir,
    ready: &str,
    configure: impl FnOnce(&mut Command),
) -> anyhow::Result<Spawned> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut command = Command::new(std::env::current_exe()?);
    configure(&mut command);
    command
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(
            dir.path().join(format!("{name}.log")),
        )?);
    let spawned = Spawned {
        child: command.spawn()?,
        base: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while ureq::get(&format!("{}{ready}", spawned.base))
        .call()
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("kiln {name} did not become ready");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(spawned)
}

/// The child processes of `pid`, whichever of its threads started them (a replaced worker is
/// started from whichever thread noticed), sorted.
pub(crate) fn children(pid: u32) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|task| {
            std::fs::read_to_string(task.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Resident memory of process `pid` in MiB, one decimal (0 when it is gone).
pub(crate) fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    (kib / 1024.0 * 10.0).round() / 10.0
}

/// A `kiln serve --linux` without keys or rate limits (the Linux benches' server) and a
/// client for it.
pub(crate) struct LinuxServer {
    pub server: Spawned,
    pub agent: ureq::Agent,
}

impl LinuxServer {
    /// Starts one in a fresh folder (its data and state in it); requests time out after
    /// `timeout`.
    pub(crate) fn start(timeout: Duration) -> anyhow::Result<LinuxServer> {
        let dir = tempfile::tempdir()?;
        let data = dir.path().join("data");
        let state = dir.path().join("state");
        let server = spawn("serve", dir, "/readyz", |command| {
            command
                .args(["serve", "--no-auth", "--linux", "--rate-limit", "0"])
                .arg("--data-dir")
                .arg(&data)
                .env("KILN_STATE_DIR", &state);
        })?;
        Ok(LinuxServer {
            server,
            agent: ureq::AgentBuilder::new().timeout(timeout).build(),
        })
    }

    pub(crate) fn base(&self) -> &str {
        &self.server.base
    }

    /// `POST path` with a JSON body: the JSON answer.
    pub(crate) fn post(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<serde_json::Value> {
        use anyhow::Context;
        Ok(self
            .agent
            .post(&format!("{}{path}", self.server.base))
            .send_json(body)
            .with_context(|| format!("POST {path}"))?
            .into_json()?)
    }

    /// `DELETE path`.
    pub(crate) fn delete(&self, path: &str) -> anyhow::Result<()> {
        use anyhow::Context;
        self.agent
            .delete(&format!("{}{path}", self.server.base))
            .call()
            .with_context(|| format!("DELETE {path}"))?;
        Ok(())
    }
}
