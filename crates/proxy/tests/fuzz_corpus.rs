//! The proxy's fuzz corpora (`fuzz/corpus/<target>/`, kept small and minimized) replayed on
//! stable Rust: every input a fuzzer kept, and every crash it found (saved there as a
//! regression), goes through the same entry point as in the fuzz target, so that a
//! regression fails `cargo test` without nightly.

use std::path::PathBuf;

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
fn the_proxy_config_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("proxy_config", nodeport_proxy::fuzzing::proxy_config);
}

#[test]
fn the_render_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("render", nodeport_proxy::fuzzing::render);
}

#[test]
fn the_netlink_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("netlink", nodeport_proxy::fuzzing::netlink);
}
