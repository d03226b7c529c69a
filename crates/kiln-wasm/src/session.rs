//! Stateful sessions: one live guest that keeps its state from turn to turn.

use std::path::PathBuf;

use kiln_core::{ExecRequest, ExecResult, Language, Limits, Mount};
use tokio::sync::mpsc;

use crate::engine::{ExecError, WasmEngine, check_code, check_request};
use crate::guest::Door;
use crate::javascript::JsSession;
use crate::output::OutputChunk;
use crate::python::{Origin, PythonGuest};
use crate::setup::Quiet;

/// What a session may touch. The memory cap in `limits` holds for the session's whole life;
/// the other limits are defaults for turns that do not name their own. A Python session
/// opened with an instruction budget (`limits.fuel`) runs on the fuel engine and gives
/// each turn a fresh budget (the turn's own, else this one); one opened without cannot
/// take a turn with a budget, and JavaScript sessions take none
/// ([`ExecError::FuelUnavailable`]).
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Environment variables the guest sees.
    pub env: Vec<(String, String)>,
    /// A host directory seen read-write at `/workspace`, the working directory.
    pub workspace: Option<PathBuf>,
    /// Where the guest sees the workspace instead of `/workspace`.
    pub workspace_at: Option<String>,
    /// Further host directories granted.
    pub mounts: Vec<Mount>,
    /// Limits (see above).
    pub limits: Limits,
    /// The template (`python-data` starts from its warm image); `None`: the language's own.
    pub template: Option<String>,
}

enum Guest {
    Python(PythonGuest),
    JavaScript(JsSession),
}

/// A live guest. Python keeps globals, imports and files between turns; JavaScript keeps
/// its declarations (`var`, `let`, `const`, functions), and runs each turn's promises and
/// timers before the turn ends. A session whose guest trapped, timed out or called `exit()`
/// has ended: every further turn answers [`ExecError::SessionEnded`].
pub struct Session {
    language: Language,
    guest: Guest,
    /// What the session's memory held when last measured ([`Session::memory_in_use`]).
    measured: Option<Measured>,
}

/// One measurement of a session's memory.
#[derive(Debug, Clone, Copy)]
struct Measured {
    /// Private resident bytes of its linear memory.
    bytes: u64,
    /// The linear memory's size then.
    size: usize,
    at: std::time::Instant,
}

/// A session's memory is measured again after a turn at most this often, unless its
/// linear memory grew (reading the page map of 64 MiB costs ~120 µs; a turn ~50 µs).
const MEASURE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("language", &self.language)
            .field("ended", &self.ended())
            .finish_non_exhaustive()
    }
}

impl Session {
    pub fn language(&self) -> Language {
        self.language
    }

    /// Why the session can no longer run code, if it cannot.
    pub fn ended(&self) -> Option<&str> {
        match &self.guest {
            Guest::Python(guest) => guest.ended.as_deref(),
            Guest::JavaScript(guest) => guest.ended.as_deref(),
        }
    }

    /// Runs one turn. `limits.memory_bytes` is ignored: memory is capped per session.
    pub async fn run(&mut self, code: &str, limits: &Limits) -> Result<ExecResult, ExecError> {
        self.run_streaming(code, limits, None).await
    }

    /// Runs one turn, sending output chunks to `listener` as the guest writes them.
    pub async fn run_streaming(
        &mut self,
        code: &str,
        limits: &Limits,
        listener: Option<mpsc::UnboundedSender<OutputChunk>>,
    ) -> Result<ExecResult, ExecError> {
        self.run_with_door(code, limits, listener, None).await
    }

    /// Runs one turn with `door` granted for this turn alone (Python; JavaScript has no
    /// door). Every turn sets the door anew, so a grant never outlives its turn.
    pub async fn run_with_door(
        &mut self,
        code: &str,
        limits: &Limits,
        listener: Option<mpsc::UnboundedSender<OutputChunk>>,
        door: Option<Door>,
    ) -> Result<ExecResult, ExecError> {
        // The memory cap was fixed when the session opened; the rest applies per turn,
        // and the turn may grow the memory by at most `session_growth_bytes` within it.
        limits.validate()?;
        check_code(code)?;
        let cap = self.memory_cap();
        if let Some(growth) = limits.session_growth_bytes {
            let (_, size) = self.linear_memory();
            let room = usize::try_from(growth).unwrap_or(usize::MAX);
            self.set_memory_cap(cap.min(size.saturating_add(room)));
        }
        let result = match &mut self.guest {
            Guest::Python(guest) => {
                guest.set_door(door);
                let result = guest.turn(code, limits, listener).await;
                guest.set_door(None);
                result
            }
            Guest::JavaScript(guest) => guest.turn(code, limits, listener).await,
        };
        self.set_memory_cap(cap);
        let mut result = result?;
        if self.ended().is_none() {
            result.session_memory_bytes = self.memory_in_use();
        }
        Ok(result)
    }

    fn memory_cap(&self) -> usize {
        match &self.guest {
            Guest::Python(guest) => guest.memory_cap(),
            Guest::JavaScript(guest) => guest.memory_cap(),
        }
    }

    fn set_memory_cap(&mut self, cap: usize) {
        match &mut self.guest {
            Guest::Python(guest) => guest.set_memory_cap(cap),
            Guest::JavaScript(guest) => guest.set_memory_cap(cap),
        }
    }

    /// Where the guest's linear memory starts in this process, and its size.
    fn linear_memory(&self) -> (usize, usize) {
        match &self.guest {
            Guest::Python(guest) => guest.linear_memory(),
            Guest::JavaScript(guest) => guest.linear_memory(),
        }
    }

    /// The memory the session really holds: the pages of its linear memory it has written
    /// (private and resident; pages still the image's or never touched cost it nothing).
    /// Measured from `/proc/self/pagemap` after a turn when the memory grew or the last
    /// measurement is older than a second, else the last figure; `None` where the page
    /// map cannot be read.
    pub fn memory_in_use(&mut self) -> Option<u64> {
        let (base, size) = self.linear_memory();
        if let Some(last) = self.measured
            && last.size == size
            && last.at.elapsed() < MEASURE_EVERY
        {
            return Some(last.bytes);
        }
        let bytes = crate::prefault::private_bytes(base, size)?;
        self.measured = Some(Measured {
            bytes,
            size,
            at: std::time::Instant::now(),
        });
        Some(bytes)
    }
}

impl Session {
    /// A new session with this one's state: its variables, imports and definitions, in a
    /// guest of its own (`options` grant its folders, environment and limits; its memory
    /// starts as this session's, copy-on-write, so a write in either is unseen by the
    /// other). Random generators are reseeded and the environment is the new one's; the
    /// monotonic clock goes on from this session's. Open files are not carried over, nor
    /// `/tmp`: the fork gets an empty one. Python only, and not a session counting fuel.
    pub async fn fork(
        &mut self,
        engine: &WasmEngine,
        options: &SessionOptions,
    ) -> Result<Session, ExecError> {
        let Guest::Python(parent) = &self.guest else {
            return Err(ExecError::CannotFork {
                why: "only Python sessions can be forked",
            });
        };
        if let Some(reason) = &parent.ended {
            return Err(ExecError::SessionEnded {
                reason: reason.clone(),
            });
        }
        if parent.counts_fuel() || options.limits.fuel.is_some() {
            return Err(ExecError::CannotFork {
                why: "a session that counts an instruction budget (fuel) cannot be forked",
            });
        }
        let request = options.request(Language::Python);
        check_request(&request)?;
        let runtime = engine.warm_python(&Quiet)?;
        let origin = Origin::Fork(parent.fork_state()?);
        let guest = PythonGuest::open(engine, &runtime, &request, true, origin).await?;
        Ok(Session {
            language: Language::Python,
            guest: Guest::Python(guest),
            measured: None,
        })
    }
}

impl SessionOptions {
    fn request(&self, language: Language) -> ExecRequest {
        ExecRequest {
            language,
            code: String::new(),
            stdin: Vec::new(),
            env: self.env.clone(),
            workspace: self.workspace.clone(),
            workspace_at: self.workspace_at.clone(),
            mounts: self.mounts.clone(),
            limits: self.limits.clone(),
            template: self.template.clone(),
            command: None,
            network: kiln_core::Network::None,
            egress: None,
            resources: None,
            idle: Default::default(),
        }
    }
}

impl WasmEngine {
    /// Opens a session: a live guest waiting for its first turn.
    pub async fn open_session(
        &self,
        language: Language,
        options: &SessionOptions,
    ) -> Result<Session, ExecError> {
        let request = options.request(language);
        check_request(&request)?;
        let fuel = options.limits.fuel.is_some();
        let guest = match language {
            Language::Python => {
                let warm = self.warm_origin(options.template.as_deref(), fuel).await?;
                let (runtime, origin) = match warm {
                    Some(origin) => (self.warm_python_runtime().await?, origin),
                    None => (self.fresh_python(&request, fuel).await?, Origin::Fresh),
                };
                Guest::Python(PythonGuest::open(self, &runtime, &request, true, origin).await?)
            }
            Language::JavaScript if fuel => {
                return Err(ExecError::FuelUnavailable {
                    why: crate::javascript::JS_SESSION_FUEL,
                });
            }
            Language::JavaScript => {
                let runtime = self.javascript_runtime(false).await?;
                Guest::JavaScript(JsSession::open(self, &runtime, &request).await?)
            }
            language @ (Language::Go | Language::Bash) => {
                return Err(ExecError::Unsupported { language });
            }
        };
        Ok(Session {
            language,
            guest,
            measured: None,
        })
    }
}
