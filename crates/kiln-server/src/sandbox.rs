//! The sandbox registry: what a container id stands for, its workspace folder, its lifetime.
//! (In memory for now; durable state is a later step of the serve issue.)

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use kiln_core::Language;
use serde_json::json;

use crate::error::ApiError;

/// The images a sandbox can be created from, and the runtime each names.
pub const IMAGES: &[(&str, Language)] = &[
    ("python", Language::Python),
    ("python3", Language::Python),
    ("@ai-sandbox/python", Language::Python),
    ("javascript", Language::JavaScript),
    ("node", Language::JavaScript),
    ("@ai-sandbox/node", Language::JavaScript),
    ("@ai-sandbox/javascript", Language::JavaScript),
];

/// The runtime an image name stands for: an exact name above, or a Docker-style
/// `python:TAG` / `node:TAG`.
pub fn image_language(image: &str) -> Option<Language> {
    let image = image.trim().to_ascii_lowercase();
    if let Some((_, language)) = IMAGES.iter().find(|(name, _)| *name == image) {
        return Some(*language);
    }
    let repo = image.split(':').next().unwrap_or_default();
    let repo = repo.rsplit('/').next().unwrap_or_default();
    match repo {
        "python" | "python3" => Some(Language::Python),
        "node" | "nodejs" | "javascript" => Some(Language::JavaScript),
        _ => None,
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// RFC 3339 UTC text for a millisecond timestamp.
pub fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// One sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    pub image: String,
    pub language: Language,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub memory_bytes: u64,
    pub workspace: PathBuf,
    pub busy: bool,
    pub executions: u64,
    pub cpu_time_ms: u64,
}

/// Every live sandbox.
#[derive(Debug)]
pub struct Registry {
    root: PathBuf,
    sandboxes: Mutex<HashMap<String, Sandbox>>,
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut buf);
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh random id with a prefix.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", random_hex(12))
}

impl Registry {
    /// A registry keeping workspaces under `root/sandboxes`.
    pub fn new(root: PathBuf) -> std::io::Result<Registry> {
        std::fs::create_dir_all(root.join("sandboxes"))?;
        Ok(Registry {
            root,
            sandboxes: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sandbox>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a sandbox with an empty workspace.
    pub fn create(
        &self,
        image: &str,
        language: Language,
        lifetime_ms: u64,
        memory_bytes: u64,
    ) -> Result<Sandbox, ApiError> {
        let id = new_id("sb_");
        let workspace = self.root.join("sandboxes").join(&id).join("workspace");
        std::fs::create_dir_all(&workspace)
            .map_err(|e| ApiError::internal(format!("could not create the workspace: {e}")))?;
        let created_ms = now_ms();
        let sandbox = Sandbox {
            id: id.clone(),
            image: image.to_owned(),
            language,
            created_ms,
            expires_ms: created_ms.saturating_add(lifetime_ms),
            memory_bytes,
            workspace,
            busy: false,
            executions: 0,
            cpu_time_ms: 0,
        };
        self.lock().insert(id, sandbox.clone());
        Ok(sandbox)
    }

    /// A live sandbox.
    pub fn get(&self, id: &str) -> Result<Sandbox, ApiError> {
        let now = now_ms();
        match self.lock().get(id) {
            Some(sandbox) if sandbox.expires_ms > now => Ok(sandbox.clone()),
            _ => Err(ApiError::sandbox_not_found(id)),
        }
    }

    /// Marks a sandbox busy for one execution; a second concurrent one is refused with 409.
    pub fn begin_exec(&self, id: &str) -> Result<Sandbox, ApiError> {
        let now = now_ms();
        let mut sandboxes = self.lock();
        let Some(sandbox) = sandboxes.get_mut(id).filter(|s| s.expires_ms > now) else {
            return Err(ApiError::sandbox_not_found(id));
        };
        if sandbox.busy {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "SANDBOX_BUSY",
                format!("sandbox {id} is already running an execution; retry when it finishes"),
            )
            .with_details(json!({ "containerId": id })));
        }
        sandbox.busy = true;
        Ok(sandbox.clone())
    }

    /// Ends an execution started with [`Registry::begin_exec`].
    pub fn end_exec(&self, id: &str, duration_ms: u64) {
        if let Some(sandbox) = self.lock().get_mut(id) {
            sandbox.busy = false;
            sandbox.executions += 1;
            sandbox.cpu_time_ms += duration_ms;
        }
    }

    /// Removes a sandbox and its workspace.
    pub fn delete(&self, id: &str) -> Result<(), ApiError> {
        let removed = self.lock().remove(id);
        match removed {
            Some(sandbox) => {
                if let Some(dir) = sandbox.workspace.parent() {
                    let _ = std::fs::remove_dir_all(dir);
                }
                Ok(())
            }
            None => Err(ApiError::sandbox_not_found(id)),
        }
    }

    /// Removes every sandbox whose lifetime is over; returns how many.
    pub fn reap_expired(&self) -> usize {
        let now = now_ms();
        let expired: Vec<Sandbox> = {
            let mut sandboxes = self.lock();
            let ids: Vec<String> = sandboxes
                .values()
                .filter(|s| s.expires_ms <= now && !s.busy)
                .map(|s| s.id.clone())
                .collect();
            ids.iter().filter_map(|id| sandboxes.remove(id)).collect()
        };
        for sandbox in &expired {
            if let Some(dir) = sandbox.workspace.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        expired.len()
    }

    /// Live sandboxes.
    pub fn count(&self) -> usize {
        self.lock().len()
    }
}

/// Checks a workspace-relative file name: relative, no `..`, no empty or `.` parts, no NUL,
/// at most 255 bytes a part and 4 096 in all. Returns the path under `workspace`.
pub fn workspace_path(workspace: &Path, name: &str) -> Result<PathBuf, ApiError> {
    let bad = |why: &str| {
        Err(ApiError::bad_request(
            "INVALID_PATH",
            format!("the file name {name:?} is not allowed: {why}"),
        )
        .with_details(json!({ "path": name })))
    };
    if name.is_empty() || name.len() > 4096 {
        return bad("it must be 1 to 4096 bytes");
    }
    if name.contains('\0') {
        return bad("it contains a NUL byte");
    }
    let path = Path::new(name);
    for component in path.components() {
        match component {
            Component::Normal(part) if part.len() <= 255 => {}
            Component::Normal(_) => return bad("a part is longer than 255 bytes"),
            Component::ParentDir => return bad("it contains `..`"),
            Component::RootDir | Component::Prefix(_) => return bad("it must be relative"),
            Component::CurDir => return bad("it contains `.`"),
        }
    }
    Ok(workspace.join(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_map_onto_runtimes() {
        for (image, language) in [
            ("python", Language::Python),
            ("python:3.12", Language::Python),
            ("@ai-sandbox/python", Language::Python),
            ("node:18-alpine", Language::JavaScript),
            ("library/node:20", Language::JavaScript),
            ("javascript", Language::JavaScript),
        ] {
            assert_eq!(image_language(image), Some(language), "{image}");
        }
        assert_eq!(image_language("ruby:3"), None);
        assert_eq!(image_language(""), None);
    }

    #[test]
    fn workspace_paths_refuse_escapes() {
        let ws = Path::new("/w");
        assert_eq!(
            workspace_path(ws, "data/in.txt").unwrap(),
            Path::new("/w/data/in.txt")
        );
        for bad in ["../x", "/etc/passwd", "a/../../x", "", "a\0b", "./a"] {
            let err = workspace_path(ws, bad).unwrap_err();
            assert_eq!(err.code, "INVALID_PATH", "{bad:?}");
        }
    }

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_000_000_123), "2026-11-18T11:06:40.123Z");
    }
}
