//! Fuzz target: untrusted bytes as a create or update body of any served kind (see `nodeport_apiserver::fuzzing`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nodeport_apiserver::fuzzing::Api;

static API: OnceLock<Api> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    API.get_or_init(Api::new).body(data);
});
