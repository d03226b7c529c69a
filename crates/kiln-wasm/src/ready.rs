//! Instances made ahead of time, so that a one-shot pays only for its turn.
//!
//! A fresh Python instance has run nothing when it is made (the snapshot's state is its
//! memory), so it can be made before anyone asks for it, with an empty context, and given a
//! request's folders, environment and limits when one arrives ([`crate::guest::dress_store`]):
//! what the guest then sees is what an instance made for that request would. A thread of
//! the engine keeps a few ready and populates their hot pages; one-shots that find none make
//! their own. Finished one-shots are dropped on another thread too (giving the memory slot
//! back costs a page scan and copies), so the caller gets its answer first.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use kiln_core::Limits;

use crate::engine::PythonRuntime;
use crate::python::Shell;

/// Ready instances of one runtime.
#[derive(Default)]
pub(crate) struct Ready {
    shells: Mutex<Vec<Shell>>,
    /// How many to keep; 0: none (small engines, such as `kiln exec`'s).
    want: usize,
    /// Wakes the refill thread, made on first use.
    wake: Mutex<Option<Sender<()>>>,
}

impl Ready {
    pub fn new(want: usize) -> Ready {
        Ready {
            want,
            ..Ready::default()
        }
    }

    /// How many it keeps.
    pub fn want(&self) -> usize {
        self.want
    }

    /// A ready instance, if there is one; asks for another either way.
    pub fn take(&self) -> Option<Shell> {
        if self.want == 0 {
            return None;
        }
        let shell = self.lock().pop();
        if let Some(wake) = self.wake.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = wake.send(());
        }
        shell
    }

    /// Starts the refill thread for `runtime` (once), and fills up.
    pub fn start(&self, runtime: &Arc<PythonRuntime>) {
        if self.want == 0 {
            return;
        }
        let mut wake = self.wake.lock().unwrap_or_else(|e| e.into_inner());
        if wake.is_some() {
            return;
        }
        let (tx, rx) = channel();
        let weak = Arc::downgrade(runtime);
        let spawned = std::thread::Builder::new()
            .name("kiln-ready".into())
            .spawn(move || refill(weak, rx));
        if spawned.is_ok() {
            let _ = tx.send(());
            *wake = Some(tx);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Shell>> {
        self.shells.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Makes instances until `want` are ready, at every wake-up; ends with the runtime.
fn refill(runtime: Weak<PythonRuntime>, wake: Receiver<()>) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return;
    };
    while wake.recv().is_ok() {
        while wake.try_recv().is_ok() {}
        loop {
            let Some(runtime) = runtime.upgrade() else {
                return;
            };
            if runtime.ready.lock().len() >= runtime.ready.want {
                break;
            }
            // A failure (every slot taken) leaves the one-shots to make their own.
            let t = std::time::Instant::now();
            let made = rt.block_on(Shell::new(&runtime, &Limits::default(), true));
            tracing::trace!(target: "kiln::timing", us = t.elapsed().as_micros() as u64, "a ready instance made");
            match made {
                Ok(shell) => runtime.ready.lock().push(shell),
                Err(_) => break,
            }
        }
    }
}

/// Drops `value` on a thread of its own, after the caller has moved on.
pub(crate) fn drop_later<T: Send + 'static>(value: T) {
    type Bin = Mutex<Option<Sender<Box<dyn Send>>>>;
    static BIN: OnceLock<Bin> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        let (tx, rx) = channel::<Box<dyn Send>>();
        let spawned = std::thread::Builder::new()
            .name("kiln-drop".into())
            .spawn(move || {
                while let Ok(guest) = rx.recv() {
                    let t = std::time::Instant::now();
                    drop(guest);
                    tracing::trace!(target: "kiln::timing", us = t.elapsed().as_micros() as u64, "a finished guest dropped");
                }
            });
        Mutex::new(spawned.ok().map(|_| tx))
    });
    let sender = bin.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match sender {
        Some(tx) => {
            if let Err(back) = tx.send(Box::new(value)) {
                drop(back);
            }
        }
        None => drop(value),
    }
}
