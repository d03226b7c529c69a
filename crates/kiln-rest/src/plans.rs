//! The plan cache: code a planner marked as generic for a route shape (`GET /members/{id}`),
//! reused for every request of that shape without asking the planner again. Per tenant, kept
//! in `<data>/plans/<tenant>.json`, inspectable and clearable with `kiln rest plans`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use kiln_http::HttpError;
use serde::{Deserialize, Serialize};

/// A path segment a `{param}` never stands for: `GET /members/{id}` does not answer
/// `GET /members/search`.
pub const RESERVED_SEGMENTS: &[&str] = &["search"];

/// One cached plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanEntry {
    /// `METHOD /literal/{param}`.
    pub pattern: String,
    /// The plan's Python code (checked again each time a session first runs it).
    pub code: String,
    /// Who wrote it: `conventions` or the model's name.
    pub planner: String,
    /// Unix seconds.
    pub created: u64,
    /// Requests it answered from the cache.
    pub hits: u64,
    /// What the plan said beside its code that its run needs: `action`, `resource` (the
    /// collection `store` is bound to) and the response `hints` honoured (`status`,
    /// `location_id`). Null in entries written before kiln kept it.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub meta: serde_json::Value,
}

/// A tenant's cache, as stored.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TenantPlans {
    pub entries: Vec<PlanEntry>,
    /// Requests answered from the cache, and those that needed the planner.
    pub hits: u64,
    pub misses: u64,
}

impl TenantPlans {
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// Splits and decodes a request's path into the segments patterns match; refuses what no
/// collection could be named by (a control character, an encoded `/`, `.` or `..`, a path
/// over 2048 bytes or 32 segments).
pub fn segments(path: &str) -> Result<Vec<String>, HttpError> {
    let bad = |why: &str| HttpError::new(StatusCode::BAD_REQUEST, "INVALID_PATH", why.to_string());
    if path.len() > 2048 {
        return Err(bad("the path is longer than 2048 bytes"));
    }
    let mut out = Vec::new();
    for raw in path.split('/').filter(|s| !s.is_empty()) {
        let decoded = percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map_err(|_| bad("a path segment is not UTF-8 once decoded"))?;
        if decoded.contains(['\0', '/']) || decoded.chars().any(char::is_control) {
            return Err(bad(
                "a path segment holds a control character or an encoded '/'",
            ));
        }
        if decoded == "." || decoded == ".." {
            return Err(bad("'.' and '..' are not path segments here"));
        }
        out.push(decoded.into_owned());
    }
    if out.len() > 32 {
        return Err(bad("the path has more than 32 segments"));
    }
    Ok(out)
}

/// A parsed pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    pub method: String,
    /// `None` for a `{param}`.
    pub segments: Vec<Option<String>>,
}

impl Pattern {
    /// Parses `METHOD /a/{b}`; `None` when malformed.
    pub fn parse(text: &str) -> Option<Pattern> {
        let (method, path) = text.trim().split_once(' ')?;
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
            return None;
        }
        let path = path.trim();
        if !path.starts_with('/') || path.len() > 512 {
            return None;
        }
        let mut segments = Vec::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                let ok = !name.is_empty()
                    && name.len() <= 64
                    && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                if !ok {
                    return None;
                }
                segments.push(None);
            } else if part.contains(['{', '}'])
                || part == "."
                || part == ".."
                || part.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                // A literal is a segment a request can have, written as it is read (the
                // fuzz target rest_plans found `GET /a/b ` read back as `/a/b`).
                return None;
            } else {
                segments.push(Some(part.to_string()));
            }
        }
        Some(Pattern {
            method: method.to_string(),
            segments,
        })
    }

    pub fn matches(&self, method: &str, segments: &[String]) -> bool {
        self.method == method
            && self.segments.len() == segments.len()
            && self
                .segments
                .iter()
                .zip(segments)
                .all(|(want, got)| match want {
                    Some(literal) => literal == got,
                    None => !RESERVED_SEGMENTS.contains(&got.as_str()),
                })
    }

    fn literals(&self) -> usize {
        self.segments.iter().filter(|s| s.is_some()).count()
    }
}

struct Loaded {
    plans: TenantPlans,
    patterns: Vec<Option<Pattern>>,
    /// The file's (modified, length, inode) when last read or written: a change made by
    /// someone else (`kiln rest plans --clear`, which replaces the file) is seen at the next
    /// lookup.
    stamp: Option<(SystemTime, u64, u64)>,
    dirty: bool,
}

/// Every tenant's plan cache.
pub struct PlanCache {
    dir: PathBuf,
    /// The tenants with a live session (others are forgotten when their session ends).
    tenants: Mutex<HashMap<String, Loaded>>,
    /// Hits and misses of the tenants forgotten since start.
    retired: Mutex<(u64, u64)>,
}

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanCache").field("dir", &self.dir).finish()
    }
}

fn stamp(path: &Path) -> Option<(SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len(), meta.ino()))
}

/// Reads a tenant's stored cache (empty when there is none).
pub fn read_tenant(path: &Path) -> std::io::Result<TenantPlans> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TenantPlans::default()),
        Err(e) => Err(e),
    }
}

impl PlanCache {
    pub fn new(dir: PathBuf) -> std::io::Result<PlanCache> {
        std::fs::create_dir_all(&dir)?;
        Ok(PlanCache {
            dir,
            tenants: Mutex::default(),
            retired: Mutex::default(),
        })
    }

    pub fn path(&self, tenant: &str) -> PathBuf {
        self.dir.join(format!("{tenant}.json"))
    }

    fn with_tenant<T>(&self, tenant: &str, f: impl FnOnce(&mut Loaded) -> T) -> T {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.path(tenant);
        let now = stamp(&path);
        let stale = tenants.get(tenant).is_none_or(|l| l.stamp != now);
        if stale {
            // A file that cannot be read is treated as empty (and overwritten on the next
            // insert): a cache is only a cache.
            let plans = read_tenant(&path).unwrap_or_default();
            let patterns = plans
                .entries
                .iter()
                .map(|e| Pattern::parse(&e.pattern))
                .collect();
            tenants.insert(
                tenant.to_string(),
                Loaded {
                    plans,
                    patterns,
                    stamp: now,
                    dirty: false,
                },
            );
        }
        let loaded = tenants.get_mut(tenant).expect("inserted above");
        f(loaded)
    }

    /// The cached plan for this request, if any. Counts a hit or a miss.
    pub fn lookup(&self, tenant: &str, method: &str, segments: &[String]) -> Option<PlanEntry> {
        self.with_tenant(tenant, |loaded| {
            let best = loaded
                .patterns
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.as_ref().map(|p| (i, p)))
                .filter(|(_, p)| p.matches(method, segments))
                .max_by_key(|(_, p)| p.literals())
                .map(|(i, _)| i);
            loaded.dirty = true;
            match best {
                Some(i) => {
                    loaded.plans.hits += 1;
                    let entry = &mut loaded.plans.entries[i];
                    entry.hits += 1;
                    Some(entry.clone())
                }
                None => {
                    loaded.plans.misses += 1;
                    None
                }
            }
        })
    }

    /// Keeps a generic plan (replacing one with the same pattern) and writes the cache now.
    /// `created` and `hits` are set here.
    pub fn insert(&self, tenant: &str, mut entry: PlanEntry) -> std::io::Result<()> {
        let path = self.path(tenant);
        entry.created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        entry.hits = 0;
        self.with_tenant(tenant, |loaded| {
            let parsed = Pattern::parse(&entry.pattern);
            match loaded
                .plans
                .entries
                .iter()
                .position(|e| e.pattern == entry.pattern)
            {
                Some(i) => {
                    loaded.plans.entries[i] = entry;
                    loaded.patterns[i] = parsed;
                }
                None => {
                    loaded.plans.entries.push(entry);
                    loaded.patterns.push(parsed);
                }
            }
            write(&path, loaded)
        })
    }

    /// Writes every cache whose counters moved (once a second, and at shutdown).
    pub fn flush(&self) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        for (tenant, loaded) in tenants.iter_mut() {
            if !loaded.dirty {
                continue;
            }
            let path = self.path(tenant);
            if stamp(&path) != loaded.stamp {
                // Changed by someone else: theirs wins; reread at the next lookup.
                loaded.dirty = false;
                continue;
            }
            let _ = write(&path, loaded);
        }
    }

    /// Writes the tenant's counters if they moved and drops it from memory (its session
    /// ended; the next lookup reads the file again).
    pub fn forget(&self, tenant: &str) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut loaded) = tenants.remove(tenant) {
            let path = self.path(tenant);
            if loaded.dirty && stamp(&path) == loaded.stamp {
                let _ = write(&path, &mut loaded);
            }
            self.retire(&loaded);
        }
    }

    /// Deletes the tenant's cache, file and memory (a tenant that stored nothing keeps
    /// nothing on disk).
    pub fn remove(&self, tenant: &str) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(loaded) = tenants.remove(tenant) {
            self.retire(&loaded);
        }
        let _ = std::fs::remove_file(self.path(tenant));
    }

    fn retire(&self, loaded: &Loaded) {
        let mut retired = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        retired.0 += loaded.plans.hits;
        retired.1 += loaded.plans.misses;
    }

    /// Hits and misses over every tenant seen since start.
    pub fn totals(&self) -> (u64, u64) {
        let tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let retired = *self.retired.lock().unwrap_or_else(|e| e.into_inner());
        tenants
            .values()
            .fold(retired, |(h, m), l| (h + l.plans.hits, m + l.plans.misses))
    }

    /// Tenants whose cache is in memory.
    pub fn loaded(&self) -> usize {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

fn write(path: &Path, loaded: &mut Loaded) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(&loaded.plans).map_err(std::io::Error::other)?;
    kiln_workspace::store::write_atomic(path, &bytes)?;
    loaded.stamp = stamp(path);
    loaded.dirty = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(path: &str) -> Vec<String> {
        path.split('/')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    }

    fn entry(pattern: &str, code: &str) -> PlanEntry {
        PlanEntry {
            pattern: pattern.into(),
            code: code.into(),
            planner: "conventions".into(),
            created: 0,
            hits: 0,
            meta: serde_json::json!({"action": "get", "resource": "a", "hints": {}}),
        }
    }

    #[test]
    fn patterns_parse_and_match_the_most_specific() {
        let p = Pattern::parse("GET /members/{id}").unwrap();
        assert!(p.matches("GET", &segs("/members/7")));
        assert!(!p.matches("GET", &segs("/members/search")));
        assert!(!p.matches("PUT", &segs("/members/7")));
        assert!(!p.matches("GET", &segs("/members")));
        for bad in [
            "get /x",
            "GET x",
            "GET /{}",
            "GET /{a-b}",
            "GET /a{b}",
            "/x",
            "",
            // Literals no request segment can be (rest_plans, the fuzz target, found the
            // first: its trailing space was lost when the pattern was written again).
            "GET /a/b\u{12} ",
            "GET /a\0/b",
            "GET /a b/c",
            "GET /../x",
        ] {
            assert_eq!(Pattern::parse(bad), None, "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        let cache = PlanCache::new(dir.path().to_path_buf()).unwrap();
        assert!(cache.lookup("t", "GET", &segs("/a/b")).is_none());
        cache.insert("t", entry("GET /a/{x}", "generic")).unwrap();
        cache.insert("t", entry("GET /a/b", "literal")).unwrap();
        assert_eq!(
            cache.lookup("t", "GET", &segs("/a/b")).unwrap().code,
            "literal"
        );
        assert_eq!(
            cache.lookup("t", "GET", &segs("/a/c")).unwrap().code,
            "generic"
        );
        assert!(
            cache.lookup("u", "GET", &segs("/a/c")).is_none(),
            "per tenant"
        );
        assert_eq!(cache.totals(), (2, 2));
        cache.flush();
        let stored = read_tenant(&cache.path("t")).unwrap();
        assert_eq!(
            (stored.hits, stored.misses, stored.entries.len()),
            (2, 1, 2)
        );

        // Forgotten when the tenant's session ends: counters written, memory freed, the
        // totals kept; removed when the tenant stored nothing: no file left.
        cache.lookup("t", "GET", &segs("/a/b"));
        cache.forget("t");
        assert_eq!(cache.loaded(), 1, "only u is in memory");
        assert_eq!(read_tenant(&cache.path("t")).unwrap().hits, 3);
        assert_eq!(cache.totals(), (3, 2));
        cache.insert("u", entry("GET /x", "code")).unwrap();
        cache.remove("u");
        assert!(!cache.path("u").exists());
        assert_eq!((cache.loaded(), cache.totals()), (0, (3, 2)));

        // Cleared from outside: the next lookup sees it.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(cache.path("t"), b"{\"entries\": []}").unwrap();
        assert!(cache.lookup("t", "GET", &segs("/a/c")).is_none());
    }
}
