//! Where runtimes are downloaded and compiled.

use std::path::PathBuf;

/// The runtime cache, read once from the environment: `KILN_CACHE_DIR` (if set and not
/// empty, else `~/.cache/kiln`) and `KILN_PIP` (the pip command setup runs, split on spaces;
/// default the first of `python3 -m pip`, `pip3`, `pip` that runs).
pub fn dir() -> kiln_wasm::CacheDir {
    static CACHE: std::sync::OnceLock<kiln_wasm::CacheDir> = std::sync::OnceLock::new();
    CACHE
        .get_or_init(|| {
            let set = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
            let root =
                set("KILN_CACHE_DIR").map_or_else(kiln_wasm::CacheDir::default_root, PathBuf::from);
            let pip = set("KILN_PIP")
                .map(|words| words.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default();
            kiln_wasm::CacheDir::new(root).with_pip(pip)
        })
        .clone()
}
