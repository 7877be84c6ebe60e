//! libFuzzer entry point of the `logical_key` target; the body and its checks are
//! `gpucache_fuzz::logical_key` (fuzz/src/logical_key.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::logical_key::run(data);
});
