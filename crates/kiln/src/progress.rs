//! Setup progress on the terminal: a spinner with the step and its elapsed time when stderr
//! is a terminal, plain lines otherwise (logs, CI).

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_wasm::Progress;

pub struct Bar {
    current: Mutex<Option<ProgressBar>>,
    terminal: bool,
}

impl Bar {
    pub fn new() -> Bar {
        Bar {
            current: Mutex::new(None),
            terminal: std::io::stderr().is_terminal(),
        }
    }
}

impl Progress for Bar {
    fn step(&self, message: &str, estimate: Option<Duration>) {
        let hint = estimate
            .map(|d| format!(" (usually about {} s)", d.as_secs().max(1)))
            .unwrap_or_default();
        if !self.terminal {
            eprintln!("kiln: {message}{hint}");
            return;
        }
        let bar = ProgressBar::new_spinner();
        bar.set_style(
            ProgressStyle::with_template("{spinner:.cyan} {msg} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(format!("{message}{hint}"));
        bar.enable_steady_tick(Duration::from_millis(120));
        if let Some(old) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(bar)
        {
            old.finish_and_clear();
        }
    }

    fn done(&self, message: &str) {
        let bar = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match bar {
            Some(bar) => bar.finish_with_message(format!("✓ {message}")),
            None => eprintln!("kiln: {message}"),
        }
    }
}
