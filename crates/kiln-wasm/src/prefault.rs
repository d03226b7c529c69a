//! Populating a new guest's hot pages in bulk.
//!
//! On a virtualised host a page fault costs several microseconds, and a fresh Python instance
//! faults in a few hundred pages of its memory image during its first turn. kiln learns which
//! pages a small first turn touches (once per runtime, from `/proc/self/pagemap`) and asks the
//! kernel to populate exactly those for each new instance with one `madvise` per range
//! (`MADV_POPULATE_WRITE` for pages the guest wrote, `MADV_POPULATE_READ` for pages it only
//! read). This changes no byte the guest sees; it only moves the faults into the kernel's
//! cheaper bulk path. Where the kernel lacks these flags (before Linux 5.14) nothing happens.

use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

const PAGE: usize = 4096;
const MADV_POPULATE_READ: libc::c_int = 22;
const MADV_POPULATE_WRITE: libc::c_int = 23;
/// A first turn that touched more than this many pages is not typical; learn from a later one.
const MAX_LEARNED_PAGES: usize = 2048;
/// Ranges of one kind closer than this many pages are populated as one.
const MERGE_GAP_PAGES: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    offset: usize,
    len: usize,
    write: bool,
}

/// The hot pages of one runtime's memory image.
#[derive(Debug, Default)]
pub(crate) struct HotPages {
    ranges: OnceLock<Vec<Range>>,
    unsupported: AtomicBool,
}

impl HotPages {
    /// Whether the pages are known.
    pub fn learned(&self) -> bool {
        self.ranges.get().is_some() || self.unsupported.load(Ordering::Relaxed)
    }

    /// Learns the pages present in `[base, base + len)` after a first turn. Does nothing if
    /// they are already known or the turn touched an untypical number of pages.
    pub fn learn(&self, base: *const u8, len: usize) {
        if self.learned() {
            return;
        }
        match read_ranges(base as usize, len) {
            Ok(Some(ranges)) => {
                let _ = self.ranges.set(ranges);
            }
            Ok(None) => {}
            Err(_) => self.unsupported.store(true, Ordering::Relaxed),
        }
    }

    /// Populates the learned pages of a new instance's memory at `base` (`len` bytes
    /// accessible).
    pub fn populate(&self, base: *mut u8, len: usize) {
        let Some(ranges) = self.ranges.get() else {
            return;
        };
        if self.unsupported.load(Ordering::Relaxed) {
            return;
        }
        for range in ranges {
            if range.offset + range.len > len {
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

/// Reads the page map of `[base, base + len)`: ranges of present pages, split by whether
/// they are private copies (written) or still the shared image (read).
fn read_ranges(base: usize, len: usize) -> std::io::Result<Option<Vec<Range>>> {
    if !base.is_multiple_of(PAGE) {
        return Ok(None);
    }
    let pages = len / PAGE;
    let file = std::fs::File::open("/proc/self/pagemap")?;
    let mut entries = vec![0u8; pages * 8];
    file.read_exact_at(&mut entries, (base / PAGE * 8) as u64)?;
    let mut ranges: Vec<Range> = Vec::new();
    let mut present = 0;
    for (page, entry) in entries.chunks_exact(8).enumerate() {
        let bits = u64::from_le_bytes(entry.try_into().expect("8 bytes"));
        if bits >> 63 & 1 == 0 {
            continue;
        }
        present += 1;
        // Bit 61: a file page or shared anonymous page, i.e. still the image; else private.
        let write = bits >> 61 & 1 == 0;
        let offset = page * PAGE;
        // Neighbouring ranges of a kind merge across small gaps: populating a few extra
        // pages costs less than another system call.
        let same_kind = ranges.iter_mut().rev().find(|r| r.write == write);
        match same_kind {
            Some(last) if offset - (last.offset + last.len) <= MERGE_GAP_PAGES * PAGE => {
                last.len = offset + PAGE - last.offset;
            }
            _ => ranges.push(Range {
                offset,
                len: PAGE,
                write,
            }),
        }
    }
    if present == 0 || present > MAX_LEARNED_PAGES {
        return Ok(None);
    }
    Ok(Some(ranges))
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
        let ranges = read_ranges(bytes as usize, len).unwrap().unwrap();
        assert_eq!(
            ranges,
            vec![
                Range {
                    offset: 0,
                    len: 6 * PAGE,
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
        assert!(hot.learned());
        hot.populate(bytes, len);
        // SAFETY: offsets are inside the mapping, which is unmapped once after the reads.
        unsafe {
            assert_eq!((*bytes, *bytes.add(PAGE), *bytes.add(5 * PAGE)), (1, 2, 3));
            assert_eq!(*bytes.add(2 * PAGE), 0);
            libc::munmap(base, len);
        }
    }
}
