//! Request bodies of seed 003's `/api/sandbox` and of `/api/v1`, built field by field by
//! `arbitrary` from kiln-server's own request types (`NewSandbox`, `Execute`, `CreateBody`,
//! `ExecBody`, and the kiln-core and kiln-runtime types inside them: egress rules,
//! resources, lifecycle, volume mounts). `json_bodies` covers the JSON reader; this target
//! covers what the handlers check once a body is read, with values a reader lets through.
//!
//! Each request is written as JSON (serde) and read back through the reader every face uses
//! (`kiln_http::json`), then checked as its handler checks it, against a catalogue of the
//! templates kiln ships (WebAssembly python and javascript; Linux boxes and microVMs from
//! the shipped definitions) and a volume of the tenant's:
//! - creates: `v1::sandbox_spec`, `api::sandbox_spec` (template, life, memory, network,
//!   egress rules, resources, lifecycle, volumes, public previews);
//! - runs: `Execute::into_code` and the runtime's checks of its environment, files and
//!   output folder; `api::parse_command` (the command line parser of seed 003's exec).
//!
//! Invariant: nothing panics; what serde writes of a request, kiln reads back the same; a
//! refusal is a 4xx, never a 5xx; a spec that passes has a life of 1 s to 24 h (or, with no
//! fixed life, an idle window of at most a year), capped by its `maxDuration`, at most 64 allowed ports, memory of
//! 16 MiB to 4 GiB, and a Linux box's resources within their documented bounds (vCPUs
//! finite, 0.05 to the host's CPUs; disk 16 MiB to 64 GiB; 16 to 32768 processes).
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use kiln_core::template::{Catalogue, TemplateInfo};
use kiln_runtime::lifecycle::{MAX_ALLOWED_PORTS, MAX_DURATION_MS};
use kiln_runtime::sandbox::{MAX_LIFETIME_MS, MIN_LIFETIME_MS, SandboxSpec};
use kiln_runtime::volumes::Volumes;
use kiln_server::error::ApiError;
use kiln_server::{api, v1};
use libfuzzer_sys::fuzz_target;
use serde::Serialize;
use serde::de::DeserializeOwned;

#[derive(Debug, Arbitrary)]
enum Request {
    V1Create(v1::NewSandbox),
    V1Exec(v1::Execute),
    SeedCreate(api::CreateBody),
    SeedExec(api::ExecBody),
}

const TENANT: &str = "fuzz";

struct World {
    catalogue: Catalogue,
    volumes: Volumes,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let mut templates = vec![TemplateInfo::example_python()];
        let mut javascript = TemplateInfo::example_python();
        javascript.id = "javascript".into();
        javascript.languages = vec![kiln_core::Language::JavaScript];
        javascript.images.repos = vec!["node".into(), "javascript".into()];
        javascript.images.names = vec!["js".into()];
        javascript.images.versions = None;
        templates.push(javascript);
        for (name, text) in kiln_native::template::SHIPPED {
            let definition = kiln_native::template::Definition::parse(text, name).unwrap();
            for vm in [false, true] {
                let template = kiln_native::builder::Template {
                    definition: definition.clone(),
                    built: kiln_native::builder::Built {
                        name: name.into(),
                        hash: "fuzz".into(),
                        suite: "bookworm".into(),
                        versions: Default::default(),
                        uid_base: 100_000,
                        size_bytes: 0,
                        build_seconds: 0.0,
                    },
                    rootfs: "/nonexistent".into(),
                    vm,
                    gvisor: false,
                };
                templates.push(kiln_native::backend::template_info(&template));
            }
        }
        let dir = std::env::temp_dir().join(format!("kiln-fuzz-api-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let volumes = Volumes::open(&dir);
        let _ = volumes.create(TENANT, "data", Some(16 << 20), Default::default(), 8, None);
        World {
            catalogue: Catalogue::new(templates),
            volumes,
        }
    })
}

/// Written by serde, read by kiln's reader: the same request.
fn round_trip<T: Serialize + DeserializeOwned>(value: &T) -> T {
    let written = serde_json::to_vec(value).unwrap();
    let read: T = match kiln_http::json::from_json_object(&written) {
        Ok(read) => read,
        Err(e) => panic!(
            "kiln refused what serde wrote: {e:?}\n{}",
            String::from_utf8_lossy(&written)
        ),
    };
    assert_eq!(serde_json::to_vec(&read).unwrap(), written);
    read
}

fn refused(error: &ApiError) {
    let status = error.status().as_u16();
    assert!(
        (400..500).contains(&status),
        "a request was refused with {status}: {} {}",
        error.code(),
        error.message()
    );
}

fn made(spec: &SandboxSpec) {
    // A fixed life of 1 s to 24 h, or none: then it ends after an idle window (at most a
    // year), which stands as its life.
    // `maxDuration` caps either.
    let cap = spec.lifecycle.max_duration_ms.unwrap_or(u64::MAX);
    match spec.lifecycle.terminate_after_idle_ms {
        Some(window) => {
            assert_eq!(spec.lifetime_ms, window.min(cap));
            assert!((1000..=MAX_DURATION_MS).contains(&window), "{window}");
        }
        None => assert!(
            (MIN_LIFETIME_MS..=MAX_LIFETIME_MS).contains(&spec.lifetime_ms),
            "{}",
            spec.lifetime_ms
        ),
    }
    assert!(spec.lifetime_ms >= MIN_LIFETIME_MS && spec.lifetime_ms <= cap);
    if let Some(ports) = &spec.lifecycle.allowed_ports {
        assert!(ports.len() <= MAX_ALLOWED_PORTS);
    }
    assert!(
        ((16 << 20)..=(4 << 30)).contains(&spec.memory_bytes),
        "{}",
        spec.memory_bytes
    );
    if let Some(r) = &spec.resources {
        assert!(r.vcpus.is_finite() && r.vcpus >= 0.05, "vcpus {}", r.vcpus);
        assert!((16..=65_536).contains(&r.disk_mb), "disk {}", r.disk_mb);
        assert!((16..=32_768).contains(&r.pids), "pids {}", r.pids);
        assert_eq!(r.memory_mb, spec.memory_bytes >> 20);
    }
    assert!(world().catalogue.get(&spec.template).is_some());
}

fn outcome<T>(result: Result<T, ApiError>, check: impl FnOnce(&T)) {
    match result {
        Ok(value) => check(&value),
        Err(error) => refused(&error),
    }
}

fuzz_target!(|request: Request| {
    let world = world();
    match request {
        Request::V1Create(body) => {
            let body = round_trip(&body);
            outcome(
                v1::sandbox_spec(&world.catalogue, &world.volumes, TENANT, body),
                made,
            );
        }
        Request::SeedCreate(body) => {
            let body = round_trip(&body);
            outcome(api::sandbox_spec(&world.catalogue, &body), made);
        }
        Request::V1Exec(body) => {
            let body = round_trip(&body);
            let Ok(code) = body.into_code().map_err(|e| refused(&e)) else {
                return;
            };
            let checked = kiln_runtime::exec::check_env(&code.env)
                .and_then(|()| {
                    kiln_runtime::exec::check_files(
                        code.files.iter().map(|(k, v)| (k, v.as_slice())),
                    )
                })
                .and_then(|files| {
                    code.output_dir
                        .as_deref()
                        .map(kiln_runtime::exec::output_dir)
                        .transpose()
                        .map(|dir| (files, dir))
                })
                .map_err(ApiError::from);
            outcome(checked, |(files, _)| {
                assert!(files.len() <= code.files.len())
            });
        }
        Request::SeedExec(body) => {
            let body = round_trip(&body);
            outcome(api::parse_command(&body.command, "/workspace"), |_| {});
            let files =
                kiln_runtime::exec::check_files(body.files.iter().map(|(k, v)| (k, v.as_bytes())))
                    .map_err(ApiError::from);
            outcome(files, |_| {});
        }
    }
});
