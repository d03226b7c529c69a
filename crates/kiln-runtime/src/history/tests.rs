use std::os::unix::fs::symlink;

use super::*;

struct Setup {
    dir: tempfile::TempDir,
    ws: PathBuf,
    tree: Tree,
    history: History,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("workspace");
    std::fs::create_dir(&ws).unwrap();
    let tree = Tree::open(&ws, Some(&dir.path().join(".tmp"))).unwrap();
    let history = History::init(&dir.path().join("history.git"), &tree).unwrap();
    Setup {
        dir,
        ws,
        tree,
        history,
    }
}

#[test]
fn commits_diffs_and_rolls_back() {
    let s = setup();
    let (ws, history, tree) = (&s.ws, &s.history, &s.tree);
    assert_eq!(history.record(tree, "noop", "e0").unwrap().commit_id, None);

    std::fs::write(ws.join("a.txt"), "one\n").unwrap();
    assert!(
        history
            .record(tree, "write a", "e1")
            .unwrap()
            .commit_id
            .is_some()
    );
    std::fs::write(ws.join("a.txt"), "two\n").unwrap();
    std::fs::create_dir(ws.join("sub")).unwrap();
    std::fs::write(ws.join("sub/b.bin"), [0u8, 1, 2]).unwrap();
    assert!(
        history
            .record(tree, "change a, add b", "e2")
            .unwrap()
            .commit_id
            .is_some()
    );

    let entries = history.entries(100).unwrap();
    let ids: Vec<_> = entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["e2", "e1", INITIAL_ID]);
    assert_eq!(entries[0].files, ["a.txt", "sub/b.bin"]);
    assert_eq!(entries[1].files, ["a.txt"]);

    let diff = history.diff("e1", "e2").unwrap();
    assert!(diff["a.txt"].contains("-one\n+two\n"), "{diff:?}");
    assert!(diff.contains_key("sub/b.bin"));

    std::fs::write(ws.join("stray.txt"), "not recorded").unwrap();
    history.rollback(tree, "e1", "r1").unwrap();
    assert_eq!(std::fs::read_to_string(ws.join("a.txt")).unwrap(), "one\n");
    assert!(!ws.join("sub").exists());
    assert!(!ws.join("stray.txt").exists());
    assert_eq!(history.entries(1).unwrap()[0].id, "r1");

    // The repository survives reopening.
    let reopened = History::open(&s.dir.path().join("history.git")).unwrap();
    assert_eq!(reopened.entries(100).unwrap().len(), 4);
    assert!(matches!(
        reopened.diff("nope", "e1"),
        Err(HistoryError::UnknownId(_))
    ));
}

#[test]
fn pages_follow_first_parents() {
    let s = setup();
    for i in 0..7 {
        std::fs::write(s.ws.join("n.txt"), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
    }
    let (first, next) = s.history.page(3, None).unwrap();
    let ids: Vec<_> = first.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, ["e6", "e5", "e4"]);
    let (second, next) = s.history.page(3, next.as_deref()).unwrap();
    let ids: Vec<_> = second.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, ["e3", "e2", "e1"]);
    let (third, next) = s.history.page(3, next.as_deref()).unwrap();
    let ids: Vec<_> = third.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, ["e0", INITIAL_ID]);
    assert_eq!(next, None);
    assert!(matches!(
        s.history.page(3, Some("zz")).unwrap_err(),
        HistoryError::UnknownId(_)
    ));
}

/// Issue 12, item 2: a guest's nested repository is recorded as plain files, diffed and
/// restored exactly, and a `.git` at the root does not survive a rollback to `initial`.
#[test]
fn nested_git_folders_are_recorded_as_plain_files() {
    let s = setup();
    let (ws, history, tree) = (&s.ws, &s.history, &s.tree);
    std::fs::create_dir_all(ws.join("proj/.git/refs")).unwrap();
    std::fs::write(ws.join("proj/.git/HEAD"), "ref: refs/heads/main\n").unwrap();
    std::fs::write(ws.join("proj/main.py"), "print(1)\n").unwrap();
    std::fs::create_dir_all(ws.join(".git")).unwrap();
    std::fs::write(ws.join(".git/config"), "[core]\n").unwrap();
    std::fs::write(ws.join(".GIT~"), "a file with a git-like name").unwrap();
    // Names only NTFS cares about are fine on Linux (the repository's config says so).
    std::fs::write(ws.join("git~1"), "x").unwrap();
    std::fs::write(ws.join(".git."), "x").unwrap();
    let recorded = history.record(tree, "make repos", "e1").unwrap();
    assert!(recorded.commit_id.is_some());
    let entry = &history.entries(1).unwrap()[0];
    assert_eq!(
        entry.files,
        [
            ".GIT~",
            ".git.",
            ".git/config",
            "git~1",
            "proj/.git/HEAD",
            "proj/main.py"
        ]
    );
    // Stored under names git accepts, so `git clone` of the history works.
    let head = history.head().unwrap().tree().unwrap();
    let names: Vec<_> = head.iter().map(|e| e.name().unwrap().to_owned()).collect();
    assert_eq!(names, [".GIT~~", ".git.", ".git~", "git~1", "proj"]);

    std::fs::write(ws.join("proj/.git/HEAD"), "ref: refs/heads/evil\n").unwrap();
    history.record(tree, "change", "e2").unwrap();
    let diff = history.diff("e1", "e2").unwrap();
    assert_eq!(diff.keys().collect::<Vec<_>>(), ["proj/.git/HEAD"]);

    history.rollback(tree, "e1", "r1").unwrap();
    assert_eq!(
        std::fs::read_to_string(ws.join("proj/.git/HEAD")).unwrap(),
        "ref: refs/heads/main\n"
    );
    history.rollback(tree, INITIAL_ID, "r2").unwrap();
    assert_eq!(
        std::fs::read_dir(ws).unwrap().count(),
        0,
        "rollback left files"
    );
}

#[test]
fn links_are_recorded_as_links_and_specials_left_out() {
    let s = setup();
    let outside = s.dir.path().join("secret.txt");
    std::fs::write(&outside, "secret").unwrap();
    symlink(&outside, s.ws.join("link")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        s.ws.join("pipe"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let recorded = s.history.record(&s.tree, "links", "e1").unwrap();
    assert_eq!(
        recorded.left_out,
        [LeftOut {
            path: "pipe".into(),
            reason: "special".into()
        }]
    );
    let head = s.history.head().unwrap().tree().unwrap();
    let link = head.get_name("link").unwrap();
    assert_eq!(link.filemode(), 0o120000);
    let blob = s.history.repo.find_blob(link.id()).unwrap();
    assert_eq!(blob.content(), outside.as_os_str().as_bytes());

    // Rolling back re-creates the link as a link (never writing through it).
    std::fs::remove_file(s.ws.join("link")).unwrap();
    std::fs::write(s.ws.join("link"), "replaced").unwrap();
    s.history.record(&s.tree, "replace", "e2").unwrap();
    s.history.rollback(&s.tree, "e1", "r1").unwrap();
    assert!(
        std::fs::symlink_metadata(s.ws.join("link"))
            .unwrap()
            .is_symlink()
    );
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "secret");
}

/// Issue 12, item 5: a 1-byte write at a 1 GiB offset is left out (never read).
#[test]
fn huge_sparse_files_are_left_out() {
    let s = setup();
    let file = std::fs::File::create(s.ws.join("sparse.bin")).unwrap();
    file.set_len(1 << 30).unwrap();
    std::fs::write(s.ws.join("small.txt"), "x").unwrap();
    let recorded = s.history.record(&s.tree, "sparse", "e1").unwrap();
    assert_eq!(
        recorded.left_out,
        [LeftOut {
            path: "sparse.bin".into(),
            reason: "too_large".into()
        }]
    );
    assert_eq!(s.history.entries(1).unwrap()[0].files, ["small.txt"]);
}

/// Issue 12, item 3: lock files a kill left behind are removed at start-up.
#[test]
fn stale_locks_are_recovered() {
    let s = setup();
    let git = s.dir.path().join("history.git");
    std::fs::write(git.join("index.lock"), "").unwrap();
    let head = std::fs::read_to_string(git.join("HEAD")).unwrap();
    let branch = head.trim().strip_prefix("ref: ").unwrap();
    std::fs::write(git.join(format!("{branch}.lock")), "").unwrap();
    std::fs::write(git.join("HEAD.lock"), "").unwrap();
    std::fs::write(s.ws.join("a.txt"), "a").unwrap();
    assert!(s.history.record(&s.tree, "a", "e1").is_err());
    let mut removed = recover(&git).unwrap();
    removed.sort();
    assert_eq!(removed.len(), 3, "{removed:?}");
    assert!(
        s.history
            .record(&s.tree, "a", "e1")
            .unwrap()
            .commit_id
            .is_some()
    );
}

#[test]
fn loose_objects_are_packed() {
    let s = setup();
    for i in 0..200 {
        std::fs::write(s.ws.join(format!("f{}.txt", i % 10)), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
    }
    assert!(s.history.pack_if_due().unwrap());
    assert!(!s.history.pack_if_due().unwrap());
    // Everything is still readable.
    assert_eq!(s.history.entries(1000).unwrap().len(), 201);
    let diff = s.history.diff(INITIAL_ID, "e199").unwrap();
    assert_eq!(diff.len(), 10);
    s.history.rollback(&s.tree, "e5", "r").unwrap();
    assert_eq!(std::fs::read_to_string(s.ws.join("f5.txt")).unwrap(), "5");
}

/// Packs are merged geometrically (a few packs, however long the history); every commit of
/// the history stays readable.
#[test]
fn folded_packs_keep_the_whole_history() {
    let s = setup();
    for i in 0..40 {
        std::fs::write(s.ws.join(format!("f{}.txt", i % 5)), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
        s.history.pack(1).unwrap();
    }
    let packs = std::fs::read_dir(s.dir.path().join("history.git/objects/pack"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".pack")
        })
        .count();
    assert!((1..=6).contains(&packs), "{packs} packs");
    // Nothing is loose any more.
    let loose = std::fs::read_dir(s.dir.path().join("history.git/objects"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().len() == 2)
        .map(|e| std::fs::read_dir(e.unwrap().path()).unwrap().count())
        .sum::<usize>();
    assert_eq!(loose, 0);
    let reopened = History::open(&s.dir.path().join("history.git")).unwrap();
    assert_eq!(reopened.entries(1000).unwrap().len(), 41);
    assert_eq!(reopened.diff(INITIAL_ID, "e39").unwrap().len(), 5);
    assert_eq!(reopened.diff("e0", "e1").unwrap().len(), 1);
    reopened.rollback(&s.tree, "e2", "r").unwrap();
    assert_eq!(std::fs::read_to_string(s.ws.join("f2.txt")).unwrap(), "2");
    assert!(!s.ws.join("f3.txt").exists());
}

#[test]
fn git_like_names_round_trip() {
    for name in [
        ".git",
        ".GIT",
        ".git~",
        ".Git~~",
        "git",
        ".gitignore",
        "a~",
        "~",
    ] {
        let stored = encode(name.as_bytes());
        assert!(!stored.eq_ignore_ascii_case(b".git"), "{name}");
        assert_eq!(decode(&stored), name.as_bytes(), "{name}");
    }
    assert_eq!(encode(b".gitignore"), b".gitignore");
}

/// Files unchanged since an earlier commit (and older than the clock's granularity) are not
/// read again.
#[test]
fn unchanged_files_are_not_read_again() {
    let s = setup();
    std::fs::write(s.ws.join("old.txt"), "old").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(150));
    s.history.record(&s.tree, "first", "e1").unwrap();
    let meta = s
        .tree
        .stat(&kiln_workspace::RelPath::parse("old.txt").unwrap())
        .unwrap()
        .unwrap();
    assert!(s.history.memory.cached_blob(&meta).is_some(), "not cached");
    std::fs::write(s.ws.join("new.txt"), "new").unwrap();
    s.history.record(&s.tree, "second", "e2").unwrap();
    assert_eq!(s.history.entries(1).unwrap()[0].files, ["new.txt"]);
}

/// A forked sandbox's history: the copy has every commit up to the head, goes on from it on
/// its own, and neither repository sees the other's later changes (loose objects and packs
/// alike, whichever is packed after the copy).
#[test]
fn a_clone_keeps_the_history_and_goes_its_own_way() {
    let s = setup();
    for i in 0..6 {
        std::fs::write(s.ws.join(format!("f{i}.txt")), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
        if i == 2 {
            s.history.pack(1).unwrap();
        }
    }
    std::fs::write(s.history.repo.path().join("index.lock"), "stale").unwrap();
    let copy_dir = s.dir.path().join("copy.git");
    let copy = s.history.clone_into(&copy_dir).unwrap();
    assert!(!copy_dir.join("index.lock").exists(), "locks stay behind");
    let ids = |h: &History| -> Vec<String> {
        h.entries(100).unwrap().into_iter().map(|e| e.id).collect()
    };
    assert_eq!(ids(&copy), ids(&s.history));
    assert_eq!(copy.diff(INITIAL_ID, "e5").unwrap().len(), 6);

    // The copy's workspace goes on from the head; the original's changes stay its own.
    let copy_ws = s.dir.path().join("copy-ws");
    std::fs::create_dir(&copy_ws).unwrap();
    let copy_tree = Tree::open(&copy_ws, Some(&s.dir.path().join(".tmp2"))).unwrap();
    copy.rollback(&copy_tree, "e5", "checkout").unwrap();
    std::fs::write(copy_ws.join("child.txt"), "c").unwrap();
    copy.record(&copy_tree, "child", "c1").unwrap();
    std::fs::write(s.ws.join("parent.txt"), "p").unwrap();
    s.history.record(&s.tree, "parent", "p1").unwrap();
    s.history.pack(1).unwrap();
    copy.pack(1).unwrap();
    assert_eq!(ids(&copy)[..2], ["c1", "checkout"]);
    assert_eq!(ids(&s.history)[0], "p1");
    assert!(matches!(
        copy.diff("e5", "p1").unwrap_err(),
        HistoryError::UnknownId(_)
    ));
    let reopened = History::open(&copy_dir).unwrap();
    assert_eq!(reopened.diff(INITIAL_ID, "c1").unwrap().len(), 7);
    assert_eq!(
        History::open(&s.dir.path().join("history.git"))
            .unwrap()
            .diff("e0", "p1")
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn a_history_made_on_first_use_is_made_once_whoever_races() {
    let dir = tempfile::tempdir().unwrap();
    let git_dir = dir.path().join("history.git");
    let created_ms = 1_700_000_000_123;
    let heads: Vec<String> = std::thread::scope(|scope| {
        let racers: Vec<_> = (0..6)
            .map(|_| {
                scope.spawn(|| {
                    let history = History::open_or_create(&git_dir, created_ms).unwrap();
                    history.repo.head().unwrap().target().unwrap().to_string()
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert!(heads.windows(2).all(|w| w[0] == w[1]), "{heads:?}");
    // What `init` of an empty workspace at creation would have recorded: one commit of
    // the empty tree, dated the sandbox's creation, also `refs/kiln/initial`.
    let history = History::open(&git_dir).unwrap();
    let head = history.repo.head().unwrap().peel_to_commit().unwrap();
    assert_eq!(head.parent_count(), 0);
    assert_eq!(head.tree().unwrap().len(), 0);
    assert_eq!(head.time().seconds(), 1_700_000_000);
    assert_eq!(history.repo.refname_to_id(INITIAL_REF).unwrap(), head.id());
    // No temporary is left beside it.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["history.git"]);
    // A half-made one a crash left is swept; the made one is kept.
    std::fs::create_dir_all(
        dir.path()
            .join(".history.git.0011223344556677.pending/objects"),
    )
    .unwrap();
    remove_pending(dir.path());
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["history.git"]);
    // A workspace with files at first use still starts from the empty initial commit.
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("a.txt"), "a").unwrap();
    let tree = Tree::open(&ws, None).unwrap();
    let other = History::open_or_create(&dir.path().join("other.git"), created_ms).unwrap();
    let recorded = other.record(&tree, "first run", "e1").unwrap();
    assert!(recorded.commit_id.is_some());
    assert_eq!(other.entries(10).unwrap().len(), 2);
}

/// Every entry of a history, paging `limit` at a time from a fresh handle; also checks each
/// page's cursor is its last commit and only the last page has none.
fn page_through(git_dir: &Path, limit: usize) -> Vec<HistoryEntry> {
    let history = History::open(git_dir).unwrap();
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let (page, next) = history.page(limit, cursor.as_deref()).unwrap();
        assert!(!page.is_empty() && page.len() <= limit);
        all.extend(page.iter().cloned());
        match next {
            Some(next) => {
                assert_eq!(page.len(), limit, "only a full page has a next one");
                assert_eq!(Some(&next), page.last().map(|e| &e.commit_id));
                cursor = Some(next);
            }
            None => return all,
        }
    }
}

/// Issue 32 §5: paging a long history (packs and loose objects, as a long-lived sandbox has)
/// visits every change once, newest first, in pages that neither overlap nor skip; the last
/// page ends with `initial` and has no cursor; entries read again (from memory) are the same
/// as read the first time, and as read by a process that never saw them.
#[test]
fn pages_of_a_long_history_neither_overlap_nor_skip() {
    let s = setup();
    let git_dir = s.dir.path().join("history.git");
    let head = s.history.append_uploads_for_bench(1, 4_999, 100).unwrap();
    let packs = std::fs::read_dir(git_dir.join("objects/pack"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension() == Some(OsStr::new("pack")))
        .count();
    assert!(packs >= 3, "{packs} packs");

    let all = page_through(&git_dir, 1000);
    assert_eq!(all.len(), 5000);
    assert_eq!(all[0].commit_id, head);
    assert_eq!(all[0].id, format!("upload_{:024x}", 4999));
    assert_eq!(all[0].files, ["f9.txt"]);
    assert_eq!(all[4998].id, format!("upload_{:024x}", 1));
    assert_eq!(all[4999].id, INITIAL_ID);
    let mut ids: Vec<&str> = all.iter().map(|e| e.commit_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 5000, "an entry came twice");

    // Odd page sizes, and a page size that divides the history exactly.
    let by_7: Vec<String> = page_through(&git_dir, 7)
        .into_iter()
        .map(|e| e.commit_id)
        .collect();
    let by_1000: Vec<String> = all.iter().map(|e| e.commit_id.clone()).collect();
    assert_eq!(by_7, by_1000);
    assert_eq!(page_through(&git_dir, 5000).len(), 5000);
    assert_eq!(page_through(&git_dir, 1).len(), 5000);

    // Read again (partly from memory, which stays bounded), and by a handle whose process
    // never read them.
    let cached = s.history.memory.entries.lock().unwrap().bytes;
    assert!(
        (1..=ENTRY_CACHE_REPO_BYTES).contains(&cached),
        "{cached} bytes"
    );
    assert_eq!(
        serde_json::to_string(&page_through(&git_dir, 1000)).unwrap(),
        serde_json::to_string(&all).unwrap()
    );
    forget(&git_dir);
    let (page, next) = History::open(&git_dir)
        .unwrap()
        .page(1000, Some(&all[2999].commit_id))
        .unwrap();
    assert_eq!(page[0].commit_id, all[3000].commit_id);
    assert_eq!(page.len(), 1000);
    assert_eq!(next.as_deref(), Some(all[3999].commit_id.as_str()));
    assert_eq!(
        serde_json::to_string(&page).unwrap(),
        serde_json::to_string(&all[3000..4000]).unwrap()
    );
}

#[test]
fn the_last_page_has_no_cursor() {
    let s = setup();
    for i in 0..4 {
        std::fs::write(s.ws.join("n.txt"), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
    }
    // Five entries: a page of exactly five, of more, and the page after the fifth.
    let (page, next) = s.history.page(5, None).unwrap();
    assert_eq!((page.len(), next), (5, None));
    let (page, next) = s.history.page(1000, None).unwrap();
    assert_eq!((page.len(), next), (5, None));
    let (page, next) = s.history.page(4, None).unwrap();
    assert_eq!(next.as_deref(), Some(page[3].commit_id.as_str()));
    let (last, next) = s.history.page(4, next.as_deref()).unwrap();
    assert_eq!(last.len(), 1);
    assert_eq!(last[0].id, INITIAL_ID);
    assert_eq!(next, None);
    // After the initial commit there is nothing.
    let (none, next) = s.history.page(4, Some(&last[0].commit_id)).unwrap();
    assert!(none.is_empty());
    assert_eq!(next, None);
}

/// A cursor must be the full id of a commit of this repository: anything else (malformed,
/// short, unknown, a tree or a blob) is `UnknownId`, which the API answers INVALID_CURSOR.
#[test]
fn bad_cursors_are_refused() {
    let s = setup();
    std::fs::write(s.ws.join("a.txt"), "a").unwrap();
    s.history.record(&s.tree, "a", "e1").unwrap();
    let head = s.history.head().unwrap();
    let tree = head.tree_id().to_string();
    let blob = head.tree().unwrap().get(0).unwrap().id().to_string();
    let short = head.id().to_string()[..12].to_owned();
    let unknown = "0123456789abcdef0123456789abcdef01234567".to_owned();
    for cursor in [
        "zz".to_owned(),
        String::new(),
        short,
        format!("{}0", head.id()),
        "g".repeat(40),
        unknown,
        tree,
        blob,
    ] {
        match s.history.page(10, Some(&cursor)) {
            Err(HistoryError::UnknownId(id)) => assert_eq!(id, cursor),
            other => panic!("{cursor:?}: {other:?}"),
        }
    }
    // The head's own id is a good cursor (uppercase too: it is the same commit).
    let upper = head.id().to_string().to_uppercase();
    assert_eq!(s.history.page(10, Some(&upper)).unwrap().0.len(), 1);
}

/// A commit that cannot be read (an object gone) is an error, never the end of the history:
/// a page must not end early without saying so.
#[test]
fn an_unreadable_commit_is_an_error_not_the_end() {
    let s = setup();
    let git_dir = s.dir.path().join("history.git");
    let mut commits = Vec::new();
    for i in 0..3 {
        std::fs::write(s.ws.join("n.txt"), i.to_string()).unwrap();
        commits.push(
            s.history
                .record(&s.tree, "n", &format!("e{i}"))
                .unwrap()
                .commit_id
                .unwrap(),
        );
    }
    // The middle commit's loose object goes; a process that never read it pages.
    let gone = &commits[1];
    std::fs::remove_file(git_dir.join("objects").join(&gone[..2]).join(&gone[2..])).unwrap();
    forget(&git_dir);
    let history = History::open(&git_dir).unwrap();
    assert!(matches!(history.page(10, None), Err(HistoryError::Git(_))));
    // The page above it still says there is more.
    let (page, next) = history.page(1, None).unwrap();
    assert_eq!(page[0].commit_id, commits[2]);
    assert_eq!(next.as_deref(), Some(commits[2].as_str()));
}

/// Entries read once come from memory after: a page already read reads no object.
#[test]
fn a_page_read_again_comes_from_memory() {
    let s = setup();
    let git_dir = s.dir.path().join("history.git");
    for i in 0..3 {
        std::fs::write(s.ws.join("n.txt"), i.to_string()).unwrap();
        s.history.record(&s.tree, "n", &format!("e{i}")).unwrap();
    }
    let (first, next) = s.history.page(2, None).unwrap();
    let (second, _) = s.history.page(2, next.as_deref()).unwrap();
    // Every commit object goes (the refs stay); the pages still read, from memory.
    for commit in first.iter().chain(&second) {
        let id = &commit.commit_id;
        let _ = std::fs::remove_file(git_dir.join("objects").join(&id[..2]).join(&id[2..]));
    }
    let again = History::open(&git_dir).unwrap();
    assert_eq!(again.page(2, None).unwrap(), (first, next.clone()));
    assert_eq!(again.page(2, next.as_deref()).unwrap().0, second);
    // A process that never read them fails.
    forget(&git_dir);
    assert!(History::open(&git_dir).unwrap().page(2, None).is_err());
}
