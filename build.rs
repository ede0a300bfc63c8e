//! Stamps the binary with the git revision it was built from (`switchyard --version`).
//! Outside a git tree (a source tarball, a container build without `.git`) the
//! revision is `unknown`; `SWITCHYARD_GIT_REV` set in the environment wins (for
//! builds that know the revision but have no `.git`, e.g. a Docker build argument).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SWITCHYARD_GIT_REV");
    let rev = std::env::var("SWITCHYARD_GIT_REV")
        .ok()
        .filter(|r| !r.trim().is_empty())
        .or_else(git_rev)
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SWITCHYARD_GIT_REV={}", rev.trim());
    // Rebuild only when HEAD moves: HEAD itself (a checkout), its reflog (appended on
    // every commit, checkout or reset, even when the branch ref is packed) and the ref
    // it names. Only files that exist: a missing one would make every build dirty.
    if let Some(git_dir) = git_dir() {
        let mut watched = vec![git_dir.join("HEAD"), git_dir.join("logs").join("HEAD")];
        if let Some(reference) = head_ref(&git_dir) {
            let common = common_dir(&git_dir);
            watched.push(common.join(&reference));
            watched.push(common.join("packed-refs"));
        }
        for path in watched.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn git_rev() -> Option<String> {
    git(&["rev-parse", "--short", "HEAD"])
}

/// This checkout's git directory (a worktree's own, not the shared one).
fn git_dir() -> Option<PathBuf> {
    git(&["rev-parse", "--absolute-git-dir"]).map(PathBuf::from)
}

/// Where refs live: the main repository's git directory for a linked worktree.
fn common_dir(git_dir: &Path) -> PathBuf {
    git(&["rev-parse", "--git-common-dir"])
        .map(|d| {
            let p = PathBuf::from(d);
            if p.is_absolute() {
                p
            } else {
                std::env::current_dir().unwrap_or_default().join(p)
            }
        })
        .unwrap_or_else(|| git_dir.to_path_buf())
}

/// `refs/heads/NAME` when HEAD is a symbolic ref; `None` when detached.
fn head_ref(git_dir: &Path) -> Option<String> {
    let head = std::fs::read_to_string(git_dir.join("HEAD")).ok()?;
    head.strip_prefix("ref: ").map(|r| r.trim().to_string())
}
