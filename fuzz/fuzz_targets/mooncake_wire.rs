//! libFuzzer entry point of the `mooncake_wire` target; the body and its checks are
//! `gpucache_fuzz::mooncake_wire` (fuzz/src/mooncake_wire.rs).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpucache_fuzz::mooncake_wire::run(data);
});
