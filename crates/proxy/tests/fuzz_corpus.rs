//! The proxy's fuzz corpora (`fuzz/corpus/<target>/`, kept small and minimized) replayed on
//! stable Rust: every input a fuzzer kept, and every crash it found (saved there as a
//! regression), goes through the same entry point as in the fuzz target, so that a
//! regression fails `cargo test` without nightly.

use nodeport_testbed::fuzz_corpus::replay_checked;

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

#[test]
fn the_iptables_save_corpus_replays_without_a_panic_and_its_seeds_are_accepted() {
    replay_checked("iptables_save", nodeport_proxy::fuzzing::iptables_save);
}
