//! API keys. A key is `kiln_` and 48 hex digits (192 random bits). Only its SHA-256 is
//! stored (`keys.json` in the data directory): a key with that much entropy needs no slow
//! password hash, and a stolen `keys.json` gives no key back. A key belongs to a tenant;
//! a tenant sees only its own sandboxes. Keys are managed with `kiln keys`; the server
//! picks up changes to `keys.json` on the next request (a revoked key stops at once).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::quota::QuotaOverrides;
use crate::sandbox::{new_id, now_ms, rfc3339};
use crate::store;

/// The tenant every request belongs to when authentication is off.
pub const LOCAL_TENANT: &str = "local";

/// One stored key (never the key itself).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyRecord {
    /// Public id, e.g. `key_1a2b3c…`; used to list and revoke.
    pub id: String,
    /// A label for people.
    pub name: String,
    /// The tenant the key acts for.
    pub tenant: String,
    /// SHA-256 of the key, hex.
    pub sha256: String,
    /// When it was created (RFC 3339).
    pub created_at: String,
    /// Quotas of its own, where they differ from the server's.
    #[serde(default, skip_serializing_if = "QuotaOverrides::is_empty")]
    pub quotas: QuotaOverrides,
    /// Whether sandboxes it makes may reach beyond the operator's network allowlist (their
    /// `allowOut` names hosts the operator did not list). Default: no, they only narrow it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub network_widen: bool,
    /// Whether it may manage keys and see every tenant's usage (`/api/v1/keys`,
    /// `/api/v1/tenants`). Its sandboxes are still only its own tenant's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin: bool,
}

/// What a new key may do beyond its tenant's sandboxes.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyGrant {
    /// See [`KeyRecord::network_widen`].
    pub network_widen: bool,
    /// See [`KeyRecord::admin`].
    pub admin: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyFile {
    keys: Vec<KeyRecord>,
}

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The tenant whose sandboxes it may touch.
    pub tenant: String,
    /// The key's public id (`local` without auth); rate limits count per key.
    pub key_id: String,
    /// The key's own quotas (see [`crate::Runtime::quotas`]).
    pub quotas: QuotaOverrides,
    /// Whether its sandboxes' egress rules may widen the operator's allowlist (see
    /// [`KeyRecord::network_widen`]); the one user of a server without keys may.
    pub network_widen: bool,
    /// Whether it is an admin key ([`KeyRecord::admin`]); never for a server without keys,
    /// nor for anything acting by a sandbox's or a volume's own token.
    pub admin: bool,
}

impl Caller {
    /// The one tenant of a server without keys (and of MCP over stdio).
    pub fn local() -> Caller {
        Caller {
            tenant: LOCAL_TENANT.into(),
            key_id: LOCAL_TENANT.into(),
            quotas: QuotaOverrides::default(),
            network_widen: true,
            admin: false,
        }
    }
}

fn hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

fn keys_path(data_dir: &Path) -> PathBuf {
    data_dir.join("keys.json")
}

fn load(path: &Path) -> std::io::Result<KeyFile> {
    match store::read_json(path) {
        Ok(file) => Ok(file),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KeyFile::default()),
        Err(e) => Err(e),
    }
}

/// Creates a key for `tenant` (a fresh tenant named after the key when `None`); returns the
/// record and the key, which is shown once and never stored.
pub fn create_key(
    data_dir: &Path,
    name: &str,
    tenant: Option<&str>,
    quotas: QuotaOverrides,
) -> std::io::Result<(KeyRecord, String)> {
    create_key_with(data_dir, name, tenant, quotas, KeyGrant::default())
}

/// Why a tenant name is refused, if it is.
pub fn check_tenant_name(tenant: &str) -> Result<(), &'static str> {
    if tenant.is_empty()
        || tenant.len() > 64
        || !tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err("a tenant name is 1 to 64 characters of A-Z, a-z, 0-9, - and _");
    }
    Ok(())
}

/// Why a key's name (a label for people) is refused, if it is.
pub fn check_key_name(name: &str) -> Result<(), &'static str> {
    if name.chars().count() > 128 || name.chars().any(char::is_control) {
        return Err("a key's name is at most 128 characters, none of them control characters");
    }
    Ok(())
}

/// As [`create_key`], with what the key may do beyond its tenant's sandboxes.
pub fn create_key_with(
    data_dir: &Path,
    name: &str,
    tenant: Option<&str>,
    quotas: QuotaOverrides,
    grant: KeyGrant,
) -> std::io::Result<(KeyRecord, String)> {
    create_key_within(data_dir, name, tenant, quotas, grant, usize::MAX)?
        .ok_or_else(|| std::io::Error::other("the server holds its most keys"))
}

/// [`create_key_with`], unless `keys.json` already holds `max` keys (`None`): counted under
/// the same lock as the write, so keys made at once never pass `max`.
pub fn create_key_within(
    data_dir: &Path,
    name: &str,
    tenant: Option<&str>,
    quotas: QuotaOverrides,
    grant: KeyGrant,
    max: usize,
) -> std::io::Result<Option<(KeyRecord, String)>> {
    if let Some(tenant) = tenant {
        check_tenant_name(tenant).map_err(std::io::Error::other)?;
    }
    check_key_name(name).map_err(std::io::Error::other)?;
    let id = new_id("key_");
    let key = format!("kiln_{}", crate::sandbox::random_hex(24));
    let record = KeyRecord {
        id: id.clone(),
        name: name.to_owned(),
        tenant: tenant.map_or_else(|| id.clone(), str::to_owned),
        sha256: hash(&key),
        created_at: rfc3339(now_ms()),
        quotas,
        network_widen: grant.network_widen,
        admin: grant.admin,
    };
    let made = edit_keys(data_dir, |keys| {
        if keys.len() >= max {
            return Err(());
        }
        keys.push(record.clone());
        Ok(())
    })?;
    Ok(made.ok().map(|()| (record, key)))
}

/// Every stored key record.
pub fn list_keys(data_dir: &Path) -> std::io::Result<Vec<KeyRecord>> {
    Ok(load(&keys_path(data_dir))?.keys)
}

/// Removes the key with public id `id`; false when there is none.
pub fn revoke_key(data_dir: &Path, id: &str) -> std::io::Result<bool> {
    let revoked = edit_keys(data_dir, |keys| {
        let before = keys.len();
        keys.retain(|k| k.id != id);
        if keys.len() == before {
            Err(())
        } else {
            Ok(())
        }
    })?;
    Ok(revoked.is_ok())
}

/// Changes the keys on file under their lock: `change` sees every record and answers
/// `Err` to leave the file as it was, `Ok` to write what it left.
pub fn edit_keys<T, E>(
    data_dir: &Path,
    change: impl FnOnce(&mut Vec<KeyRecord>) -> Result<T, E>,
) -> std::io::Result<Result<T, E>> {
    std::fs::create_dir_all(data_dir)?;
    let path = keys_path(data_dir);
    let _lock = FileLock::acquire(&data_dir.join(".keys.lock"))?;
    let mut file = load(&path)?;
    let outcome = change(&mut file.keys);
    if outcome.is_ok() {
        store::write_json(&path, &file)?;
    }
    Ok(outcome)
}

struct FileLock(std::fs::File);

impl FileLock {
    fn acquire(path: &Path) -> std::io::Result<FileLock> {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::create(path)?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(FileLock(file))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking the descriptor we locked.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// How requests are authenticated.
pub enum Auth {
    /// Anyone is the local tenant.
    Off,
    /// Bearer keys from `keys.json`, reloaded when the file changes.
    Keys(KeyStore),
}

impl Auth {
    /// Who acts for a request that reached `sandbox` by the sandbox's own token (no API
    /// key): the key that made it, with that key's quotas and rate limit. `None` where that
    /// key was revoked. A sandbox recorded before kiln kept its key acts for its tenant with
    /// the server's default quotas.
    pub fn acting_for(&self, sandbox: &crate::sandbox::Sandbox) -> Option<Caller> {
        match self {
            Auth::Off => Some(Caller::local()),
            Auth::Keys(store) => match &sandbox.key_id {
                Some(key_id) => store.by_id(key_id).filter(|c| c.tenant == sandbox.tenant),
                None => Some(Caller {
                    tenant: sandbox.tenant.clone(),
                    key_id: format!("sandbox:{}", sandbox.id),
                    quotas: QuotaOverrides::default(),
                    network_widen: false,
                    admin: false,
                }),
            }
            // A sandbox's token acts for its key's tenant, never as an admin.
            .map(|caller| Caller {
                admin: false,
                ..caller
            }),
        }
    }
}

/// When `keys.json` last changed: (modified time, inode).
type FileStamp = (SystemTime, u64);

/// The server's view of `keys.json`.
pub struct KeyStore {
    path: PathBuf,
    cache: Mutex<(Option<FileStamp>, HashMap<String, Caller>)>,
}

impl KeyStore {
    pub fn new(data_dir: &Path) -> KeyStore {
        KeyStore {
            path: keys_path(data_dir),
            cache: Mutex::new((None, HashMap::new())),
        }
    }

    /// Number of keys on file.
    pub fn count(&self) -> usize {
        self.refresh();
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).1.len()
    }

    fn refresh(&self) {
        // Every write renames a new file into place, so the inode changes with each one.
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| Ok((m.modified()?, std::os::unix::fs::MetadataExt::ino(&m))))
            .ok();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.0 == modified && modified.is_some() {
            return;
        }
        let keys = load(&self.path).map(|f| f.keys).unwrap_or_else(|e| {
            tracing::error!(
                "cannot read {}: {e}; refusing every key",
                self.path.display()
            );
            Vec::new()
        });
        cache.1 = keys
            .into_iter()
            .map(|k| {
                (
                    k.sha256,
                    Caller {
                        tenant: k.tenant,
                        key_id: k.id,
                        quotas: k.quotas,
                        network_widen: k.network_widen,
                        admin: k.admin,
                    },
                )
            })
            .collect();
        cache.0 = modified;
    }

    /// The caller of the key whose public id is `key_id`, while it is on file.
    pub fn by_id(&self, key_id: &str) -> Option<Caller> {
        self.refresh();
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .values()
            .find(|c| c.key_id == key_id)
            .cloned()
    }

    /// The caller a presented key stands for.
    pub fn check(&self, key: &str) -> Option<Caller> {
        self.refresh();
        let digest = hash(key);
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .get(&digest)
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attack: many keys made at once against a cap. The count is taken under the lock that
    /// writes, so the cap holds (before, it was counted first and written after).
    #[test]
    fn keys_made_at_once_never_pass_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let made: usize = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..12)
                .map(|i| {
                    let dir = dir.path();
                    scope.spawn(move || {
                        let name = format!("k{i}");
                        create_key_within(
                            dir,
                            &name,
                            None,
                            QuotaOverrides::default(),
                            KeyGrant::default(),
                            5,
                        )
                        .unwrap()
                        .is_some() as usize
                    })
                })
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).sum()
        });
        assert_eq!(made, 5);
        assert_eq!(list_keys(dir.path()).unwrap().len(), 5);
    }

    #[test]
    fn keys_are_stored_hashed_checked_and_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let (record, key) = create_key(dir.path(), "ci", None, QuotaOverrides::default()).unwrap();
        assert!(key.starts_with("kiln_") && key.len() == 53);
        let text = std::fs::read_to_string(dir.path().join("keys.json")).unwrap();
        assert!(!text.contains(&key), "the key itself must never be stored");
        let store = KeyStore::new(dir.path());
        let caller = store.check(&key).unwrap();
        assert_eq!(caller.tenant, record.id);
        assert_eq!(store.check("kiln_wrong"), None);
        assert!(revoke_key(dir.path(), &record.id).unwrap());
        assert_eq!(store.check(&key), None);
        assert!(create_key(dir.path(), "x", Some("../evil"), QuotaOverrides::default()).is_err());
    }
}
