//! The `serve` configuration: the embedded default and a full example validate, and each kind of
//! mistake is refused with an error that names the key it is about.

use std::net::SocketAddr;
use std::sync::Arc;

use gpucache_dataplane::caller::Rights;
use gpucache_dataplane::clock::MonotonicClock;
use gpucache_dataplane::limits::ResourceLimits;
use gpucache_service::auth::KeyFileError;
use gpucache_service::config::{
    ConfigError, DurabilityName, EngineName, RightName, ServeConfig, StoreKind, ValidConfig,
};
use gpucache_storage::file::Durability;
use gpucache_storage::file::engine::EngineChoice;
use gpucache_wire::SealAlgorithm;

/// Parses `text` and returns the error, failing the test if it was accepted.
fn refused(text: &str) -> ConfigError {
    match ValidConfig::from_toml_str(text) {
        Ok(c) => panic!("accepted:\n{text}\nas {c:#?}"),
        Err(e) => e,
    }
}

/// Asserts that `text` is refused, naming `key` both in `key()` and at the start of Display.
fn refused_at(text: &str, key: &str) -> ConfigError {
    let e = refused(text);
    assert_eq!(e.key(), Some(key), "wrong key for {e}");
    let shown = e.to_string();
    assert!(shown.starts_with(&format!("{key}: ")), "Display does not start with {key}: {shown}");
    e
}

#[test]
fn default_validates_and_is_what_an_empty_file_means() {
    let d = ServeConfig::default().validate().expect("the embedded default is valid");
    assert_eq!(ServeConfig::parse("").expect("empty file"), *d);
    assert_eq!(ValidConfig::from_toml_str("").expect("empty file").config(), d.config());
    assert_eq!(d.store.kind, StoreKind::Tiered);
    assert_eq!(d.store.root.to_str(), Some("./gpucache-data"));
    assert_eq!(d.listen.native, "127.0.0.1:7470".parse::<SocketAddr>().unwrap());
    assert_eq!(d.listen.resp, "127.0.0.1:7471".parse::<SocketAddr>().unwrap());
    assert_eq!(d.listen.metrics, "127.0.0.1:7472".parse::<SocketAddr>().unwrap());
    assert!(!d.listen.allow_remote);
    assert_eq!(
        d.local_socket().as_deref(),
        Some(std::path::Path::new("./gpucache-data/gpucache.sock")),
        "the embedded default offers the same-host socket next to its file store"
    );
    assert_eq!(d.listen.shm_mapped_bytes_max, 16 << 30);
    assert_eq!(d.limits(), ResourceLimits::default());
    let callers = d.callers();
    assert_eq!(callers.len(), 1);
    assert_eq!(callers[0].tenant.as_str(), "default");
    assert_eq!(callers[0].rights, Rights::READ_WRITE);
}

#[test]
fn the_repository_example_parses() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../gpucache.example.toml");
    let c = ValidConfig::load(std::path::Path::new(path)).expect("example config");
    assert_eq!(*c, ServeConfig::default(), "the example spells out the defaults");
}

#[test]
fn full_example_parses() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("team-b.secret");
    write_private(&secret, &format!("k1 {}\n", "ab".repeat(32)));
    let text = format!(
        r#"
[store]
kind = "file"
root = "/var/lib/gpucache"
engine = "psync"
direct_io = true
durability = "group-commit"
queue_depth = 64
group_commit_deadline_ms = 2000

[limits]
object_bytes_max = "16MiB"
inflight_requests_max = 512
registrations_max = 100000
tenant_inflight_bytes_max = "256M"
retained_bytes_max = "8GiB"
tenant_retained_bytes_max = 1073741824
tenants_max = 8
idempotency_entries_max = 1000
idempotency_ttl_ms = 60000
write_lease_ms = 5000

[listen]
native = "0.0.0.0:9000"
resp = "[::]:9001"
metrics = "127.0.0.1:9002"
allow_remote = true
allow_open_tenants = true
clock_skew_max_ms = 30000
connections_max = 64

[[tenants]]
name = "team-a"
rights = ["read", "write"]

[[tenants]]
name = "team-b"
rights = ["read", "write", "admin"]
secret_file = "{}"
seal_algorithms = ["hmac-sha256"]
"#,
        secret.display()
    );
    let c = ValidConfig::from_toml_str(&text).expect("full example");
    assert_eq!(c.store.engine, EngineName::Psync);
    assert_eq!(c.store.durability, DurabilityName::GroupCommit);
    assert_eq!(c.limits.object_bytes_max, 16 << 20);
    assert_eq!(c.limits.tenant_inflight_bytes_max, 256 << 20);
    assert_eq!(c.limits.retained_bytes_max, 8 << 30);
    assert_eq!(c.limits.tenant_retained_bytes_max, 1 << 30);
    assert_eq!(c.tenants[1].rights, [RightName::Read, RightName::Write, RightName::Admin]);
    assert_eq!(c.tenants[1].secret_file.as_deref(), Some(secret.as_path()));
    assert_eq!(c.listen.clock_skew_max_ms, 30_000);
    let auth = c.tenant_auth();
    assert_eq!(auth.len(), 1, "only team-b has keys");
    let team_b = auth.values().next().expect("team-b");
    assert_eq!(team_b.accepted, [SealAlgorithm::HmacSha256]);
    assert_eq!(team_b.keys.current().len(), 1);
    assert_eq!(c.callers()[1].rights, Rights::ALL);
    let f = c.file_store_config();
    assert_eq!(f.engine, EngineChoice::Psync);
    assert_eq!(f.durability, Durability::GroupCommit);
    assert_eq!(f.engine_config.queue_depth, 64);
    assert!(f.direct_io);
    assert_eq!(f.group_commit_deadline_ms, 2000);
    assert_eq!(f.limits, c.limits());
    for (name, durability) in [("per-block", Durability::PerBlock), ("none", Durability::None)] {
        let c = ValidConfig::from_toml_str(&format!("[store]\ndurability = \"{name}\"\n"))
            .unwrap_or_else(|e| panic!("durability = {name:?}: {e}"));
        assert_eq!(c.file_store_config().durability, durability, "{name}");
    }
}

#[test]
fn unknown_keys_are_refused_by_name() {
    let e = refused_at("[limits]\nretained_bytes_mx = 5\n", "limits.retained_bytes_mx");
    assert!(e.to_string().contains("unknown field"), "{e}");
    refused_at("[store]\nkind = \"memory\"\nrooot = \"/x\"\n", "store.rooot");
    refused_at("[listen]\nnative = \"127.0.0.1:1\"\n\n[lisen]\n", "lisen");
    refused_at("verbose = true\n", "verbose");
    refused_at(
        "[[tenants]]\nname = \"a\"\nrights = [\"read\"]\n\n[[tenants]]\nname = \"b\"\nrights = [\"read\"]\nsecret = \"x\"\n",
        "tenants[1].secret",
    );
}

#[test]
fn malformed_values_name_their_key() {
    refused_at("[store]\nkind = \"disk\"\n", "store.kind");
    refused_at("[store]\nengine = \"aio\"\n", "store.engine");
    refused_at("[store]\ndurability = \"always\"\n", "store.durability");
    refused_at("[store]\nqueue_depth = \"deep\"\n", "store.queue_depth");
    refused_at("[limits]\nretained_bytes_max = \"4 parsecs\"\n", "limits.retained_bytes_max");
    refused_at("[limits]\nobject_bytes_max = -1\n", "limits.object_bytes_max");
    refused_at("[listen]\nnative = \"localhost:7470\"\n", "listen.native");
    refused_at("[[tenants]]\nname = \"a\"\nrights = [\"read\", \"wrte\"]\n", "tenants[0].rights");
    refused_at("[[tenants]]\nname = \"a\"\n", "tenants[0].rights");
    let e = refused("[store\nkind = 1\n");
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn limits_are_checked_by_name() {
    let e = refused_at("[limits]\nretained_bytes_max = 0\n", "limits.retained_bytes_max");
    assert!(matches!(e, ConfigError::Limits { .. }), "{e:?}");
    refused_at(
        "[limits]\nretained_bytes_max = \"1G\"\ntenant_retained_bytes_max = \"2G\"\n",
        "limits.tenant_retained_bytes_max",
    );
    refused_at("[store]\nqueue_depth = 0\n", "store.queue_depth");
    refused_at("[store]\nqueue_depth = 5000\n", "store.queue_depth");
    refused_at("[listen]\nconnections_max = 0\n", "listen.connections_max");
    // A key the service does not have is refused by name, not ignored.
    refused_at("[listen]\ninflight_per_connection_max = 8\n", "listen.inflight_per_connection_max");
}

#[test]
fn listen_addresses_are_loopback_unless_allowed() {
    let e = refused_at("[listen]\nnative = \"0.0.0.0:7470\"\n", "listen.native");
    assert!(e.to_string().contains("allow_remote"), "{e}");
    refused_at("[listen]\nresp = \"10.1.2.3:7471\"\n", "listen.resp");
    refused_at("[listen]\nmetrics = \"[::]:7472\"\n", "listen.metrics");
    let ok = "[listen]\nnative = \"[::1]:7470\"\nresp = \"127.0.0.2:7471\"\n";
    ValidConfig::from_toml_str(ok).expect("loopback addresses");
    let remote =
        "[listen]\nallow_remote = true\nallow_open_tenants = true\nnative = \"0.0.0.0:7470\"\n";
    ValidConfig::from_toml_str(remote).expect("remote when allowed");
    refused_at("[listen]\nresp = \"127.0.0.1:7470\"\n", "listen.resp");
    let ephemeral =
        "[listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n";
    ValidConfig::from_toml_str(ephemeral).expect("port 0 never collides");
}

#[test]
fn tenants_are_checked_by_index() {
    let two = |a: &str, b: &str| {
        format!(
            "[[tenants]]\nname = \"{a}\"\nrights = [\"read\"]\n\n[[tenants]]\nname = \"{b}\"\nrights = [\"read\"]\n"
        )
    };
    refused_at(&two("a", "bad name"), "tenants[1].name");
    refused_at(&two("a", ""), "tenants[1].name");
    let e = refused_at(&two("same", "same"), "tenants[1].name");
    assert!(matches!(e, ConfigError::DuplicateTenant { first: 0, .. }), "{e:?}");
    refused_at("[[tenants]]\nname = \"a\"\nrights = []\n", "tenants[0].rights");
    refused_at("tenants = []\n", "tenants");
    refused_at(&format!("[limits]\ntenants_max = 1\n\n{}", two("a", "b")), "tenants");
    refused_at(
        "[[tenants]]\nname = \"a\"\nrights = [\"read\"]\nsecret_file = \"/nonexistent/gpucache.secret\"\n",
        "tenants[0].secret_file",
    );
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[[tenants]]\nname = \"a\"\nrights = [\"read\"]\nsecret_file = \"{}\"\n",
        dir.path().display()
    );
    let e = refused_at(&text, "tenants[0].secret_file");
    assert!(
        matches!(e, ConfigError::KeyFile { source: KeyFileError::NotAFile { .. }, .. }),
        "{e:?}"
    );
}

fn write_private(path: &std::path::Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn with_secret(path: &std::path::Path) -> String {
    format!(
        "[[tenants]]\nname = \"a\"\nrights = [\"read\"]\nsecret_file = \"{}\"\n",
        path.display()
    )
}

#[test]
fn key_files_are_validated_line_by_line_and_must_be_private() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.keys");
    let good = "ab".repeat(32);
    write_private(&path, &format!("# rotation\nk1 {good} 1800000000\nk2 {good}\n"));
    ValidConfig::from_toml_str(&with_secret(&path)).expect("two keys");
    write_private(&path, &format!("k1 {good}\n\nk-2 abcd\n"));
    let e = refused_at(&with_secret(&path), "tenants[0].secret_file");
    assert!(e.to_string().contains("line 3: the secret has 2 bytes"), "{e}");
    write_private(&path, &format!("k1 {good}\n"));
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let e = refused_at(&with_secret(&path), "tenants[0].secret_file");
    assert!(e.to_string().contains("chmod 600"), "{e}");
    let bad_seal = format!("{}seal_algorithms = [\"md5\"]\n", with_secret(&path));
    write_private(&path, &format!("k1 {good}\n"));
    let e = refused_at(&bad_seal, "tenants[0].seal_algorithms");
    assert!(e.to_string().contains("md5"), "{e}");
}

#[test]
fn open_tenants_on_a_remote_address_need_an_explicit_yes() {
    let remote = "[listen]\nallow_remote = true\nnative = \"0.0.0.0:7470\"\n";
    let e = refused_at(remote, "tenants[0].secret_file");
    assert!(e.to_string().contains("listen.allow_open_tenants = true"), "{e}");
    ValidConfig::from_toml_str(&format!("{remote}allow_open_tenants = true\n"))
        .expect("open tenants when allowed");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.keys");
    write_private(&path, &format!("k1 {}\n", "cd".repeat(32)));
    ValidConfig::from_toml_str(&format!("{remote}\n{}", with_secret(&path)))
        .expect("a sealed tenant may be served remotely");
}

#[test]
fn load_reports_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.toml");
    let e = ValidConfig::load(&missing).unwrap_err();
    assert!(e.to_string().starts_with(&missing.display().to_string()), "{e}");
    let big = dir.path().join("big.toml");
    std::fs::write(&big, vec![b'#'; 2 << 20]).unwrap();
    assert!(matches!(ValidConfig::load(&big), Err(ConfigError::TooLarge { .. })));
}

#[test]
fn open_store_builds_either_kind() {
    let clock = Arc::new(MonotonicClock::default());
    let memory = ValidConfig::from_toml_str("[store]\nkind = \"memory\"\n").unwrap();
    assert_eq!(memory.open_store(clock.clone()).unwrap().store.info().name, "memory");

    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[store]\nkind = \"file\"\nroot = \"{}\"\nengine = \"psync\"\ndurability = \"none\"\n",
        dir.path().join("data").display()
    );
    let file = ValidConfig::from_toml_str(&text).unwrap();
    let opened = file.open_store(clock.clone()).unwrap();
    assert_eq!(opened.store.info().name, "file");
    assert!(opened.io_engine.is_some_and(|e| e.engine == "psync" && e.reason == "configured"));
    // A second open of the same root is refused by its lock, naming store.root.
    let Err(e) = file.open_store(clock) else { panic!("a locked root opened twice") };
    assert_eq!(e.key(), "store.root");
    assert!(e.to_string().starts_with("store.root: "), "{e}");
}

#[test]
fn the_local_socket_is_checked_by_name() {
    // "" turns it off; a memory store has none unless one is named.
    let off = ValidConfig::from_toml_str("[listen]\nlocal = \"\"\n").expect("off");
    assert_eq!(off.local_socket(), None);
    let memory = ValidConfig::from_toml_str("[store]\nkind = \"memory\"\n").expect("memory");
    assert_eq!(memory.local_socket(), None);
    let dir = tempfile::tempdir().unwrap();
    let named = dir.path().join("s.sock");
    let c = ValidConfig::from_toml_str(&format!(
        "[store]\nkind = \"memory\"\n[listen]\nlocal = \"{}\"\nshm_mapped_bytes_max = \"2G\"\n",
        named.display()
    ))
    .expect("named socket");
    assert_eq!(c.local_socket(), Some(named));
    assert_eq!(c.listen.shm_mapped_bytes_max, 2 << 30);
    // A file store's root need not exist yet: the service creates it before binding.
    let c = ValidConfig::from_toml_str(&format!(
        "[store]\nroot = \"{}\"\n",
        dir.path().join("not-yet").display()
    ))
    .expect("socket in the store root");
    assert_eq!(c.local_socket(), Some(dir.path().join("not-yet/gpucache.sock")));

    let e = refused_at("[listen]\nlocal = \"/no/such/dir/gpucache.sock\"\n", "listen.local");
    assert!(e.to_string().contains("does not exist"), "{e}");
    let long = format!("/tmp/{}/gpucache.sock", "d".repeat(100));
    let e = refused_at(&format!("[listen]\nlocal = \"{long}\"\n"), "listen.local");
    assert!(e.to_string().contains("at most 107"), "{e}");
    // The default socket under a long store root is refused by the same key.
    let e = refused_at(&format!("[store]\nroot = \"/tmp/{}\"\n", "r".repeat(100)), "listen.local");
    assert!(e.to_string().contains("bytes as an absolute path"), "{e}");
    refused_at("[listen]\nshm_mapped_bytes_max = \"4K\"\n", "listen.shm_mapped_bytes_max");
    refused_at("[listen]\nshm_mapped_bytes_max = \"lots\"\n", "listen.shm_mapped_bytes_max");
}

#[test]
fn every_error_display_names_its_key() {
    let text = |e: ConfigError| e.to_string();
    let addr: SocketAddr = "10.0.0.1:1".parse().unwrap();
    assert_eq!(
        text(ConfigError::OutOfRange { key: "store.queue_depth", value: 0, min: 1, max: 4096 }),
        "store.queue_depth: 0 is outside 1..=4096"
    );
    assert_eq!(
        text(ConfigError::NotLoopback { key: "listen.native", addr }),
        "listen.native: 10.0.0.1:1 is not a loopback address; set listen.allow_remote = true to \
         accept connections from other hosts"
    );
    assert_eq!(
        text(ConfigError::AddressReused { key: "listen.resp", other: "listen.native", addr }),
        "listen.resp: 10.0.0.1:1 is already used by listen.native"
    );
    assert_eq!(text(ConfigError::NoTenants), "tenants: at least one tenant is required");
    assert_eq!(
        text(ConfigError::TooManyTenants { configured: 3, max: 2 }),
        "tenants: 3 tenants configured, limits.tenants_max is 2"
    );
    assert_eq!(
        text(ConfigError::DuplicateTenant {
            key: "tenants[2].name".into(),
            name: "a".into(),
            first: 0
        }),
        "tenants[2].name: tenant a is already defined by tenants[0]"
    );
    assert_eq!(
        text(ConfigError::NoRights { key: "tenants[0].rights".into() }),
        "tenants[0].rights: a tenant needs at least one right (read, write or admin)"
    );
    assert_eq!(
        text(ConfigError::Parse {
            key: "store.kind".into(),
            message: "bad".into(),
            line: 2,
            column: 8
        }),
        "store.kind: bad (line 2, column 8)"
    );
    assert_eq!(
        text(ConfigError::Parse { key: String::new(), message: "bad".into(), line: 1, column: 1 }),
        "line 1, column 1: bad"
    );
    assert_eq!(
        text(ConfigError::KeyFile {
            key: "tenants[0].secret_file".into(),
            source: KeyFileError::NotAFile { path: "/tmp".into() },
        }),
        "tenants[0].secret_file: /tmp is not a regular file"
    );
    assert_eq!(
        text(ConfigError::SealAlgorithm {
            key: "tenants[0].seal_algorithms".into(),
            name: "md5".into()
        }),
        "tenants[0].seal_algorithms: \"md5\" is not a seal algorithm (\"blake3\" or \"hmac-sha256\")"
    );
    assert_eq!(
        text(ConfigError::TooLarge { path: "/x.toml".into(), bytes_max: 1 }),
        "/x.toml: larger than 1 bytes; not a configuration file"
    );
}

#[test]
fn the_nixl_section_has_documented_defaults_and_is_checked_by_name() {
    let d = ServeConfig::default().nixl;
    assert!(!d.enabled, "NIXL staging is off unless asked for");
    assert_eq!((d.pool_bytes, d.slot_bytes, d.slots()), (256 << 20, 4 << 20, 64));
    assert_eq!((d.stage_lease_ms, d.per_connection_max, d.staged_max), (30_000, 64, 1024));
    assert_eq!(d.agent_name(), format!("gpucache-{}", std::process::id()));

    let c = ValidConfig::from_toml_str(
        "[nixl]\nenabled = true\nagent = \"node-a.0\"\npool_bytes = \"8MiB\"\nslot_bytes = \"1M\"\n\
         stage_lease_ms = 500\nper_connection_max = 4\nstaged_max = 8\n",
    )
    .expect("a full [nixl] section");
    let n = &c.nixl;
    assert!(n.enabled);
    assert_eq!((n.agent_name().as_str(), n.slots(), n.slot_bytes), ("node-a.0", 8, 1 << 20));
    let l = n.limits();
    assert_eq!((l.per_connection_max, l.staged_max, l.stage_lease_ms), (4, 8, 500));

    let e = refused_at("[nixl]\nenabled = true\npool = 5\n", "nixl.pool");
    assert!(e.to_string().contains("unknown field"), "{e}");
    refused_at("[nixl]\nslot_bytes = 100\n", "nixl.slot_bytes");
    refused_at("[nixl]\nslot_bytes = \"2G\"\n", "nixl.slot_bytes");
    refused_at("[nixl]\nslot_bytes = \"4M\"\npool_bytes = \"1M\"\n", "nixl.pool_bytes");
    let e = refused_at("[nixl]\nslot_bytes = \"1M\"\npool_bytes = \"1536K\"\n", "nixl.pool_bytes");
    assert!(e.to_string().contains("not a multiple of nixl.slot_bytes"), "{e}");
    refused_at(
        "[nixl]\nslot_bytes = 4096\npool_bytes = \"1G\"\n",
        "nixl.pool_bytes / nixl.slot_bytes",
    );
    refused_at("[nixl]\nstage_lease_ms = 0\n", "nixl.stage_lease_ms");
    refused_at("[nixl]\nper_connection_max = 0\n", "nixl.per_connection_max");
    refused_at("[nixl]\nper_connection_max = 8\nstaged_max = 4\n", "nixl.staged_max");
    refused_at("[nixl]\nagent = \"\"\n", "nixl.agent");
    let e = refused_at("[nixl]\nagent = \"a b\"\n", "nixl.agent");
    assert!(e.to_string().contains("only letters, digits"), "{e}");
    refused_at(&format!("[nixl]\nagent = \"{}\"\n", "a".repeat(129)), "nixl.agent");
    refused_at("[nixl]\nenabled = \"yes\"\n", "nixl.enabled");
}

/// Keys whose documented default is a sentence rather than a value (unset, required, derived
/// from other keys): the tables say what happens, and the embedded default leaves them unset.
const DOCUMENTED_WITHOUT_A_VALUE: [&str; 18] = [
    "store.tiers",
    // Unset by default; a test below reads what it resolves to.
    "store.layout",
    // Keys of `[[store.tiers]]` sections, whose defaults a test above reads from the config.
    "store.tiers.write",
    "store.tiers.write_back_dirty_max",
    "store.tiers.write_back_age_max_ms",
    "store.tiers.memory",
    "store.eviction",
    "listen.resp_tenant",
    "listen.local",
    "tenants.name",
    "tenants.rights",
    "tenants.secret_file",
    "tenants.seal_algorithms",
    "tenants.cold_retention_s",
    "nixl.agent",
    "dpu.spdk_pci_addr",
    "dpu.doca_device",
    "cluster.advertise",
];

/// A table cell's default as a TOML value: `` `"file"` ``, `` `32` ``, `1048576`, `64 MiB`.
fn documented_value(cell: &str) -> Option<String> {
    let cell = cell.trim();
    if let Some(inner) = cell.strip_prefix('`').and_then(|c| c.strip_suffix('`')) {
        return (!inner.contains('`')).then(|| inner.to_owned());
    }
    if !cell.is_empty() && cell.bytes().all(|b| b.is_ascii_digit()) {
        return Some(cell.to_owned());
    }
    let (n, unit) = cell.split_once(' ')?;
    let unit_ok = ["KiB", "MiB", "GiB", "TiB"].contains(&unit);
    (unit_ok && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .then(|| format!("\"{n}{unit}\""))
}

/// The `(section.key, default cell)` rows of every key table in docs/OPERATIONS.md.
fn documented_defaults() -> Vec<(String, String)> {
    let text = include_str!("../../docs/OPERATIONS.md");
    let mut section: Option<&str> = None;
    let mut in_key_table = false;
    let mut rows = Vec::new();
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("### ") {
            section = heading
                .strip_prefix("`[")
                .and_then(|h| h.split(']').next())
                .map(|h| h.trim_start_matches('['));
            continue;
        }
        // Only the `| key | default | meaning |` table right under a section's heading.
        in_key_table =
            line.starts_with('|') && (in_key_table || line == "| key | default | meaning |");
        let Some(section) = section.filter(|_| in_key_table) else { continue };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let key = cells[1].trim_matches('`');
        rows.push((format!("{section}.{key}"), cells[2].to_owned()));
    }
    rows
}

#[test]
fn every_default_the_operations_tables_state_is_the_embedded_default() {
    let rows = documented_defaults();
    let default = ServeConfig::default();
    let mut checked = 0;
    for (path, cell) in &rows {
        if DOCUMENTED_WITHOUT_A_VALUE.contains(&path.as_str()) {
            continue;
        }
        let value = documented_value(cell)
            .unwrap_or_else(|| panic!("docs/OPERATIONS.md: {path}: default {cell:?} is no value"));
        let (section, key) = path.split_once('.').expect("section.key");
        let text = format!("[{section}]\n{key} = {value}\n");
        let c = ValidConfig::from_toml_str(&text)
            .unwrap_or_else(|e| panic!("docs/OPERATIONS.md: {path} = {value}: {e}"));
        assert_eq!(*c, default, "docs/OPERATIONS.md states {path} = {value}, not the default");
        checked += 1;
    }
    for path in DOCUMENTED_WITHOUT_A_VALUE {
        assert!(rows.iter().any(|(p, _)| p == path), "docs/OPERATIONS.md has no row for {path}");
    }
    let d = &default;
    let unset = [
        d.listen.resp_tenant.is_none(),
        d.listen.local.is_none(),
        d.nixl.agent.is_none(),
        d.dpu.spdk_pci_addr.is_none() && d.dpu.doca_device.is_none(),
        d.tenants.iter().all(|t| t.secret_file.is_none() && t.seal_algorithms.is_none()),
    ];
    assert!(unset.iter().all(|u| *u), "a key documented as unset has a value in the default");

    // Every key the example file sets has its row, so no section of the tables is missing.
    let example = include_str!("../../gpucache.example.toml");
    let mut section = String::new();
    let mut example_keys = 0;
    for line in example.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            section = header.trim_matches(|c| c == '[').split(']').next().unwrap_or("").to_owned();
            continue;
        }
        let Some((key, _)) = line.split_once('=').filter(|_| !line.starts_with('#')) else {
            continue;
        };
        let path = format!("{}.{}", section.split('.').next().unwrap_or(""), key.trim());
        if section == "dpu.reactors" {
            continue; // documented in the sentence under the [dpu] table
        }
        assert!(rows.iter().any(|(p, _)| *p == path), "docs/OPERATIONS.md has no row for {path}");
        example_keys += 1;
    }
    assert!(example_keys >= 40 && checked >= example_keys - 2, "{checked} of {example_keys}");
}

#[test]
fn the_examples_commented_defaults_mean_the_embedded_default() {
    // Uncommented, the keys the example shows at their default change nothing.
    let example = include_str!("../../gpucache.example.toml");
    let shown = ["# resp_tenant = ", "# local = ", "# seal_algorithms = "];
    let mut uncommented = 0;
    let text: String = example
        .lines()
        .map(|line| match shown.iter().find(|p| line.starts_with(*p)) {
            Some(_) => {
                uncommented += 1;
                format!("{}\n", &line[2..])
            }
            None => format!("{line}\n"),
        })
        .collect();
    assert_eq!(uncommented, shown.len(), "the example no longer shows these keys");
    let c = ValidConfig::from_toml_str(&text).expect("the example with its defaults spelt out");
    let d = ServeConfig::default().validate().expect("the embedded default");
    assert_eq!(c.local_socket(), d.local_socket());
    assert_eq!(c.resp_caller(), d.resp_caller());
    let seals = |c: &ValidConfig| {
        let mut codes: Vec<u8> =
            c.tenants[0].accepted_seals().expect("seals").iter().map(|a| a.code()).collect();
        codes.sort_unstable();
        codes
    };
    assert_eq!(seals(&c), seals(&d), "the example's seal_algorithms are not both");
}

#[test]
fn the_readme_states_the_embedded_default() {
    let readme = include_str!("../../README.md");
    let d = ServeConfig::default().validate().expect("the embedded default");
    let local = d.local_socket().expect("a local socket");
    for said in [
        format!("a FileStore under `{}`", d.store.root.display()),
        format!("`{}`", d.listen.native),
        format!("`{}`", d.listen.resp),
        format!("`{}`", d.listen.metrics),
        format!("tenant named `{}` (read and write)", d.resp_caller().tenant),
        format!("`{}`", local.display()),
    ] {
        assert!(readme.contains(&said), "README.md does not say {said}");
    }
    assert_eq!(d.callers().len(), 1);
    assert_eq!(d.callers()[0].rights, Rights::READ_WRITE);
}

#[test]
fn eviction_defaults_by_kind_and_takes_any_policy_by_name() {
    use gpucache_service::config::Eviction;
    use gpucache_storage::evict::PolicyKind;
    let memory = ValidConfig::from_toml_str("[store]\nkind = \"memory\"\n").unwrap();
    assert_eq!(memory.store.eviction(), Eviction::Refuse);
    let file = ValidConfig::from_toml_str("[store]\nkind = \"file\"\n").unwrap();
    assert_eq!(file.store.eviction(), Eviction::Policy(PolicyKind::Fifo));
    assert_eq!(file.file_store_config().policy, PolicyKind::Fifo);
    for kind in PolicyKind::ALL {
        for store in ["memory", "file"] {
            let text = format!("[store]\nkind = \"{store}\"\neviction = \"{}\"\n", kind.name());
            let c = ValidConfig::from_toml_str(&text).unwrap();
            assert_eq!(c.store.eviction(), Eviction::Policy(*kind), "{text}");
            assert_eq!(c.file_store_config().policy, *kind);
        }
    }
    let e = refused_at("[store]\nkind = \"file\"\neviction = \"refuse\"\n", "store.eviction");
    assert!(e.to_string().contains("always evicts"), "{e}");
    let e = refused("[store]\neviction = \"mru\"\n");
    assert_eq!(e.key(), Some("store.eviction"), "{e}");
    assert!(e.to_string().contains("prefix") && e.to_string().contains("refuse"), "{e}");
}

#[test]
fn the_layout_defaults_to_the_block_log_and_to_a_file_per_block_under_direct_io() {
    use gpucache_storage::file::Layout;
    let layout_of =
        |text: &str| ValidConfig::from_toml_str(text).unwrap().file_store_config().layout;
    assert_eq!(layout_of(""), Layout::Log);
    assert_eq!(layout_of("[store]\nkind = \"file\"\n"), Layout::Log);
    assert_eq!(layout_of("[store]\ndirect_io = true\n"), Layout::Files);
    assert_eq!(layout_of("[store]\nlayout = \"files\"\n"), Layout::Files);
    assert_eq!(layout_of("[store]\nlayout = \"log\"\n"), Layout::Log);
    let e = refused_at("[store]\ndirect_io = true\nlayout = \"log\"\n", "store.direct_io");
    assert!(e.to_string().contains("layout = \"files\""), "{e}");
}

#[test]
fn an_evicting_memory_store_reports_its_policy_and_makes_room() {
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::store::{FullPolicy, Put};
    use gpucache_dataplane::testing::fixture::{caller, key, payload};
    let text = "[store]\nkind = \"memory\"\neviction = \"lru\"\n[limits]\nretained_bytes_max = \"2MiB\"\ntenant_retained_bytes_max = \"2MiB\"\nobject_bytes_max = \"1MiB\"\n";
    let config = ValidConfig::from_toml_str(text).unwrap();
    let opened = config.open_store(Arc::new(MonotonicClock::default())).unwrap();
    let store = opened.store;
    assert_eq!(store.info().full_policy, FullPolicy::Evict);
    for link in 0..3u8 {
        let put =
            store.put(&caller(0), &key(0, &[link], KvDtype::F16, 16), &payload(1, 1 << 20), None);
        assert!(matches!(put, Ok(Put::Committed(_))), "{put:?}");
    }
    assert_eq!(store.stats().evictions, 1, "the third block made room instead of being refused");
}

#[test]
fn tiered_store_sections_set_each_tier_and_mistakes_name_store_tiers() {
    use gpucache_service::config::{Eviction, memory_tier_default_bytes};
    use gpucache_storage::evict::PolicyKind;
    use gpucache_storage::tiered::{TierMemory, WriteMode};
    let d = ValidConfig::from_toml_str("").unwrap();
    let m = d.store.memory_tier();
    assert_eq!(m.capacity_bytes, memory_tier_default_bytes());
    assert!(m.capacity_bytes <= 4 << 30 && m.capacity_bytes > 0);
    assert_eq!((m.policy, m.promote), (PolicyKind::Prefix, true));
    assert_eq!((m.write, m.backing), (WriteMode::Through, TierMemory::Mapped));
    // What docs/OPERATIONS.md states for the write-back window.
    assert_eq!((m.window.dirty_bytes_max, m.window.dirty_age_max_ms), (256 << 20, 5_000));
    assert_eq!(d.file_store_config().policy, PolicyKind::Prefix);
    let text = "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\ncapacity = \"64MiB\"\neviction = \"lru\"\npromote = false\nwrite = \"back\"\nwrite_back_dirty_max = \"8MiB\"\nwrite_back_age_max_ms = 250\nmemory = \"heap\"\n[[store.tiers]]\nkind = \"file\"\ncapacity = \"1GiB\"\neviction = \"arc\"\n";
    let c = ValidConfig::from_toml_str(text).unwrap();
    let m = c.store.memory_tier();
    assert_eq!((m.capacity_bytes, m.policy, m.promote), (64 << 20, PolicyKind::Lru, false));
    assert_eq!((m.write, m.backing), (WriteMode::Back, TierMemory::Heap));
    assert_eq!((m.window.dirty_bytes_max, m.window.dirty_age_max_ms), (8 << 20, 250));
    assert_eq!(c.store.eviction(), Eviction::Policy(PolicyKind::Arc));
    let f = c.file_store_config();
    assert_eq!((f.policy, f.limits.retained_bytes_max), (PolicyKind::Arc, 1 << 30));
    for (bad, says) in [
        ("[store]\nkind = \"file\"\n[[store.tiers]]\nkind = \"memory\"\n", "kind = \"tiered\""),
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"file\"\n[[store.tiers]]\nkind = \"memory\"\n",
            "memory tier, then a file tier",
        ),
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\neviction = \"refuse\"\n",
            "not a policy",
        ),
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\ncapacity = 0\n",
            "holds no block",
        ),
    ] {
        let e = refused_at(bad, "store.tiers");
        assert!(e.to_string().contains(says), "{bad}: {e}");
    }
    let bad =
        "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\nwrite = \"behind\"\n";
    let e = refused_at(bad, "store.tiers[0].write");
    assert!(e.to_string().contains("expected \"through\" or \"back\""), "{e}");
    assert!(e.to_string().ends_with("(line 5, column 9)"), "the place of the value: {e}");
    // A key of another kind's tier is refused by the parser, at its line.
    let bad = "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\n[[store.tiers]]\nkind = \"file\"\nwrite = \"back\"\n";
    let e = refused_at(bad, "store.tiers[1].write");
    assert!(matches!(e, ConfigError::Parse { line: 7, column: 1, .. }), "{e:?}");
    assert!(
        e.to_string().contains("unknown field `write`, expected `capacity` or `eviction`"),
        "{e}"
    );
}

#[test]
fn an_s3_tier_takes_its_own_keys_below_both_upper_tiers_and_names_each_mistake() {
    let upper = "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\n[[store.tiers]]\nkind = \"file\"\n";
    let good = format!(
        "{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\nendpoint = \"http://127.0.0.1:9\"\nprefix = \"team/a\"\nrefill_bytes_max = \"8MiB\"\nqueue_bytes_max = \"64MiB\"\npack_bytes = \"4MiB\"\n"
    );
    let c = ValidConfig::from_toml_str(&good).unwrap();
    let s3 = c.store.s3_tier().expect("the s3 section");
    assert_eq!((s3.bucket.as_str(), s3.refill_bytes_max), ("b", Some(8 << 20)));
    let with_tenant = format!(
        "{good}[[tenants]]\nname = \"tenant-a\"\nrights = [\"read\"]\ncold_retention_s = 60\n"
    );
    ValidConfig::from_toml_str(&with_tenant).unwrap();
    let e = refused_at(
        "[[tenants]]\nname = \"tenant-a\"\nrights = [\"read\"]\ncold_retention_s = 60\n",
        "tenants[0].cold_retention_s",
    );
    assert!(e.to_string().contains("no s3 tier"), "{e}");
    for (bad, says) in [
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\n"
                .to_owned(),
            "then optionally an s3 tier",
        ),
        (
            format!("{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"\"\n"),
            "tiers[2].bucket: the s3 tier needs a bucket",
        ),
        (
            format!("{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\nprefix = \"/x\"\n"),
            "not a folder name",
        ),
        (
            format!(
                "{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\nendpoint = \"127.0.0.1:9000\"\n"
            ),
            "not an http:// or https:// URL",
        ),
        (
            format!(
                "{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\nrefill_within_ms = 0\n"
            ),
            "tiers[2].refill_within_ms: must be more than 0",
        ),
        (
            format!(
                "{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\npack_bytes = \"2GiB\"\nqueue_bytes_max = \"1GiB\"\n"
            ),
            "more than queue_bytes_max",
        ),
    ] {
        let e = refused_at(&bad, "store.tiers");
        assert!(e.to_string().contains(says), "{bad}: {e}");
    }
    // The parser refuses a tier it cannot read: no bucket, a key of the tiers above, a value
    // of the wrong type, a kind that is none, no kind.
    for (bad, key, says) in [
        (
            format!("{upper}[[store.tiers]]\nkind = \"s3\"\n"),
            "store.tiers[2].bucket",
            "missing field `bucket`",
        ),
        (
            format!("{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\ncapacity = \"1GiB\"\n"),
            "store.tiers[2].capacity",
            "unknown field `capacity`",
        ),
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\nkind = \"memory\"\nbucket = \"b\"\n"
                .to_owned(),
            "store.tiers[0].bucket",
            "unknown field `bucket`",
        ),
        (
            format!(
                "{upper}[[store.tiers]]\nkind = \"s3\"\nbucket = \"b\"\nqueue_jobs_max = \"8\"\n"
            ),
            "store.tiers[2].queue_jobs_max",
            "invalid type: string \"8\"",
        ),
        (
            format!("{upper}[[store.tiers]]\nkind = \"disk\"\n"),
            "store.tiers[2].kind",
            "unknown variant `disk`",
        ),
        (
            "[store]\nkind = \"tiered\"\n[[store.tiers]]\ncapacity = 1\n".to_owned(),
            "store.tiers[0].kind",
            "missing field `kind`",
        ),
    ] {
        let e = refused_at(&bad, key);
        let parsed = matches!(e, ConfigError::Parse { .. });
        assert!(parsed && e.to_string().contains(says), "{bad}: {e}");
    }
}

/// Each tier kind's keys, with a value of each.
const TIER_KEYS: [(&str, &str, &str); 22] = [
    ("memory", "capacity", "\"64MiB\""),
    ("memory", "eviction", "\"lru\""),
    ("memory", "promote", "false"),
    ("memory", "write", "\"back\""),
    ("memory", "memory", "\"heap\""),
    ("file", "capacity", "\"1G\""),
    ("file", "eviction", "\"arc\""),
    ("s3", "bucket", "\"b\""),
    ("s3", "endpoint", "\"http://127.0.0.1:9000\""),
    ("s3", "region", "\"eu-west-1\""),
    ("s3", "prefix", "\"team/a\""),
    ("s3", "request_timeout_ms", "5000"),
    ("s3", "retention_s", "60"),
    ("s3", "refill_bytes_max", "\"8MiB\""),
    ("s3", "refill_within_ms", "100"),
    ("s3", "degrade_ms", "100"),
    ("s3", "queue_jobs_max", "16"),
    ("s3", "queue_bytes_max", "\"64MiB\""),
    ("s3", "pack_bytes", "\"4M\""),
    ("s3", "drain_interval_ms", "50"),
    ("s3", "pack_open_ms", "500"),
    ("s3", "reclaim_interval_s", "0"),
];

#[test]
fn each_tier_kind_takes_its_own_keys_and_the_parser_refuses_every_other_kinds() {
    let store = "[store]\nkind = \"tiered\"\n";
    let memory = format!("{store}[[store.tiers]]\nkind = \"memory\"\n");
    let file = format!("{memory}[[store.tiers]]\nkind = \"file\"\n");
    // Each kind at its place (so that a refusal is the parser's, not the order's), with what it
    // requires.
    let kinds =
        [("memory", store.to_owned(), ""), ("file", memory, ""), ("s3", file, "bucket = \"b\"\n")];
    for (i, (kind, above, required)) in kinds.iter().enumerate() {
        let tier = format!("{above}[[store.tiers]]\nkind = \"{kind}\"\n{required}");
        for (_, key, value) in TIER_KEYS {
            if required.starts_with(key) {
                continue;
            }
            let text = format!("{tier}{key} = {value}\n");
            if TIER_KEYS.iter().any(|(owner, k, _)| owner == kind && *k == key) {
                ValidConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
                continue;
            }
            let e = ServeConfig::parse(&text).expect_err(&text);
            assert_eq!(e.key(), Some(format!("store.tiers[{i}].{key}").as_str()), "{text}: {e}");
            assert!(e.to_string().contains(&format!("unknown field `{key}`")), "{text}: {e}");
        }
    }
    // Every key at once, each byte count through the one grammar of sizes.
    let all = |kind: &str| -> String {
        let keys = TIER_KEYS.iter().filter(|(o, _, _)| *o == kind);
        keys.map(|(_, k, v)| format!("{k} = {v}\n")).collect()
    };
    let text = format!(
        "{store}[[store.tiers]]\nkind = \"memory\"\n{}[[store.tiers]]\nkind = \"file\"\n{}\
         [[store.tiers]]\nkind = \"s3\"\n{}",
        all("memory"),
        all("file"),
        all("s3")
    );
    let c = ValidConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let m = c.store.memory_tier();
    assert_eq!(
        (m.capacity_bytes, c.file_store_config().limits.retained_bytes_max),
        (64 << 20, 1 << 30)
    );
    let s3 = c.store.s3_tier().expect("the s3 tier");
    let bytes = (s3.refill_bytes_max, s3.queue_bytes_max, s3.pack_bytes);
    assert_eq!(bytes, (Some(8 << 20), Some(64 << 20), Some(4 << 20)));
}

#[test]
fn every_tiers_example_parses_to_the_tiers_it_spells() {
    use gpucache_service::config::{
        Eviction, FileTierSection, MemoryTierSection, S3TierSection, TierMemoryName, TierSection,
    };
    use gpucache_storage::evict::PolicyKind;
    use gpucache_storage::tiered::WriteMode;
    let s3 = |endpoint: &str, bucket: &str, retention_s| {
        TierSection::S3(S3TierSection {
            bucket: bucket.to_owned(),
            endpoint: Some(endpoint.to_owned()),
            region: None,
            prefix: None,
            request_timeout_ms: None,
            retention_s: Some(retention_s),
            refill_bytes_max: None,
            refill_within_ms: None,
            degrade_ms: None,
            queue_jobs_max: None,
            queue_bytes_max: None,
            pack_bytes: None,
            drain_interval_ms: None,
            pack_open_ms: None,
            reclaim_interval_s: None,
        })
    };
    let bare_file = TierSection::File(FileTierSection::default());
    // The example file's commented tiers, uncommented.
    let example = include_str!("../../gpucache.example.toml");
    let (head, tiers) = example.split_once("# [[store.tiers]]").expect("the example's tiers");
    let (tiers, tail) = tiers.split_once("\n\n").expect("the end of the [store] section");
    let tiers = format!("# [[store.tiers]]{tiers}").replace("\n# ", "\n");
    let text = format!("{head}{}\n\n{tail}", tiers.trim_start_matches("# "));
    let c = ValidConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let memory = MemoryTierSection {
        write: Some(WriteMode::Through),
        memory: Some(TierMemoryName::Mapped),
        ..MemoryTierSection::default()
    };
    let want =
        [TierSection::Memory(memory), bare_file.clone(), s3("http://127.0.0.1:9000", "kv-cold", 0)];
    assert_eq!(c.store.tiers, want, "gpucache.example.toml");
    // The cold tier's example in docs/OPERATIONS.md.
    let docs = include_str!("../../docs/OPERATIONS.md");
    let block = docs.split("### The cold tier on S3").nth(1).expect("the section");
    let block = block.split("```toml\n").nth(1).and_then(|b| b.split("```").next()).expect("toml");
    let c = ValidConfig::from_toml_str(&format!("[store]\nkind = \"tiered\"\n{block}"))
        .unwrap_or_else(|e| panic!("{block}: {e}"));
    let memory = TierSection::Memory(MemoryTierSection::default());
    assert_eq!(c.store.tiers, [memory, bare_file, s3("http://127.0.0.1:9000", "kv-cold", 604_800)]);
    // The tiers scripts/bench-tiers.sh writes, its shell values filled in.
    let script = include_str!("../../scripts/bench-tiers.sh");
    let tiers =
        script.split("tiers() {\n    cat <<EOF\n").nth(1).and_then(|t| t.split("EOF").next());
    let tiers = tiers.expect("the script's tiers").replace("$memory_bytes", "4096");
    let text = format!("[store]\n{}", tiers.replace("$file_bytes", "8192").replace("$1", "back"));
    let c = ValidConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let prefix = Some(Eviction::Policy(PolicyKind::Prefix));
    let memory = MemoryTierSection {
        capacity: Some(4096),
        eviction: prefix,
        write: Some(WriteMode::Back),
        ..MemoryTierSection::default()
    };
    let file = FileTierSection { capacity: Some(8192), eviction: prefix };
    assert_eq!(c.store.tiers, [TierSection::Memory(memory), TierSection::File(file)]);
}

/// A documented byte count (`"64MiB"`, `1024`) as bytes.
fn documented_bytes(value: &str) -> Option<u64> {
    let v = value.trim_matches('"');
    let (digits, unit): (String, String) = v.chars().partition(|c| c.is_ascii_digit());
    let n: u64 = digits.parse().ok()?;
    let shift = match unit.as_str() {
        "" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    Some(n << shift)
}

#[test]
fn the_s3_tier_table_states_the_defaults_the_cold_tier_runs_with() {
    use gpucache_cold as cold;
    let text = include_str!("../../docs/OPERATIONS.md");
    let table = text.split("### The cold tier on S3").nth(1).expect("the section");
    let rows: Vec<(&str, &str)> = table
        .lines()
        .skip_while(|l| *l != "| key | default | meaning |")
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            Some((cells.get(1)?.trim_matches('`'), cells.get(2)?.trim_matches('`')))
        })
        .collect();
    let expected: [(&str, String); 13] = [
        ("region", format!("\"{}\"", cold::S3Config::new("b").region)),
        ("prefix", format!("\"{}\"", cold::ColdConfig::default().prefix)),
        ("request_timeout_ms", cold::S3_REQUEST_TIMEOUT_MS_DEFAULT.to_string()),
        ("retention_s", cold::ColdConfig::default().retention_s.to_string()),
        ("reclaim_interval_s", cold::RECLAIM_INTERVAL_S_DEFAULT.to_string()),
        ("refill_bytes_max", cold::REFILL_BYTES_MAX_DEFAULT.to_string()),
        ("refill_within_ms", cold::REFILL_WITHIN_MS_DEFAULT.to_string()),
        ("degrade_ms", cold::DEGRADE_MS_DEFAULT.to_string()),
        ("queue_jobs_max", cold::SINK_JOBS_MAX_DEFAULT.to_string()),
        ("queue_bytes_max", cold::SINK_BYTES_MAX_DEFAULT.to_string()),
        ("pack_bytes", cold::PACK_BYTES_TARGET_DEFAULT.to_string()),
        ("drain_interval_ms", cold::DRAIN_INTERVAL_MS_DEFAULT.to_string()),
        ("pack_open_ms", gpucache_service::build::PACK_OPEN_MS_DEFAULT.to_string()),
    ];
    for (key, want) in &expected {
        let (_, documented) = rows
            .iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("no row for {key} in the s3 tier's table"));
        let same = documented == want
            || documented_bytes(documented).is_some_and(|b| Some(b) == documented_bytes(want));
        assert!(same, "{key}: the table says {documented}, the tier runs with {want}");
    }
    assert_eq!(rows.len(), expected.len() + 2, "bucket and endpoint, and a row per default");
}

#[test]
fn the_default_tiered_store_serves_hits_from_memory_and_reloads_its_file_tier() {
    use gpucache_dataplane::identity::KvDtype;
    use gpucache_dataplane::store::{Get, Put};
    use gpucache_dataplane::testing::fixture::{caller, key, payload};
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[store]\nkind = \"tiered\"\nroot = \"{}\"\ndurability = \"none\"\n[[store.tiers]]\nkind = \"memory\"\ncapacity = \"1MiB\"\n",
        dir.path().join("data").display()
    );
    let config = ValidConfig::from_toml_str(&text).unwrap();
    let clock = Arc::new(MonotonicClock::default());
    let k = key(0, &[1], KvDtype::F16, 16);
    let bytes = payload(3, 4096);
    let mut dst = vec![0u8; 4096];
    {
        let opened = config.open_store(clock.clone()).unwrap();
        assert_eq!(opened.store.info().name, "tiered");
        assert!(matches!(opened.store.put(&caller(0), &k, &bytes, None), Ok(Put::Committed(_))));
        let got = opened.store.get_into(&caller(0), &k, &mut dst).unwrap();
        assert!(matches!(got, Get::Hit { len: 4096, .. }) && dst == bytes);
    }
    // A restart finds the block in the file tier (memory starts empty) and promotes it.
    let opened = config.open_store(clock).unwrap();
    dst.fill(0);
    let got = opened.store.get_into(&caller(0), &k, &mut dst).unwrap();
    assert!(matches!(got, Get::Hit { len: 4096, .. }) && dst == bytes, "{got:?}");
}
