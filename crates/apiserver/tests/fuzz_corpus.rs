//! The fuzz corpora (`fuzz/corpus/<target>/`, kept small and minimized) replayed on stable Rust:
//! every input a fuzzer ever kept, and every crash it found (saved there as a regression), goes
//! through the same entry point as in the fuzz target, so a regression fails `cargo test`
//! without nightly.

use nodeport_apiserver::fuzzing::Api;
use nodeport_testbed::fuzz_corpus::{corpus, replay_checked};

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
