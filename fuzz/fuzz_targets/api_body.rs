//! Fuzz target: untrusted bytes as a create or update body of any served kind (see `nodeport_apiserver::fuzzing`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nodeport_apiserver::fuzzing::Api;

static API: OnceLock<Api> = OnceLock::new();

// The server is built before the first input (libFuzzer's initialization), not in it: on a
// loaded machine building it took over a second, which `-timeout=1` reported against the
// empty input libFuzzer runs first.
fuzz_target!(
    init: {
        API.get_or_init(Api::new);
    },
    |data: &[u8]| {
        API.get_or_init(Api::new).body(data);
    }
);
