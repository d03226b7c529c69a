//! Files a run wrote under its output folder, returned with its result (seed 002's `files`
//! artifacts). They are read through the workspace's directory handles, so a link the guest
//! planted is never followed, and bounded in count and size.

use std::io::Read;

use base64::Engine as _;
use kiln_workspace::{Kind, RelPath};
use serde::Serialize;

use crate::sandbox::Sandbox;

/// The output folder when a request names none: `/workspace/out` in the guest.
pub const DEFAULT_OUTPUT_DIR: &str = "out";
/// The most files one result carries; more are listed, without their bytes.
pub const MAX_OUTPUT_FILES: usize = 32;
/// The largest file one result carries: 4 MiB. A larger one is listed, without its bytes.
pub const MAX_OUTPUT_FILE_BYTES: u64 = 4 << 20;
/// The most bytes of files one result carries: 8 MiB.
pub const MAX_OUTPUT_BYTES: u64 = 8 << 20;

/// A file the run added or changed under the output folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputFile {
    /// Its path in the workspace.
    #[schema(example = "out/report.csv")]
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its bytes, base64; absent when they were left out (see `omitted`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_base64: Option<String>,
    /// Why its bytes are not here (a large file, too many files): download it instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub omitted: Option<String>,
}

/// The files change `exec_id` (the newest in the history) added or changed under `dir`, in
/// path order. Nothing when the folder does not exist or the change is not the newest.
/// Blocking: call it off the async threads, while the sandbox is still busy with the run.
pub fn collect(sandbox: &Sandbox, exec_id: &str, dir: &RelPath) -> Vec<OutputFile> {
    let Ok(tree) = sandbox.tree() else {
        return Vec::new();
    };
    if !matches!(tree.stat(dir), Ok(Some(meta)) if meta.kind == Kind::Dir) {
        return Vec::new();
    }
    let entry = sandbox
        .history()
        .ok()
        .and_then(|history| history.entries(1).ok())
        .and_then(|mut entries| entries.pop());
    let Some(entry) = entry.filter(|entry| entry.id == exec_id) else {
        return Vec::new();
    };
    let prefix = format!("{}/", dir.as_str());
    let mut files = Vec::new();
    let mut carried = 0u64;
    for path in entry.files.iter().filter(|path| path.starts_with(&prefix)) {
        let Ok(rel) = RelPath::parse(path) else {
            continue;
        };
        // Removed files, links, fifos and devices are not outputs.
        let Ok((file, meta)) = tree.open_file(&rel) else {
            continue;
        };
        let omitted = if files.len() >= MAX_OUTPUT_FILES {
            Some(format!("a result carries at most {MAX_OUTPUT_FILES} files"))
        } else if meta.size > MAX_OUTPUT_FILE_BYTES {
            Some(format!(
                "a result carries files of at most {} MiB",
                MAX_OUTPUT_FILE_BYTES >> 20
            ))
        } else if carried + meta.size > MAX_OUTPUT_BYTES {
            Some(format!(
                "a result carries at most {} MiB of files",
                MAX_OUTPUT_BYTES >> 20
            ))
        } else {
            None
        };
        let mut output = OutputFile {
            path: path.clone(),
            size: meta.size,
            content_base64: None,
            omitted,
        };
        if output.omitted.is_none() {
            // The size was checked on the open file; a guest cannot grow it past the bound now.
            let mut bytes = Vec::new();
            if file
                .take(MAX_OUTPUT_FILE_BYTES)
                .read_to_end(&mut bytes)
                .is_err()
            {
                continue;
            }
            carried += bytes.len() as u64;
            output.size = bytes.len() as u64;
            output.content_base64 = Some(base64::engine::general_purpose::STANDARD.encode(&bytes));
        }
        files.push(output);
    }
    files
}
