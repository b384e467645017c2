//! Fuzz target: untrusted bytes as the kernel's netlink replies the proxy reads (see `nodeport_proxy::fuzzing::netlink`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_proxy::fuzzing::netlink(data);
});
