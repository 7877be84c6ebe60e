//! libFuzzer entry point of the `block_header` target; the body and its checks are
//! `gpucache_fuzz::block_header` (fuzz/src/block_header.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::block_header::run(data);
});
