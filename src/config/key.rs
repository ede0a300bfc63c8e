//! Key paths for messages: `Key::new("pools").index(3).field("workers")` is
//! `pools[3].workers`, the form every problem starts with.

use std::fmt;
use std::ops::Deref;

/// A key path in the configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Key(String);

impl Key {
    /// A top-level key (`server`, `pools`).
    pub(crate) fn new(root: &str) -> Key {
        Key(root.to_string())
    }

    /// The key `name` under this one: `a.name`.
    pub(crate) fn field(&self, name: &str) -> Key {
        Key(format!("{}.{name}", self.0))
    }

    /// Element `i` of the list at this key: `a[i]`.
    pub(crate) fn index(&self, i: usize) -> Key {
        Key(format!("{}[{i}]", self.0))
    }
}

impl Deref for Key {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_indices_make_a_path() {
        let k = Key::new("pools")
            .index(3)
            .field("workers")
            .index(0)
            .field("url");
        assert_eq!(k.to_string(), "pools[3].workers[0].url");
        assert_eq!(&*Key::new("server").field("timeouts"), "server.timeouts");
    }
}
