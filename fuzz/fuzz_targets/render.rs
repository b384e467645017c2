//! Fuzz target: untrusted bytes as `nodeport render` input, through to the rules of every mode (see `nodeport_proxy::fuzzing::render`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_proxy::fuzzing::render(data);
});
