//! Fuzz target: untrusted bytes as the `iptables-save` output the proxy and `nodeport trace` read (see `nodeport_proxy::fuzzing::iptables_save`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_proxy::fuzzing::iptables_save(data);
});
