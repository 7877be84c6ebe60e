//! libFuzzer entry point of the `frame` target; the body and its checks are
//! `gpucache_fuzz::frame` (fuzz/src/frame.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::frame::run(data);
});
