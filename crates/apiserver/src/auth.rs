//! Bearer-token authentication with kube-apiserver's `--token-auth-file`.
//!
//! The file is CSV, one token a line: `token,user,uid,"group1,group2"` (at least three columns;
//! groups optional), as kube-apiserver's `tokenfile` authenticator reads it: an empty token is
//! skipped with a warning, a duplicate token replaces the earlier one with a warning, fewer than
//! three columns is an error.
//!
//! Tokens are compared in constant time (every listed token is compared with the one sent, each
//! comparison looking at every byte), and never logged. The file is read again every
//! [`RELOAD_INTERVAL`] and a changed file replaces the tokens without a restart (a file that no
//! longer parses is logged and the previous tokens stay). What a request without a valid token
//! gets, and what a user may do, is [`crate::authz`]'s business.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How often the token file is read again to pick up changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// A user a token authenticates as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// The user name (second column).
    pub name: String,
    /// The user's UID (third column).
    pub uid: String,
    /// Groups (fourth column, comma-separated inside quotes).
    pub groups: Vec<String>,
}

/// The tokens of a `--token-auth-file`.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    users: HashMap<String, User>,
}

/// Why a token file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("cannot read token file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A record has too few columns (kube-apiserver's message).
    #[error(
        "token file '{path}' must have at least 3 columns (token, user name, user uid), found {found}"
    )]
    Columns {
        /// The file.
        path: PathBuf,
        /// How many columns the record had.
        found: usize,
    },
    /// A quoted field is not closed.
    #[error("token file '{path}' line {line}: unterminated quoted field")]
    Quote {
        /// The file.
        path: PathBuf,
        /// The 1-based line.
        line: usize,
    },
    /// The file lists no token at all.
    #[error("token file '{path}' has no tokens")]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// Splits one CSV line into fields (RFC 4180 quoting, `""` for a quote inside quotes, leading
/// spaces of a field trimmed as Go's `csv.Reader` does with `TrimLeadingSpace`).
fn csv_fields(line: &str) -> Option<Vec<String>> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.peek() == Some(&' ') || chars.peek() == Some(&'\t') {
            chars.next();
        }
        let mut field = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    None => return None,
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        field.push('"');
                    }
                    Some('"') => break,
                    Some(c) => field.push(c),
                }
            }
            // Anything between the closing quote and the comma is kept, as Go's lazy quotes do.
            for c in chars.by_ref() {
                if c == ',' {
                    fields.push(field);
                    field = String::new();
                    break;
                }
                field.push(c);
            }
            if !field.is_empty() || chars.peek().is_none() {
                fields.push(field);
                if chars.peek().is_none() {
                    return Some(fields);
                }
            }
            continue;
        }
        loop {
            match chars.next() {
                None => {
                    fields.push(field);
                    return Some(fields);
                }
                Some(',') => break,
                Some(c) => field.push(c),
            }
        }
        fields.push(field);
    }
}

impl Tokens {
    /// Reads a `--token-auth-file`.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let tokens = Self::parse(path, &text)?;
        if tokens.users.is_empty() {
            return Err(Error::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(tokens)
    }

    /// Parses the text of a token file (`path` is for messages).
    pub fn parse(path: &Path, text: &str) -> Result<Self, Error> {
        let mut users = HashMap::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let fields = csv_fields(line).ok_or_else(|| Error::Quote {
                path: path.to_path_buf(),
                line: index + 1,
            })?;
            if fields.len() < 3 {
                return Err(Error::Columns {
                    path: path.to_path_buf(),
                    found: fields.len(),
                });
            }
            let token = fields[0].clone();
            if token.is_empty() {
                tracing::warn!(path = %path.display(), line = index + 1, "empty token has been found in token file");
                continue;
            }
            let groups = fields
                .get(3)
                .map(|g| {
                    g.split(',')
                        .map(str::trim)
                        .filter(|g| !g.is_empty())
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            let user = User {
                name: fields[1].clone(),
                uid: fields[2].clone(),
                groups,
            };
            if users.insert(token, user).is_some() {
                tracing::warn!(path = %path.display(), line = index + 1, "duplicate token has been found in token file");
            }
        }
        Ok(Tokens { users })
    }

    /// Every token with its user, in no particular order.
    pub fn users(&self) -> impl Iterator<Item = (&str, &User)> {
        self.users
            .iter()
            .map(|(token, user)| (token.as_str(), user))
    }

    /// The user a token authenticates as. Every listed token is compared, each in constant
    /// time, so the answer's timing does not tell how much of a token was right.
    pub fn authenticate(&self, token: &str) -> Option<&User> {
        let mut found = None;
        for (candidate, user) in &self.users {
            if constant_time_eq(candidate.as_bytes(), token.as_bytes()) {
                found = Some(user);
            }
        }
        found
    }

    /// How many tokens are listed.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether no token is listed.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }
}

/// Compares two byte strings in time that depends only on their lengths (Go's
/// `subtle.ConstantTimeCompare`).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let difference = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(difference) == 0
}

/// The tokens of a `--token-auth-file`, read again when the file changes.
#[derive(Debug)]
pub struct TokenSource {
    path: PathBuf,
    current: RwLock<(String, Arc<Tokens>)>,
}

impl TokenSource {
    /// Reads the file.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let (text, tokens) = Self::read(path)?;
        Ok(TokenSource {
            path: path.to_path_buf(),
            current: RwLock::new((text, Arc::new(tokens))),
        })
    }

    fn read(path: &Path) -> Result<(String, Tokens), Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let tokens = Tokens::parse(path, &text)?;
        if tokens.is_empty() {
            return Err(Error::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok((text, tokens))
    }

    /// The tokens now.
    pub fn tokens(&self) -> Arc<Tokens> {
        self.current.read().expect("not poisoned").1.clone()
    }

    /// The user a token authenticates as (see [`Tokens::authenticate`]).
    pub fn authenticate(&self, token: &str) -> Option<User> {
        self.tokens().authenticate(token).cloned()
    }

    /// How many tokens are listed now.
    pub fn len(&self) -> usize {
        self.tokens().len()
    }

    /// Whether no token is listed.
    pub fn is_empty(&self) -> bool {
        self.tokens().is_empty()
    }

    /// Reads the file again; replaces the tokens if its text changed. Returns whether it did.
    pub fn reload(&self) -> Result<bool, Error> {
        let (text, tokens) = Self::read(&self.path)?;
        let mut current = self.current.write().expect("not poisoned");
        if current.0 == text {
            return Ok(false);
        }
        *current = (text, Arc::new(tokens));
        Ok(true)
    }

    /// Reloads the file every `every` for as long as the runtime runs.
    pub fn spawn_reloader(self: Arc<Self>, every: Duration) {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let mut failing = false;
            loop {
                ticker.tick().await;
                match self.reload() {
                    Ok(changed) => {
                        if changed {
                            tracing::info!(path = %self.path.display(), tokens = self.len(), "token file reloaded");
                        }
                        failing = false;
                    }
                    Err(err) if !failing => {
                        failing = true;
                        tracing::warn!(error = %crate::report(&err), "cannot reload the token file; the previous tokens stay");
                    }
                    Err(_) => {}
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Tokens, Error> {
        Tokens::parse(Path::new("tokens.csv"), text)
    }

    #[test]
    fn token_file_rows_give_user_uid_and_quoted_groups() {
        let t = parse(
            "s3cret,admin,uid-1,\"system:masters,dev\"\nother,bob,2\n\n,empty,3\n t2 , carol ,4,ops\n",
        )
        .unwrap();
        assert_eq!(t.len(), 3, "the empty token is skipped");
        let admin = t.authenticate("s3cret").unwrap();
        assert_eq!(admin.name, "admin");
        assert_eq!(admin.uid, "uid-1");
        assert_eq!(admin.groups, vec!["system:masters", "dev"]);
        assert!(t.authenticate("other").unwrap().groups.is_empty());
        assert_eq!(t.authenticate("t2 ").unwrap().name, "carol ");
        assert!(t.authenticate("nope").is_none());
    }

    #[test]
    fn a_row_with_fewer_than_three_columns_is_refused_with_kube_apiservers_message() {
        let err = parse("tok,user\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "token file 'tokens.csv' must have at least 3 columns (token, user name, user uid), found 2"
        );
    }

    #[test]
    fn an_unterminated_quote_is_refused() {
        assert!(matches!(
            parse("tok,user,uid,\"a,b\n"),
            Err(Error::Quote { line: 1, .. })
        ));
    }

    #[test]
    fn a_changed_token_file_is_reloaded_and_a_broken_one_keeps_the_previous_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.csv");
        std::fs::write(&path, "old,alice,1\n").unwrap();
        let source = TokenSource::load(&path).unwrap();
        assert!(!source.reload().unwrap(), "unchanged");
        std::fs::write(&path, "new,bob,2\n").unwrap();
        assert!(source.reload().unwrap());
        assert!(source.authenticate("old").is_none());
        assert_eq!(source.authenticate("new").unwrap().name, "bob");
        std::fs::write(&path, "broken\n").unwrap();
        assert!(source.reload().is_err());
        assert_eq!(source.authenticate("new").unwrap().name, "bob");
    }

    #[test]
    fn tokens_of_other_lengths_or_one_byte_off_are_refused() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }

    #[test]
    fn a_later_duplicate_token_replaces_the_earlier_one() {
        let t = parse("tok,first,1\ntok,second,2\n").unwrap();
        assert_eq!(t.authenticate("tok").unwrap().name, "second");
    }
}
