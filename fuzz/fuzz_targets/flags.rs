//! Fuzz target: untrusted bytes as `--service-node-port-range` or `--service-cluster-ip-range` (see `nodeport_apiserver::fuzzing::flags`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_apiserver::fuzzing::flags(data);
});
