//! The object store layer against a real S3 server on loopback: moto (`scripts/setup.sh moto`),
//! started and stopped by PID here. Without it these tests say so and pass, unless
//! GPUCACHE_REQUIRE_MOTO=1 (CI), where they fail.

use std::time::Duration;

use gpucache_cold::{ColdError, ColdObjects, FaultKind, FaultPlan, FaultyObjects};

const T: Duration = Duration::from_secs(10);

use gpucache_cold::moto::{open, start};

#[test]
fn create_only_put_head_ranges_and_delete_against_a_real_s3_server() {
    let Some(moto) = start("cold") else { return };
    let s3 = open(&moto, "cold");
    let bytes: Vec<u8> = (0..100_000u32).map(|i| u8::try_from(i % 251).expect("a byte")).collect();
    assert_eq!(s3.head("packs/a").expect("head"), None, "absent before");
    s3.put_new("packs/a", &bytes).expect("put");
    assert_eq!(s3.head("packs/a").expect("head"), Some(bytes.len() as u64));
    assert_eq!(
        s3.put_new("packs/a", b"other bytes"),
        Err(ColdError::AlreadyExists { key: "packs/a".into() }),
        "names are create-only"
    );
    assert_eq!(s3.get_range("packs/a", 0..bytes.len() as u64, T).expect("get"), bytes, "unchanged");
    assert_eq!(s3.get_range("packs/a", 4_096..8_192, T).expect("range"), bytes[4_096..8_192]);
    assert!(matches!(s3.get_range("packs/none", 0..1, T), Err(ColdError::NotFound { .. })));
    s3.delete("packs/a").expect("delete");
    assert_eq!(s3.head("packs/a").expect("head"), None, "a head proves the delete");
    s3.delete("packs/a").expect("deleting an absent object succeeds");
}

#[test]
fn a_bucket_that_does_not_exist_is_a_permanent_error() {
    let Some(moto) = start("present") else { return };
    let s3 = open(&moto, "absent");
    let e = s3.put_new("k", b"v").expect_err("no bucket");
    assert!(!e.is_transient(), "{e:?}");
}

#[test]
fn seeded_faults_replay_and_each_kind_does_what_it_says() {
    let Some(moto) = start("faults") else { return };
    let plan = FaultPlan {
        server_errors: 100,
        timeouts: 100,
        lost_acks: 150,
        torn_ranges: 200,
        ..FaultPlan::none(7)
    };
    let faulty = FaultyObjects::new(open(&moto, "faults"), plan);
    let mut acked = Vec::new();
    let mut lost = Vec::new();
    for i in 0..60u8 {
        let key = format!("k/{i}");
        match faulty.put_new(&key, &[i; 1000]) {
            Ok(()) => acked.push(key),
            Err(e) => {
                assert!(e.is_transient(), "{e:?}");
                if e.to_string().contains("lost acknowledgement") {
                    lost.push(key);
                }
            }
        }
    }
    let store = faulty.inner();
    for key in &acked {
        assert_eq!(store.head(key).expect("head"), Some(1000), "an acknowledged PUT is there");
    }
    assert!(!lost.is_empty(), "the plan lost some acknowledgements");
    for key in &lost {
        assert_eq!(
            store.head(key).expect("head"),
            Some(1000),
            "a lost acknowledgement still wrote"
        );
    }
    let mut torn = 0;
    for key in &acked {
        if let Ok(b) = faulty.get_range(key, 0..1000, T)
            && b.len() < 1000
        {
            torn += 1;
        }
    }
    assert!(torn > 0, "some ranges came back torn");
    // The same seed over the same calls meets the same faults.
    let again = FaultyObjects::new(open(&moto, "faults"), plan);
    for i in 0..60 {
        let _ = again.put_new(&format!("again/{i}"), &[1u8; 10]);
    }
    let first: Vec<FaultKind> = faulty.faults().into_iter().take(60).collect();
    assert_eq!(again.faults(), first);
}
