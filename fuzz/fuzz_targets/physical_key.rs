//! libFuzzer entry point of the `physical_key` target; the body and its checks are
//! `gpucache_fuzz::physical_key` (fuzz/src/physical_key.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::physical_key::run(data);
});
