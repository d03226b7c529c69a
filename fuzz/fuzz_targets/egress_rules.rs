//! A sandbox's egress rules (`kiln_core::net::Egress`, E2B's `network` and kiln's
//! `networkRules`), as a client sends them, and the decisions they make.
//!
//! Invariant: parsing, checking and deciding never panic; rules that check make a policy;
//! whatever the rules say, a name the operator does not list is never let through by a
//! policy that may not widen, and an address no sandbox may reach (loopback, link-local,
//! the unspecified address) is refused for every host.
#![no_main]

use kiln_core::net::{Allowlist, Egress, EgressGrant, EgressPolicy};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first line is a host to decide; the rest the rules, as JSON.
    let text = String::from_utf8_lossy(data);
    let (host, rules) = text.split_once('\n').unwrap_or(("api.example.com", &text));
    let Ok(egress) = serde_json::from_str::<Egress>(rules) else {
        return;
    };
    let checked = egress.validate();
    for widen in [false, true] {
        let policy = EgressPolicy::new(EgressGrant {
            rules: egress.clone(),
            widen,
            tenant: "t".into(),
            sandbox: "s".into(),
        });
        assert_eq!(policy.is_ok(), checked.is_ok());
        let Ok(policy) = policy else { return };
        let operator = Allowlist::new(&["pypi.org", "*.example.com"]).unwrap();
        for port in [80, 443, 5432] {
            let by_name = policy.check_name(&operator, host, port);
            if !widen && by_name.is_ok() {
                assert!(
                    operator.allows(&kiln_core::net::normal_host(host), port),
                    "{host}:{port} let through beyond the operator's list"
                );
            }
            for never in ["127.0.0.1", "169.254.169.254", "::1", "0.0.0.0"] {
                let ip = never.parse().unwrap();
                assert!(policy.check_address(&operator, host, port, ip, &[]).is_err());
            }
            let _ = policy.headers_for(host);
        }
    }
});
