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
    fn drop(&mut self) {
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
