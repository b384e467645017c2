//! The fuzz corpora (`fuzz/corpus/<target>/`, kept small and minimized) replayed on stable Rust:
//! every input a fuzzer ever kept, and every crash it found (saved there as a regression), goes
//! through the same entry point as in the fuzz target, so a regression fails `cargo test`
//! without nightly.

use std::path::PathBuf;

use nodeport_apiserver::fuzzing::Api;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
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

fn replay(target: &str, run: impl Fn(&Api, &[u8]) -> u16) {
    let api = Api::new();
    for (path, data) in corpus(target) {
        let status = run(&api, &data);
        // The harness panics on a 5xx; also make sure each input reached the server.
        assert!(
            status >= 200 || data.is_empty(),
            "{}: no answer ({status})",
            path.display()
        );
    }
}

#[test]
fn the_api_body_corpus_replays_without_a_panic_or_an_internal_error() {
    replay("api_body", Api::body);
}

#[test]
fn the_api_patch_corpus_replays_without_a_panic_or_an_internal_error() {
    replay("api_patch", Api::patch);
}

#[test]
fn the_api_query_corpus_replays_without_a_panic_or_an_internal_error() {
    replay("api_query", Api::query);
}

/// Replays a corpus through an entry point that tells whether it accepted the input: every
/// input must return (a panic is a finding), and the hand-written or captured seeds
/// (`seed-*`), valid inputs all, must be accepted, so that a harness that stopped reaching
/// the code under test fails here.
fn replay_checked(target: &str, run: impl Fn(&[u8]) -> bool) {
    for (path, data) in corpus(target) {
        let accepted = run(&data);
        let seed = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("seed-"));
        assert!(accepted || !seed, "{}: a seed was refused", path.display());
    }
}

#[test]
fn the_flags_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("flags", nodeport_apiserver::fuzzing::flags);
}

#[test]
fn the_token_file_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("token_file", nodeport_apiserver::fuzzing::token_file);
}

#[test]
fn the_range_allocation_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked(
        "range_allocation",
        nodeport_apiserver::fuzzing::range_allocation,
    );
}
