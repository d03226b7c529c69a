//! TLS for the egress proxy's header rules: a CA of this kiln process (its key lives in
//! memory only, made at start) signs a certificate for each host a sandbox's rules name, so
//! the proxy can read and rewrite HTTPS requests to those hosts, and nothing else. Boxes
//! trust the CA through the bundle kiln mounts at `/etc/ssl/certs/ca-certificates.crt`
//! (the host's own bundle with the CA appended). The proxy opens its own TLS to the host,
//! verified against the host's bundle. HTTPS to hosts without rules is never opened.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// The most hosts whose certificates are kept (past it the cache starts over).
const MAX_LEAVES: usize = 4096;

/// The CA and the certificates it made.
pub struct Interceptor {
    ca_key: KeyPair,
    ca_cert: rcgen::Certificate,
    leaves: Mutex<HashMap<String, Arc<ServerConfig>>>,
    /// TLS to the hosts, verified against the host's bundle; `None` when the host has no
    /// bundle (then HTTPS rules cannot be applied, and say so).
    client: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor").finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Interceptor {
    /// A new CA; `roots`: the host's CA bundle, which the hosts' certificates are checked
    /// against.
    pub fn new(roots: Option<&Path>) -> Result<Interceptor, String> {
        let ca_key = KeyPair::generate().map_err(|e| format!("a CA key: {e}"))?;
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| format!("a CA certificate: {e}"))?;
        params.distinguished_name.push(
            DnType::CommonName,
            format!("kiln egress CA (pid {})", std::process::id()),
        );
        params
            .distinguished_name
            .push(DnType::OrganizationName, "kiln");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = params
            .self_signed(&ca_key)
            .map_err(|e| format!("a CA certificate: {e}"))?;
        let client = match roots {
            None => None,
            Some(path) => {
                let mut store = RootCertStore::empty();
                let certs = CertificateDer::pem_file_iter(path)
                    .map_err(|e| format!("reading {}: {e}", path.display()))?
                    .filter_map(Result::ok);
                let (added, _) = store.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(format!("{} holds no CA certificate", path.display()));
                }
                let mut config = ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| e.to_string())?
                    .with_root_certificates(store)
                    .with_no_client_auth();
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some(Arc::new(config))
            }
        };
        Ok(Interceptor {
            ca_key,
            ca_cert,
            leaves: Mutex::new(HashMap::new()),
            client,
        })
    }

    /// The CA's certificate (PEM), for the boxes' trust store.
    pub fn ca_pem(&self) -> String {
        self.ca_cert.pem()
    }

    /// TLS to the hosts, if the host has a bundle to check them against.
    pub fn client(&self) -> Option<Arc<ClientConfig>> {
        self.client.clone()
    }

    /// A server configuration presenting a certificate for `host`, made once.
    pub fn server_for(&self, host: &str) -> Result<Arc<ServerConfig>, String> {
        let host = kiln_core::net::normal_host(host);
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(config) = leaves.get(&host) {
            return Ok(config.clone());
        }
        let key = KeyPair::generate().map_err(|e| format!("a key for {host}: {e}"))?;
        let mut params = CertificateParams::new(vec![host.clone()])
            .map_err(|e| format!("a certificate for {host}: {e}"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, host.clone());
        params.use_authority_key_identifier_extension = true;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&key, &self.ca_cert, &self.ca_key)
            .map_err(|e| format!("a certificate for {host}: {e}"))?;
        let chain = vec![cert.der().clone(), self.ca_cert.der().clone()];
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(|e| format!("a certificate for {host}: {e}"))?;
        // The proxy reads HTTP/1.1 only.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host, config.clone());
        Ok(config)
    }

    /// Writes the boxes' bundle to `to`: the host's bundle (`host`, if any), then this CA.
    /// Written in place, so boxes that mount it see the CA of the kiln that serves them.
    pub fn write_bundle(&self, host: Option<&Path>, to: &Path) -> std::io::Result<()> {
        let mut text = match host {
            Some(path) => std::fs::read(path)?,
            None => Vec::new(),
        };
        if !text.is_empty() && !text.ends_with(b"\n") {
            text.push(b'\n');
        }
        text.extend_from_slice(b"# kiln's egress CA: signs certificates only for hosts a sandbox's network rules name\n");
        text.extend_from_slice(self.ca_pem().as_bytes());
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(to)?;
        std::io::Write::write_all(&mut file, &text)?;
        file.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_signs_one_certificate_per_host_and_writes_a_bundle() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("host.pem");
        let other = Interceptor::new(None).unwrap();
        std::fs::write(&host, other.ca_pem()).unwrap();
        let tls = Interceptor::new(Some(&host)).unwrap();
        assert!(tls.client().is_some());
        let a = tls.server_for("API.example.com.").unwrap();
        let b = tls.server_for("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(tls.server_for("10.1.2.3").is_ok());
        let bundle = dir.path().join("out/bundle.pem");
        tls.write_bundle(Some(&host), &bundle).unwrap();
        let text = std::fs::read_to_string(&bundle).unwrap();
        assert_eq!(text.matches("BEGIN CERTIFICATE").count(), 2, "{text}");
        assert!(text.ends_with(&tls.ca_pem()));
        // A bundle without certificates is an error that names it.
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "nothing").unwrap();
        assert!(
            Interceptor::new(Some(&empty))
                .unwrap_err()
                .contains("no CA")
        );
    }
}
