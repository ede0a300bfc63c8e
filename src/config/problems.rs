//! The problems (and notes) of one configuration check. Every problem starts with
//! the key path it is about (`pools[0].workers[1].url: …`). A value rejected while
//! reading the file is set aside; later problems at or under its key would only
//! be consequences of that rejection and are dropped.

use super::{ConfigError, Secret};

/// Whether the secret environment variables (`*_env` keys) must be set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Secrets {
    /// An unset variable is a problem (`serve`, `check-config`).
    #[default]
    Required,
    /// An unset variable is a note; set ones are still checked
    /// (`check-config --no-secrets`, for CI without the secrets).
    Optional,
}

/// Problems and notes found so far.
#[derive(Debug, Default)]
pub(crate) struct Problems {
    problems: Vec<String>,
    notes: Vec<String>,
    /// Key paths whose value in the file was rejected while reading it.
    rejected: Vec<String>,
    /// The text is not TOML: there is nothing to validate.
    unreadable: bool,
    pub(crate) secrets: Secrets,
}

/// Whether `key` is `prefix` or a key under it (`prefix.x`, `prefix[3]`).
fn under(key: &str, prefix: &str) -> bool {
    key.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// The key path a problem is about: its text before the first `: `.
fn key_of(problem: &str) -> &str {
    problem.split_once(": ").map_or(problem, |(k, _)| k)
}

impl Problems {
    /// Report `problem`, unless it is about a key whose value was rejected earlier.
    pub(crate) fn push(&mut self, problem: String) {
        if !self.follows_rejection(key_of(&problem)) {
            self.problems.push(problem);
        }
    }

    /// The value at `key` was rejected: report `problem` (unless it follows an
    /// earlier rejection) and drop later problems at or under `key`.
    pub(crate) fn reject(&mut self, key: &str, problem: String) {
        if !self.follows_rejection(key) {
            self.problems.push(problem);
        }
        self.rejected.push(key.to_string());
    }

    /// Drop later problems at or under `key`, reporting nothing (the cause was).
    pub(crate) fn set_aside(&mut self, key: &str) {
        self.rejected.push(key.to_string());
    }

    /// The text could not be read at all.
    pub(crate) fn unreadable(&mut self, problem: String) {
        self.problems.push(problem);
        self.unreadable = true;
    }

    pub(crate) fn is_unreadable(&self) -> bool {
        self.unreadable
    }

    fn follows_rejection(&self, key: &str) -> bool {
        self.rejected.iter().any(|r| under(key, r))
    }

    /// Whether a problem was found at or under `key`, while reading or since.
    pub(crate) fn reported(&self, key: &str) -> bool {
        self.rejected.iter().any(|r| under(r, key))
            || self.problems.iter().any(|p| under(key_of(p), key))
    }

    /// Whether the value at exactly `key` was rejected while reading (so whatever
    /// it would have declared is missing).
    pub(crate) fn rejected_at(&self, key: &str) -> bool {
        self.rejected.iter().any(|r| r == key)
    }

    /// The secret in the environment variable `var`, named by the key `key`. Unset
    /// or empty: a problem, or a note when secrets are optional.
    pub(crate) fn secret(&mut self, key: &str, var: &str) -> Option<Secret> {
        if var.is_empty() {
            self.push(format!("{key}: must name an environment variable"));
            return None;
        }
        match std::env::var(var) {
            Ok(v) if !v.is_empty() => Some(Secret::new(v)),
            _ => {
                let problem = format!("{key}: environment variable `{var}` is not set");
                match self.secrets {
                    Secrets::Required => self.push(problem),
                    Secrets::Optional => self.notes.push(format!("{problem} (`serve` needs it)")),
                }
                None
            }
        }
    }

    /// A note for `check-config` (and `serve`'s log): nothing wrong, but
    /// something the operator should know.
    pub(crate) fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    /// The error, when there are problems.
    pub(crate) fn error(&self) -> Option<ConfigError> {
        (!self.problems.is_empty()).then(|| ConfigError {
            problems: self.problems.clone(),
        })
    }

    pub(crate) fn into_notes(self) -> Vec<String> {
        self.notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_under_a_rejected_key_are_dropped() {
        let mut p = Problems::default();
        p.reject(
            "pools[0].workers[1].url",
            "pools[0].workers[1].url: required key is missing".into(),
        );
        p.push("pools[0].workers[1].url: `` is not a URL".into());
        p.push("pools[0].workers[10].url: `x` is not a URL".into());
        p.reject("pools[0].workers[1].url.x", "nested".into());
        assert_eq!(p.problems.len(), 2, "{:?}", p.problems);
        assert!(p.reported("pools[0].workers"));
        assert!(p.reported("pools[0].workers[10]"));
        assert!(!p.reported("pools[0].worker"));
        assert!(!p.reported("pools[1]"));
        assert!(p.rejected_at("pools[0].workers[1].url"));
        assert!(!p.rejected_at("pools[0].workers"));
    }
}
