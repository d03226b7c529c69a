//! Each tenant's secrets: values a sandbox's network rules put into requests to named hosts
//! (`${secrets.NAME}` in a rule's header), which never enter the sandbox. A value is sealed
//! with ChaCha20-Poly1305 under the operator's key before it is written
//! (`secrets/<tenant>.json` in the data directory), bound to its tenant and id, and is
//! never returned by any read, list or log; only kiln's egress proxy reads it, per request.
//!
//! The key: `KILN_SECRETS_KEY` (64 hex digits), else the file `KILN_SECRETS_KEY_FILE`
//! names, else `secrets.key` in the data directory, made (mode 0600) the first time a
//! secret is stored. A key beside the data protects against little; an operator who wants
//! the values safe from a copy of the data directory keeps the key elsewhere.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

use crate::error::{Result, RuntimeError};
use crate::sandbox::{new_id, now_ms, rfc3339};
use crate::store;

/// The most secrets a tenant keeps, the longest value, and metadata's bounds.
pub const MAX_SECRETS: usize = 256;
pub const MAX_VALUE: usize = 64 << 10;
pub const MAX_METADATA: usize = 32;
pub const MAX_METADATA_BYTES: usize = 1024;

/// The environment variable holding the key (64 hex digits).
pub const KEY_ENV: &str = "KILN_SECRETS_KEY";
/// The environment variable naming the key's file.
pub const KEY_FILE_ENV: &str = "KILN_SECRETS_KEY_FILE";

/// What anyone may read of a secret: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretInfo {
    /// `sec_…`.
    pub id: String,
    /// Unique within the tenant; what `${secrets.NAME}` names.
    pub name: String,
    /// 1 when made, one more with each update.
    pub version: u64,
    pub metadata: BTreeMap<String, String>,
    /// RFC 3339.
    pub created_at: String,
    pub updated_at: String,
}

/// One stored secret: its info and its sealed value.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    #[serde(flatten)]
    info: SecretInfo,
    /// The 12-byte nonce, hex.
    nonce: String,
    /// The value sealed (ciphertext and tag), hex.
    sealed: String,
}

impl std::fmt::Debug for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stored")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TenantFile {
    /// Which key sealed its values (the first 8 bytes of its SHA-256, hex): a different
    /// key is told apart from a damaged file.
    key_id: String,
    secrets: Vec<Stored>,
}

/// The secrets of every tenant of a server.
pub struct Secrets {
    dir: PathBuf,
    key_source: KeySource,
    /// The key once read (or made).
    key: Mutex<Option<([u8; 32], String)>>,
    /// Serialises read-modify-write of the tenants' files.
    lock: Mutex<()>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Where the key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// 32 bytes given (from [`KEY_ENV`]).
    Given([u8; 32]),
    /// A file holding 64 hex digits; `create`: made if missing.
    File { path: PathBuf, create: bool },
}

impl KeySource {
    /// The key as the environment says, or the data directory's own file.
    pub fn from_env(data_dir: &Path) -> std::result::Result<KeySource, String> {
        if let Ok(text) = std::env::var(KEY_ENV) {
            return parse_key(&text)
                .map(KeySource::Given)
                .map_err(|why| format!("{KEY_ENV}: {why}"));
        }
        if let Some(path) = std::env::var_os(KEY_FILE_ENV) {
            return Ok(KeySource::File {
                path: PathBuf::from(path),
                create: false,
            });
        }
        Ok(KeySource::File {
            path: data_dir.join("secrets.key"),
            create: true,
        })
    }
}

fn parse_key(text: &str) -> std::result::Result<[u8; 32], String> {
    let bytes = hex::decode(text.trim())
        .map_err(|_| "a key is 64 hex digits (`openssl rand -hex 32`)".to_string())?;
    bytes
        .try_into()
        .map_err(|_| "a key is 64 hex digits (32 bytes)".to_string())
}

fn key_id(key: &[u8; 32]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(key)[..8])
}

fn invalid(message: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidOption {
        message: message.into(),
    }
}

fn failed(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::internal(format!("{what}: {e}"))
}

fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<()> {
    let bad = metadata.len() > MAX_METADATA
        || metadata.iter().any(|(k, v)| {
            k.is_empty() || k.len() > 256 || v.len() > MAX_METADATA_BYTES || k.contains('\0')
        });
    if bad {
        return Err(invalid(format!(
            "metadata: at most {MAX_METADATA} entries, keys of 1..=256 bytes, values of at most {MAX_METADATA_BYTES}"
        )));
    }
    Ok(())
}

fn check_value(value: &str) -> Result<()> {
    if value.is_empty() || value.len() > MAX_VALUE {
        return Err(invalid(format!(
            "a secret's value is 1..={MAX_VALUE} bytes"
        )));
    }
    Ok(())
}

impl Secrets {
    /// The secrets under `data_dir`, sealed with the key `key_source` gives (read when
    /// first needed).
    pub fn new(data_dir: &Path, key_source: KeySource) -> Secrets {
        Secrets {
            dir: data_dir.join("secrets"),
            key_source,
            key: Mutex::new(None),
            lock: Mutex::new(()),
        }
    }

    /// The key and its id; made where the source says to and it is missing.
    fn key(&self, create: bool) -> Result<Option<([u8; 32], String)>> {
        let mut cached = self.key.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = &*cached {
            return Ok(Some(key.clone()));
        }
        let key = match &self.key_source {
            KeySource::Given(key) => *key,
            KeySource::File {
                path,
                create: may_create,
            } => match std::fs::read_to_string(path) {
                Ok(text) => parse_key(&text)
                    .map_err(|why| failed(&format!("the secrets key {}", path.display()), why))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && *may_create && create => {
                    let mut key = [0u8; 32];
                    SystemRandom::new()
                        .fill(&mut key)
                        .map_err(|_| failed("the secrets key", "no randomness"))?;
                    write_private(path, hex::encode(key).as_bytes()).map_err(|e| {
                        failed(&format!("writing the secrets key {}", path.display()), e)
                    })?;
                    tracing::info!(
                        "made the secrets key {} (keep a copy: without it the secrets cannot be read)",
                        path.display()
                    );
                    key
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => {
                    return Err(failed(
                        &format!("reading the secrets key {}", path.display()),
                        e,
                    ));
                }
            },
        };
        let id = key_id(&key);
        *cached = Some((key, id.clone()));
        Ok(Some((key, id)))
    }

    fn path(&self, tenant: &str) -> PathBuf {
        // Tenant names are 1..=64 of A-Z a-z 0-9 - _ (or a key's id): safe as a file name.
        self.dir.join(format!("{tenant}.json"))
    }

    fn load(&self, tenant: &str) -> Result<TenantFile> {
        match store::read_json::<TenantFile>(&self.path(tenant)) {
            Ok(file) => Ok(file),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TenantFile::default()),
            Err(e) => Err(failed("reading the tenant's secrets", e)),
        }
    }

    fn save(&self, tenant: &str, file: &TenantFile) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| failed("the secrets folder", e))?;
        let _ = std::fs::set_permissions(
            &self.dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        );
        store::write_json(&self.path(tenant), file)
            .map_err(|e| failed("writing the tenant's secrets", e))?;
        let _ = std::fs::set_permissions(
            self.path(tenant),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        );
        Ok(())
    }

    fn seal(key: &[u8; 32], aad: &str, value: &str) -> Result<(String, String)> {
        let mut nonce = [0u8; 12];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| failed("sealing a secret", "no randomness"))?;
        let key = LessSafeKey::new(
            UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| failed("sealing", "bad key"))?,
        );
        let mut data = value.as_bytes().to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad.as_bytes()),
            &mut data,
        )
        .map_err(|_| failed("sealing a secret", "refused"))?;
        Ok((hex::encode(nonce), hex::encode(data)))
    }

    fn open(key: &[u8; 32], aad: &str, stored: &Stored) -> std::result::Result<String, String> {
        let nonce: [u8; 12] = hex::decode(&stored.nonce)
            .ok()
            .and_then(|n| n.try_into().ok())
            .ok_or("a damaged nonce")?;
        let mut data = hex::decode(&stored.sealed).map_err(|_| "a damaged value")?;
        let key =
            LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| "bad key")?);
        let plain = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad.as_bytes()),
                &mut data,
            )
            .map_err(
                |_| "it does not open with this server's key (damaged, or moved from elsewhere)",
            )?;
        String::from_utf8(plain.to_vec()).map_err(|_| "not text".to_string())
    }

    fn aad(tenant: &str, id: &str) -> String {
        format!("kiln secret\0{tenant}\0{id}")
    }

    /// Stores a new secret `name` for `tenant`.
    pub fn create(
        &self,
        tenant: &str,
        name: &str,
        value: &str,
        metadata: BTreeMap<String, String>,
    ) -> Result<SecretInfo> {
        if !kiln_core::net::secret_name_ok(name) {
            return Err(invalid(format!(
                "{name:?} is not a secret name: 1..=128 of A-Z a-z 0-9 _ . -"
            )));
        }
        check_value(value)?;
        check_metadata(&metadata)?;
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let (key, kid) = self
            .key(true)?
            .ok_or_else(|| failed("the secrets key", "missing"))?;
        let mut file = self.load(tenant)?;
        self.same_key(&file, &kid)?;
        if file.secrets.iter().any(|s| s.info.name == name) {
            return Err(RuntimeError::SecretExists {
                name: name.to_owned(),
            });
        }
        if file.secrets.len() >= MAX_SECRETS {
            return Err(invalid(format!(
                "a tenant keeps at most {MAX_SECRETS} secrets; delete one first"
            )));
        }
        let id = new_id("sec_");
        let at = rfc3339(now_ms());
        let (nonce, sealed) = Secrets::seal(&key, &Secrets::aad(tenant, &id), value)?;
        let info = SecretInfo {
            id,
            name: name.to_owned(),
            version: 1,
            metadata,
            created_at: at.clone(),
            updated_at: at,
        };
        file.key_id = kid;
        file.secrets.push(Stored {
            info: info.clone(),
            nonce,
            sealed,
        });
        self.save(tenant, &file)?;
        Ok(info)
    }

    fn same_key(&self, file: &TenantFile, kid: &str) -> Result<()> {
        if !file.secrets.is_empty() && file.key_id != kid {
            return Err(failed(
                "the tenant's secrets",
                "they were sealed with another key than this server's (KILN_SECRETS_KEY / KILN_SECRETS_KEY_FILE)",
            ));
        }
        Ok(())
    }

    /// Replaces the value of `tenant`'s secret `which` (its id or name), and its metadata
    /// where given.
    pub fn update(
        &self,
        tenant: &str,
        which: &str,
        value: &str,
        metadata: Option<BTreeMap<String, String>>,
    ) -> Result<SecretInfo> {
        check_value(value)?;
        if let Some(metadata) = &metadata {
            check_metadata(metadata)?;
        }
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let (key, kid) = self
            .key(true)?
            .ok_or_else(|| failed("the secrets key", "missing"))?;
        let mut file = self.load(tenant)?;
        self.same_key(&file, &kid)?;
        let stored = file
            .secrets
            .iter_mut()
            .find(|s| s.info.id == which || s.info.name == which)
            .ok_or_else(|| RuntimeError::SecretNotFound {
                name: which.to_owned(),
            })?;
        let (nonce, sealed) = Secrets::seal(&key, &Secrets::aad(tenant, &stored.info.id), value)?;
        stored.nonce = nonce;
        stored.sealed = sealed;
        stored.info.version += 1;
        stored.info.updated_at = rfc3339(now_ms());
        if let Some(metadata) = metadata {
            stored.info.metadata = metadata;
        }
        let info = stored.info.clone();
        self.save(tenant, &file)?;
        Ok(info)
    }

    /// `tenant`'s secrets, oldest first (never their values).
    pub fn list(&self, tenant: &str) -> Result<Vec<SecretInfo>> {
        Ok(self
            .load(tenant)?
            .secrets
            .into_iter()
            .map(|s| s.info)
            .collect())
    }

    /// One of `tenant`'s secrets by id or name (never its value).
    pub fn get(&self, tenant: &str, which: &str) -> Result<SecretInfo> {
        self.load(tenant)?
            .secrets
            .into_iter()
            .find(|s| s.info.id == which || s.info.name == which)
            .map(|s| s.info)
            .ok_or_else(|| RuntimeError::SecretNotFound {
                name: which.to_owned(),
            })
    }

    /// Deletes one of `tenant`'s secrets; false when there is none.
    pub fn delete(&self, tenant: &str, which: &str) -> Result<bool> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut file = self.load(tenant)?;
        let before = file.secrets.len();
        file.secrets
            .retain(|s| s.info.id != which && s.info.name != which);
        if file.secrets.len() == before {
            return Ok(false);
        }
        self.save(tenant, &file)?;
        Ok(true)
    }

    /// The value of `tenant`'s secret `name`: for kiln's egress proxy only.
    pub fn reveal(&self, tenant: &str, name: &str) -> std::result::Result<String, String> {
        let file = self.load(tenant).map_err(|e| e.to_string())?;
        let stored = file
            .secrets
            .iter()
            .find(|s| s.info.name == name)
            .ok_or_else(|| format!("tenant {tenant} has no secret {name:?}"))?;
        let (key, kid) = self
            .key(false)
            .map_err(|e| e.to_string())?
            .ok_or("this server has no secrets key")?;
        if file.key_id != kid {
            return Err(format!(
                "the secret {name:?} was sealed with another key than this server's"
            ));
        }
        Secrets::open(&key, &Secrets::aad(tenant, &stored.info.id), stored)
            .map_err(|why| format!("the secret {name:?}: {why}"))
    }
}

impl kiln_core::net::SecretSource for Secrets {
    fn secret(&self, tenant: &str, name: &str) -> std::result::Result<String, String> {
        self.reveal(tenant, name)
    }
}

/// Writes `bytes` to a new file only its owner may read.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grep(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                found.extend(grep(&path, needle));
            } else if std::fs::read(&path)
                .unwrap()
                .windows(needle.len())
                .any(|w| w == needle)
            {
                found.push(path);
            }
        }
        found
    }

    #[test]
    fn values_are_sealed_at_rest_and_only_revealed_to_the_proxy() {
        let data = tempfile::tempdir().unwrap();
        let secrets = Secrets::new(data.path(), KeySource::from_env(data.path()).unwrap());
        let value = "sk-live-0123456789abcdef";
        let info = secrets
            .create(
                "alice",
                "openai",
                value,
                BTreeMap::from([("team".into(), "ml".into())]),
            )
            .unwrap();
        assert_eq!((info.name.as_str(), info.version), ("openai", 1));
        assert!(info.id.starts_with("sec_"));
        // Nowhere on disk in the clear; the key file is private.
        assert!(grep(data.path(), value.as_bytes()).is_empty());
        let key = data.path().join("secrets.key");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&key).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        // Reads give the info, never the value.
        let listed = serde_json::to_string(&secrets.list("alice").unwrap()).unwrap();
        assert!(
            !listed.contains(value) && listed.contains("openai"),
            "{listed}"
        );
        assert_eq!(secrets.get("alice", &info.id).unwrap(), info);
        assert_eq!(secrets.reveal("alice", "openai").unwrap(), value);
        // Another tenant has none of it, even named the same.
        assert!(
            secrets
                .reveal("bob", "openai")
                .unwrap_err()
                .contains("no secret")
        );
        assert!(matches!(
            secrets.get("bob", "openai"),
            Err(RuntimeError::SecretNotFound { .. })
        ));
        // A sealed value moved to another tenant's file does not open there.
        let alice = std::fs::read_to_string(data.path().join("secrets/alice.json")).unwrap();
        std::fs::write(data.path().join("secrets/bob.json"), &alice).unwrap();
        assert!(
            secrets
                .reveal("bob", "openai")
                .unwrap_err()
                .contains("does not open")
        );
        // Update: a new version; the name stays unique.
        let updated = secrets.update("alice", "openai", "sk-new", None).unwrap();
        assert_eq!(updated.version, 2);
        assert_eq!(updated.metadata, info.metadata);
        assert_eq!(secrets.reveal("alice", "openai").unwrap(), "sk-new");
        assert!(matches!(
            secrets.create("alice", "openai", "x", BTreeMap::new()),
            Err(RuntimeError::SecretExists { .. })
        ));
        // A server with another key says so instead of reading garbage.
        let other = Secrets::new(data.path(), KeySource::Given([7; 32]));
        assert!(
            other
                .reveal("alice", "openai")
                .unwrap_err()
                .contains("another key")
        );
        assert!(other.create("alice", "more", "x", BTreeMap::new()).is_err());
        // Delete.
        assert!(secrets.delete("alice", &info.id).unwrap());
        assert!(!secrets.delete("alice", "openai").unwrap());
        assert!(secrets.reveal("alice", "openai").is_err());
    }

    #[test]
    fn bad_names_values_metadata_and_keys_are_refused() {
        let data = tempfile::tempdir().unwrap();
        let secrets = Secrets::new(data.path(), KeySource::Given([1; 32]));
        for name in ["", "a b", "${x}", "a/b", &"n".repeat(129)] {
            assert!(
                secrets.create("t", name, "v", BTreeMap::new()).is_err(),
                "{name:?}"
            );
        }
        assert!(secrets.create("t", "empty", "", BTreeMap::new()).is_err());
        let big = "v".repeat(MAX_VALUE + 1);
        assert!(secrets.create("t", "big", &big, BTreeMap::new()).is_err());
        let many: BTreeMap<String, String> = (0..=MAX_METADATA)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(secrets.create("t", "meta", "v", many).is_err());
        for _ in 0..MAX_SECRETS {
            let name = format!("s{}", secrets.list("t").unwrap().len());
            secrets.create("t", &name, "v", BTreeMap::new()).unwrap();
        }
        let full = secrets
            .create("t", "one-more", "v", BTreeMap::new())
            .unwrap_err();
        assert!(full.to_string().contains("at most"), "{full}");
        for bad in ["", "xyz", &"ab".repeat(31)] {
            assert!(parse_key(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_key(&"0f".repeat(32)).unwrap(), [0x0f; 32]);
        // A key file named by the operator that is missing is not made in its place.
        let named = Secrets::new(
            data.path(),
            KeySource::File {
                path: data.path().join("elsewhere.key"),
                create: false,
            },
        );
        assert!(named.create("t", "x", "v", BTreeMap::new()).is_err());
        assert!(!data.path().join("elsewhere.key").exists());
    }
}
