//! Fuzz target: untrusted bytes as a stored `RangeAllocation` restored into an allocator (see `nodeport_apiserver::fuzzing::range_allocation`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodeport_apiserver::fuzzing::range_allocation(data);
});
