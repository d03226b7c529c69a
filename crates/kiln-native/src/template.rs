//! Template definitions: YAML in the shape of seed 002's `templates:` (base, packages,
//! default_shell, working_dir, resources, expose_ports, env, post_install), plus the image
//! names a template honours, the languages its code cells speak and the packages whose
//! versions a sandbox reports. kiln ships `debian`, `python`, `node`, `go` and `services`
//! (the databases and web server of workspaces); operators add
//! their own in a folder named in the configuration (a file there replaces a shipped one of
//! the same name).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The definitions kiln ships.
pub const SHIPPED: [(&str, &str); 5] = [
    ("debian", include_str!("../templates/debian.yaml")),
    ("python", include_str!("../templates/python.yaml")),
    ("node", include_str!("../templates/node.yaml")),
    ("go", include_str!("../templates/go.yaml")),
    ("services", include_str!("../templates/services.yaml")),
];

/// The Debian releases a template may be built from.
pub const SUITES: [&str; 3] = ["bookworm", "trixie", "bullseye"];

/// Bumped whenever the builder's steps change what a root filesystem holds (or how it is
/// made: 2 builds in the jail), so every template is rebuilt once.
pub const BUILDER_VERSION: u32 = 2;

/// The largest definition file read.
const MAX_DEFINITION_BYTES: u64 = 64 << 10;

pub use kiln_core::template::Resources;

/// The image names a template honours (see `kiln_core::template::ImageRule`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Images {
    #[serde(default)]
    pub names: Vec<String>,
    #[serde(default)]
    pub repos: Vec<String>,
    /// `MIN-MAX` as `major.minor` (`3.0-3.11`); absent: any tag.
    #[serde(default)]
    pub versions: Option<String>,
}

/// One template definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// `debian:SUITE`: the Debian release the root filesystem is bootstrapped from.
    pub base: String,
    /// Debian packages installed with apt-get after the bootstrap.
    #[serde(default)]
    pub packages: Vec<String>,
    #[serde(default = "default_shell")]
    pub default_shell: String,
    /// Where the sandbox's workspace is mounted, and where commands start.
    #[serde(default = "default_working_dir")]
    pub working_dir: String,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default)]
    pub expose_ports: Vec<u16>,
    /// Environment for every process in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// A shell script run as root inside the new root filesystem after the packages.
    #[serde(default)]
    pub post_install: Option<String>,
    #[serde(default)]
    pub images: Images,
    /// The languages code cells may use (`python`, `javascript`, `go`, `bash`).
    #[serde(default)]
    pub languages: Vec<String>,
    /// Packages whose installed versions a sandbox reports.
    #[serde(default)]
    pub versions: Vec<String>,
    /// Its warm pool (seed 002): `target_pool_size`, `max_vms`, `empty_pool_policy`
    /// (`wait`, `boot_sync`, `reject`), `claim_timeout_seconds`. What it leaves unset comes
    /// from the server's settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<kiln_core::pool::PoolDefinition>,
    /// The container runtime its boxes run under: `runc`, or gVisor's `runsc` (a user-space
    /// kernel between the box and the host). Absent: the server's `--box-runtime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub box_runtime: Option<BoxRuntime>,
}

/// The container runtimes a box may run under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoxRuntime {
    /// runc: the box's processes on the host's kernel, in namespaces, cgroups and seccomp.
    Runc,
    /// gVisor's runsc: a user-space kernel between the box and the host.
    Runsc,
}

impl BoxRuntime {
    pub fn name(self) -> &'static str {
        match self {
            BoxRuntime::Runc => "runc",
            BoxRuntime::Runsc => "runsc",
        }
    }
}

fn default_shell() -> String {
    "/bin/bash".into()
}
fn default_working_dir() -> String {
    "/workspace".into()
}

/// A definition that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("template {origin}: {message}")]
pub struct DefinitionError {
    /// Where it came from (a file, or `shipped NAME`).
    pub origin: String,
    pub message: String,
}

fn valid_name(name: &str, max: usize, extra: &[char]) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(&c))
}

impl Definition {
    /// Parses and checks one definition.
    pub fn parse(text: &str, origin: &str) -> Result<Definition, DefinitionError> {
        let err = |message: String| DefinitionError {
            origin: origin.to_string(),
            message,
        };
        let definition: Definition =
            serde_yaml_ng::from_str(text).map_err(|e| err(e.to_string()))?;
        definition.check().map_err(err)?;
        Ok(definition)
    }

    fn check(&self) -> Result<(), String> {
        if !valid_name(&self.name, 40, &['-']) {
            return Err(format!(
                "the name {:?} must be 1–40 lower-case letters, digits and dashes",
                self.name
            ));
        }
        self.suite()?;
        if let Some(bad) = self
            .packages
            .iter()
            .chain(&self.versions)
            .find(|p| !valid_name(p, 100, &['-', '+', '.']))
        {
            return Err(format!("{bad:?} is not a Debian package name"));
        }
        for path in [&self.working_dir, &self.default_shell] {
            if !path.starts_with('/') || path.split('/').any(|p| p == "..") || path.contains('\0') {
                return Err(format!("{path:?} must be an absolute path without `..`"));
            }
        }
        if let Some(key) = self.env.keys().find(|k| {
            k.is_empty()
                || k.starts_with(|c: char| c.is_ascii_digit())
                || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }) {
            return Err(format!("{key:?} is not an environment variable name"));
        }
        let r = &self.resources;
        if !(r.vcpus > 0.0 && r.vcpus <= 64.0) || r.memory_mb < 16 || r.pids < 8 || r.disk_mb < 16 {
            return Err(
                "resources need vcpus in (0, 64], memory_mb ≥ 16, disk_mb ≥ 16 and pids ≥ 8".into(),
            );
        }
        if let Some(bad) = self.languages.iter().find(|l| {
            !matches!(
                l.as_str(),
                "python" | "javascript" | "go" | "bash" | "typescript"
            )
        }) {
            return Err(format!(
                "the language {bad:?} is not one of python, javascript, go, bash"
            ));
        }
        if let Some(pool) = &self.pool {
            pool.check()?;
        }
        if let Some(range) = &self.images.versions {
            parse_range(range)
                .ok_or_else(|| format!("images.versions {range:?} must be MIN-MAX, as 3.0-3.11"))?;
        }
        Ok(())
    }

    /// The Debian release to bootstrap.
    pub fn suite(&self) -> Result<&str, String> {
        match self.base.split_once(':') {
            Some(("debian", suite)) if SUITES.contains(&suite) => Ok(suite),
            _ => Err(format!(
                "base {:?} must be debian:SUITE, with SUITE one of {}",
                self.base,
                SUITES.join(", ")
            )),
        }
    }

    /// The content address of the root filesystem this definition builds: a digest of
    /// everything that changes what the builder writes (base, packages, post-install
    /// script, the mirror, the uid shift and the builder's version), not of what only
    /// applies when a sandbox runs (env, resources, image names).
    pub fn build_hash(&self, mirror: &str, uid_base: u32) -> String {
        let mut packages = self.packages.clone();
        packages.sort();
        packages.dedup();
        // A struct, not a JSON map: its field order is fixed whatever serde_json features
        // the build unifies (`preserve_order` would reorder a map and change the hash).
        #[derive(Serialize)]
        struct Key<'a> {
            builder: u32,
            base: &'a str,
            packages: Vec<String>,
            post_install: Option<&'a str>,
            mirror: &'a str,
            uid_base: u32,
            user: u32,
        }
        let key = serde_json::to_string(&Key {
            builder: BUILDER_VERSION,
            base: &self.base,
            packages,
            post_install: self.post_install.as_deref(),
            mirror,
            uid_base,
            user: USER_UID,
        })
        .unwrap_or_default();
        hex::encode(Sha256::digest(key.as_bytes()))
    }
}

/// The unprivileged user code runs as inside a box, and its home.
pub const USER_NAME: &str = "user";
pub const USER_UID: u32 = 1000;
pub const USER_HOME: &str = "/home/user";

/// `3.0-3.11` → ((3, 0), (3, 11)).
pub fn parse_range(range: &str) -> Option<((u32, u32), (u32, u32))> {
    let version = |v: &str| {
        let (major, minor) = v.trim().split_once('.')?;
        Some((major.parse().ok()?, minor.parse().ok()?))
    };
    let (min, max) = range.split_once('-')?;
    let (min, max) = (version(min)?, version(max)?);
    (min <= max).then_some((min, max))
}

/// Every definition: the shipped ones, replaced or joined by the `*.yaml` files in
/// `folder` (an operator's). A bad file is an error naming it, never skipped silently.
pub fn load(folder: Option<&Path>) -> Result<Vec<Definition>, DefinitionError> {
    let mut all: Vec<Definition> = SHIPPED
        .iter()
        .map(|(name, text)| Definition::parse(text, &format!("shipped {name}")))
        .collect::<Result<_, _>>()?;
    let Some(folder) = folder else {
        return Ok(all);
    };
    let err = |message: String| DefinitionError {
        origin: folder.display().to_string(),
        message,
    };
    let mut files: Vec<_> = std::fs::read_dir(folder)
        .map_err(|e| err(format!("cannot read the folder: {e}")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    for path in files {
        let origin = path.display().to_string();
        let text = read_small(&path).map_err(|message| DefinitionError {
            origin: origin.clone(),
            message,
        })?;
        let definition = Definition::parse(&text, &origin)?;
        all.retain(|d| d.name != definition.name);
        all.push(definition);
    }
    Ok(all)
}

fn read_small(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut text = String::new();
    file.take(MAX_DEFINITION_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_DEFINITION_BYTES {
        return Err(format!("larger than {} KiB", MAX_DEFINITION_BYTES >> 10));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_definitions_parse() {
        let all = load(None).unwrap();
        let names: Vec<_> = all.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["debian", "python", "node", "go", "services"]);
        let python = &all[1];
        assert!(python.packages.contains(&"python3-venv".to_string()));
        assert_eq!(python.working_dir, "/workspace");
        assert_eq!(python.suite().unwrap(), "bookworm");
    }

    #[test]
    fn the_hash_follows_what_is_built_and_nothing_else() {
        let python = load(None).unwrap().remove(1);
        let hash = python.build_hash("http://m", 100_000);
        let mut same = python.clone();
        same.env.insert("X".into(), "1".into());
        same.description = "other".into();
        same.packages.reverse();
        assert_eq!(same.build_hash("http://m", 100_000), hash);
        let mut more = python.clone();
        more.packages.push("jq".into());
        assert_ne!(more.build_hash("http://m", 100_000), hash);
        let mut script = python.clone();
        script.post_install = Some("true".into());
        assert_ne!(script.build_hash("http://m", 100_000), hash);
        assert_ne!(python.build_hash("http://other", 100_000), hash);
        assert_ne!(python.build_hash("http://m", 200_000), hash);
    }

    #[test]
    fn bad_definitions_are_refused_with_the_reason() {
        for (text, needle) in [
            ("name: x\nbase: ubuntu:jammy\n", "must be debian:SUITE"),
            ("name: X!\nbase: debian:bookworm\n", "lower-case"),
            (
                "name: x\nbase: debian:bookworm\npackages: ['a;rm -rf /']\n",
                "package",
            ),
            (
                "name: x\nbase: debian:bookworm\nworking_dir: rel\n",
                "absolute",
            ),
            (
                "name: x\nbase: debian:bookworm\nworking_dir: /a/../b\n",
                "absolute",
            ),
            (
                "name: x\nbase: debian:bookworm\nenv: {'A B': 1}\n",
                "environment",
            ),
            (
                "name: x\nbase: debian:bookworm\nlanguages: [cobol]\n",
                "cobol",
            ),
            (
                "name: x\nbase: debian:bookworm\nresources: {pids: 1}\n",
                "pids",
            ),
            (
                "name: x\nbase: debian:bookworm\nimages: {versions: '3'}\n",
                "MIN-MAX",
            ),
            (
                "name: x\nbase: debian:bookworm\nsurprise: 1\n",
                "unknown field",
            ),
            ("- just\n- a list\n", "invalid type"),
        ] {
            let err = Definition::parse(text, "test").unwrap_err();
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn an_operator_folder_adds_and_replaces_definitions_and_names_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("python.yaml"),
            "name: python\nbase: debian:trixie\npackages: [python3]\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("rust.yml"),
            "name: rust\nbase: debian:bookworm\npackages: [rustc, cargo]\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let all = load(Some(dir.path())).unwrap();
        let names: Vec<_> = all.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            ["debian", "node", "go", "services", "python", "rust"]
        );
        assert_eq!(all[4].suite().unwrap(), "trixie");

        std::fs::write(dir.path().join("zz.yaml"), "name: [").unwrap();
        let err = load(Some(dir.path())).unwrap_err();
        assert!(err.origin.ends_with("zz.yaml"), "{err}");
        std::fs::write(dir.path().join("zz.yaml"), "#".repeat(70_000)).unwrap();
        assert!(
            load(Some(dir.path()))
                .unwrap_err()
                .message
                .contains("larger")
        );
    }
}
