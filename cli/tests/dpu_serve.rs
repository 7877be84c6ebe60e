//! `gpucache serve` with `[store] kind = "dpu"`: the DPU agent runs in-process and its
//! DpuStore is served over the normal GPCW listener. Exact bytes round-trip; the start line and
//! /metrics report host threads, never active offload; a SIGKILLed service restarted over the
//! same state dir bumps the agent epoch, drops the write that was in flight (a clean miss) and
//! keeps the committed block (the backing FileStore's restart rule, which DpuStore forwards);
//! spdk and doca fail closed; `[dpu]` mistakes are refused with the key they are about.

use std::path::Path;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::{KvDtype, TenantId};
use gpucache_dataplane::store::{Get, MissReason, Put, Reserve, Store};
use gpucache_dataplane::testing::fixture::{key, payload};
use gpucache_service::config::ValidConfig;

mod common;

use common::{Serve, gpucache, http_get};

const LISTEN: &str = "[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\n\
                      metrics = \"127.0.0.1:0\"\n\n[[tenants]]\nname = \"tenant-a\"\n\
                      rights = [\"read\", \"write\"]\n";

/// A dpu-store configuration under `dir` with `dpu` as the `[dpu]` body (reactors appended).
fn config(dir: &Path, dpu: &str, reactors: &str) -> std::path::PathBuf {
    let path = dir.join("gpucache.toml");
    let text = format!(
        "[store]\nkind = \"dpu\"\nroot = \"{}\"\ndurability = \"per-block\"\n\n{LISTEN}\n\
         [dpu]\nstate_dir = \"{}\"\n{dpu}\n{reactors}",
        dir.join("data").display(),
        dir.join("agent").display(),
    );
    std::fs::write(&path, text).expect("write config");
    path
}

const TWO_REACTORS: &str =
    "[[dpu.reactors]]\nid = 0\ncore = 0\n\n[[dpu.reactors]]\nid = 1\ncore = 1\n";

fn caller() -> Caller {
    Caller::new(TenantId::parse("tenant-a").expect("tenant"), Rights::READ_WRITE)
}

#[test]
fn dpu_store_round_trips_exact_bytes_and_reports_host_threads() {
    let dir = tempfile::tempdir().expect("temp dir");
    let serve =
        Serve::start(&config(dir.path(), "queues_per_reactor = 2\nslab_slots = 8\n", TWO_REACTORS));
    assert_eq!(serve.field("store="), "dpu", "{}", serve.line);
    assert_eq!(serve.field("offload="), "host-threads", "{}", serve.line);
    assert_eq!(serve.field("reactors="), "2", "{}", serve.line);
    assert!(!serve.line.contains("active"), "claims offload: {}", serve.line);
    let pinned = serve.field("pinned=");
    assert!(
        pinned == "none" || pinned.split(',').all(|c| c == "0" || c == "1"),
        "pinned names a core no reactor asked for: {}",
        serve.line
    );
    assert_eq!(serve.field("agent_epoch="), "1", "a fresh state dir starts at epoch 1");

    let c = caller();
    let client = TcpStore::new(ClientConfig::new(serve.native(), c.clone()));
    for (i, len) in [(0u8, 1usize), (1, 65_536), (2, 1_048_576 + 17)] {
        let k = key(0, &[3, 1, i], KvDtype::Bf16, 16);
        let data = payload(u64::from(i) + 40, len);
        assert!(matches!(client.put(&c, &k, &data, None).expect("put"), Put::Committed(_)));
        let mut buf = vec![0u8; len + 8];
        match client.get_into(&c, &k, &mut buf).expect("get") {
            Get::Hit { len: got, .. } => assert_eq!(got, len as u64),
            other => panic!("block {i} answered {other:?}"),
        }
        assert_eq!(&buf[..len], &data[..], "block {i} came back changed");
        assert!(buf[len..].iter().all(|b| *b == 0), "block {i} wrote past its length");
    }
    let absent = key(0, &[9], KvDtype::Bf16, 16);
    let mut buf = vec![0u8; 16];
    assert!(matches!(client.get_into(&c, &absent, &mut buf).expect("get"), Get::Miss(_)));

    let metrics = http_get(serve.metrics(), "/metrics");
    let active: Vec<&str> =
        metrics.lines().filter(|l| l.starts_with("gpucache_dpu_offload_active ")).collect();
    assert_eq!(active, ["gpucache_dpu_offload_active 0"], "{metrics}");
    assert!(metrics.contains("mode=\"host-threads\""), "{metrics}");
    assert!(metrics.contains("reactors=\"2\""), "{metrics}");
    assert!(metrics.contains("gpucache_dpu_agent_epoch 1"), "{metrics}");
    serve.stop();
}

#[test]
fn kill_9_restart_bumps_the_agent_epoch_drops_in_flight_and_keeps_committed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = config(dir.path(), "", TWO_REACTORS);
    let first = Serve::start(&path);
    let (first_epoch, first_agent) = (first.epoch(), first.field("agent_epoch=").to_owned());
    let c = caller();
    let client = TcpStore::new(ClientConfig::new(first.native(), c.clone()));
    let committed = key(0, &[1, 1], KvDtype::Bf16, 16);
    let data = payload(11, 200_000);
    assert!(matches!(client.put(&c, &committed, &data, None).expect("put"), Put::Committed(_)));
    // In flight at the kill: reserved and half written, never committed.
    let in_flight = key(0, &[1, 2], KvDtype::Bf16, 16);
    let half = payload(12, 100_000);
    let Reserve::Reserved(r) = client.reserve(&c, &in_flight, 200_000, None).expect("reserve")
    else {
        panic!("reserve was not granted");
    };
    client.write(&c, &r, 0, &half).expect("write half");
    first.kill_9();

    let second = Serve::start(&path);
    let agent_epoch: u64 = second.field("agent_epoch=").parse().expect("agent_epoch");
    let first_agent: u64 = first_agent.parse().expect("agent_epoch");
    assert_eq!(agent_epoch, first_agent + 1, "restart did not bump the agent epoch by one");
    assert!(second.epoch() > first_epoch, "restart did not bump the store epoch");
    assert_eq!(second.field("offload="), "host-threads");
    let client = TcpStore::new(ClientConfig::new(second.native(), c.clone()));
    let mut buf = vec![0u8; 200_000];
    match client.get_into(&c, &in_flight, &mut buf).expect("get in flight") {
        Get::Miss(MissReason::Absent) => {}
        other => panic!("the write in flight at the kill answered {other:?}"),
    }
    assert!(buf.iter().all(|b| *b == 0), "a miss wrote the destination");
    assert!(matches!(client.get_into(&c, &committed, &mut buf).expect("get"), Get::Hit { .. }));
    assert_eq!(buf, data, "a committed block changed across kill -9");
    // The dropped key is free again under the new epoch.
    assert!(matches!(client.put(&c, &in_flight, &data, None).expect("put"), Put::Committed(_)));
    second.stop();
}

#[test]
fn spdk_and_doca_fail_closed_at_start_naming_what_is_missing() {
    for (backend, key, what) in [
        ("spdk", "spdk_pci_addr = \"0000:ff:1f.7\"", "NVMe controller 0000:ff:1f.7"),
        ("doca", "doca_device = \"mlx5_no_such\"", "BlueField mlx5_no_such"),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = config(dir.path(), &format!("backend = \"{backend}\"\n{key}\n"), "");
        let (code, out, err) = gpucache(&["serve", "--config", path.to_str().expect("utf-8")]);
        assert_eq!(code, 2, "{backend}: stdout {out} stderr {err}");
        assert!(!err.contains("listening"), "{backend} served: {err}");
        assert!(err.contains(&format!("dpu.backend: {backend} backend unavailable")), "{err}");
        let built = match backend {
            "spdk" => cfg!(feature = "spdk"),
            _ => cfg!(feature = "doca"),
        };
        if built {
            // Built with the feature: the agent probes and names each missing piece.
            assert!(err.contains(what), "{backend}: the missing device is not named: {err}");
            assert!(err.contains(&format!("the gpucache {backend} binding (not built)")), "{err}");
        } else {
            assert!(err.contains(&format!("built without the {backend} feature")), "{err}");
        }
        // Failing closed happens before the file store is opened.
        assert!(!dir.path().join("data").exists(), "{backend} opened the store");
        let (code, _, err) = gpucache(&["dpu-agent", "--config", path.to_str().expect("utf-8")]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("{backend} backend unavailable")), "{err}");
    }
}

#[test]
fn dpu_agent_refuses_other_store_kinds() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("memory.toml");
    std::fs::write(&path, format!("[store]\nkind = \"memory\"\n\n{LISTEN}")).expect("write");
    let (code, _, err) = gpucache(&["dpu-agent", "--config", path.to_str().expect("utf-8")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("store.kind") && err.contains("Memory"), "{err}");
}

#[test]
fn dpu_config_mistakes_name_their_key() {
    let cases: [(&str, &str); 10] = [
        ("[dpu]\nreactor = 2\n", "dpu.reactor"),
        ("[dpu]\nbackend = \"rdma\"\n", "dpu.backend"),
        ("[dpu]\nqueue_depth = 0\n", "dpu.queue_depth"),
        ("[dpu]\nqueues_per_reactor = 0\n", "dpu.queues_per_reactor"),
        ("[dpu]\nslab_slot_bytes = \"1K\"\n", "dpu.slab_slot_bytes"),
        ("[dpu]\nslab_slots = 70000\n", "dpu.slab_slots"),
        ("[dpu]\nbackend = \"spdk\"\n", "dpu.spdk_pci_addr"),
        ("[dpu]\ndoca_device = \"mlx5_0\"\n", "dpu.doca_device"),
        ("[[dpu.reactors]]\nid = 0\ncpu = 1\n", "dpu.reactors[0].cpu"),
        ("[[dpu.reactors]]\nid = 3\n\n[[dpu.reactors]]\nid = 3\n", "dpu.reactors[1].id"),
    ];
    for (text, want) in cases {
        let e = ValidConfig::from_toml_str(text).expect_err(text);
        assert_eq!(e.key(), Some(want), "{text:?} -> {e}");
        assert!(e.to_string().starts_with(want), "{text:?}: {e}");
    }
    let e = ValidConfig::from_toml_str("[dpu]\nreactors = []\n").expect_err("no reactors");
    assert!(e.to_string().starts_with("dpu.reactors"), "{e}");
    let e =
        ValidConfig::from_toml_str("[[dpu.reactors]]\nid = 0\ncore = 5000\n").expect_err("core");
    assert_eq!(e.key(), Some("dpu.reactors[0].core"), "{e}");
    // The defaults and a full section are accepted.
    let ok = ValidConfig::from_toml_str(
        "[store]\nkind = \"dpu\"\n[dpu]\nbackend = \"io_uring\"\nqueue_depth = 32\n\
         slab_slot_bytes = \"4MiB\"\npin = \"required\"\n[[dpu.reactors]]\nid = 0\ncore = 0\n",
    )
    .expect("valid");
    assert_eq!(ok.dpu.slab_slot_bytes, 4 << 20);

    // The binary refuses a bad file before starting anything, naming the key.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = config(dir.path(), "queue_depth = 5000\n", "");
    let (code, _, err) = gpucache(&["serve", "--config", path.to_str().expect("utf-8")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("dpu.queue_depth: 5000 is outside 1..=4096"), "{err}");
    assert!(!dir.path().join("agent").exists(), "a refused config started the agent");
}
