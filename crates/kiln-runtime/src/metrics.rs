//! Prometheus metrics, in the text exposition format at `/metrics`: requests by route and
//! status, request latency, executions by language and status, execution latency, errors by
//! code, and live sandboxes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use kiln_core::{ExecResult, Language, Outcome};

/// Reads one per-worker figure for `/metrics`.
type WorkerGauge = fn(&kiln_executor::WorkerLoad) -> u64;

use kiln_core::pool::Histogram;

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, String, u16), u64>,
    request_seconds: BTreeMap<String, Histogram>,
    executions: BTreeMap<(&'static str, &'static str), u64>,
    execution_seconds: BTreeMap<&'static str, Histogram>,
    errors: BTreeMap<String, u64>,
}

/// The server's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts an HTTP request (`route` is the matched pattern, never the raw path).
    pub fn request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let mut inner = self.lock();
        *inner
            .requests
            .entry((method.to_owned(), route.to_owned(), status))
            .or_default() += 1;
        inner
            .request_seconds
            .entry(route.to_owned())
            .or_default()
            .observe(seconds);
    }

    /// Counts an API error by its code.
    pub fn error(&self, code: &str) {
        *self.lock().errors.entry(code.to_owned()).or_default() += 1;
    }

    /// Counts an execution.
    pub fn execution(&self, language: Language, result: &ExecResult) {
        let status = match result.outcome {
            Outcome::TimedOut => "timeout",
            Outcome::MemoryLimit => "memory_limit",
            Outcome::Crashed { .. } => "crashed",
            Outcome::FuelExhausted => "fuel_exhausted",
            _ if result.success() => "success",
            _ => "error",
        };
        let mut inner = self.lock();
        *inner
            .executions
            .entry((language.name(), status))
            .or_default() += 1;
        inner
            .execution_seconds
            .entry(language.name())
            .or_default()
            .observe(result.duration_us as f64 / 1e6);
    }

    /// The exposition text.
    pub fn render(&self, sandboxes: usize, workers: &[kiln_executor::WorkerLoad]) -> String {
        let inner = self.lock();
        let mut out = String::new();
        out.push_str("# HELP kiln_http_requests_total HTTP requests by method, route and status.\n# TYPE kiln_http_requests_total counter\n");
        for ((method, route, status), n) in &inner.requests {
            let _ = writeln!(
                out,
                "kiln_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str("# HELP kiln_http_request_duration_seconds HTTP request latency by route.\n# TYPE kiln_http_request_duration_seconds histogram\n");
        for (route, histogram) in &inner.request_seconds {
            histogram.render(
                &mut out,
                "kiln_http_request_duration_seconds",
                &format!("route=\"{route}\""),
            );
        }
        out.push_str("# HELP kiln_executions_total Executions by language and status.\n# TYPE kiln_executions_total counter\n");
        for ((language, status), n) in &inner.executions {
            let _ = writeln!(
                out,
                "kiln_executions_total{{language=\"{language}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str("# HELP kiln_execution_duration_seconds Time inside the sandbox by language.\n# TYPE kiln_execution_duration_seconds histogram\n");
        for (language, histogram) in &inner.execution_seconds {
            histogram.render(
                &mut out,
                "kiln_execution_duration_seconds",
                &format!("language=\"{language}\""),
            );
        }
        out.push_str(
            "# HELP kiln_errors_total API errors by code.\n# TYPE kiln_errors_total counter\n",
        );
        for (code, n) in &inner.errors {
            let _ = writeln!(out, "kiln_errors_total{{code=\"{code}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP kiln_sandboxes_active Live sandboxes.\n# TYPE kiln_sandboxes_active gauge\nkiln_sandboxes_active {sandboxes}"
        );
        let _ = writeln!(
            out,
            "# HELP kiln_workers_alive Live executor worker processes.\n# TYPE kiln_workers_alive gauge\nkiln_workers_alive {}",
            workers.len()
        );
        let gauges: [(&str, &str, WorkerGauge); 4] = [
            (
                "kiln_worker_sessions",
                "Sessions held by each worker.",
                |w| w.sessions as u64,
            ),
            (
                "kiln_worker_session_memory_bytes",
                "Memory caps of the sessions each worker holds.",
                |w| w.session_memory_bytes,
            ),
            (
                "kiln_worker_in_flight",
                "Requests each worker is running.",
                |w| w.in_flight as u64,
            ),
            (
                "kiln_worker_responsive",
                "Whether each worker answered its last heartbeat in time (1) or gets no new work (0).",
                |w| u64::from(w.responsive),
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (i, w) in workers.iter().enumerate() {
                let _ = writeln!(out, "{name}{{worker=\"{i}\"}} {}", value(w));
            }
        }
        out
    }
}
