//! Git-versioned workspaces. Each sandbox has a real git repository, `history.git` beside
//! (never inside) its workspace, so code in the sandbox cannot rewrite its own history.
//! Every change made through the API (an exec or session turn that changed files, an upload,
//! a delete, a rollback) is one commit whose message carries the change's id in a
//! `Kiln-Exec-Id:` trailer. Users can `git clone` the repository or inspect it with any git
//! tool.

use std::path::Path;

use git2::build::CheckoutBuilder;
use git2::{DiffOptions, IndexAddOption, Oid, Repository, Signature, Sort, Time};
use serde::Serialize;

use crate::sandbox::now_ms;

/// The id of the commit every history starts from.
pub const INITIAL_ID: &str = "initial";

const TRAILER: &str = "Kiln-Exec-Id: ";

/// Most history entries one listing returns.
pub const MAX_HISTORY: usize = 1000;

/// A history operation failed.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("no change {0:?} in this sandbox's history")]
    UnknownId(String),
    #[error("the workspace history could not be read or written: {0}")]
    Git(#[from] git2::Error),
}

/// One entry of a sandbox's history.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEntry {
    /// The change's id: an execution id (`python_run_…`), `upload_…`, `delete_…`,
    /// `rollback_…`, or `initial`.
    #[schema(example = "python_run_3f2a9c1b7d4e5f60718293a4")]
    pub id: String,
    /// The git commit.
    #[schema(example = "9fceb02d0ae598e95dc970b74767f19372d61af8")]
    pub commit_id: String,
    /// When it was recorded (RFC 3339).
    #[schema(example = "2026-11-22T14:03:32.120Z")]
    pub timestamp: String,
    /// What happened.
    #[schema(example = "python main.py")]
    pub message: String,
    /// The files it added, changed or removed.
    pub files: Vec<String>,
}

/// A sandbox's workspace repository.
pub struct History {
    repo: Repository,
}

fn signature() -> Result<Signature<'static>, git2::Error> {
    let ms = now_ms();
    Signature::new(
        "kiln",
        "kiln@localhost",
        &Time::new(i64::try_from(ms / 1000).unwrap_or(i64::MAX), 0),
    )
}

fn message(summary: &str, id: &str) -> String {
    // One line of summary, bounded, then the trailer.
    let mut line: String = summary
        .lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(200)
        .collect();
    if line.is_empty() {
        line = "change".into();
    }
    format!("{line}\n\n{TRAILER}{id}\n")
}

fn id_of(commit: &git2::Commit<'_>) -> Option<String> {
    let text = commit.message()?;
    text.lines()
        .rev()
        .find_map(|line| line.strip_prefix(TRAILER))
        .map(|id| id.trim().to_owned())
}

impl History {
    /// Creates the repository at `git_dir` for `workspace` and records the initial commit
    /// (whatever the workspace holds).
    pub fn init(git_dir: &Path, workspace: &Path) -> Result<History, HistoryError> {
        let repo = Repository::init_bare(git_dir)?;
        repo.set_workdir(workspace, false)?;
        let history = History { repo };
        {
            let tree = history.stage()?;
            let sig = signature()?;
            let tree = history.repo.find_tree(tree)?;
            history.repo.commit(
                Some("HEAD"),
                &sig,
                &sig,
                &message("initial workspace", INITIAL_ID),
                &tree,
                &[],
            )?;
        }
        Ok(history)
    }

    /// Opens the repository of a workspace.
    pub fn open(git_dir: &Path, workspace: &Path) -> Result<History, HistoryError> {
        let repo = Repository::open_bare(git_dir)?;
        repo.set_workdir(workspace, false)?;
        Ok(History { repo })
    }

    /// Stages the whole workspace (new, changed and removed files, ignored ones too) and
    /// returns its tree.
    fn stage(&self) -> Result<Oid, git2::Error> {
        let mut index = self.repo.index()?;
        index.add_all(["*"], IndexAddOption::DEFAULT | IndexAddOption::FORCE, None)?;
        index.update_all(["*"], None)?;
        index.write()?;
        index.write_tree()
    }

    fn head(&self) -> Result<git2::Commit<'_>, git2::Error> {
        self.repo.head()?.peel_to_commit()
    }

    /// Commits the workspace as change `id` if it differs from the last commit; returns the
    /// commit id, or `None` when nothing changed.
    pub fn commit_if_changed(
        &self,
        summary: &str,
        id: &str,
    ) -> Result<Option<String>, HistoryError> {
        let tree = self.stage()?;
        let head = self.head()?;
        if head.tree_id() == tree {
            return Ok(None);
        }
        let tree = self.repo.find_tree(tree)?;
        let sig = signature()?;
        let oid = self.repo.commit(
            Some("HEAD"),
            &sig,
            &sig,
            &message(summary, id),
            &tree,
            &[&head],
        )?;
        Ok(Some(oid.to_string()))
    }

    fn changed_files(&self, commit: &git2::Commit<'_>) -> Result<Vec<String>, git2::Error> {
        let tree = commit.tree()?;
        let parent = match commit.parent(0) {
            Ok(parent) => Some(parent.tree()?),
            Err(_) => None,
        };
        let diff = self
            .repo
            .diff_tree_to_tree(parent.as_ref(), Some(&tree), None)?;
        Ok(diff
            .deltas()
            .filter_map(|d| {
                d.new_file()
                    .path()
                    .or_else(|| d.old_file().path())
                    .map(|p| p.to_string_lossy().into_owned())
            })
            .collect())
    }

    /// The history, newest first, at most `limit` entries.
    pub fn entries(&self, limit: usize) -> Result<Vec<HistoryEntry>, HistoryError> {
        let mut walk = self.repo.revwalk()?;
        walk.push_head()?;
        walk.set_sorting(Sort::TOPOLOGICAL)?;
        let mut entries = Vec::new();
        for oid in walk.take(limit) {
            let commit = self.repo.find_commit(oid?)?;
            let ms = u64::try_from(commit.time().seconds()).unwrap_or(0) * 1000;
            entries.push(HistoryEntry {
                id: id_of(&commit).unwrap_or_else(|| commit.id().to_string()),
                commit_id: commit.id().to_string(),
                timestamp: crate::sandbox::rfc3339(ms),
                message: commit.summary().unwrap_or_default().to_owned(),
                files: self.changed_files(&commit)?,
            });
        }
        Ok(entries)
    }

    /// The newest commit recorded as change `id` (or a commit id itself).
    fn find(&self, id: &str) -> Result<git2::Commit<'_>, HistoryError> {
        let mut walk = self.repo.revwalk()?;
        walk.push_head()?;
        walk.set_sorting(Sort::TOPOLOGICAL)?;
        for oid in walk {
            let commit = self.repo.find_commit(oid?)?;
            if id_of(&commit).as_deref() == Some(id) || commit.id().to_string() == id {
                return Ok(commit);
            }
        }
        Err(HistoryError::UnknownId(id.to_owned()))
    }

    /// A unified diff per changed file between the states after changes `from` and `to`.
    pub fn diff(
        &self,
        from: &str,
        to: &str,
    ) -> Result<std::collections::BTreeMap<String, String>, HistoryError> {
        let from = self.find(from)?.tree()?;
        let to = self.find(to)?.tree()?;
        let mut options = DiffOptions::new();
        options.context_lines(3);
        let diff = self
            .repo
            .diff_tree_to_tree(Some(&from), Some(&to), Some(&mut options))?;
        let mut out = std::collections::BTreeMap::new();
        for index in 0..diff.deltas().len() {
            let Some(mut patch) = git2::Patch::from_diff(&diff, index)? else {
                continue;
            };
            let delta = patch.delta();
            let name = delta
                .new_file()
                .path()
                .or_else(|| delta.old_file().path())
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = patch.to_buf()?;
            out.insert(name, String::from_utf8_lossy(&text).into_owned());
        }
        Ok(out)
    }

    /// Restores the workspace to its state after change `target` and records that as change
    /// `id`. Returns the new commit.
    pub fn rollback(&self, target: &str, id: &str) -> Result<String, HistoryError> {
        let commit = self.find(target)?;
        let tree = commit.tree()?;
        let mut checkout = CheckoutBuilder::new();
        checkout.force().remove_untracked(true).remove_ignored(true);
        // Stage first so files the last exec left unrecorded count as tracked and are
        // replaced too.
        self.stage()?;
        self.repo
            .checkout_tree(tree.as_object(), Some(&mut checkout))?;
        let mut index = self.repo.index()?;
        index.read_tree(&tree)?;
        index.write()?;
        let head = self.head()?;
        let sig = signature()?;
        let oid = self.repo.commit(
            Some("HEAD"),
            &sig,
            &sig,
            &message(&format!("rollback to {target}"), id),
            &tree,
            &[&head],
        )?;
        Ok(oid.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_diffs_and_rolls_back() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path().join("workspace");
        std::fs::create_dir(&ws).unwrap();
        let history = History::init(&dir.path().join("history.git"), &ws).unwrap();
        assert_eq!(history.commit_if_changed("noop", "e0").unwrap(), None);

        std::fs::write(ws.join("a.txt"), "one\n").unwrap();
        assert!(
            history
                .commit_if_changed("write a", "e1")
                .unwrap()
                .is_some()
        );
        std::fs::write(ws.join("a.txt"), "two\n").unwrap();
        std::fs::create_dir(ws.join("sub")).unwrap();
        std::fs::write(ws.join("sub/b.bin"), [0u8, 1, 2]).unwrap();
        assert!(
            history
                .commit_if_changed("change a, add b", "e2")
                .unwrap()
                .is_some()
        );

        let entries = history.entries(100).unwrap();
        let ids: Vec<_> = entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["e2", "e1", INITIAL_ID]);
        assert_eq!(entries[0].files, ["a.txt", "sub/b.bin"]);

        let diff = history.diff("e1", "e2").unwrap();
        assert!(diff["a.txt"].contains("-one\n+two\n"), "{diff:?}");
        assert!(diff.contains_key("sub/b.bin"));

        std::fs::write(ws.join("stray.txt"), "not recorded").unwrap();
        history.rollback("e1", "r1").unwrap();
        assert_eq!(std::fs::read_to_string(ws.join("a.txt")).unwrap(), "one\n");
        assert!(!ws.join("sub/b.bin").exists());
        assert!(!ws.join("stray.txt").exists());
        assert_eq!(history.entries(1).unwrap()[0].id, "r1");

        // The repository survives reopening.
        let reopened = History::open(&dir.path().join("history.git"), &ws).unwrap();
        assert_eq!(reopened.entries(100).unwrap().len(), 4);
        assert!(matches!(
            reopened.diff("nope", "e1"),
            Err(HistoryError::UnknownId(_))
        ));
    }
}
