//! Domain types shared by every part of kiln: what to run ([`ExecRequest`]), within which
//! bounds ([`Limits`]), and what came of it ([`ExecResult`], [`Outcome`]).
//!
//! ```
//! use kiln_core::{ExecRequest, Language, Limits};
//!
//! let request = ExecRequest::new(Language::Python, "print(1 + 1)");
//! assert_eq!(request.limits, Limits::default());
//! assert_eq!(request.limits.timeout_ms, 30_000);
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod backend;
pub mod jail;
pub mod net;
pub mod pool;
pub mod process;
pub mod template;

/// Where a guest sees its workspace unless a request says otherwise.
pub const WORKSPACE_GUEST: &str = "/workspace";

/// Whether `path` may be where a guest sees its workspace: absolute, normalised (no `.`,
/// `..` or empty parts), not `/`, at most 256 bytes, no NUL.
pub fn valid_workspace_at(path: &str) -> bool {
    path.len() <= 256
        && path.len() > 1
        && path.starts_with('/')
        && !path.contains('\0')
        && path[1..]
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

/// A language kiln can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// CPython 3.15 on WebAssembly, with numpy, pandas, scipy, scikit-learn and matplotlib.
    Python,
    /// QuickJS-NG on WebAssembly (ES2023, no Node.js APIs); Node.js on Linux templates.
    #[serde(alias = "js")]
    JavaScript,
    /// Go, compiled and run with `go run` (Linux templates only).
    Go,
    /// A bash script (Linux templates only).
    Bash,
}

impl Language {
    /// Every language, in a stable order.
    pub const ALL: [Language; 4] = [
        Language::Python,
        Language::JavaScript,
        Language::Go,
        Language::Bash,
    ];

    /// The languages the WebAssembly backend runs (its runtimes are fetched for these).
    pub const WASM: [Language; 2] = [Language::Python, Language::JavaScript];

    /// The language's canonical name, as accepted by [`Language::from_name`].
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::JavaScript => "javascript",
            Language::Go => "go",
            Language::Bash => "bash",
        }
    }

    /// Parses a language name: `python`, `py`, `javascript`, `js`, `go`, `bash`, `sh` (any
    /// case).
    pub fn from_name(name: &str) -> Option<Language> {
        match name.to_ascii_lowercase().as_str() {
            "python" | "py" | "python3" => Some(Language::Python),
            "javascript" | "js" | "node" | "quickjs" => Some(Language::JavaScript),
            "go" | "golang" => Some(Language::Go),
            "bash" | "sh" | "shell" => Some(Language::Bash),
            _ => None,
        }
    }

    /// The smallest memory limit the runtime starts with (Python's snapshot alone is 40 MiB).
    pub fn min_memory_bytes(self) -> u64 {
        match self {
            Language::Python | Language::Go => 64 << 20,
            Language::JavaScript | Language::Bash => 16 << 20,
        }
    }

    /// Whether the WebAssembly backend runs it.
    pub fn is_wasm(self) -> bool {
        Language::WASM.contains(&self)
    }

    /// Chooses a language from a file name's extension: `.py`, `.js`/`.mjs`, `.go`, `.sh`.
    pub fn from_path(path: &std::path::Path) -> Option<Language> {
        match path.extension()?.to_str()? {
            "py" => Some(Language::Python),
            "js" | "mjs" | "cjs" => Some(Language::JavaScript),
            "go" => Some(Language::Go),
            "sh" | "bash" => Some(Language::Bash),
            _ => None,
        }
    }

    /// The file extension of a program in this language.
    pub fn extension(self) -> &'static str {
        match self {
            Language::Python => "py",
            Language::JavaScript => "js",
            Language::Go => "go",
            Language::Bash => "sh",
        }
    }
}

impl std::fmt::Display for Language {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bounds on one execution (or one session turn). Every execution is bounded; the defaults
/// suit code an LLM wrote and a person waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Wall-clock deadline in milliseconds, including time spent blocked (`time.sleep`).
    /// Default 30 000.
    pub timeout_ms: u64,
    /// Cap on the guest's linear memory in bytes. Default 512 MiB. Python sees a
    /// `MemoryError` when it would go over; JavaScript an out-of-memory exception.
    pub memory_bytes: u64,
    /// Bytes of stdout kept; the rest is dropped and the result is flagged truncated.
    /// Default 1 MiB.
    pub stdout_bytes: u64,
    /// Bytes of stderr kept, as for stdout. Default 1 MiB.
    pub stderr_bytes: u64,
    /// Bytes the guest may write to files (workspace and `/tmp`) during the execution,
    /// counted as written (an overwrite counts again), plus the holes a write past a file's
    /// end leaves and the growth of a file made longer by truncation (so a sparse file cannot
    /// outgrow it). Writes beyond it fail with `ENOSPC`. Default 64 MiB.
    pub fs_write_bytes: u64,
    /// Files and directories the guest may create during the execution. Default 1 000.
    pub fs_create_count: u64,
    /// An instruction budget in fuel units (about one per WebAssembly instruction, see
    /// [`MAX_FUEL`]): the guest stops with [`Outcome::FuelExhausted`] when it is spent, at
    /// the same point on every run of the same code, whatever the machine's load. Time
    /// blocked in the host (`time.sleep`) costs none, so the deadline still holds too.
    /// Default `None`: no budget, only the deadline (the fast path: runtimes compiled
    /// with fuel run slower and are compiled, once, on first use). WebAssembly only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuel: Option<u64>,
    /// For a session turn: how many bytes the turn may add to the session's memory (the
    /// room left under its tenant's session memory quota), within the session's own cap.
    /// Growing past it fails as growing past the cap does (`MemoryError`). `None`: only
    /// the cap. WebAssembly sessions only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_growth_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout_ms: 30_000,
            memory_bytes: 512 << 20,
            stdout_bytes: 1 << 20,
            stderr_bytes: 1 << 20,
            fs_write_bytes: 64 << 20,
            fs_create_count: 1_000,
            fuel: None,
            session_growth_bytes: None,
        }
    }
}

impl Limits {
    /// The deadline as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Checks the limits are usable: nothing zero, memory within what a 32-bit guest can
    /// address (4 GiB).
    pub fn validate(&self) -> Result<(), LimitsError> {
        if self.timeout_ms == 0 {
            return Err(LimitsError::ZeroTimeout);
        }
        if self.timeout_ms > 24 * 3600 * 1000 {
            return Err(LimitsError::TimeoutTooLong {
                timeout_ms: self.timeout_ms,
            });
        }
        if self.memory_bytes < 16 << 20 || self.memory_bytes > 4 << 30 {
            return Err(LimitsError::MemoryOutOfRange {
                memory_bytes: self.memory_bytes,
            });
        }
        for (stream, bytes) in [("stdout", self.stdout_bytes), ("stderr", self.stderr_bytes)] {
            if bytes > MAX_OUTPUT_BYTES {
                return Err(LimitsError::OutputTooLarge { stream, bytes });
            }
        }
        if let Some(fuel) = self.fuel
            && !(1..=MAX_FUEL).contains(&fuel)
        {
            return Err(LimitsError::FuelOutOfRange { fuel });
        }
        Ok(())
    }
}

/// The largest instruction budget ([`Limits::fuel`]) a request may ask for: 10^12 units,
/// about a minute of Python busy looping on the development machine (which spends 1.5 to
/// 2 x 10^10 units a second), so a deadline usually stops such a run first.
pub const MAX_FUEL: u64 = 1_000_000_000_000;

/// The largest output cap a request may ask for, per stream: 16 MiB.
pub const MAX_OUTPUT_BYTES: u64 = 16 << 20;
/// The largest stdin a request may carry: 16 MiB.
pub const MAX_STDIN_BYTES: usize = 16 << 20;
/// The most environment variables a request may grant, and their total size in bytes.
pub const MAX_ENV_VARS: usize = 1_000;
pub const MAX_ENV_BYTES: usize = 1 << 20;
/// The most directories a request may grant.
pub const MAX_MOUNTS: usize = 64;

/// Limits that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// the timeout must be greater than zero
    #[error("the timeout must be greater than zero")]
    ZeroTimeout,
    /// the timeout may be at most 24 hours
    #[error("the timeout of {timeout_ms} ms is longer than the maximum of 24 hours")]
    TimeoutTooLong { timeout_ms: u64 },
    /// memory must lie between 16 MiB and 4 GiB
    #[error("a memory limit of {memory_bytes} bytes is outside 16 MiB..=4 GiB")]
    MemoryOutOfRange { memory_bytes: u64 },
    /// an output cap above the maximum
    #[error("a {stream} cap of {bytes} bytes is above the maximum of 16 MiB")]
    OutputTooLarge { stream: &'static str, bytes: u64 },
    /// an instruction budget of zero or above the maximum
    #[error("an instruction budget (fuel) of {fuel} is outside 1..=1000000000000")]
    FuelOutOfRange { fuel: u64 },
}

/// Parses a size such as `512m`, `1g`, `64k`, `100` (bytes); units are binary and
/// case-insensitive (`k`/`kb`/`kib`, `m`…, `g`…). The error says what was wrong.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let at = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = (&text[..at], &text[at..]);
    let value: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 64k, 512m or 1g"))?;
    let factor: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use k, m or g)")),
    };
    value
        .checked_mul(factor)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// A host directory granted to the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    /// The directory on the host.
    pub host: PathBuf,
    /// Where the guest sees it: an absolute path such as `/data`.
    pub guest: String,
    /// Whether the guest may create, change and delete files in it (within the file quota).
    pub writable: bool,
}

/// One execution: code, its input, and what it may touch.
///
/// Deny by default: with only `language` and `code` set, the guest sees no host files but a
/// private empty `/tmp`, no environment variables but the runtime's own, no network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Which runtime runs the code.
    pub language: Language,
    /// Source code to run.
    pub code: String,
    /// Bytes the guest reads on stdin (then end of file). Base64 in JSON.
    #[serde(default, with = "base64_bytes")]
    pub stdin: Vec<u8>,
    /// Environment variables the guest sees, besides the runtime's own (`HOME`, `TMPDIR`).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// A host directory the guest sees read-write at `/workspace` (or [`Self::workspace_at`]),
    /// which is also its working directory.
    #[serde(default)]
    pub workspace: Option<PathBuf>,
    /// Where the guest sees the workspace; `None`: `/workspace`. (E2B's sandboxes keep it
    /// at `/home/user`.) An absolute, normalised path other than `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_at: Option<String>,
    /// Further host directories granted to the guest.
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// Bounds on time, memory, output and files.
    #[serde(default)]
    pub limits: Limits,
    /// The template to run in (see [`template`]); `None`: the language's own template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// A command to run instead of `code`, where the template can run commands
    /// ([`template::Capabilities::commands`]); others refuse it as unsupported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Command>,
    /// The sandbox's network (Linux templates; WebAssembly guests have none at all).
    #[serde(default, skip_serializing_if = "Network::is_none")]
    pub network: Network,
    /// The sandbox's own egress rules, within the operator's list (with a network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<net::EgressGrant>,
    /// The live box's resources (Linux templates); `None`: the template's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<template::Resources>,
    /// What becomes of the sandbox's live box when nothing uses it (Linux templates), where
    /// the sandbox chose otherwise than the backend's default.
    #[serde(default, skip_serializing_if = "process::IdleOverrides::is_default")]
    pub idle: process::IdleOverrides,
}

/// A sandbox's network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// Only the sandbox's own loopback: no route, no DNS.
    #[default]
    None,
    /// The host names on the server's allowlist, through its proxy (Linux templates).
    Allowlist,
}

impl Network {
    pub fn is_none(&self) -> bool {
        *self == Network::None
    }

    /// Parses `none` or `allowlist`.
    pub fn from_name(name: &str) -> Option<Network> {
        match name {
            "none" => Some(Network::None),
            "allowlist" => Some(Network::Allowlist),
            _ => None,
        }
    }
}

/// A program given as an argv, as a shell would run it after word splitting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Command {
    /// The program and its arguments; never empty.
    pub argv: Vec<String>,
    /// The working directory inside the sandbox; default the workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// A terminal of this size, where the template has terminals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terminal: Option<TerminalSize>,
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalSize {
    pub rows: u16,
    pub cols: u16,
}

/// What an execution runs: code in a language, or a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program<'a> {
    Code { language: Language, source: &'a str },
    Command(&'a Command),
}

impl ExecRequest {
    /// A request with no input, no grants and default limits.
    pub fn new(language: Language, code: impl Into<String>) -> ExecRequest {
        ExecRequest {
            language,
            code: code.into(),
            stdin: Vec::new(),
            env: Vec::new(),
            workspace: None,
            workspace_at: None,
            mounts: Vec::new(),
            limits: Limits::default(),
            template: None,
            command: None,
            network: Network::None,
            egress: None,
            resources: None,
            idle: process::IdleOverrides::default(),
        }
    }

    /// Where the guest sees its workspace: [`Self::workspace_at`] or `/workspace`.
    pub fn workspace_guest(&self) -> &str {
        self.workspace_at.as_deref().unwrap_or(WORKSPACE_GUEST)
    }

    /// What the request runs: its command if it has one, else its code.
    pub fn program(&self) -> Program<'_> {
        match &self.command {
            Some(command) => Program::Command(command),
            None => Program::Code {
                language: self.language,
                source: &self.code,
            },
        }
    }
}

/// How an execution ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    /// The guest ran to its end; see the exit code.
    Completed,
    /// The guest ran to its end but wrote more output than the caps allow; the rest was
    /// dropped.
    OutputTruncated,
    /// The deadline passed; the guest was stopped.
    TimedOut,
    /// The guest needed more memory than its cap.
    MemoryLimit,
    /// The guest trapped (a WebAssembly fault such as a stack overflow); `trap` names it.
    Crashed { trap: String },
    /// The instruction budget ([`Limits::fuel`]) was spent; the guest was stopped.
    FuelExhausted,
}

impl Outcome {
    /// Whether the guest ran to its own end (completed, possibly with truncated output).
    pub fn ran_to_end(&self) -> bool {
        matches!(self, Outcome::Completed | Outcome::OutputTruncated)
    }

    /// A one-line reason for the outcomes that are not a normal end.
    pub fn reason(&self, limits: &Limits) -> Option<String> {
        match self {
            Outcome::Completed => None,
            Outcome::OutputTruncated => Some(format!(
                "output truncated (limits: stdout {} bytes, stderr {} bytes)",
                limits.stdout_bytes, limits.stderr_bytes
            )),
            Outcome::TimedOut => Some(format!("timed out after {} ms", limits.timeout_ms)),
            Outcome::MemoryLimit => Some(format!(
                "memory limit of {} MiB exceeded",
                limits.memory_bytes >> 20
            )),
            Outcome::Crashed { trap } => Some(format!("sandbox crashed: {trap}")),
            Outcome::FuelExhausted => Some(match limits.fuel {
                Some(fuel) => format!("the instruction budget of {fuel} units (fuel) ran out"),
                None => "the instruction budget (fuel) ran out".into(),
            }),
        }
    }
}

/// What an execution produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    /// Captured stdout, at most `limits.stdout_bytes`. Base64 in JSON.
    #[serde(with = "base64_bytes")]
    pub stdout: Vec<u8>,
    /// Captured stderr, at most `limits.stderr_bytes`. Base64 in JSON.
    #[serde(with = "base64_bytes")]
    pub stderr: Vec<u8>,
    /// The guest's exit code; meaningful when the outcome ran to its end, else -1.
    pub exit_code: i32,
    /// How it ended.
    pub outcome: Outcome,
    /// Whether stdout lost bytes to its cap.
    pub stdout_truncated: bool,
    /// Whether stderr lost bytes to its cap.
    pub stderr_truncated: bool,
    /// Wall-clock time of the execution in microseconds.
    pub duration_us: u64,
    /// The guest's largest linear memory in bytes.
    pub peak_memory_bytes: u64,
    /// Bytes the guest wrote to files.
    pub fs_written_bytes: u64,
    /// Whether a write or file creation was refused (`ENOSPC`) because the execution's
    /// file budget ([`Limits::fs_write_bytes`], [`Limits::fs_create_count`]) was spent.
    #[serde(default)]
    pub fs_refused: bool,
    /// Whether the run may have changed files: `Some(false)` when the backend saw every file
    /// operation the guest made and none could change a file or folder (the host then need
    /// not look at the workspace to record it); `None` when the backend cannot tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_changed: Option<bool>,
    /// Rich results, in the order the guest produced them: a cell's final value, each
    /// `display(...)`, each matplotlib figure. Empty for runtimes that produce none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<RichResult>,
    /// For a session turn: the memory the session really holds after it, in bytes (the
    /// pages of its memory it has written: private, resident), as its worker last measured
    /// it. `None` where the backend cannot tell (its cap is then what counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_memory_bytes: Option<u64>,
}

/// The most rich results one execution keeps.
pub const MAX_RICH_RESULTS: usize = 64;
/// The most bytes of rich results (all forms, PNGs as base64) one execution keeps: 16 MiB.
pub const MAX_RICH_RESULT_BYTES: usize = 16 << 20;

/// A value shown as a notebook shows it: one or more forms of it by MIME type
/// (`text/plain`, `text/html`, `image/png` as base64, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct RichResult {
    /// Whether this is the cell's own value (its final expression), rather than something
    /// it displayed along the way (a figure, a `display(...)` call).
    #[serde(default)]
    pub main: bool,
    /// The forms, by MIME type; binary forms are base64.
    #[cfg_attr(feature = "schema", schema(example = json!({"text/plain": "42"})))]
    pub data: std::collections::BTreeMap<String, String>,
}

impl RichResult {
    /// Reads the frame a guest sends for one result: a JSON object
    /// `{"main": bool, "data": {mime: string}}` with at least one form. `None` if malformed.
    pub fn from_frame(frame: &[u8]) -> Option<RichResult> {
        let result: RichResult = serde_json::from_slice(frame).ok()?;
        let valid = !result.data.is_empty()
            && result.data.keys().all(|mime| {
                mime.len() <= 100
                    && mime.contains('/')
                    && mime.bytes().all(|b| b.is_ascii_graphic())
            });
        valid.then_some(result)
    }

    /// The bytes this result holds (the forms and their names).
    pub fn size(&self) -> usize {
        self.data.iter().map(|(k, v)| k.len() + v.len()).sum()
    }
}

impl ExecResult {
    /// A one-line reason when the file budget stopped a write or a creation.
    pub fn fs_reason(&self, limits: &Limits) -> Option<String> {
        self.fs_refused.then(|| {
            format!(
                "file writes stopped at this execution's budget ({} MiB written, {} files created at most): writes beyond it failed with ENOSPC",
                limits.fs_write_bytes >> 20,
                limits.fs_create_count
            )
        })
    }

    /// stdout as text (invalid UTF-8 replaced).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// stderr as text (invalid UTF-8 replaced).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    /// Whether the guest ran to its end with exit code 0.
    pub fn success(&self) -> bool {
        self.outcome.ran_to_end() && self.exit_code == 0
    }
}

/// Byte buffers as base64 strings: compact and exact for any bytes, unlike a JSON array.
/// Use with `#[serde(with = "kiln_core::base64_bytes")]`.
pub mod base64_bytes {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        STANDARD
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn language_names_round_trip() {
        for language in Language::ALL {
            assert_eq!(Language::from_name(language.name()), Some(language));
        }
        assert_eq!(Language::from_name("JS"), Some(Language::JavaScript));
        assert_eq!(Language::from_name("golang"), Some(Language::Go));
        assert_eq!(Language::from_name("sh"), Some(Language::Bash));
        assert_eq!(
            Language::from_path(std::path::Path::new("main.go")),
            Some(Language::Go)
        );
        assert!(Language::WASM.iter().all(|l| l.is_wasm()));
        assert!(!Language::Go.is_wasm() && !Language::Bash.is_wasm());
        assert_eq!(Language::from_name("ruby"), None);
        assert_eq!(
            Language::from_path(std::path::Path::new("a/b.py")),
            Some(Language::Python)
        );
        assert_eq!(Language::from_path(std::path::Path::new("b.txt")), None);
        assert_eq!(Language::from_path(std::path::Path::new("Makefile")), None);
    }

    #[test]
    fn limits_validate() {
        assert_eq!(Limits::default().validate(), Ok(()));
        let zero = Limits {
            timeout_ms: 0,
            ..Limits::default()
        };
        assert_eq!(zero.validate(), Err(LimitsError::ZeroTimeout));
        let huge = Limits {
            memory_bytes: 8 << 30,
            ..Limits::default()
        };
        assert_eq!(
            huge.validate(),
            Err(LimitsError::MemoryOutOfRange {
                memory_bytes: 8 << 30
            })
        );
    }

    #[test]
    fn byte_fields_travel_as_base64() {
        let mut request = ExecRequest::new(Language::Python, "x");
        request.stdin = vec![0, 255, b'a'];
        let json = serde_json::to_value(&request).unwrap();
        assert_eq!(json["stdin"], "AP9h");
        let back: ExecRequest = serde_json::from_value(json).unwrap();
        assert_eq!(back, request);
        let err = serde_json::from_str::<ExecRequest>(
            r#"{"language":"python","code":"","stdin":"not base64!"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("Invalid"), "{err}");
    }

    #[test]
    fn outcome_serializes_with_a_kind_tag() {
        let json = serde_json::to_string(&Outcome::Crashed {
            trap: "stack overflow".into(),
        })
        .unwrap();
        assert_eq!(json, r#"{"kind":"crashed","trap":"stack overflow"}"#);
        let limits: Limits = serde_json::from_str(r#"{"timeout_ms": 5}"#).unwrap();
        assert_eq!(limits.timeout_ms, 5);
        assert_eq!(limits.memory_bytes, Limits::default().memory_bytes);
        let err = serde_json::from_str::<Limits>(r#"{"timeout": 5}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn fuel_is_optional_bounded_and_reported() {
        assert_eq!(
            serde_json::to_string(&Outcome::FuelExhausted).unwrap(),
            r#"{"kind":"fuel_exhausted"}"#
        );
        // Absent by default, and absent from the JSON of limits without it.
        let json = serde_json::to_value(Limits::default()).unwrap();
        assert!(json.get("fuel").is_none(), "{json}");
        let limits: Limits = serde_json::from_str(r#"{"fuel": 2000000000}"#).unwrap();
        assert_eq!(limits.fuel, Some(2_000_000_000));
        assert_eq!(limits.validate(), Ok(()));
        assert_eq!(
            Outcome::FuelExhausted.reason(&limits).as_deref(),
            Some("the instruction budget of 2000000000 units (fuel) ran out")
        );
        for fuel in [0, MAX_FUEL + 1] {
            let limits = Limits {
                fuel: Some(fuel),
                ..Limits::default()
            };
            assert_eq!(limits.validate(), Err(LimitsError::FuelOutOfRange { fuel }));
        }
    }
}
