//! Attack tests: a planted tree never makes the host read, write or remove anything outside
//! it. Each runs with both resolvers (`openat2` and the walk).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::*;

struct Setup {
    _dir: tempfile::TempDir,
    ws: PathBuf,
    outside: PathBuf,
    secret: PathBuf,
    tree: Tree,
}

fn setup(resolver: Resolver) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("workspace");
    let outside = dir.path().join("outside");
    std::fs::create_dir(&ws).unwrap();
    std::fs::create_dir(&outside).unwrap();
    let secret = outside.join("keys.json");
    std::fs::write(&secret, "secret").unwrap();
    let tree = Tree::open(&ws, Some(&dir.path().join(".tmp")))
        .unwrap()
        .with_resolver(resolver);
    Setup {
        _dir: dir,
        ws,
        outside,
        secret,
        tree,
    }
}

fn rel(path: &str) -> RelPath {
    RelPath::parse(path).unwrap()
}

fn outside_untouched(s: &Setup) {
    assert_eq!(std::fs::read_to_string(&s.secret).unwrap(), "secret");
    let names: Vec<_> = std::fs::read_dir(&s.outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [OsString::from("keys.json")]);
}

const BOTH: [Resolver; 2] = [Resolver::Auto, Resolver::Walk];

#[test]
fn names_are_checked() {
    for bad in [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a\0b",
        "./a",
        "a/./b",
        "a//b",
        "a/",
    ] {
        let err = RelPath::parse(bad).unwrap_err();
        assert!(
            matches!(err, TreeError::InvalidName { .. }),
            "{bad:?}: {err}"
        );
    }
    assert_eq!(rel("a/b/c").split_last().unwrap(), (rel("a/b"), "c"));
    assert_eq!(rel("c").split_last().unwrap(), (RelPath::root(), "c"));
    assert!(RelPath::parse(&"x".repeat(256)).is_err());
    assert!(RelPath::parse(&"x/".repeat(2100)).is_err());
}

#[test]
fn writes_reads_lists_and_removes() {
    for resolver in BOTH {
        let s = setup(resolver);
        assert_eq!(
            s.tree.write(&rel("a/b/c.txt"), &mut &b"hello"[..]).unwrap(),
            5
        );
        assert_eq!(
            std::fs::read_to_string(s.ws.join("a/b/c.txt")).unwrap(),
            "hello"
        );
        let (mut file, meta) = s.tree.open_file(&rel("a/b/c.txt")).unwrap();
        assert_eq!(meta.size, 5);
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "hello");
        let mut seen = Vec::new();
        let truncated = s
            .tree
            .walk(&RelPath::root(), 100, &mut |path, meta| {
                seen.push((path.to_owned(), meta.kind))
            })
            .unwrap();
        seen.sort_by(|a, b| a.0.cmp(&b.0));
        assert!(!truncated);
        assert_eq!(
            seen,
            [
                ("a".to_owned(), Kind::Dir),
                ("a/b".to_owned(), Kind::Dir),
                ("a/b/c.txt".to_owned(), Kind::File)
            ]
        );
        assert_eq!(s.tree.remove(&rel("a")).unwrap(), Kind::Dir);
        assert!(!s.ws.join("a").exists());
        assert!(matches!(
            s.tree.remove(&rel("a")).unwrap_err(),
            TreeError::NotFound { .. }
        ));
        // Nothing is left in the scratch folder.
        assert_eq!(s.tree.scratch.as_ref().unwrap().names(10).unwrap().len(), 0);
    }
}

#[test]
fn attack_links_on_every_component_are_never_followed() {
    for resolver in BOTH {
        let s = setup(resolver);
        // A link as the first, a middle and the last component.
        symlink(&s.outside, s.ws.join("first")).unwrap();
        std::fs::create_dir(s.ws.join("d")).unwrap();
        symlink(&s.outside, s.ws.join("d/middle")).unwrap();
        symlink(&s.secret, s.ws.join("d/last.json")).unwrap();
        symlink("../../outside/keys.json", s.ws.join("relative")).unwrap();
        for path in [
            "first/keys.json",
            "first/new.txt",
            "d/middle/keys.json",
            "d/middle/x/y.txt",
            "d/last.json",
            "relative",
        ] {
            let err = s.tree.write(&rel(path), &mut &b"pwned"[..]).unwrap_err();
            assert!(matches!(err, TreeError::Link { .. }), "{path}: {err}");
            let err = s.tree.open_file(&rel(path)).unwrap_err();
            assert!(matches!(err, TreeError::Link { .. }), "read {path}: {err}");
            let err = s.tree.dir(&rel(path)).unwrap_err();
            assert!(
                matches!(err, TreeError::Link { .. } | TreeError::NotDir { .. }),
                "dir {path}: {err}"
            );
        }
        // The error names the link, relative to the workspace.
        let err = s
            .tree
            .write(&rel("d/middle/x/y.txt"), &mut &b""[..])
            .unwrap_err();
        assert_eq!(err.path(), Some("d/middle"));
        // Removing a link removes the link, not its target.
        assert_eq!(s.tree.remove(&rel("first")).unwrap(), Kind::Symlink);
        assert_eq!(s.tree.remove(&rel("d")).unwrap(), Kind::Dir);
        outside_untouched(&s);
    }
}

#[test]
fn attack_walks_never_enter_links() {
    let s = setup(Resolver::Auto);
    symlink(&s.outside, s.ws.join("out")).unwrap();
    let mut seen = Vec::new();
    s.tree
        .walk(&RelPath::root(), 100, &mut |path, meta| {
            seen.push((path.to_owned(), meta.kind))
        })
        .unwrap();
    assert_eq!(seen, [("out".to_owned(), Kind::Symlink)]);
    let err = s.tree.walk(&rel("out"), 100, &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, TreeError::Link { .. }), "{err}");
}

#[test]
fn attack_fifos_and_devices_are_refused_unopened() {
    let s = setup(Resolver::Auto);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        s.ws.join("pipe"),
        FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    // Opening a fifo for reading would block until a writer came; it must not even open.
    let err = s.tree.open_file(&rel("pipe")).unwrap_err();
    assert!(
        matches!(err, TreeError::NotRegular { kind: "fifo", .. }),
        "{err}"
    );
    assert_eq!(s.tree.stat(&rel("pipe")).unwrap().unwrap().kind, Kind::Fifo);
    // A write over it replaces the name, never writes into the fifo.
    s.tree.write(&rel("pipe"), &mut &b"data"[..]).unwrap();
    assert_eq!(std::fs::read(s.ws.join("pipe")).unwrap(), b"data");
}

#[test]
fn attack_hard_links_keep_the_other_name_unchanged() {
    let s = setup(Resolver::Auto);
    // Same file system: a hard link to a file outside the workspace.
    std::fs::hard_link(&s.secret, s.ws.join("linked.json")).unwrap();
    s.tree
        .write(&rel("linked.json"), &mut &b"pwned"[..])
        .unwrap();
    assert_eq!(std::fs::read(s.ws.join("linked.json")).unwrap(), b"pwned");
    outside_untouched(&s);
}

#[test]
fn attack_planted_temporary_names_are_not_used() {
    let s = setup(Resolver::Auto);
    // The old scheme wrote `.<name>.<pid>.tmp` beside the target.
    let planted = format!(".up.txt.{}.tmp", std::process::id());
    symlink(&s.secret, s.ws.join(&planted)).unwrap();
    s.tree.write(&rel("up.txt"), &mut &b"upload"[..]).unwrap();
    assert_eq!(std::fs::read(s.ws.join("up.txt")).unwrap(), b"upload");
    assert!(
        std::fs::symlink_metadata(s.ws.join(&planted))
            .unwrap()
            .is_symlink()
    );
    outside_untouched(&s);
}

/// A thread swaps a folder for a link to the outside and back as fast as it can while
/// writes, reads and removals go through the folder. Whatever interleaving happens, nothing
/// outside changes.
#[test]
fn attack_links_swapped_in_between_check_and_use() {
    for resolver in BOTH {
        let s = setup(resolver);
        let real = s.ws.join("real");
        let spot = s.ws.join("spot");
        std::fs::create_dir(&real).unwrap();
        let link = s.ws.join("link");
        symlink(&s.outside, &link).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let racer = {
            let (stop, real, spot, link, ws) = (
                stop.clone(),
                real.clone(),
                spot.clone(),
                link.clone(),
                s.ws.clone(),
            );
            std::thread::spawn(move || {
                let parked = ws.join("parked");
                while !stop.load(Ordering::Relaxed) {
                    let _ = std::fs::rename(&real, &spot);
                    let _ = std::fs::rename(&spot, &parked);
                    let _ = std::fs::rename(&link, &spot);
                    let _ = std::fs::rename(&spot, &link);
                    let _ = std::fs::rename(&parked, &real);
                }
            })
        };
        let started = std::time::Instant::now();
        let mut wrote = 0;
        while started.elapsed() < std::time::Duration::from_millis(700) {
            if s.tree
                .write(&rel("spot/keys.json"), &mut &b"pwned"[..])
                .is_ok()
            {
                wrote += 1;
            }
            let _ = s.tree.open_file(&rel("spot/keys.json"));
            let _ = s.tree.remove(&rel("spot/keys.json"));
            let _ = s.tree.write(&rel("spot/new/deep.txt"), &mut &b"x"[..]);
            let _ = s.tree.remove(&rel("spot/new"));
        }
        stop.store(true, Ordering::Relaxed);
        racer.join().unwrap();
        outside_untouched(&s);
        // The race did not make every write fail: some went into the real folder.
        assert!(wrote > 0, "no write succeeded during the race");
    }
}

#[test]
fn scratch_is_swept() {
    let s = setup(Resolver::Auto);
    let scratch = s.ws.parent().unwrap().join(".tmp");
    std::fs::write(scratch.join("kiln-left-by-a-crash"), "x").unwrap();
    s.tree.sweep_scratch().unwrap();
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
}

#[test]
fn a_read_only_tree_refuses_writes() {
    let s = setup(Resolver::Auto);
    let tree = Tree::open(&s.ws, None).unwrap();
    let err = tree.write(&rel("a.txt"), &mut &b""[..]).unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
    assert!(!Path::new(&s.ws.join("a.txt")).exists());
}

#[test]
fn what_the_host_makes_in_a_box_users_tree_is_the_box_users() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: giving files away needs root");
        return;
    }
    use std::os::unix::fs::MetadataExt;
    for resolver in BOTH {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("workspace");
        std::fs::create_dir(&ws).unwrap();
        std::os::unix::fs::lchown(&ws, Some(101_000), Some(101_000)).unwrap();
        // A link the guest planted at a name the host then writes under is refused, and
        // nothing it points at changes hands.
        symlink(dir.path(), ws.join("planted")).unwrap();
        let tree = Tree::open(&ws, Some(&dir.path().join(".tmp")))
            .unwrap()
            .with_resolver(resolver);
        tree.write(&rel("a/b/file.txt"), &mut &b"x"[..]).unwrap();
        tree.root()
            .symlink(b"a/b/file.txt", OsStr::new("link"))
            .unwrap();
        for made in ["a", "a/b", "a/b/file.txt", "link"] {
            let meta = std::fs::symlink_metadata(ws.join(made)).unwrap();
            assert_eq!((meta.uid(), meta.gid()), (101_000, 101_000), "{made}");
        }
        assert!(tree.write(&rel("planted/x"), &mut &b"x"[..]).is_err());
        assert_eq!(std::fs::metadata(dir.path()).unwrap().uid(), 0);
        // A tree of kiln's own user gives nothing away.
        let own = dir.path().join("own");
        std::fs::create_dir(&own).unwrap();
        let tree = Tree::open(&own, Some(&dir.path().join(".tmp"))).unwrap();
        tree.write(&rel("f"), &mut &b"x"[..]).unwrap();
        assert_eq!(std::fs::metadata(own.join("f")).unwrap().uid(), 0);
    }
}
