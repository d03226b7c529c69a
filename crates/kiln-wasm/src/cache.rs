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
                mark_used(&path);
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
    let compiled = {
        let _lock = cache.lock()?;
        let missing = !path.is_file();
        if missing {
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
        missing
    };
    let module = load(engine, &path).map_err(|detail| ModuleError::Corrupt {
        dir: cache.modules_dir(),
        path: path.clone(),
        detail,
    })?;
    mark_used(&path);
    if compiled {
        // A new module often means a new kiln: the old one's may have gone unused long.
        prune_quietly(cache);
    }
    Ok(module)
}

/// [`prune`]s what has gone unused, logging a failure instead of failing the caller.
pub fn prune_quietly(cache: &CacheDir) {
    if let Err(e) = prune(cache, Prune::Unused) {
        tracing::warn!(target: "kiln_wasm", error = %e, "could not prune the cache");
    }
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

/// Compiled modules and warm images nothing has used for this long are removed when kiln
/// next compiles a module, builds an image or runs `kiln setup`: an upgrade of kiln (or of a
/// runtime, or a changed warm-up) leaves the old version's files behind, about 280 MB per
/// Python module and 80 MB per image.
pub const UNUSED_FOR: Duration = Duration::from_secs(14 * 24 * 3600);
/// A file's time of last use (its modification time) is brought up to date at most this
/// often, so loading it stays one `stat` most of the time.
const MARK_EVERY: Duration = Duration::from_secs(24 * 3600);
/// What an interrupted write leaves (`tempfile`'s names) is removed after this long.
const STALE_TEMPORARY: Duration = Duration::from_secs(24 * 3600);

/// The cache files this process has loaded or built.
static USED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Records that this process uses the cache file at `path` (a `.cwasm` or an image): its
/// modification time says when it was last used, so pruning keeps it.
pub fn mark_used(path: &Path) {
    {
        let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
        if !used.iter().any(|p| p == path) {
            used.push(path.to_owned());
        }
    }
    let now = std::time::SystemTime::now();
    let stale = std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .is_ok_and(|at| now.duration_since(at).is_ok_and(|age| age >= MARK_EVERY));
    if stale {
        // A failure only makes the file look older than it is; pruning never removes one
        // this process uses.
        let _ = std::fs::File::open(path).and_then(|f| f.set_modified(now));
    }
}

/// What [`prune`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// The files removed.
    pub files: Vec<PathBuf>,
    /// Their sizes, added up.
    pub bytes: u64,
}

/// Which cache files [`prune`] removes.
#[derive(Debug, Clone, Copy)]
pub enum Prune {
    /// Those unused for [`UNUSED_FOR`].
    Unused,
    /// Every one this process has not used (`kiln setup --prune`, after setup loaded or
    /// built what this kiln needs).
    AllButUsed,
}

/// Removes compiled modules (`modules/*.cwasm`) and warm images (`images/*.img`) of the
/// cache at `root` as `which` says, and temporaries an interrupted write left there a day
/// ago or more. Never a file this process has used, never anything but a plain file of
/// those names (no link is followed). Holds the cache's lock while it removes, so nothing
/// is removed while another kiln writes.
pub fn prune(cache: &CacheDir, which: Prune) -> Result<Pruned, SetupError> {
    // Plain paths are safe here: the cache is kiln's own folder, never granted to a guest,
    // and an entry that is a link is skipped (removing a link would not follow it anyway).
    let _lock = cache.lock()?;
    let used = USED.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let now = std::time::SystemTime::now();
    let mut pruned = Pruned::default();
    for (folder, suffix) in [("modules", ".cwasm"), ("images", ".img")] {
        let dir = cache.root().join(folder);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.file_type().is_file() || used.contains(&path) {
                continue;
            }
            let age = meta
                .modified()
                .ok()
                .and_then(|at| now.duration_since(at).ok())
                .unwrap_or_default();
            let remove = if name.starts_with(".tmp") {
                age >= STALE_TEMPORARY
            } else if name.ends_with(suffix) {
                match which {
                    Prune::Unused => age >= UNUSED_FOR,
                    Prune::AllButUsed => true,
                }
            } else {
                false
            };
            if remove && std::fs::remove_file(&path).is_ok() {
                tracing::info!(target: "kiln_wasm", path = %path.display(), bytes = meta.len(), "removed an unused cache file");
                pruned.bytes += meta.len();
                pruned.files.push(path);
            }
        }
    }
    Ok(pruned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn file(path: &Path, days_old: u64) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"0123456789").unwrap();
        let at = SystemTime::now() - Duration::from_secs(days_old * 24 * 3600 + 60);
        std::fs::File::open(path).unwrap().set_modified(at).unwrap();
    }

    #[test]
    fn prunes_unused_modules_images_and_stale_temporaries_never_used_or_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CacheDir::new(dir.path());
        let modules = dir.path().join("modules");
        let images = dir.path().join("images");
        let old_module = modules.join("python-old.cwasm");
        let new_module = modules.join("python-new.cwasm");
        let used_old = modules.join("python-used.cwasm");
        let old_image = images.join("python-old.img");
        let stale_tmp = modules.join(".tmpAbC123");
        let fresh_tmp = images.join(".tmpXyZ789");
        let other = modules.join("README");
        file(&old_module, 20);
        file(&new_module, 1);
        file(&used_old, 30);
        file(&old_image, 15);
        file(&stale_tmp, 2);
        file(&fresh_tmp, 0);
        file(&other, 100);
        // Links are never followed nor removed, whatever they point at.
        let outside = dir.path().join("outside.cwasm");
        file(&outside, 100);
        let link = modules.join("link.cwasm");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let sub = modules.join("folder.cwasm");
        std::fs::create_dir(&sub).unwrap();

        // A file this process uses is marked (its time brought up to date) and kept.
        mark_used(&used_old);
        let age = std::fs::metadata(&used_old).unwrap().modified().unwrap();
        assert!(SystemTime::now().duration_since(age).unwrap() < MARK_EVERY);

        let pruned = prune(&cache, Prune::Unused).unwrap();
        let mut removed = pruned.files.clone();
        removed.sort();
        let mut expected = vec![old_module.clone(), old_image.clone(), stale_tmp.clone()];
        expected.sort();
        assert_eq!(removed, expected);
        assert_eq!(pruned.bytes, 30);
        for kept in [&new_module, &used_old, &fresh_tmp, &other, &outside] {
            assert!(kept.is_file(), "{} was removed", kept.display());
        }
        assert!(link.symlink_metadata().is_ok() && sub.is_dir());

        // Everything this process has not used, at once (`kiln setup --prune`).
        let pruned = prune(&cache, Prune::AllButUsed).unwrap();
        assert_eq!(pruned.files, vec![new_module.clone()]);
        assert!(used_old.is_file() && other.is_file() && outside.is_file());

        // A cache that has no folders yet prunes nothing.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            prune(&CacheDir::new(empty.path()), Prune::AllButUsed).unwrap(),
            Pruned::default()
        );
    }
}
