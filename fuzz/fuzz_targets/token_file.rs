//! Fuzz target: untrusted bytes as a `--token-auth-file` (see `nodeport_apiserver::fuzzing::token_file`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_apiserver::fuzzing::token_file(data);
});
