//! The peers that are not key-value stores driven from Rust: iperf3 (loopback TCP), memcpy
//! (in process), and Mooncake Store (through its Python driver, `bench/peers/mooncake_bench.py`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::load::{PhaseStats, PointResult};
use super::process::{ChildGuard, found_on_path, free_port, version_line};
use crate::stats;
use gpucache_service::units::narrow;

/// The Mooncake driver, embedded so that the binary does not depend on where it runs from.
const MOONCAKE_SCRIPT: &str = include_str!("../../peers/mooncake_bench.py");
/// How long the iperf3 server may take to accept the client.
const IPERF3_START_DEADLINE: Duration = Duration::from_secs(10);
/// Time beyond the measurement an iperf3 client run may take.
const IPERF3_SLACK: Duration = Duration::from_secs(20);
/// iperf3's largest `-l` (its MAX_BLOCKSIZE); larger values are sent in buffers of this size.
pub(super) const IPERF3_BLOCK_BYTES_MAX: u64 = 1 << 20;
/// Time per point beyond its two phases the Mooncake driver may take (worker start-up,
/// segment mounting), plus a fixed allowance for starting the three services.
const MOONCAKE_SLACK_PER_POINT: Duration = Duration::from_secs(40);
const MOONCAKE_SLACK: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------------
// iperf3

pub(super) fn iperf3_version() -> Option<String> {
    found_on_path("iperf3").then(|| version_line(Path::new("iperf3"), &["--version"])).flatten()
}

/// `iperf3 -c` arguments for one point: `clients` parallel streams writing `value_bytes` per
/// call (at most [`IPERF3_BLOCK_BYTES_MAX`], iperf3's limit) for `seconds` (iperf3 takes whole
/// seconds), JSON output.
pub(super) fn iperf3_client_args(
    port: u16,
    seconds: u64,
    value_bytes: u64,
    clients: usize,
) -> Vec<String> {
    vec![
        "-c".into(),
        "127.0.0.1".into(),
        "-p".into(),
        port.to_string(),
        "-t".into(),
        seconds.max(1).to_string(),
        "-l".into(),
        value_bytes.min(IPERF3_BLOCK_BYTES_MAX).to_string(),
        "-P".into(),
        clients.to_string(),
        "-J".into(),
    ]
}

/// The receiver's view of an iperf3 run: `end.sum_received`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Iperf3Outcome {
    pub bits_per_second: f64,
    pub bytes: u64,
    pub seconds: f64,
}

/// Reads `end.sum_received` from `iperf3 -J` output; iperf3's own `error` field is an error.
pub(super) fn parse_iperf3(json: &str) -> Result<Iperf3Outcome, String> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("iperf3 JSON does not parse: {e}"))?;
    if let Some(e) = v.get("error").and_then(serde_json::Value::as_str) {
        return Err(format!("iperf3: {e}"));
    }
    let sum = v
        .get("end")
        .and_then(|e| e.get("sum_received"))
        .ok_or_else(|| "iperf3 JSON has no end.sum_received".to_owned())?;
    let number = |name: &str| {
        sum.get(name)
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| format!("iperf3 JSON has no end.sum_received.{name}"))
    };
    Ok(Iperf3Outcome {
        bits_per_second: number("bits_per_second")?,
        bytes: sum.get("bytes").and_then(serde_json::Value::as_u64).unwrap_or(0),
        seconds: number("seconds")?,
    })
}

/// One iperf3 point: a one-shot server (`-s -1`) and a client, both on 127.0.0.1. The figure is
/// the same for PUT and GET (loopback is symmetric; the table says so).
pub(super) fn iperf3_point(
    scratch: &Path,
    value_bytes: u64,
    clients: usize,
    phase: Duration,
) -> PointResult {
    let fail = |e: String| PointResult::failed(value_bytes, clients, e);
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let tag = format!("{value_bytes}-{clients}");
    let mut server_cmd = Command::new("iperf3");
    server_cmd.args(["-s", "-1", "-p", &port.to_string(), "-B", "127.0.0.1"]);
    let mut server = match ChildGuard::spawn(
        "iperf3 -s",
        server_cmd,
        &scratch.join(format!("iperf3-server-{tag}.log")),
        false,
    ) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let seconds = phase.as_secs() + u64::from(phase.subsec_nanos() > 0);
    let out_path = scratch.join(format!("iperf3-client-{tag}.json"));
    let start_deadline = Instant::now() + IPERF3_START_DEADLINE;
    // A client that finds no listener yet fails at once without using up the one-shot server:
    // retry until the server accepts (no fixed sleep).
    let outcome = loop {
        if let Some(status) = server.exited() {
            break Err(format!("iperf3 server exited ({status}) before the client ran"));
        }
        let mut client_cmd = Command::new("iperf3");
        client_cmd.args(iperf3_client_args(port, seconds, value_bytes, clients));
        let mut client = match ChildGuard::spawn("iperf3 -c", client_cmd, &out_path, false) {
            Ok(c) => c,
            Err(e) => break Err(e),
        };
        let run_deadline = Instant::now() + Duration::from_secs(seconds) + IPERF3_SLACK;
        let Some(status) = client.wait_until(run_deadline) else {
            break Err("iperf3 client did not finish in time (killed)".to_owned());
        };
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        let parsed = parse_iperf3(&text);
        match parsed {
            Ok(o) if status.success() => break Ok(o),
            Err(e) if e.contains("unable to connect") && Instant::now() < start_deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(_) => break Err(format!("iperf3 client exited {status}")),
            Err(e) => break Err(e),
        }
    };
    drop(server);
    match outcome {
        Ok(o) => {
            let bytes = if o.bytes > 0 {
                o.bytes
            } else {
                whole_bytes(o.bits_per_second / 8.0 * o.seconds)
            };
            let stats = PhaseStats {
                ops: 0,
                bytes,
                seconds: o.seconds,
                p50_us: None,
                p99_us: None,
                errors: 0,
            };
            PointResult {
                size: value_bytes,
                clients,
                put: Some(stats.clone()),
                get: Some(stats),
                verified: 0,
                mismatches: 0,
                error: None,
            }
        }
        Err(e) => fail(e),
    }
}

/// A non-negative byte count computed in floating point, rounded down.
fn whole_bytes(x: f64) -> u64 {
    // Saturating float-to-int conversion: NaN and negatives give 0.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = x.max(0.0) as u64;
    n
}

// ---------------------------------------------------------------------------------------------
// memcpy

/// One memcpy point: `threads` threads each copy `value_bytes` chunks from their share of a
/// source buffer to the same offsets of a destination buffer, cycling through `buffer_bytes`
/// (chosen larger than the last-level cache) until the deadline. The figure is the same for
/// PUT and GET.
pub(super) fn memcpy_point(
    value_bytes: u64,
    threads: usize,
    buffer_bytes: u64,
    phase: Duration,
) -> PointResult {
    let size = narrow(value_bytes);
    let per_thread = narrow(buffer_bytes) / threads.max(1) / size * size;
    if per_thread == 0 {
        return PointResult::failed(
            value_bytes,
            threads,
            "memcpy buffer smaller than one value per thread".into(),
        );
    }
    let barrier = Barrier::new(threads);
    let parts: Vec<(u64, Vec<u64>, Instant, Instant)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                scope.spawn(move || {
                    // Each thread owns (and faults in, untimed) its share of both buffers.
                    let fill = u8::try_from(t % 200).unwrap_or(0) + 1;
                    let src = vec![fill; per_thread];
                    let mut dst = vec![0xa5u8; per_thread];
                    let chunks = per_thread / size;
                    let mut latencies = Vec::new();
                    let mut copies = 0u64;
                    barrier.wait();
                    let start = Instant::now();
                    let deadline = start + phase;
                    while Instant::now() < deadline {
                        let at = (usize::try_from(copies).unwrap_or(0) % chunks) * size;
                        let t0 = Instant::now();
                        dst[at..at + size].copy_from_slice(&src[at..at + size]);
                        latencies.push(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX));
                        copies += 1;
                    }
                    let end = Instant::now();
                    std::hint::black_box(&dst);
                    (copies, latencies, start, end)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    if parts.len() != threads {
        return PointResult::failed(value_bytes, threads, "a memcpy thread panicked".into());
    }
    let start = parts.iter().map(|p| p.2).min();
    let end = parts.iter().map(|p| p.3).max();
    let (Some(start), Some(end)) = (start, end) else {
        return PointResult::failed(value_bytes, threads, "no memcpy thread ran".into());
    };
    let copies: u64 = parts.iter().map(|p| p.0).sum();
    let mut lat: Vec<u64> = parts.into_iter().flat_map(|p| p.1).collect();
    lat.sort_unstable();
    let stats = PhaseStats {
        ops: copies,
        bytes: copies * value_bytes,
        seconds: end.duration_since(start).as_secs_f64(),
        p50_us: stats::percentile_us(&lat, 50.0),
        p99_us: stats::percentile_us(&lat, 99.0),
        errors: 0,
    };
    PointResult {
        size: value_bytes,
        clients: threads,
        put: Some(stats.clone()),
        get: Some(stats),
        verified: 0,
        mismatches: 0,
        error: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Mooncake Store

/// Where the Mooncake venv's Python and binaries are.
#[derive(Debug, Clone)]
pub(crate) struct MooncakeVenv {
    pub python: PathBuf,
    pub bin_dir: PathBuf,
}

/// The venv at `venv`, or why it cannot be used.
pub(crate) fn mooncake_venv(venv: &Path) -> Result<MooncakeVenv, String> {
    let bin_dir = venv.join("bin");
    let python = bin_dir.join("python");
    if !python.is_file() {
        return Err(format!("{} not found (run scripts/setup.sh mooncake)", python.display()));
    }
    for b in ["mooncake_master", "mooncake_http_metadata_server", "mooncake_client"] {
        if !bin_dir.join(b).is_file() {
            return Err(format!(
                "{} not found: mooncake-transfer-engine-non-cuda is not installed in {} (run \
                 scripts/setup.sh mooncake)",
                bin_dir.join(b).display(),
                venv.display()
            ));
        }
    }
    Ok(MooncakeVenv { python, bin_dir })
}

/// The driver's JSON: one object with every point.
#[derive(Debug, Deserialize)]
pub(crate) struct MooncakeReport {
    pub version: Option<String>,
    pub segment_bytes: Option<u64>,
    pub points: Vec<MooncakePoint>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct MooncakePoint {
    size: u64,
    clients: usize,
    put: Option<MooncakePhase>,
    get: Option<MooncakePhase>,
    verified: u64,
    mismatches: u64,
    error: Option<String>,
}

/// One phase as a Python driver reports it (the Mooncake one and `gpucache-bench python`'s).
#[derive(Debug, Deserialize)]
pub(crate) struct MooncakePhase {
    ops: u64,
    bytes: u64,
    seconds: f64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    errors: u64,
}

impl From<MooncakePhase> for PhaseStats {
    fn from(p: MooncakePhase) -> Self {
        PhaseStats {
            ops: p.ops,
            bytes: p.bytes,
            seconds: p.seconds,
            p50_us: p.p50_us,
            p99_us: p.p99_us,
            errors: p.errors,
        }
    }
}

impl From<MooncakePoint> for PointResult {
    fn from(p: MooncakePoint) -> Self {
        PointResult {
            size: p.size,
            clients: p.clients,
            put: p.put.map(Into::into),
            get: p.get.map(Into::into),
            verified: p.verified,
            mismatches: p.mismatches,
            error: p.error,
        }
    }
}

/// Parses the driver's output: the last line that holds a JSON object.
pub(crate) fn parse_mooncake(stdout: &str) -> Result<MooncakeReport, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| "the Mooncake driver printed no JSON".to_owned())?;
    serde_json::from_str(line)
        .map_err(|e| format!("the Mooncake driver's JSON does not parse: {e}"))
}

/// Runs the Mooncake driver over every point at once (its three services start once), in its
/// own process group, which is killed on every path out of here. `batch` values move per call
/// (`batch_put_from` / `batch_get_into`); 0 is one value per call (`put_from` / `get_into`).
pub(crate) fn mooncake_run(
    venv: &MooncakeVenv,
    scratch: &Path,
    sizes: &[u64],
    clients: &[usize],
    phase: Duration,
    working_set_bytes: u64,
    batch: usize,
) -> Result<MooncakeReport, String> {
    let tag = |v: Vec<String>| v.join("_");
    let dir = scratch.join(format!(
        "mooncake-{}-x{}",
        tag(sizes.iter().map(u64::to_string).collect()),
        tag(clients.iter().map(usize::to_string).collect())
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let script = dir.join("mooncake_bench.py");
    std::fs::write(&script, MOONCAKE_SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;
    let join = |v: Vec<String>| v.join(",");
    let mut command = Command::new(&venv.python);
    command
        .arg(&script)
        .arg("--bin-dir")
        .arg(&venv.bin_dir)
        .arg("--sizes")
        .arg(join(sizes.iter().map(u64::to_string).collect()))
        .arg("--clients")
        .arg(join(clients.iter().map(usize::to_string).collect()))
        .arg("--seconds")
        .arg(phase.as_secs_f64().to_string())
        .arg("--working-set")
        .arg(working_set_bytes.to_string())
        .arg("--log-dir")
        .arg(&dir)
        .arg("--batch")
        .arg(batch.to_string());
    // The driver writes its JSON to stdout and its log to stderr; both land in one file here
    // (the JSON is its last line).
    let out_path = dir.join("driver.out");
    let mut child = ChildGuard::spawn("mooncake driver", command, &out_path, true)?;
    let points = u32::try_from(sizes.len() * clients.len()).unwrap_or(u32::MAX);
    let budget = (phase * 2 + MOONCAKE_SLACK_PER_POINT) * points + MOONCAKE_SLACK;
    let status = child.wait_until(Instant::now() + budget);
    child.stop();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let tail = || text.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
    match status {
        None => Err(format!("the Mooncake driver did not finish in {budget:?}; killed its group")),
        Some(s) if !s.success() => Err(format!("the Mooncake driver exited {s}: {}", tail())),
        Some(_) => parse_mooncake(&text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from a real `iperf3 -c 127.0.0.1 -t 1 -J` run (iperf3 3.12).
    const IPERF3_SAMPLE: &str = r#"{
        "start": {"version": "iperf 3.12", "test_start": {"protocol": "TCP", "num_streams": 1}},
        "intervals": [],
        "end": {
            "sum_sent": {"start": 0, "end": 1.000051, "seconds": 1.000051, "bytes": 2861563904,
                         "bits_per_second": 22891347386.1, "retransmits": 0, "sender": true},
            "sum_received": {"start": 0, "end": 1.000423, "seconds": 1.000423,
                             "bytes": 2861563904, "bits_per_second": 22882836329.5,
                             "sender": true}
        }
    }"#;

    #[test]
    fn iperf3_json_gives_the_received_sum() {
        let o = parse_iperf3(IPERF3_SAMPLE).expect("parses");
        assert_eq!(o.bytes, 2_861_563_904);
        assert!((o.bits_per_second - 22_882_836_329.5).abs() < 1e-3);
        assert!((o.seconds - 1.000423).abs() < 1e-9);
        let e = parse_iperf3(r#"{"start": {}, "error": "unable to connect to server: refused"}"#)
            .expect_err("error");
        assert!(e.contains("unable to connect"), "{e}");
        assert!(parse_iperf3("not json").is_err());
        assert!(parse_iperf3(r#"{"end": {}}"#).is_err());
    }

    #[test]
    fn iperf3_client_args_match_the_point() {
        let a = iperf3_client_args(5201, 3, 1 << 20, 8).join(" ");
        assert_eq!(a, "-c 127.0.0.1 -p 5201 -t 3 -l 1048576 -P 8 -J");
        let big = iperf3_client_args(5201, 3, 4 << 20, 1).join(" ");
        assert!(big.contains("-l 1048576"), "{big}");
    }

    #[test]
    fn the_mooncake_driver_json_parses_after_log_lines() {
        let out = "mooncake_bench: starting metadata\nI1130 log line {not json\n\
                   {\"peer\": \"mooncake\", \"version\": \"0.3.13.post1\", \"segment_bytes\": 1024, \
                   \"points\": [{\"size\": 1048576, \"clients\": 1, \"put\": {\"ops\": 64, \
                   \"bytes\": 67108864, \"seconds\": 0.05, \"p50_us\": 1041.9, \"p99_us\": 1464.3, \
                   \"errors\": 0}, \"get\": null, \"verified\": 61, \"mismatches\": 0, \
                   \"error\": \"worker 0: boom\"}]}\n";
        let r = parse_mooncake(out).expect("parses");
        assert_eq!(r.version.as_deref(), Some("0.3.13.post1"));
        let p: PointResult = r.points.into_iter().next().expect("point").into();
        assert_eq!(p.size, 1 << 20);
        let put = p.put.expect("put");
        assert!((put.gbps() - 67_108_864.0 / 0.05 / 1e9).abs() < 1e-9);
        assert_eq!(put.p99_us, Some(1464.3));
        assert_eq!(p.get, None);
        assert_eq!(p.verified, 61);
        assert_eq!(p.error.as_deref(), Some("worker 0: boom"));
        assert!(parse_mooncake("no json\n").is_err());
    }

    #[test]
    fn memcpy_moves_bytes_and_times_them() {
        let p = memcpy_point(64 << 10, 2, 4 << 20, Duration::from_millis(50));
        let get = p.get.expect("stats");
        assert!(get.ops > 0 && get.bytes == get.ops * (64 << 10), "{get:?}");
        assert!(get.gbps() > 0.0);
        assert!(get.p99_us.is_some());
    }

    #[test]
    fn a_missing_venv_is_a_reason_not_a_crash() {
        let e = mooncake_venv(Path::new("/nonexistent/venv")).expect_err("missing");
        assert!(e.contains("scripts/setup.sh"), "{e}");
    }
}
