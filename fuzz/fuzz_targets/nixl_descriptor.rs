//! libFuzzer entry point of the `nixl_descriptor` target; the body and its checks are
//! `gpucache_fuzz::nixl_descriptor` (fuzz/src/nixl_descriptor.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::nixl_descriptor::run(data);
});
