//! The files APIs' paths, as a client writes them. The first byte picks the face:
//!
//! - even: a URL path after `/api/v1/sandboxes/{id}/files/` (percent-encoded, any bytes),
//!   read by axum's wildcard route as the real router reads it, then checked as a workspace
//!   path (`kiln_runtime::sandbox::workspace_path`);
//! - odd: a path as E2B's SDKs send it (envd's filesystem service and `/files?path=`):
//!   absolute, relative to the home folder, or `~/…`, mapped into the workspace
//!   (`e2b::envd::rel_under`), then checked as a workspace path; the second byte picks the
//!   home folder (`/home/user`, or a template's own such as `/workspace`).
//!
//! Invariant: nothing panics; a path that is accepted is relative, has no empty, `.` or
//! `..` part and no NUL, and is at most 4096 bytes (255 a part); an E2B path that maps is
//! under the home folder (the home joined with it is the path, normalized as a file system
//! would), and one that leaves the home folder is refused.
#![no_main]

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use kiln_runtime::sandbox::workspace_path;
use kiln_server::e2b::envd::rel_under;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

fn check(rel: &kiln_workspace::RelPath) {
    let s = rel.as_str();
    assert!(
        s.len() <= 4096 && !s.starts_with('/') && !s.contains('\0'),
        "{s:?}"
    );
    for part in rel.parts() {
        assert!(!part.is_empty() && part != "." && part != ".." && part.len() <= 255);
    }
}

/// `path` normalized as a file system walks it from `home`: `.` stays, `..` goes up (not
/// past `/`).
fn normalized(home: &str, path: &str) -> String {
    let full = if path.starts_with('/') {
        path.to_string()
    } else if let Some(rest) = path.strip_prefix('~') {
        format!("{home}{rest}")
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in full.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    format!("/{}", parts.join("/"))
}

fn url_path(raw: &[u8]) {
    // What a client can put in a request line: anything but spaces, controls and `?`/`#`
    // (they end the path), which it percent-encodes.
    let mut encoded = String::new();
    for &b in raw {
        if b.is_ascii_graphic() && b != b'?' && b != b'#' {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    let Ok(request) = Request::get(format!("/files/{encoded}")).body(Body::empty()) else {
        return;
    };
    let router: Router = Router::new().route(
        "/files/{*path}",
        get(|Path(path): Path<String>| async move {
            if let Ok(rel) = workspace_path(&path) {
                check(&rel);
            }
            StatusCode::OK
        }),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let response = runtime.block_on(router.oneshot(request)).unwrap();
    assert_ne!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

fn e2b_path(home: &str, path: &str) {
    let Ok(rel) = rel_under(home, path) else {
        let n = normalized(home, path);
        // Refused: it holds NUL, is too long, or leaves the home folder.
        assert!(
            path.contains('\0')
                || path.len() > 4096
                || (n != home && !n.starts_with(&format!("{home}/"))),
            "{path:?} was refused"
        );
        return;
    };
    let n = normalized(home, path);
    if rel.is_empty() {
        assert_eq!(n, home);
        return;
    }
    assert_eq!(format!("{home}/{rel}"), n, "{path:?}");
    if let Ok(checked) = workspace_path(&rel) {
        check(&checked);
        assert_eq!(checked.as_str(), rel);
    }
}

fuzz_target!(|data: &[u8]| {
    let [face, home, rest @ ..] = data else {
        return;
    };
    if face % 2 == 0 {
        url_path(rest);
    } else {
        let home = if home % 2 == 0 {
            "/home/user"
        } else {
            "/workspace"
        };
        e2b_path(home, &String::from_utf8_lossy(rest));
    }
});
