//! The wasm engine as a [`Backend`]: the `python` and `javascript` templates.
//!
//! A thin adapter: each call goes straight to [`WasmEngine`]'s own methods.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use kiln_core::backend::{Backend, BackendError, BackendSession, Door, ErrorKind, OutputSink};
use kiln_core::template::{
    BackendKind, Capabilities, ImageRule, Lifecycle, TemplateInfo, VersionRange,
};
use kiln_core::{ExecRequest, ExecResult, Language, Limits};

use crate::engine::{ExecError, WasmEngine};
use crate::session::{Session, SessionOptions};

/// The templates the wasm backend runs: `python` and `javascript`.
pub fn templates() -> Vec<TemplateInfo> {
    let names = |list: &[&str]| list.iter().map(|n| (*n).to_string()).collect::<Vec<_>>();
    // A WebAssembly sandbox's sessions run either language, whatever its template.
    let capabilities = Capabilities {
        sessions: true,
        session_languages: Language::WASM.to_vec(),
        fuel: true,
        ..Capabilities::default()
    };
    let python = Capabilities {
        fork: true,
        ..capabilities.clone()
    };
    vec![
        TemplateInfo {
            id: "python".into(),
            description: "CPython 3.15 on WebAssembly with numpy, pandas, scipy, scikit-learn \
                          and matplotlib; no network, no subprocesses"
                .into(),
            backend: BackendKind::Wasm,
            lifecycle: Lifecycle::Ephemeral,
            languages: vec![Language::Python],
            capabilities: python.clone(),
            images: ImageRule {
                names: names(&["python3", "py", "@ai-sandbox/python"]),
                repos: names(&["python", "python3"]),
                versions: Some(VersionRange {
                    min: (3, 0),
                    max: (3, 15),
                }),
            },
            resources: None,
            workspace_owner: None,
        },
        TemplateInfo {
            id: crate::warm::PYTHON_DATA.into(),
            description: "The python template started warm: numpy, pandas, scipy and \
                          matplotlib already imported (a copy-on-write memory image built \
                          once), so a sandbox is ready for data work in milliseconds"
                .into(),
            backend: BackendKind::Wasm,
            lifecycle: Lifecycle::Ephemeral,
            languages: vec![Language::Python],
            capabilities: python,
            images: ImageRule {
                names: names(&[crate::warm::PYTHON_DATA]),
                repos: Vec::new(),
                versions: None,
            },
            resources: None,
            workspace_owner: None,
        },
        TemplateInfo {
            id: "javascript".into(),
            description: "QuickJS-NG (ES2023) on WebAssembly; no Node.js APIs, no network".into(),
            backend: BackendKind::Wasm,
            lifecycle: Lifecycle::Ephemeral,
            languages: vec![Language::JavaScript],
            capabilities,
            images: ImageRule {
                names: names(&[
                    "js",
                    "node",
                    "nodejs",
                    "quickjs",
                    "@ai-sandbox/node",
                    "@ai-sandbox/javascript",
                ]),
                repos: names(&["node", "nodejs", "javascript"]),
                versions: None,
            },
            resources: None,
            workspace_owner: None,
        },
    ]
}

impl From<ExecError> for BackendError {
    fn from(error: ExecError) -> BackendError {
        let kind = match &error {
            ExecError::Engine(_) => ErrorKind::Setup,
            ExecError::Limits(_)
            | ExecError::MemoryTooSmall { .. }
            | ExecError::FuelUnavailable { .. } => ErrorKind::Limits,
            ExecError::Grant(_) => ErrorKind::Grant,
            ExecError::CodeTooLarge { .. } | ExecError::RequestTooLarge { .. } => {
                ErrorKind::TooLarge
            }
            ExecError::SessionEnded { .. } => ErrorKind::SessionEnded,
            ExecError::Unsupported { .. } | ExecError::CannotFork { .. } => ErrorKind::Unsupported,
            ExecError::Busy { .. } => ErrorKind::Busy,
            ExecError::Tmp(_) | ExecError::Instantiate { .. } => ErrorKind::Instantiate,
        };
        BackendError::new(kind, error.to_string())
    }
}

/// Refuses what the wasm templates cannot run: commands, and a template that is not the
/// language's own.
fn check_program(request: &ExecRequest) -> Result<(), BackendError> {
    if let Some(command) = &request.command {
        let program = command.argv.first().map_or("", String::as_str);
        return Err(BackendError::unsupported(format!(
            "the {} template runs code, not commands ({program:?}); send code in a language, \
             or use a template that runs commands",
            request.language
        )));
    }
    match request.template.as_deref() {
        None => Ok(()),
        Some(t) if t == request.language.name() => Ok(()),
        Some(crate::warm::PYTHON_DATA) if request.language == Language::Python => Ok(()),
        Some(t) => Err(BackendError::unsupported(format!(
            "the {t:?} template does not run {} code",
            request.language
        ))),
    }
}

impl Backend for WasmEngine {
    type Session = Session;

    fn templates(&self) -> Vec<TemplateInfo> {
        templates()
    }

    fn contention_flag(&self) -> Option<Arc<AtomicBool>> {
        Some(self.contended())
    }

    async fn run_once(
        &self,
        request: &ExecRequest,
        output: Option<OutputSink>,
    ) -> Result<ExecResult, BackendError> {
        check_program(request)?;
        Ok(self.execute_streaming(request, output).await?)
    }

    async fn open_session(&self, request: ExecRequest) -> Result<Session, BackendError> {
        check_program(&request)?;
        let language = request.language;
        let options = session_options(request);
        Ok(WasmEngine::open_session(self, language, &options).await?)
    }

    async fn fork_session(
        &self,
        parent: &mut Session,
        request: ExecRequest,
    ) -> Result<Session, BackendError> {
        check_program(&request)?;
        let options = session_options(request);
        Ok(parent.fork(self, &options).await?)
    }
}

/// A session's grants and limits, from the request that opens (or forks) it.
fn session_options(request: ExecRequest) -> SessionOptions {
    SessionOptions {
        env: request.env,
        workspace: request.workspace,
        workspace_at: request.workspace_at,
        mounts: request.mounts,
        limits: request.limits,
        template: request.template,
    }
}

impl BackendSession for Session {
    async fn run(
        &mut self,
        code: &str,
        limits: &Limits,
        output: Option<OutputSink>,
        door: Option<Door>,
    ) -> Result<ExecResult, BackendError> {
        Ok(self.run_with_door(code, limits, output, door).await?)
    }
}
