//! The warm pool's shapes (seed 002): what a template's pool is set to, and what it reports.
//! The pool itself lives with the backend whose members it keeps (boxes, microVMs); faces read
//! [`PoolStats`] through the backend's process host (`/metrics`, `kiln doctor`).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// What a claim on an empty pool does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmptyPoolPolicy {
    /// Wait (up to the claim timeout) for the replenisher's next member.
    #[default]
    Wait,
    /// Start one on the request path (while the pool is under its `max_vms`).
    BootSync,
    /// Refuse at once.
    Reject,
}

impl EmptyPoolPolicy {
    pub fn name(self) -> &'static str {
        match self {
            EmptyPoolPolicy::Wait => "wait",
            EmptyPoolPolicy::BootSync => "boot_sync",
            EmptyPoolPolicy::Reject => "reject",
        }
    }

    /// `wait`, `boot_sync` (or `boot-sync`), `reject`.
    pub fn parse(text: &str) -> Option<EmptyPoolPolicy> {
        match text.trim() {
            "wait" => Some(EmptyPoolPolicy::Wait),
            "boot_sync" | "boot-sync" => Some(EmptyPoolPolicy::BootSync),
            "reject" => Some(EmptyPoolPolicy::Reject),
            _ => None,
        }
    }
}

/// A template's pool settings as written (its YAML's `pool:`, a configuration's override):
/// each one unset falls back to the next source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolDefinition {
    /// Members kept ready (0: no pool; every claim starts its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_pool_size: Option<usize>,
    /// Members alive at once, ready and in use together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_vms: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_pool_policy: Option<EmptyPoolPolicy>,
    /// How long a claim waits for a member before it is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_timeout_seconds: Option<f64>,
}

impl PoolDefinition {
    /// `self`'s settings, the unset ones from `below`.
    pub fn or(&self, below: &PoolDefinition) -> PoolDefinition {
        PoolDefinition {
            target_pool_size: self.target_pool_size.or(below.target_pool_size),
            max_vms: self.max_vms.or(below.max_vms),
            empty_pool_policy: self.empty_pool_policy.or(below.empty_pool_policy),
            claim_timeout_seconds: self.claim_timeout_seconds.or(below.claim_timeout_seconds),
        }
    }

    /// Refuses what cannot be meant: a size above the maximum, a timeout out of (0, 600].
    pub fn check(&self) -> Result<(), String> {
        if let (Some(target), Some(max)) = (self.target_pool_size, self.max_vms)
            && target > max
        {
            return Err(format!(
                "pool: target_pool_size {target} is above max_vms {max}"
            ));
        }
        if self.max_vms == Some(0) {
            return Err("pool: max_vms must be at least 1".into());
        }
        if let Some(size) = self.target_pool_size
            && size > MAX_POOL_SIZE
        {
            return Err(format!(
                "pool: target_pool_size {size} is above {MAX_POOL_SIZE}"
            ));
        }
        if let Some(max) = self.max_vms
            && max > MAX_POOL_MEMBERS
        {
            return Err(format!("pool: max_vms {max} is above {MAX_POOL_MEMBERS}"));
        }
        if let Some(t) = self.claim_timeout_seconds
            && !(t > 0.0 && t <= 600.0)
        {
            return Err(format!(
                "pool: claim_timeout_seconds {t} must be in (0, 600]"
            ));
        }
        Ok(())
    }
}

/// The largest `target_pool_size` accepted.
pub const MAX_POOL_SIZE: usize = 256;
/// The largest `max_vms` accepted.
pub const MAX_POOL_MEMBERS: usize = 4096;

/// Histogram bucket bounds in seconds (the same as the server's request latencies).
pub const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// A Prometheus histogram over [`BUCKETS`].
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: [u64; BUCKETS.len()],
    pub sum: f64,
    pub total: u64,
}

impl Histogram {
    pub fn observe(&mut self, seconds: f64) {
        for (i, bound) in BUCKETS.iter().enumerate() {
            if seconds <= *bound {
                self.counts[i] += 1;
            }
        }
        self.sum += seconds;
        self.total += 1;
    }

    /// The mean, in seconds (0 with none).
    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum / self.total as f64
        }
    }

    /// Writes it in the text exposition format, as `name` with `labels` (`a="b",c="d"`).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, bound) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                self.counts[i]
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.total
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.total);
    }
}

/// One template's pool, as it stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolStats {
    /// The template (its catalogue id).
    pub template: String,
    /// What its members are: `box` or `vm`.
    pub tier: String,
    pub target: usize,
    pub max: usize,
    pub policy: EmptyPoolPolicy,
    pub claim_timeout_seconds: f64,
    /// Members ready to be claimed.
    pub ready: usize,
    /// Members being started.
    pub starting: usize,
    /// Members claimed and not yet destroyed.
    pub in_use: usize,
    /// Claims waiting for a member.
    pub waiting: usize,
    /// Claims by how they ended: `ready` (a member was there), `waited`, `boot_sync`,
    /// `rejected`, `timed_out`.
    pub claims: std::collections::BTreeMap<String, u64>,
    /// How long claims took, in seconds.
    pub claim_wait: Histogram,
    /// How long members took to start, in seconds.
    pub boot: Histogram,
    /// Members started by the replenisher.
    pub replenished: u64,
    pub replenish_failures: u64,
    /// Ready members found dead and dropped.
    pub lost: u64,
    /// Why the last start failed, if one did.
    pub last_error: Option<String>,
}

/// A figure's name, help and how to read it from a pool.
type Figure<T> = (&'static str, &'static str, fn(&PoolStats) -> T);

/// Writes every pool's figures in the text exposition format.
pub fn render_metrics(pools: &[PoolStats], out: &mut String) {
    let gauges: [Figure<f64>; 6] = [
        (
            "kiln_pool_ready",
            "Warm pool members ready to be claimed.",
            |p| p.ready as f64,
        ),
        (
            "kiln_pool_starting",
            "Warm pool members being started.",
            |p| p.starting as f64,
        ),
        (
            "kiln_pool_in_use",
            "Warm pool members claimed and not yet destroyed.",
            |p| p.in_use as f64,
        ),
        (
            "kiln_pool_waiting",
            "Claims waiting for a warm pool member.",
            |p| p.waiting as f64,
        ),
        (
            "kiln_pool_target",
            "The number of members each warm pool keeps ready.",
            |p| p.target as f64,
        ),
        (
            "kiln_pool_max",
            "The most members each warm pool has alive at once.",
            |p| p.max as f64,
        ),
    ];
    let labels = |p: &PoolStats| format!("template=\"{}\",tier=\"{}\"", p.template, p.tier);
    for (name, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for p in pools {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(p), value(p));
        }
    }
    let _ = writeln!(
        out,
        "# HELP kiln_pool_claims_total Warm pool claims by outcome (ready, waited, boot_sync, rejected, timed_out).\n# TYPE kiln_pool_claims_total counter"
    );
    for p in pools {
        for (outcome, n) in &p.claims {
            let _ = writeln!(
                out,
                "kiln_pool_claims_total{{{},outcome=\"{outcome}\"}} {n}",
                labels(p)
            );
        }
    }
    let counters: [Figure<u64>; 3] = [
        (
            "kiln_pool_replenished_total",
            "Warm pool members started in the background.",
            |p| p.replenished,
        ),
        (
            "kiln_pool_replenish_failures_total",
            "Warm pool members that failed to start.",
            |p| p.replenish_failures,
        ),
        (
            "kiln_pool_lost_total",
            "Ready warm pool members found dead and dropped.",
            |p| p.lost,
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for p in pools {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(p), value(p));
        }
    }
    let _ = writeln!(
        out,
        "# HELP kiln_pool_claim_wait_seconds How long claims on a warm pool took.\n# TYPE kiln_pool_claim_wait_seconds histogram"
    );
    for p in pools {
        p.claim_wait
            .render(out, "kiln_pool_claim_wait_seconds", &labels(p));
    }
    let _ = writeln!(
        out,
        "# HELP kiln_pool_boot_seconds How long warm pool members took to start.\n# TYPE kiln_pool_boot_seconds histogram"
    );
    for p in pools {
        p.boot.render(out, "kiln_pool_boot_seconds", &labels(p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_fall_back_in_order_and_nonsense_is_refused() {
        let template = PoolDefinition {
            target_pool_size: Some(3),
            ..Default::default()
        };
        let config = PoolDefinition {
            target_pool_size: Some(1),
            max_vms: Some(8),
            empty_pool_policy: Some(EmptyPoolPolicy::Reject),
            claim_timeout_seconds: None,
        };
        let merged = template.or(&config);
        assert_eq!(merged.target_pool_size, Some(3));
        assert_eq!(merged.max_vms, Some(8));
        assert_eq!(merged.empty_pool_policy, Some(EmptyPoolPolicy::Reject));
        assert!(merged.check().is_ok());
        for (bad, says) in [
            (
                PoolDefinition {
                    target_pool_size: Some(9),
                    max_vms: Some(8),
                    ..Default::default()
                },
                "above max_vms",
            ),
            (
                PoolDefinition {
                    max_vms: Some(0),
                    ..Default::default()
                },
                "at least 1",
            ),
            (
                PoolDefinition {
                    target_pool_size: Some(100_000),
                    ..Default::default()
                },
                "above 256",
            ),
            (
                PoolDefinition {
                    claim_timeout_seconds: Some(0.0),
                    ..Default::default()
                },
                "(0, 600]",
            ),
            (
                PoolDefinition {
                    claim_timeout_seconds: Some(f64::NAN),
                    ..Default::default()
                },
                "(0, 600]",
            ),
        ] {
            let err = bad.check().unwrap_err();
            assert!(err.contains(says), "{err}");
        }
        let yaml: Result<PoolDefinition, _> =
            serde_json::from_str(r#"{"target_pool_size": 2, "size": 3}"#);
        assert!(yaml.is_err(), "an unknown key is refused");
        assert_eq!(
            EmptyPoolPolicy::parse("boot-sync"),
            Some(EmptyPoolPolicy::BootSync)
        );
        assert_eq!(EmptyPoolPolicy::parse("sometimes"), None);
    }

    #[test]
    fn metrics_name_each_pool_and_outcome() {
        let mut p = PoolStats {
            template: "linux-python".into(),
            tier: "box".into(),
            target: 2,
            max: 50,
            ready: 2,
            ..Default::default()
        };
        p.claims.insert("ready".into(), 5);
        p.claim_wait.observe(0.0004);
        let mut out = String::new();
        render_metrics(&[p], &mut out);
        assert!(
            out.contains("kiln_pool_ready{template=\"linux-python\",tier=\"box\"} 2"),
            "{out}"
        );
        assert!(
            out.contains(
                "kiln_pool_claims_total{template=\"linux-python\",tier=\"box\",outcome=\"ready\"} 5"
            ),
            "{out}"
        );
        assert!(out.contains("kiln_pool_claim_wait_seconds_bucket{template=\"linux-python\",tier=\"box\",le=\"0.001\"} 1"), "{out}");
    }
}
