#![allow(clippy::print_stdout)]
use std::sync::Arc;
use std::time::Instant;
use gpucache_backends::file::engine::EngineChoice;
use gpucache_backends::file::{Durability, FileStoreConfig};
use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::clock::ManualClock;
use gpucache_dataplane::key::PhysicalKey;
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::store::Store;
use gpucache_dataplane::testing::fixture::{caller, key, payload};

#[test]
fn scratch() {
    let t = Instant::now();
    let p = payload(1, 4 << 20);
    println!("payload 4MiB: {:?}", t.elapsed());
    let t = Instant::now();
    let c = Checksum::of(&p);
    println!("xxh3 4MiB: {:?} {c:?}", t.elapsed());
    for (eng, dur) in [(EngineChoice::Psync, Durability::PerBlock), (EngineChoice::Uring, Durability::PerBlock), (EngineChoice::Psync, Durability::None), (EngineChoice::Psync, Durability::GroupCommit)] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = FileStoreConfig::new(dir.path());
        cfg.engine = eng; cfg.durability = dur;
        let s = cfg.open(Arc::new(ManualClock::default())).unwrap();
        let t = Instant::now();
        let data = payload(2, 300 << 10);
        let keys: Vec<PhysicalKey> = (0..50u8).map(|i| key(0, &[1, i], KvDtype::F16, 16)).collect();
        for k in &keys { s.put(&caller(0), k, &data, None).unwrap(); }
        println!("{eng:?} {dur:?} 50 puts 300KiB: {:?}", t.elapsed());
        let t = Instant::now();
        let mut buf = vec![0u8; 300<<10];
        for k in &keys { s.get_into(&caller(0), k, &mut buf).unwrap(); }
        println!("50 gets: {:?}", t.elapsed());
        let t = Instant::now();
        let big = payload(3, 4<<20);
        s.put(&caller(0), &key(0, &[2], KvDtype::F16, 16), &big, None).unwrap();
        println!("4MiB put: {:?}", t.elapsed());
    }
}
