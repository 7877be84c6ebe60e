//! libFuzzer entry point of the `resp_request` target; the body and its checks are
//! `gpucache_fuzz::resp_request` (fuzz/src/resp_request.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::resp_request::run(data);
});
