//! Fuzz target: untrusted bytes as a `KubeProxyConfiguration` file or `--nodeport-addresses` (see `nodeport_proxy::fuzzing::proxy_config`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_proxy::fuzzing::proxy_config(data);
});
