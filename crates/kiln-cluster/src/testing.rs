//! A real Postgres for tests and benches (`kiln-cluster`'s own, and the multi-node tests).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Postgres;

/// A Postgres server of its own, for tests and benches: initdb into a temporary folder, a
/// server on a Unix socket there (no TCP), as the `postgres` user when run as root (Postgres
/// refuses root). Stopped (fast shutdown) when dropped.
pub struct Server {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    port: u16,
    child: Child,
}

/// A port of its own for each server of this process (it names the socket file; no TCP is
/// opened), so tests may start servers side by side.
fn next_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 2000) as u16 * 10;
    base + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn bin_dir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    found.sort();
    found.pop().filter(|d| d.join("initdb").exists()).expect(
        "the tests need Postgres (initdb, postgres): scripts/ensure-deps installs the postgresql package",
    )
}

/// `program` as the user Postgres runs as: `postgres` when we are root.
fn as_owner(program: &Path) -> Command {
    if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

impl Server {
    /// Starts one; panics saying what is missing or what the server logged.
    pub fn start() -> Server {
        let bin = bin_dir();
        let dir = tempfile::tempdir().unwrap();
        if running_as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(status.success());
        }
        let data = dir.path().join("data");
        let out = as_owner(&bin.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-U", "kiln", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let socket = dir.path().to_path_buf();
        let port = next_port();
        let log = std::fs::File::create(dir.path().join("postgres.log")).unwrap();
        let child = as_owner(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(&socket)
            .args([
                "-c",
                "listen_addresses=",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=200",
                "-p",
            ])
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.join(format!(".s.PGSQL.{port}")).exists() {
            if Instant::now() > deadline {
                let log =
                    std::fs::read_to_string(dir.path().join("postgres.log")).unwrap_or_default();
                panic!("Postgres did not start in 30 s:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Server {
            _dir: dir,
            socket,
            port,
            child,
        }
    }

    /// Its connection settings, for [`Postgres::connect`].
    pub fn config(&self) -> String {
        format!(
            "host={} port={} user=kiln dbname=postgres connect_timeout=10",
            self.socket.display(),
            self.port
        )
    }

    /// A connection, once the server accepts.
    pub async fn connect(&self) -> Postgres {
        // The socket file appears a moment before the server accepts.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Postgres::connect(&self.config()).await {
                Ok(db) => return db,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("could not connect: {e}"),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGINT to the server itself (its pid heads postmaster.pid; runuser does not pass
        // signals on): Postgres's fast shutdown.
        let pid = std::fs::read_to_string(self._dir.path().join("data/postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next().map(str::to_owned));
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-INT", &pid]).status();
        }
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}
