//! The kept fuzz corpora (`fuzz/corpus/<target>/`), read for the tests that replay them on
//! stable Rust (`tests/fuzz_corpus.rs` of the crates that own the entry points).

use std::path::PathBuf;

/// Every input of `target`'s kept corpus with its path, sorted by path; panics when there is
/// none (a corpus that went missing must not pass as an empty one).
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            (path, data)
        })
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "no corpus in {}", dir.display());
    inputs
}

/// Replays a corpus through an entry point that tells whether it accepted the input: every
/// input must return (a panic is a finding), and the hand-written or captured seeds
/// (`seed-*`), valid inputs all, must be accepted, so that a harness that stopped reaching
/// the code under test fails here.
pub fn replay_checked(target: &str, run: impl Fn(&[u8]) -> bool) {
    for (path, data) in corpus(target) {
        let accepted = run(&data);
        let seed = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("seed-"));
        assert!(accepted || !seed, "{}: a seed was refused", path.display());
    }
}
