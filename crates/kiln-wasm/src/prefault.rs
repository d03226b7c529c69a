//! Populating a new guest's hot pages in bulk.
//!
//! On a virtualised host a page fault costs several microseconds, and a fresh Python instance
//! faults in a few hundred pages of its memory image during its first turn. kiln learns which
//! pages the first few turns touch (the union of [`LEARNED_TURNS`] turns' pages, per runtime,
//! from `/proc/self/pagemap`) and asks the kernel to populate exactly those for each new
//! instance with one `madvise` per range (`MADV_POPULATE_WRITE` for pages the guest wrote,
//! `MADV_POPULATE_READ` for pages it only read). This changes no byte the guest sees; it
//! only moves the faults into the kernel's cheaper bulk path, ahead of the turn where the
//! instance is made ahead of time. Where the kernel lacks these flags (before Linux 5.14)
//! nothing happens. A memory slot wasmtime reuses usually still has the pages: its reset
//! copies the image back over the few the last guest wrote and leaves the read ones mapped,
//! so an instance whose first and last written ranges are still there is left as it is.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

const PAGE: usize = 4096;
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// How many turns (those that touched a typical number of pages) the hot pages are learned
/// from: the pages any of them touched. One turn alone may be untypically small (a first
/// `print` of a warm template that later runs pandas cells).
const LEARNED_TURNS: u32 = 4;
/// A turn of a fresh interpreter that touched more than this many pages (8 MiB) is not
/// typical; nor is a union of turns this large.
const MAX_LEARNED_PAGES: usize = 2048;
/// The same for a warm template's interpreter, whose turns use what its warm-up imported: a
/// first pandas `DataFrame` touches about 7 200 pages (28 MiB, about 2 500 of them written).
const WARM_MAX_LEARNED_PAGES: usize = 16384;
/// Read ranges closer than this many pages are populated as one.
const MERGE_GAP_PAGES: usize = 16;
/// At most this many ranges of written pages are populated (wasmtime's reset keeps 32 runs
/// of a slot's private pages; the rest leaves room for what a guest writes besides).
const MAX_WRITTEN_RANGES: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    offset: usize,
    len: usize,
    write: bool,
}

/// A page as a turn left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Touch {
    None,
    /// Present, still the image's page.
    Read,
    /// Present, a private copy.
    Written,
}

/// What the turns so far have taught.
#[derive(Debug, Default)]
struct Learning {
    /// Turns learned from.
    turns: u32,
    /// Every page any of them touched, by index.
    pages: Vec<Touch>,
    /// Those pages as ranges to populate.
    ranges: Arc<Vec<Range>>,
}

/// The hot pages of one runtime's memory image.
#[derive(Debug)]
pub(crate) struct HotPages {
    learning: Mutex<Learning>,
    /// Set when learning is over (enough turns, or the page map cannot be read).
    done: AtomicBool,
    unsupported: AtomicBool,
    /// A turn (or union of turns) that touched more pages than this is not learned from.
    max_pages: usize,
    /// Whether pages the turns only read are populated too, or only those they wrote.
    populate_reads: bool,
    /// Whether written runs are kept few enough for a slot's reset to keep them
    /// ([`ranges_of`]), or merge across small gaps like read ones.
    few_written: bool,
}

impl Default for HotPages {
    fn default() -> Self {
        HotPages::fresh()
    }
}

impl HotPages {
    /// The hot pages of a fresh interpreter's image: a few hundred, read and written.
    pub fn fresh() -> HotPages {
        HotPages {
            learning: Mutex::default(),
            done: AtomicBool::new(false),
            unsupported: AtomicBool::new(false),
            max_pages: MAX_LEARNED_PAGES,
            populate_reads: true,
            few_written: true,
        }
    }

    /// The hot pages of a warm template's image, whose turns use what its warm-up imported:
    /// thousands of pages, most of them only read. Only the written ones are populated. A
    /// page the guest reads before it writes it costs two faults (the read maps the image's
    /// page, with its neighbours; the write copies it and, where another thread of the
    /// process runs on another CPU, flushes that CPU's TLB with an interrupt); populated for
    /// writing it costs none. Populating the read pages as well only moves faults that are
    /// cheap in bulk already (the kernel maps a read fault's neighbours with it) and leaves
    /// more to unmap when the guest ends: on the 2-core VM it made a pandas one-shot slower
    /// (11.8 ms against 4.7 ms with the written pages alone). Its written pages (~2 500 for
    /// a pandas cell) are more than a slot's reset keeps (2 048 pages) however they are
    /// merged, so they merge across small gaps only: merged down to a few ranges, the gaps'
    /// copies made a pandas one-shot take 8.4–9.1 ms against 4.3–5.4 ms.
    pub fn warm() -> HotPages {
        HotPages {
            max_pages: WARM_MAX_LEARNED_PAGES,
            populate_reads: false,
            few_written: false,
            ..HotPages::fresh()
        }
    }

    /// Whether learning is over.
    pub fn learned(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Learning> {
        self.learning.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Learns the pages present in `[base, base + len)` after a turn: adds them to what the
    /// turns before taught, until [`LEARNED_TURNS`] turns have. A turn that touched an
    /// untypical number of pages is passed over.
    pub fn learn(&self, base: *const u8, len: usize) {
        if self.learned() {
            return;
        }
        let pages = match read_pages(base as usize, len) {
            Ok(Some(pages)) => pages,
            Ok(None) => return,
            Err(_) => {
                self.unsupported.store(true, Ordering::Relaxed);
                self.done.store(true, Ordering::Relaxed);
                return;
            }
        };
        let present = pages.iter().filter(|&&t| t != Touch::None).count();
        if present == 0 || present > self.max_pages {
            return;
        }
        let mut learning = self.lock();
        let mut union = std::mem::take(&mut learning.pages);
        if union.len() < pages.len() {
            union.resize(pages.len(), Touch::None);
        }
        for (page, touch) in union.iter_mut().zip(&pages) {
            *page = (*page).max(*touch);
        }
        let present = union.iter().filter(|&&t| t != Touch::None).count();
        learning.turns += 1;
        if present > self.max_pages {
            // The union grew untypical: keep what the turns before taught.
            self.done.store(true, Ordering::Relaxed);
            return;
        }
        let ranges = ranges_of(&union, self.few_written);
        let written: usize = ranges
            .iter()
            .filter(|r| r.write)
            .map(|r| r.len / PAGE)
            .sum();
        tracing::debug!(target: "kiln_wasm", turn = learning.turns, present, written, ranges = ranges.len(), "learned a turn's pages");
        learning.ranges = Arc::new(ranges);
        learning.pages = union;
        if learning.turns >= LEARNED_TURNS {
            self.done.store(true, Ordering::Relaxed);
        }
    }

    /// Populates the learned pages of a new instance's memory at `base` (`len` bytes
    /// accessible).
    pub fn populate(&self, base: *mut u8, len: usize) {
        if self.unsupported.load(Ordering::Relaxed) {
            return;
        }
        let ranges = self.lock().ranges.clone();
        // A reused slot usually still has them: checking costs two reads of the page map,
        // populating them again a walk of every page (300 µs of a 450 µs one-shot here).
        if still_populated(base, len, &ranges) {
            return;
        }
        for range in ranges.iter() {
            if range.offset + range.len > len || (!range.write && !self.populate_reads) {
                continue;
            }
            let advice = if range.write {
                MADV_POPULATE_WRITE
            } else {
                MADV_POPULATE_READ
            };
            // SAFETY: the range lies inside the guest's accessible linear memory, a mapping
            // wasmtime owns for the life of the store we hold; populate advice only faults
            // pages in (copy-on-write as a write would) and never changes their contents.
            let rc = unsafe { libc::madvise(base.add(range.offset).cast(), range.len, advice) };
            if rc != 0 {
                let errno = std::io::Error::last_os_error().raw_os_error();
                if matches!(errno, Some(libc::EINVAL) | Some(libc::ENOSYS)) {
                    self.unsupported.store(true, Ordering::Relaxed);
                }
                return;
            }
        }
    }
}

/// Whether the memory at `base` still holds the written pages of `ranges` from the guest
/// that used it before (wasmtime resets a reused slot's written pages in place when they are
/// few enough, and leaves the pages it read mapped): then populating them again would only
/// walk present pages. Looks at the first page of the first and of the last written range.
fn still_populated(base: *mut u8, len: usize, ranges: &[Range]) -> bool {
    let mut written = ranges.iter().filter(|r| r.write && r.offset + r.len <= len);
    let (Some(first), Some(last)) = (written.next(), written.next_back()) else {
        return false;
    };
    [first, last].iter().all(|range| {
        let page = (base as usize + range.offset) / PAGE;
        page_entry(page).is_some_and(|bits| bits >> 63 & 1 == 1 && bits >> 61 & 1 == 0)
    })
}

/// The page map's entry of the page at `page` (an address divided by the page size).
fn page_entry(page: usize) -> Option<u64> {
    static PAGEMAP: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let file = PAGEMAP
        .get_or_init(|| std::fs::File::open("/proc/self/pagemap").ok())
        .as_ref()?;
    let mut entry = [0u8; 8];
    file.read_exact_at(&mut entry, (page * 8) as u64).ok()?;
    Some(u64::from_le_bytes(entry))
}

/// Reads the page map of `[base, base + len)`: each page, present or not, and if present
/// whether it is a private copy (written) or still the shared image (read). `None` where
/// `base` is not page-aligned.
fn read_pages(base: usize, len: usize) -> std::io::Result<Option<Vec<Touch>>> {
    if !base.is_multiple_of(PAGE) {
        return Ok(None);
    }
    let pages = len / PAGE;
    let file = std::fs::File::open("/proc/self/pagemap")?;
    let mut entries = vec![0u8; pages * 8];
    file.read_exact_at(&mut entries, (base / PAGE * 8) as u64)?;
    Ok(Some(
        entries
            .chunks_exact(8)
            .map(|entry| {
                let bits = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
                match (bits >> 63 & 1, bits >> 61 & 1) {
                    (0, _) => Touch::None,
                    // Bit 61: a file page or shared anonymous page, i.e. still the image.
                    (_, 1) => Touch::Read,
                    _ => Touch::Written,
                }
            })
            .collect(),
    ))
}

/// Bytes of `[base, base + len)` that are private copies (pages the guest wrote), from the
/// page map; `None` where it cannot be read.
pub(crate) fn private_bytes(base: usize, len: usize) -> Option<u64> {
    let pages = read_pages(base, len).ok().flatten()?;
    let written = pages.iter().filter(|t| **t == Touch::Written).count();
    Some(written as u64 * PAGE as u64)
}

/// Ranges of touched pages, of one kind each, in address order.
///
/// Read pages merge across small gaps: populating a few extra pages for reading costs less
/// than another system call, and they stay the image's pages. Written pages do not, where
/// they can help it: every page populated for writing becomes a private copy that wasmtime
/// copies back from the image at each reset of the slot, whether the next guest writes it or
/// not (a `print` one-shot writes 135 pages in 87 runs; merged across 16-page gaps they were
/// 481). But wasmtime's reset finds a slot's private pages in at most 32 runs, and unmaps
/// everything past the 32nd (which the next guest then faults in again): so written runs
/// merge across their smallest gaps until at most [`MAX_WRITTEN_RANGES`] remain. Without
/// `few_written` (more written pages than a reset keeps anyway) they merge as read ones do.
fn ranges_of(pages: &[Touch], few_written: bool) -> Vec<Range> {
    let mut reads: Vec<Range> = Vec::new();
    let mut writes: Vec<Range> = Vec::new();
    for (page, touch) in pages.iter().enumerate() {
        let (ranges, gap) = match touch {
            Touch::None => continue,
            Touch::Read => (&mut reads, MERGE_GAP_PAGES),
            Touch::Written if few_written => (&mut writes, 0),
            Touch::Written => (&mut writes, MERGE_GAP_PAGES),
        };
        let offset = page * PAGE;
        match ranges.last_mut() {
            Some(last) if offset - (last.offset + last.len) <= gap * PAGE => {
                last.len = offset + PAGE - last.offset;
            }
            _ => ranges.push(Range {
                offset,
                len: PAGE,
                write: matches!(touch, Touch::Written),
            }),
        }
    }
    let mut ranges = reads;
    if few_written {
        writes = merge_smallest_gaps(writes, MAX_WRITTEN_RANGES);
    }
    ranges.extend(writes);
    ranges.sort_by_key(|r| r.offset);
    ranges
}

/// Merges neighbouring ranges (in address order) across their smallest gaps until at most
/// `max` remain: the fewest extra pages for that many ranges.
fn merge_smallest_gaps(ranges: Vec<Range>, max: usize) -> Vec<Range> {
    if ranges.len() <= max.max(1) {
        return ranges;
    }
    // Gap i lies between range i and range i + 1; merge the smallest len - max of them.
    let mut gaps: Vec<(usize, usize)> = ranges
        .windows(2)
        .enumerate()
        .map(|(i, w)| (w[1].offset - (w[0].offset + w[0].len), i))
        .collect();
    gaps.sort_unstable();
    let mut merge = vec![false; ranges.len()];
    for &(_, i) in &gaps[..ranges.len() - max.max(1)] {
        merge[i] = true;
    }
    let mut merged: Vec<Range> = Vec::with_capacity(max);
    let mut join = false;
    for (i, range) in ranges.into_iter().enumerate() {
        match merged.last_mut() {
            Some(last) if join => last.len = range.offset + range.len - last.offset,
            _ => merged.push(range),
        }
        join = merge[i];
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_touched_pages_and_populates_without_changing_them() {
        let len = 64 * PAGE;
        // SAFETY: a fresh private anonymous mapping this test owns and unmaps at the end.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let bytes = base.cast::<u8>();
        // SAFETY: offsets are inside the mapping.
        unsafe {
            *bytes = 1;
            *bytes.add(PAGE) = 2;
            *bytes.add(5 * PAGE) = 3;
            *bytes.add(40 * PAGE) = 4;
        }
        let pages = read_pages(bytes as usize, len).unwrap().unwrap();
        assert_eq!(
            ranges_of(&pages, true),
            vec![
                Range {
                    offset: 0,
                    len: 2 * PAGE,
                    write: true
                },
                Range {
                    offset: 5 * PAGE,
                    len: PAGE,
                    write: true
                },
                Range {
                    offset: 40 * PAGE,
                    len: PAGE,
                    write: true
                },
            ]
        );
        let hot = HotPages::default();
        hot.learn(bytes, len);
        assert!(!hot.learned(), "one turn of {LEARNED_TURNS} taught");
        // A later turn touches another page: the union is learned.
        // SAFETY: inside the mapping.
        unsafe { *bytes.add(60 * PAGE) = 5 };
        for _ in 1..LEARNED_TURNS {
            hot.learn(bytes, len);
        }
        assert!(hot.learned());
        let learned = hot.lock().ranges.clone();
        assert_eq!(learned.len(), 4, "{learned:?}");
        assert_eq!(learned[3].offset, 60 * PAGE);
        assert!(still_populated(bytes, len, &learned));
        // A page of the last range given back: populating again brings it back.
        // SAFETY: inside the mapping; the page is zero again when next read.
        unsafe { libc::madvise(bytes.add(60 * PAGE).cast(), PAGE, libc::MADV_DONTNEED) };
        assert!(!still_populated(bytes, len, &learned));
        hot.populate(bytes, len);
        assert!(still_populated(bytes, len, &learned));
        // SAFETY: offsets are inside the mapping, which is unmapped once after the reads.
        unsafe {
            assert_eq!((*bytes, *bytes.add(PAGE), *bytes.add(5 * PAGE)), (1, 2, 3));
            assert_eq!(*bytes.add(2 * PAGE), 0);
            libc::munmap(base, len);
        }
    }

    #[test]
    fn written_ranges_merge_across_their_smallest_gaps_reads_across_small_ones() {
        let r = |page: usize, pages: usize, write: bool| Range {
            offset: page * PAGE,
            len: pages * PAGE,
            write,
        };
        // Runs at 0, 10, 12, 30, 31 (gaps 9, 1, 17): three ranges merge the gap of 1.
        let runs = vec![
            r(0, 1, true),
            r(10, 1, true),
            r(12, 1, true),
            r(30, 2, true),
        ];
        assert_eq!(
            merge_smallest_gaps(runs.clone(), 3),
            vec![r(0, 1, true), r(10, 3, true), r(30, 2, true)]
        );
        // Two: also the gap of 9.
        assert_eq!(
            merge_smallest_gaps(runs.clone(), 2),
            vec![r(0, 13, true), r(30, 2, true)]
        );
        assert_eq!(merge_smallest_gaps(runs.clone(), 1), vec![r(0, 32, true)]);
        assert_eq!(merge_smallest_gaps(runs.clone(), 4), runs);
        assert_eq!(merge_smallest_gaps(Vec::new(), 4), Vec::new());

        // 40 written pages, every other one: no more than MAX_WRITTEN_RANGES ranges, and
        // the read pages between them still merge across small gaps.
        let mut pages = vec![Touch::None; 200];
        for page in (0..80).step_by(2) {
            pages[page] = Touch::Written;
        }
        pages[100] = Touch::Read;
        pages[110] = Touch::Read;
        pages[150] = Touch::Read;
        let ranges = ranges_of(&pages, true);
        let written: Vec<_> = ranges.iter().filter(|r| r.write).collect();
        assert_eq!(written.len(), MAX_WRITTEN_RANGES);
        let written_pages: usize = written.iter().map(|r| r.len / PAGE).sum();
        // 40 runs to 24 merges 16 one-page gaps.
        assert_eq!(written_pages, 40 + 16);
        let read: Vec<_> = ranges.iter().filter(|r| !r.write).copied().collect();
        assert_eq!(read, vec![r(100, 11, false), r(150, 1, false)]);
        assert!(ranges.windows(2).all(|w| w[0].offset < w[1].offset));
        // A warm template's many written pages merge across small gaps, as read ones do.
        let ranges = ranges_of(&pages, false);
        let written: Vec<_> = ranges.iter().filter(|r| r.write).copied().collect();
        assert_eq!(written, vec![r(0, 79, true)]);
    }
}
