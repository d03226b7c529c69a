//! Compiled modules on disk.
//!
//! Compiling the Python module takes about 90 CPU-seconds, so kiln does it once and keeps the
//! native code as a `.cwasm` file keyed by the wasm's SHA-256, the wasmtime version and a hash
//! of the engine configuration: a key that changes never loads a stale file. Loading maps the
//! file (`Module::deserialize_file`), so every instance shares its pages.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use wasmtime::{Engine, Module};

use crate::setup::{CacheDir, Progress, SetupError, write_file_synced};

/// The wasmtime release kiln is built against; part of every cache key.
pub const WASMTIME_VERSION: &str = "48.0.8";

/// Failed to compile or load a module.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// Setup (writing the cache) failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// wasmtime rejected the wasm.
    #[error("could not compile {name}: {detail}")]
    Compile { name: String, detail: String },
    /// A cached `.cwasm` could not be loaded even after it was rebuilt.
    #[error(
        "the compiled module {path} could not be loaded ({detail}); delete {dir} and run `kiln setup`"
    )]
    Corrupt {
        path: PathBuf,
        dir: PathBuf,
        detail: String,
    },
}

/// The file a module compiles to, for this engine.
pub fn cwasm_path(engine: &Engine, cache: &CacheDir, name: &str, wasm_sha256: &str) -> PathBuf {
    let mut hasher = std::hash::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let config_hash = hasher.finish();
    // A module kiln patches before compiling has its own key (see `qjs_exports`).
    let patch = crate::qjs_exports::key_tag(wasm_sha256);
    cache.modules_dir().join(format!(
        "{name}-{}{patch}-wasmtime{WASMTIME_VERSION}-{config_hash:016x}.cwasm",
        &wasm_sha256[..16]
    ))
}

/// What kiln does to a runtime's bytes before compiling them (see `qjs_exports::prepare` and
/// `warm::strip`); the module's `name` must say which, so files never mix.
pub type Prepare<'a> = &'a dyn Fn(Vec<u8>) -> Result<Vec<u8>, crate::qjs_exports::PatchError>;

/// Loads the module from its `.cwasm`, compiling it first if needed (with the setup lock
/// held). A `.cwasm` that fails to load is rebuilt once, with a message; a second failure is
/// an error.
#[allow(clippy::too_many_arguments)]
pub fn load_or_compile(
    engine: &Engine,
    cache: &CacheDir,
    name: &str,
    wasm_path: &Path,
    wasm_sha256: &str,
    compile_estimate: Duration,
    progress: &dyn Progress,
    prepare: Prepare<'_>,
) -> Result<Module, ModuleError> {
    let path = cwasm_path(engine, cache, name, wasm_sha256);
    if path.is_file() {
        match load(engine, &path) {
            Ok(module) => {
                tracing::debug!(target: "kiln_wasm", name, path = %path.display(), "loaded the compiled module from the cache");
                return Ok(module);
            }
            Err(detail) => {
                tracing::warn!(target: "kiln_wasm", name, %detail, "the compiled module was unusable; rebuilding it");
                progress.done(&format!(
                    "the compiled {name} module was unusable ({detail}); rebuilding it"
                ));
                let _lock = cache.lock()?;
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    let _lock = cache.lock()?;
    if !path.is_file() {
        tracing::info!(target: "kiln_wasm", name, path = %path.display(), "compiling the runtime to native code");
        compile_to(
            engine,
            name,
            wasm_path,
            &path,
            compile_estimate,
            progress,
            prepare,
        )?;
    }
    load(engine, &path).map_err(|detail| ModuleError::Corrupt {
        dir: cache.modules_dir(),
        path: path.clone(),
        detail,
    })
}

fn load(engine: &Engine, path: &Path) -> Result<Module, String> {
    // SAFETY: the file is native code kiln compiled itself with this engine configuration and
    // wrote atomically into its own cache; wasmtime checks the header (version, config)
    // before use. Guests never get a grant on the cache directory.
    unsafe { Module::deserialize_file(engine, path) }.map_err(|e| format!("{e:#}"))
}

fn compile_to(
    engine: &Engine,
    name: &str,
    wasm_path: &Path,
    out: &Path,
    estimate: Duration,
    progress: &dyn Progress,
    prepare: Prepare<'_>,
) -> Result<(), ModuleError> {
    progress.step(
        &format!("compiling the {name} runtime to native code (once)"),
        Some(estimate),
    );
    let wasm = std::fs::read(wasm_path).map_err(|e| SetupError::io("read", wasm_path, e))?;
    let wasm = prepare(wasm).map_err(|e| ModuleError::Compile {
        name: name.to_owned(),
        detail: e.to_string(),
    })?;
    let compiled = engine
        .precompile_module(&wasm)
        .map_err(|e| ModuleError::Compile {
            name: name.to_owned(),
            detail: format!("{e:#}"),
        })?;
    drop(wasm);
    write_file_synced(out, &compiled)?;
    progress.done(&format!("compiled the {name} runtime"));
    Ok(())
}
