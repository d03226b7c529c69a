//! Warm starts and forks: Python guests that start from a memory image instead of the
//! module's own data.
//!
//! A guest's whole state between turns is its linear memory (bytes and size): the only
//! mutable global, the stack pointer, is back at its initial value after every turn, and
//! tables never change. So a guest can start from any memory kiln captured between turns:
//! the memory after a template's warm-up (`python-data`: numpy, pandas, scipy and matplotlib
//! imported), or a live session's memory (a fork).
//!
//! How: such guests run in an engine of their own (on-demand allocation) from a copy of the
//! Python module whose active data segments are empty, so instantiating writes nothing into
//! memory. kiln then grows the memory to the image's size and maps the image over it
//! `MAP_PRIVATE`: pages are shared with every other guest started from the same image until
//! one writes them (copy-on-write), so starting costs a `mmap`, and a guest's private memory
//! is only what it changed. The image is a file: on disk in kiln's cache for templates (the
//! page cache shares it between processes), or a `memfd` for a fork of a guest that did not
//! start from one.
//!
//! The image file is a header page (`KILNIMG1`, the memory's length, the guest's monotonic
//! clock when captured) followed by the memory, with pages of zeros left as holes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_core::{ExecRequest, Language, Limits};
use sha2::{Digest, Sha256};
use wasmtime::{Config, Engine};

use crate::engine::{EngineError, ExecError, PythonRuntime, WasmEngine, instantiate_error};
use crate::python::{Origin, PythonGuest};
use crate::qjs_exports::{Export, PatchError, Reader, add_exports, write_u32};
use crate::setup::{PYTHON, Progress};

/// The `python-data` template's warm-up: the data stack imported once, at setup. The
/// modules stay in `sys.modules`; no name is left bound, so code sees the globals a fresh
/// interpreter has (a plain `python` one-shot that imports the stack starts from this image
/// too, [`imports_data_stack`]).
pub const PYTHON_DATA_WARM_UP: &str = "import numpy, pandas, scipy, matplotlib\nimport matplotlib.pyplot\ndel numpy, pandas, scipy, matplotlib\n";

/// The packages whose import the `python-data` image has done (or made cheap: scikit-learn
/// and seaborn are built on them).
const DATA_STACK: &[&str] = &[
    "numpy",
    "pandas",
    "scipy",
    "matplotlib",
    "sklearn",
    "seaborn",
];

/// Whether Python `code` imports a package of the data stack at the start of one of its
/// lines (`import pandas as pd`, `from sklearn.linear_model import …`, `import os, numpy`,
/// indented or not). A guess that only picks where code starts: a wrong one costs time,
/// never a different answer.
pub fn imports_data_stack(code: &str) -> bool {
    let top = |name: &str| {
        let name = name.trim();
        let module = name
            .split(|c: char| c == '.' || c.is_whitespace())
            .next()
            .unwrap_or("");
        DATA_STACK.contains(&module)
    };
    code.lines().any(|line| {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("import ") {
            rest.split('#').next().unwrap_or("").split(',').any(top)
        } else if let Some(rest) = line.strip_prefix("from ") {
            rest.split_whitespace().next().is_some_and(top)
        } else {
            false
        }
    })
}

/// The template whose sandboxes start warm, and its warm-up.
pub const PYTHON_DATA: &str = "python-data";

/// The warm-up code of a template that has one.
pub fn warm_up_of(template: &str) -> Option<&'static str> {
    (template == PYTHON_DATA).then_some(PYTHON_DATA_WARM_UP)
}

/// The engine of guests started from an image: on-demand allocation (each guest's memory
/// is its own mapping, which kiln maps the image over), otherwise as the default engine.
pub(crate) struct WarmVariant {
    pub engine: Engine,
    python: Mutex<Option<Arc<PythonRuntime>>>,
    /// Template images loaded in this process, by file.
    images: tokio::sync::Mutex<HashMap<PathBuf, Arc<Image>>>,
    live: Arc<AtomicU32>,
    slots: u32,
}

/// A guest's place in the warm engine, given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot(Arc<AtomicU32>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WarmVariant {
    pub fn new(max_instances: u32) -> Result<WarmVariant, EngineError> {
        let engine =
            Engine::new(&warm_config()).map_err(|e| EngineError::Config(format!("{e:#}")))?;
        Ok(WarmVariant {
            engine,
            python: Mutex::new(None),
            images: Default::default(),
            live: Arc::new(AtomicU32::new(0)),
            slots: max_instances.max(1),
        })
    }

    /// A slot for one more guest, or `Busy` when all are taken.
    pub fn take_slot(&self) -> Result<Slot, ExecError> {
        let taken = self.live.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.live.clone());
        if taken >= self.slots {
            return Err(ExecError::Busy { limit: self.slots });
        }
        Ok(slot)
    }
}

/// The warm engine's configuration: the default engine's, with on-demand allocation and a
/// memory that never moves (an image stays mapped where it was put).
fn warm_config() -> Config {
    let mut config = Config::new();
    config
        .wasm_exceptions(true)
        .max_wasm_stack(crate::engine::MAX_WASM_STACK)
        .async_stack_size(crate::engine::MAX_WASM_STACK + (1 << 20))
        .epoch_interruption(true)
        .cranelift_opt_level(wasmtime::OptLevel::Speed)
        .memory_reservation(4 << 30)
        .memory_may_move(false)
        .allocation_strategy(wasmtime::InstanceAllocationStrategy::OnDemand);
    config
}

impl WasmEngine {
    /// The Python runtime of the warm engine: the module compiled with its data emptied
    /// ([`strip`]), once, as `python-warm`.
    pub(crate) fn warm_python(
        &self,
        progress: &dyn Progress,
    ) -> Result<Arc<PythonRuntime>, EngineError> {
        let variant = self.warm_variant()?;
        let mut slot = variant.python.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(runtime) = slot.as_ref() {
            return Ok(runtime.clone());
        }
        let name = format!("python-warm{STRIP_VERSION}");
        let runtime = self.derived_python(
            &variant.engine,
            variant.slots,
            &name,
            &strip,
            0,
            None,
            progress,
        )?;
        *slot = Some(runtime.clone());
        Ok(runtime)
    }

    /// Like [`WasmEngine::warm_python`] without progress, for async callers: loaded (perhaps
    /// compiled, about a minute) on a blocking thread when not yet loaded
    /// ([`WasmEngine::python_runtime`] says why).
    pub(crate) async fn warm_python_runtime(&self) -> Result<Arc<PythonRuntime>, EngineError> {
        let slot = &self.warm_variant()?.python;
        self.loaded_or_off_thread(slot, Language::Python, |engine| {
            engine.warm_python(&crate::setup::Quiet)
        })
        .await
    }

    /// Where the image of a template with this warm-up is cached: keyed by the runtime's
    /// digest, the wasmtime version, both engines' configurations, kiln's image format and
    /// the warm-up code, so a change to any of them builds a new image.
    pub fn warm_image_path(&self, warm_up: &str) -> Result<PathBuf, EngineError> {
        let warm = self.warm_variant()?;
        let mut hasher = Sha256::new();
        hasher.update(PYTHON.files[0].sha256);
        hasher.update(crate::cache::WASMTIME_VERSION);
        for engine in [self.plain_engine(), &warm.engine] {
            let mut h = std::hash::DefaultHasher::new();
            std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut h);
            hasher.update(std::hash::Hasher::finish(&h).to_le_bytes());
        }
        hasher.update(format!("strip{STRIP_VERSION} image1 "));
        // What runs before the capture, in its order: the list the warm-up run runs.
        for (code, _) in warm_turns(warm_up) {
            hasher.update(code);
            hasher.update("\0turn\0");
        }
        let key = hex::encode(hasher.finalize());
        Ok(self
            .cache()
            .root()
            .join("images")
            .join(format!("python-{}.img", &key[..24])))
    }

    /// Makes ready the warm start of a template with `warm_up`: the warm engine's module
    /// and the image, built (the warm-up run once in a fresh guest) if not cached. Answers
    /// whether it built the image.
    pub async fn prepare_warm(
        &self,
        warm_up: &str,
        progress: &dyn Progress,
    ) -> Result<bool, ExecError> {
        self.warm_python(progress)?;
        let path = self.warm_image_path(warm_up)?;
        if self.warm_variant()?.images.lock().await.contains_key(&path) {
            return Ok(false);
        }
        let (_, built) = self.warm_image(warm_up, progress).await?;
        Ok(built)
    }

    /// The image of a template with `warm_up`: loaded once per process, built once per cache.
    pub(crate) async fn warm_image(
        &self,
        warm_up: &str,
        progress: &dyn Progress,
    ) -> Result<(Arc<Image>, bool), ExecError> {
        let path = self.warm_image_path(warm_up)?;
        let mut images = self.warm_variant()?.images.lock().await;
        if let Some(image) = images.get(&path) {
            return Ok((image.clone(), false));
        }
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            instantiate_error(
                Language::Python,
                format!("{what} the warm image {}: {e}", path.display()),
            )
        };
        let mut built = false;
        let image = match Image::open(&path) {
            Ok(image) => image,
            Err(_) => {
                // Another process may be building it: wait for its lock off this thread.
                let _lock = self
                    .off_thread(Language::Python, |engine| {
                        engine.cache().lock().map_err(EngineError::from)
                    })
                    .await?;
                if Image::open(&path).is_err() {
                    progress.step("warming the python-data template: importing numpy, pandas, scipy and matplotlib (once)", Some(Duration::from_secs(3)));
                    let (memory, clock) = self.run_warm_up(warm_up).await?;
                    Image::save(&memory, clock, &path).map_err(|e| fail("could not write", &e))?;
                    progress.done("warmed the python-data template");
                    built = true;
                }
                Image::open(&path).map_err(|e| fail("could not read", &e))?
            }
        };
        crate::cache::mark_used(&path);
        if built {
            // A new image often means a new kiln or warm-up: the old one may be unused long.
            crate::cache::prune_quietly(self.cache());
        }
        let image = Arc::new(image);
        images.insert(path, image.clone());
        Ok((image, built))
    }

    /// Runs `warm_up` in a fresh guest and answers its memory and clock afterwards.
    async fn run_warm_up(&self, warm_up: &str) -> Result<(Vec<u8>, u64), ExecError> {
        let runtime = self.python_runtime(false).await?;
        self.capture_after(&runtime, &warm_turns(warm_up)).await
    }

    /// Runs `turns` (code, and what it is for an error) as one-shot turns in a fresh guest
    /// of `runtime` (2 GiB and 10 minutes at most) and answers its memory and clock after.
    pub(crate) async fn capture_after(
        &self,
        runtime: &PythonRuntime,
        turns: &[(&str, &str)],
    ) -> Result<(Vec<u8>, u64), ExecError> {
        let mut request = ExecRequest::new(Language::Python, "");
        request.limits = Limits {
            memory_bytes: 2 << 30,
            timeout_ms: 600_000,
            ..Limits::default()
        };
        let mut guest = PythonGuest::open(self, runtime, &request, false, Origin::Fresh).await?;
        for (code, what) in turns {
            let result = guest.plain_turn(code, &request.limits).await?;
            if !result.success() {
                return Err(instantiate_error(
                    Language::Python,
                    format!("{what} failed: {}", result.stderr_text().trim()),
                ));
            }
        }
        Ok((guest.memory().to_vec(), guest.clock_ns()))
    }
}

/// The header page before the memory in an image file.
const HEADER: usize = 4096;
const MAGIC: &[u8; 8] = b"KILNIMG1";
/// The host page size kiln assumes (and checks) for copy-on-write and dirty-page scans.
const PAGE: usize = 4096;
/// The largest memory an image holds: a wasm32 memory's 4 GiB.
const MAX_LEN: u64 = 4 << 30;

/// A captured memory, ready to map under new guests.
#[derive(Debug)]
pub(crate) struct Image {
    file: File,
    len: usize,
    clock_ns: u64,
}

impl Image {
    /// An image of `memory` held in an anonymous file (a fork's).
    pub fn from_memory(memory: &[u8], clock_ns: u64) -> io::Result<Image> {
        // SAFETY: a NUL-terminated name; the flags are valid.
        let fd = unsafe { libc::memfd_create(c"kiln-image".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        write_image(&file, memory, clock_ns)?;
        Ok(Image {
            file,
            len: memory.len(),
            clock_ns,
        })
    }

    /// Writes an image of `memory` to `path` (through a temporary file beside it, renamed
    /// into place, so a reader never sees half an image).
    pub fn save(memory: &[u8], clock_ns: u64, path: &Path) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        let tmp = tempfile::NamedTempFile::new_in(dir)?;
        write_image(tmp.as_file(), memory, clock_ns)?;
        tmp.as_file().sync_all()?;
        tmp.persist(path).map_err(|e| e.error)?;
        Ok(())
    }

    /// Opens an image file kiln saved; anything else is refused.
    pub fn open(path: &Path) -> io::Result<Image> {
        let mut file = File::open(path)?;
        let mut header = [0u8; 24];
        file.read_exact(&mut header)?;
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
        if &header[..8] != MAGIC {
            return Err(bad("not a kiln memory image"));
        }
        let len = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let clock_ns = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if len == 0 || len > MAX_LEN || !len.is_multiple_of(65536) {
            return Err(bad(
                "the image's memory length is not a whole number of wasm pages",
            ));
        }
        if file.metadata()?.len() < HEADER as u64 + len {
            return Err(bad("the image is shorter than its header says"));
        }
        Ok(Image {
            file,
            len: len as usize,
            clock_ns,
        })
    }

    /// The memory's length in bytes (whole wasm pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The captured memory, read whole (to prime a module with it).
    pub fn read_memory(&self) -> io::Result<Vec<u8>> {
        let mut memory = vec![0u8; self.len];
        self.file.read_exact_at(&mut memory, HEADER as u64)?;
        Ok(memory)
    }

    /// The guest's monotonic clock when the image was captured, in nanoseconds.
    pub fn clock_ns(&self) -> u64 {
        self.clock_ns
    }

    /// Maps the image copy-on-write over the first [`Image::len`] bytes at `base`.
    ///
    /// # Safety
    /// `base` must be page-aligned and start at least `len` bytes of memory that nothing
    /// else borrows now, and that the caller owns (a guest's linear memory between calls,
    /// already grown to `len`).
    pub unsafe fn map_over(&self, base: *mut u8) -> io::Result<()> {
        // SAFETY: per this function's contract; MAP_FIXED replaces the pages in place.
        let at = unsafe {
            libc::mmap(
                base.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                HEADER as libc::off_t,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if at != base.cast() {
            return Err(io::Error::other("the image was mapped at another address"));
        }
        Ok(())
    }
}

/// Writes the header and every page of `memory` that is not all zeros.
fn write_image(file: &File, memory: &[u8], clock_ns: u64) -> io::Result<()> {
    let len = memory.len();
    if len == 0 || len as u64 > MAX_LEN || !len.is_multiple_of(65536) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a memory image must be whole wasm pages",
        ));
    }
    file.set_len((HEADER + len) as u64)?;
    let mut header = vec![0u8; HEADER];
    header[..8].copy_from_slice(MAGIC);
    header[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    header[16..24].copy_from_slice(&clock_ns.to_le_bytes());
    file.write_all_at(&header, 0)?;
    for run in nonzero_runs(memory) {
        file.write_all_at(&memory[run.clone()], (HEADER + run.start) as u64)?;
    }
    Ok(())
}

/// The runs of pages of `memory` that hold anything but zeros.
fn nonzero_runs(memory: &[u8]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, page) in memory.chunks(PAGE).enumerate() {
        if is_zero(page) {
            continue;
        }
        let at = i * PAGE;
        match runs.last_mut() {
            Some(run) if run.end == at => run.end = at + page.len(),
            _ => runs.push(at..at + page.len()),
        }
    }
    runs
}

fn is_zero(bytes: &[u8]) -> bool {
    // SAFETY: any bytes are valid u128s; the unaligned ends are checked bytewise.
    let (head, body, tail) = unsafe { bytes.align_to::<u128>() };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// The page runs of the `len` bytes at `base` (page-aligned) that this process holds
/// privately: pages written since they were mapped from an image (copy-on-write copies) or
/// touched where no image is. Pages never touched, and pages still shared with the image
/// file, are left out: a guest started from the same image sees them as they are.
pub(crate) fn private_pages(base: *const u8, len: usize) -> io::Result<Vec<Range<usize>>> {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE_OR_SHARED: u64 = 1 << 61;
    let pagemap = File::open("/proc/self/pagemap")?;
    let first = base as usize / PAGE;
    let pages = len.div_ceil(PAGE);
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut entries = vec![0u8; 8 * 4096];
    let mut page = 0;
    while page < pages {
        let batch = (pages - page).min(4096);
        let bytes = &mut entries[..8 * batch];
        pagemap.read_exact_at(bytes, ((first + page) * 8) as u64)?;
        for (i, entry) in bytes.chunks_exact(8).enumerate() {
            let entry = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
            let private = entry & (PRESENT | SWAPPED) != 0 && entry & FILE_OR_SHARED == 0;
            if !private {
                continue;
            }
            let at = (page + i) * PAGE;
            let end = (at + PAGE).min(len);
            match runs.last_mut() {
                Some(run) if run.end == at => run.end = end,
                _ => runs.push(at..end),
            }
        }
        page += batch;
    }
    Ok(runs)
}

/// The name kiln exports wasi-libc's `__wasilibc_reset_preopens` under: after a warm start
/// the guest forgets the preopened folders it knew and asks the host again, so a guest may
/// see other folders than the one its image was captured in.
pub(crate) const RESET_PREOPENS: &str = "kiln_reset_preopens";

/// Bumped whenever [`strip`] changes what it makes, so a stale `.cwasm` is never loaded.
pub(crate) const STRIP_VERSION: u32 = 1;

/// The Python module for warm starts: its active data segments emptied (the image brings
/// the memory), [`RESET_PREOPENS`] exported, and what every Python module of kiln's exports
/// ([`crate::qjs_exports::PYTHON_EXPORTS`]: its file name carries their tag).
pub(crate) fn strip(wasm: Vec<u8>) -> Result<Vec<u8>, PatchError> {
    let mut exports = vec![Export {
        name: RESET_PREOPENS,
        function: "__wasilibc_reset_preopens",
        params: &[],
        results: &[],
    }];
    exports.extend(crate::qjs_exports::PYTHON_EXPORTS.iter().map(|e| Export {
        name: e.name,
        function: e.function,
        params: e.params,
        results: e.results,
    }));
    let wasm = add_exports(&wasm, &exports)?;
    empty_active_data(&wasm)
}

const SECTION_DATA: u8 = 11;
const SECTION_MEMORY: u8 = 5;
const SECTION_DATA_COUNT: u8 = 12;

/// Bumped whenever priming ([`prime`], [`PRIMING_CODE`], what a primed guest is given)
/// changes what it makes, so a stale `.cwasm` is never loaded.
pub(crate) const PRIME_VERSION: u32 = 1;

/// What a primed module's guest ran before its memory was captured: a one-shot's first turn
/// of nothing, which does the interpreter's first-turn work once, at setup (the reactor's
/// first-call setup and its import of `linecache`, a quarter of a fresh `print(1+1)`).
pub(crate) const PRIMING_CODE: &str = "pass";

/// Where a primed guest's monotonic clock starts: past any clock its priming run read (a
/// priming run that took longer is refused), so the clock never goes backwards.
pub(crate) const PRIMED_CLOCK_NS: u64 = 10_000_000_000;

/// The Python module for primed starts: [`strip`]'s (kiln's exports, active data emptied),
/// with `memory` — a guest's memory after [`PRIMING_CODE`] — as its one active data segment
/// and initial size. Instances of it start where the priming run ended, through wasmtime's
/// copy-on-write images and slot reuse like any module.
pub(crate) fn prime(wasm: Vec<u8>, memory: &[u8]) -> Result<Vec<u8>, PatchError> {
    fill_memory(&strip(wasm)?, memory)
}

/// `wasm` (whose active data segments are empty) with memory 0's initial size `memory`'s
/// and `memory` as one more active segment at offset 0, from its first non-zero byte to its
/// last (dense, so wasmtime always makes it a copy-on-write image). Passive segments keep
/// their indices.
fn fill_memory(wasm: &[u8], memory: &[u8]) -> Result<Vec<u8>, PatchError> {
    if wasm.get(..8) != Some(b"\0asm\x01\0\0\0") {
        return Err(PatchError::Malformed("not a WebAssembly 1 module"));
    }
    if memory.is_empty() || !memory.len().is_multiple_of(65536) || memory.len() as u64 > MAX_LEN {
        return Err(PatchError::Malformed(
            "a primed memory must be whole wasm pages",
        ));
    }
    let first = memory.iter().position(|&b| b != 0).unwrap_or(0);
    let last = memory.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let (start, end) = (first / PAGE * PAGE, last.div_ceil(PAGE) * PAGE);
    let segment = if end > start {
        &memory[start..end]
    } else {
        &[][..]
    };
    let pages = (memory.len() / 65536) as u32;
    let mut out = Vec::with_capacity(wasm.len() + segment.len() + 16);
    out.extend_from_slice(&wasm[..8]);
    let mut reader = Reader::new(&wasm[8..]);
    let (mut saw_memory, mut saw_data) = (false, false);
    while !reader.done() {
        let id = reader.byte()?;
        let len = reader.u32()? as usize;
        let contents = reader.take(len)?;
        let rewritten = match id {
            SECTION_MEMORY => {
                saw_memory = true;
                Some(resize_memory(contents, pages)?)
            }
            SECTION_DATA_COUNT => {
                let count = Reader::new(contents).u32()?;
                let mut section = Vec::new();
                write_u32(&mut section, count + 1);
                Some(section)
            }
            SECTION_DATA => {
                saw_data = true;
                Some(append_segment(contents, start, segment)?)
            }
            _ => None,
        };
        let contents = rewritten.as_deref().unwrap_or(contents);
        out.push(id);
        write_u32(&mut out, contents.len() as u32);
        out.extend_from_slice(contents);
    }
    if !saw_memory || !saw_data {
        return Err(PatchError::Malformed("no memory or data section to prime"));
    }
    Ok(out)
}

/// A memory section whose first memory's initial size is `pages` (its maximum, if any, kept).
fn resize_memory(section: &[u8], pages: u32) -> Result<Vec<u8>, PatchError> {
    let mut reader = Reader::new(section);
    let count = reader.u32()?;
    if count == 0 {
        return Err(PatchError::Malformed("no memory to prime"));
    }
    let flags = reader.byte()?;
    let min = reader.u32()?;
    let max = match flags {
        0 => None,
        1 => Some(reader.u32()?),
        _ => {
            return Err(PatchError::Malformed(
                "a memory kiln cannot prime (shared or 64-bit)",
            ));
        }
    };
    if pages < min || max.is_some_and(|max| pages > max) {
        return Err(PatchError::Malformed(
            "the primed memory does not fit the module's",
        ));
    }
    let mut out = Vec::new();
    write_u32(&mut out, count);
    out.push(flags);
    write_u32(&mut out, pages);
    if let Some(max) = max {
        write_u32(&mut out, max);
    }
    out.extend_from_slice(&section[reader.at()..]);
    Ok(out)
}

/// A data section with one more active segment: `bytes` at `offset` of memory 0.
fn append_segment(section: &[u8], offset: usize, bytes: &[u8]) -> Result<Vec<u8>, PatchError> {
    let mut reader = Reader::new(section);
    let count = reader.u32()?;
    let mut out = Vec::with_capacity(section.len() + bytes.len() + 16);
    write_u32(&mut out, count + 1);
    out.extend_from_slice(&section[reader.at()..]);
    out.push(0);
    out.push(0x41);
    write_i32(&mut out, offset as u32 as i32);
    out.push(0x0b);
    write_u32(&mut out, bytes.len() as u32);
    out.extend_from_slice(bytes);
    Ok(out)
}

/// Signed LEB128, as `i32.const` takes it.
fn write_i32(out: &mut Vec<u8>, mut value: i32) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        let done = (value == 0 && byte & 0x40 == 0) || (value == -1 && byte & 0x40 != 0);
        out.push(if done { byte } else { byte | 0x80 });
        if done {
            return;
        }
    }
}

/// `wasm` with every active data segment's bytes removed (passive segments are kept: code
/// copies from them at run time).
fn empty_active_data(wasm: &[u8]) -> Result<Vec<u8>, PatchError> {
    if wasm.get(..8) != Some(b"\0asm\x01\0\0\0") {
        return Err(PatchError::Malformed("not a WebAssembly 1 module"));
    }
    let mut out = Vec::with_capacity(wasm.len());
    out.extend_from_slice(&wasm[..8]);
    let mut reader = Reader::new(&wasm[8..]);
    while !reader.done() {
        let id = reader.byte()?;
        let len = reader.u32()? as usize;
        let contents = reader.take(len)?;
        let rewritten;
        let contents = if id == SECTION_DATA {
            rewritten = rewrite_data(contents)?;
            &rewritten[..]
        } else {
            contents
        };
        out.push(id);
        write_u32(&mut out, contents.len() as u32);
        out.extend_from_slice(contents);
    }
    Ok(out)
}

fn rewrite_data(section: &[u8]) -> Result<Vec<u8>, PatchError> {
    let mut reader = Reader::new(section);
    let mut out = Vec::new();
    let count = reader.u32()?;
    write_u32(&mut out, count);
    for _ in 0..count {
        let start = reader.at();
        let flags = reader.u32()?;
        let active = match flags {
            0 => {
                skip_const_expr(&mut reader)?;
                true
            }
            1 => false,
            2 => {
                reader.u32()?;
                skip_const_expr(&mut reader)?;
                true
            }
            _ => return Err(PatchError::Malformed("a data segment kiln does not know")),
        };
        let header_end = reader.at();
        let len = reader.u32()? as usize;
        let bytes = reader.take(len)?;
        out.extend_from_slice(&section[start..header_end]);
        if active {
            write_u32(&mut out, 0);
        } else {
            write_u32(&mut out, len as u32);
            out.extend_from_slice(bytes);
        }
    }
    if !reader.done() {
        return Err(PatchError::Malformed("bytes after the data segments"));
    }
    Ok(out)
}

/// Skips a constant expression (a data segment's offset) up to its `end`.
fn skip_const_expr(reader: &mut Reader<'_>) -> Result<(), PatchError> {
    loop {
        match reader.byte()? {
            0x0b => return Ok(()),
            // i32.const, i64.const: a signed LEB128.
            0x41 | 0x42 => while reader.byte()? & 0x80 != 0 {},
            // global.get
            0x23 => {
                reader.u32()?;
            }
            // Extended constant expressions: add, sub, mul.
            0x6a | 0x6b | 0x6c | 0x7c | 0x7d | 0x7e => {}
            _ => return Err(PatchError::Malformed("a data offset kiln cannot read")),
        }
    }
}

/// What a warm template's image is captured after, turn by turn (code, and what it is for an
/// error): kiln's turn, the warm-up, then the rebirth defined (a start from the image only
/// calls it). The image's key hashes this list, so it is said once.
fn warm_turns(warm_up: &str) -> [(&str, &str); 3] {
    [
        (crate::python::FAST_TURNS_DEF, "kiln's turns"),
        (warm_up, "the warm-up"),
        (crate::python::REBIRTH_DEF, "defining the rebirth"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_stack_imports_are_found_where_code_starts_them() {
        for code in [
            "import pandas as pd\nprint(1)",
            "import os, numpy as np",
            "from sklearn.linear_model import LinearRegression",
            "def f():\n    import matplotlib.pyplot as plt",
            "import scipy.stats  # stats",
            "x = 1\nfrom numpy import arange",
        ] {
            assert!(imports_data_stack(code), "{code}");
        }
        for code in [
            "print('import pandas')",
            "import numpyx",
            "# import pandas",
            "import os\nfrom pathlib import Path",
            "pandas = 1",
            "from . import numpy",
        ] {
            assert!(!imports_data_stack(code), "{code}");
        }
    }

    #[test]
    fn active_data_is_emptied_and_passive_data_kept() {
        let mut wasm = b"\0asm\x01\0\0\0".to_vec();
        // memory section: one memory, min 1
        wasm.extend_from_slice(&[5, 3, 1, 0, 1]);
        let mut data = Vec::new();
        write_u32(&mut data, 3);
        data.extend_from_slice(&[0, 0x41, 0x80, 0x01, 0x0b, 3, b'a', b'b', b'c']);
        data.extend_from_slice(&[1, 2, b'p', b'q']);
        data.extend_from_slice(&[2, 0, 0x41, 8, 0x0b, 1, b'z']);
        wasm.push(SECTION_DATA);
        write_u32(&mut wasm, data.len() as u32);
        wasm.extend_from_slice(&data);
        let out = empty_active_data(&wasm).unwrap();
        let expected = [
            3, 0, 0x41, 0x80, 0x01, 0x0b, 0, 1, 2, b'p', b'q', 2, 0, 0x41, 8, 0x0b, 0,
        ];
        assert!(out.ends_with(&expected), "{out:?}");
        wasmtime::Module::validate(&wasmtime::Engine::default(), &out)
            .expect("still a valid module");
    }

    #[test]
    fn a_primed_module_starts_with_the_captured_memory() {
        let mut wasm = b"\0asm\x01\0\0\0".to_vec();
        // memory section: one memory, min 1; export "memory"; data count 2; data: an active
        // segment (emptied, as `strip` leaves it) and a passive one.
        wasm.extend_from_slice(&[5, 3, 1, 0, 1]);
        wasm.extend_from_slice(&[7, 10, 1, 6, b'm', b'e', b'm', b'o', b'r', b'y', 2, 0]);
        wasm.extend_from_slice(&[12, 1, 2]);
        let data = [2, 0, 0x41, 0x10, 0x0b, 0, 1, 2, b'p', b'q'];
        wasm.push(SECTION_DATA);
        write_u32(&mut wasm, data.len() as u32);
        wasm.extend_from_slice(&data);
        wasmtime::Module::validate(&wasmtime::Engine::default(), &wasm).unwrap();

        let mut memory = vec![0u8; 3 * 65536];
        memory[70_000] = 7;
        memory[2 * 65536 + 5] = 9;
        let primed = fill_memory(&wasm, &memory).unwrap();
        let engine = wasmtime::Engine::default();
        let module = wasmtime::Module::new(&engine, &primed).unwrap();
        let mut store = wasmtime::Store::new(&engine, ());
        let instance = wasmtime::Instance::new(&mut store, &module, &[]).unwrap();
        let mem = instance.get_memory(&mut store, "memory").unwrap();
        assert_eq!(
            mem.data(&store),
            &memory[..],
            "the memory as captured, and its size"
        );
        // Only the pages that hold data are in the module (from the first to the last).
        assert!(primed.len() < wasm.len() + 2 * 65536, "{}", primed.len());

        // Bad input is refused, never mis-primed.
        assert!(fill_memory(&wasm, &memory[..1000]).is_err());
        assert!(fill_memory(b"\0asm\x02\0\0\0", &memory).is_err());
        let no_memory = [&wasm[..8], &wasm[13..]].concat();
        assert!(fill_memory(&no_memory, &memory).is_err());
        let mut bounded = wasm.clone();
        bounded.splice(8..13, [5, 4, 1, 1, 1, 2]);
        assert!(
            fill_memory(&bounded, &memory).is_err(),
            "3 pages past a maximum of 2"
        );
    }

    #[test]
    fn signed_leb128_as_i32_const_takes_it() {
        for (value, bytes) in [
            (0, vec![0]),
            (63, vec![63]),
            (64, vec![0xc0, 0]),
            (-1, vec![0x7f]),
            (0x10000, vec![0x80, 0x80, 0x04]),
            (i32::MIN, vec![0x80, 0x80, 0x80, 0x80, 0x78]),
        ] {
            let mut out = Vec::new();
            write_i32(&mut out, value);
            assert_eq!(out, bytes, "{value}");
        }
    }

    #[test]
    fn an_image_round_trips_with_zero_pages_as_holes() {
        let mut memory = vec![0u8; 2 * 65536];
        memory[5] = 1;
        memory[65536 + 4095] = 2;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        Image::save(&memory, 77, &path).unwrap();
        let image = Image::open(&path).unwrap();
        assert_eq!((image.len(), image.clock_ns()), (2 * 65536, 77));
        let mut read = vec![0u8; memory.len()];
        image.file.read_exact_at(&mut read, HEADER as u64).unwrap();
        assert_eq!(read, memory);
        // Two pages hold data; the rest are holes.
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&path).unwrap().blocks() * 512 <= 4 * 4096 + 4096 * 2);
        std::fs::write(&path, b"KILNIMG1 not really").unwrap();
        assert!(Image::open(&path).is_err());
    }

    #[test]
    fn private_pages_are_the_pages_written_after_mapping() {
        let mut memory = vec![0u8; 65536];
        memory[100] = 9;
        let image = Image::from_memory(&memory, 0).unwrap();
        // SAFETY: a fresh anonymous mapping this test owns.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                65536,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        }
        .cast::<u8>();
        // SAFETY: map_over's contract: `base` starts the 64 KiB anonymous mapping just made,
        // page-aligned as every mmap result is, owned by this test and borrowed by nothing, and the
        // image is 64 KiB long, so exactly that mapping is replaced. (Had mmap failed, `base` would
        // be MAP_FAILED, which MAP_FIXED refuses as unaligned: the unwrap fails before any access.)
        unsafe { image.map_over(base) }.unwrap();
        // SAFETY: the mapping is 64 KiB and this test's alone.
        let view = unsafe { std::slice::from_raw_parts_mut(base, 65536) };
        assert_eq!(view[100], 9);
        assert_eq!(view[5000], 0);
        view[3 * 4096 + 1] = 7;
        view[4 * 4096] = 7;
        view[9 * 4096] = 1;
        let runs = private_pages(base, 65536).unwrap();
        assert_eq!(runs, vec![3 * 4096..5 * 4096, 9 * 4096..10 * 4096]);
        // SAFETY: unmapping what this test mapped.
        unsafe { libc::munmap(base.cast(), 65536) };
    }
}
