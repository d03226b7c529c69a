//! kiln's default sandbox backend: WebAssembly guests on wasmtime.
//!
//! Python (CPython 3.15 with numpy, pandas, scipy, scikit-learn, matplotlib) and JavaScript
//! (QuickJS-NG) run as WebAssembly with no network, only the directories they are granted,
//! and hard limits on time, memory, output and files.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kiln_core::{ExecRequest, Language};
//! use kiln_wasm::{CacheDir, WasmEngine};
//!
//! let engine = WasmEngine::new(CacheDir::new(CacheDir::default_root()))?;
//! let mut session = engine.open_session(Language::Python, &Default::default()).await?;
//! session.run("x = 41", &Default::default()).await?;
//! let result = session.run("print(x + 1)", &Default::default()).await?;
//! assert_eq!(result.stdout, b"42\n");
//! # Ok(()) }
//! ```

mod backend;
mod cache;
mod engine;
mod guest;
mod javascript;
mod output;
mod prefault;
mod python;
mod qjs;
mod qjs_exports;
mod quota;
mod ready;
mod session;
pub mod setup;
mod warm;

pub use backend::templates;
pub use cache::{ModuleError, Prune, Pruned, UNUSED_FOR, WASMTIME_VERSION, cwasm_path, prune};
pub use engine::{
    CONTENDED_EPOCH_TICK, EPOCH_TICK, EngineError, EngineOptions, ExecError, MAX_CODE_BYTES,
    WasmEngine, engine_config,
};
pub use guest::{Door, DoorFuture, GrantError, MAX_DOOR_FRAME_BYTES};
pub use output::{OutputChunk, StreamKind};
pub use session::{Session, SessionOptions};
pub use setup::{CacheDir, Progress, Quiet, SetupError};
pub use warm::{PYTHON_DATA, PYTHON_DATA_WARM_UP, imports_data_stack, warm_up_of};
