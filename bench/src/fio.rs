//! Running fio as the reference for the FileStore benchmark, and reading its JSON output.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Which way a fio job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Write,
    Read,
}

impl Direction {
    fn rw(self) -> &'static str {
        match self {
            Direction::Write => "write",
            Direction::Read => "read",
        }
    }
}

/// One sequential fio job on one file.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    pub file: &'a Path,
    pub direction: Direction,
    /// `io_uring` or `psync`.
    pub ioengine: &'static str,
    pub block_bytes: u64,
    pub total_bytes: u64,
    pub queue_depth: u32,
    pub direct: bool,
    /// fsync after every write (the peer of per-block durability).
    pub fsync_each: bool,
    /// fio stops after this long even when `total_bytes` are not done.
    pub runtime: Duration,
}

/// What fio reported for one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Bytes per second.
    pub bw_bytes: f64,
    pub io_bytes: u64,
    pub runtime_ms: u64,
    /// Latency percentiles of each I/O from submission to completion (fio's `lat_ns`, asked
    /// for with `--lat_percentiles=1`; `clat_ns` when only that is reported), in nanoseconds.
    /// An fsync after a write is not part of it.
    pub lat_p50_ns: Option<u64>,
    pub lat_p99_ns: Option<u64>,
}

/// fio's version string, or `None` when fio is not on PATH (or does not run).
pub fn version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

impl Job<'_> {
    /// The fio arguments for this job. The page cache is left alone (`--invalidate=0`) so that
    /// fio's buffered reads see the same cache state as the store's (the caller drops caches
    /// for both when asked), and the file is not preallocated (`--fallocate=none`), as the
    /// store's block files are not.
    pub fn args(&self) -> Vec<String> {
        let runtime_s = self.runtime.as_secs().max(1);
        let mut args = vec![
            format!("--name=gpucache-{}", self.direction.rw()),
            format!("--filename={}", self.file.display()),
            format!("--rw={}", self.direction.rw()),
            format!("--bs={}", self.block_bytes),
            format!("--size={}", self.total_bytes),
            format!("--iodepth={}", self.queue_depth),
            format!("--ioengine={}", self.ioengine),
            format!("--direct={}", u8::from(self.direct)),
            format!("--runtime={runtime_s}"),
            "--numjobs=1".to_owned(),
            "--invalidate=0".to_owned(),
            // The store writes new files without preallocating; so does fio here.
            "--fallocate=none".to_owned(),
            "--output-format=json".to_owned(),
            // Percentiles of the whole I/O: a buffered io_uring read that hits the page cache
            // completes at submission, so its completion latency alone reads as zero.
            "--lat_percentiles=1".to_owned(),
        ];
        if self.fsync_each && self.direction == Direction::Write {
            args.push("--fsync=1".to_owned());
        }
        args
    }

    /// Runs fio and returns the job's bandwidth.
    pub fn run(&self) -> Result<Outcome, String> {
        run_fio(&self.args(), self.direction)
    }
}

/// Random reads of one block in each of the files under a directory (the FileStore's own
/// block files, each holding one block after its header), every block read once per loop,
/// `loops` times over.
#[derive(Debug, Clone)]
pub struct FilesJob<'a> {
    /// fio opens every file below it (`--opendir`); it must hold exactly `files` files.
    pub dir: &'a Path,
    pub files: u64,
    /// `io_uring` or `psync`.
    pub ioengine: &'static str,
    /// Where the block starts in every file (the block file's header length).
    pub offset: u64,
    pub block_bytes: u64,
    pub queue_depth: u32,
    pub direct: bool,
    pub loops: u32,
    /// fio stops after this long even when the loops are not done.
    pub runtime: Duration,
}

impl FilesJob<'_> {
    /// The fio arguments: `--rw=randread` over the files (fio divides `--size` between them,
    /// so each file contributes exactly its block from `--offset`), the page cache left alone
    /// as in [`Job::args`].
    pub fn args(&self) -> Vec<String> {
        let runtime_s = self.runtime.as_secs().max(1);
        vec![
            "--name=gpucache-files-randread".to_owned(),
            format!("--opendir={}", self.dir.display()),
            "--rw=randread".to_owned(),
            format!("--bs={}", self.block_bytes),
            format!("--offset={}", self.offset),
            format!("--size={}", self.block_bytes.saturating_mul(self.files)),
            format!("--iodepth={}", self.queue_depth),
            format!("--ioengine={}", self.ioengine),
            format!("--direct={}", u8::from(self.direct)),
            format!("--loops={}", self.loops.max(1)),
            format!("--runtime={runtime_s}"),
            "--numjobs=1".to_owned(),
            "--invalidate=0".to_owned(),
            "--output-format=json".to_owned(),
            "--lat_percentiles=1".to_owned(),
        ]
    }

    /// Runs fio and returns the job's read bandwidth.
    pub fn run(&self) -> Result<Outcome, String> {
        run_fio(&self.args(), Direction::Read)
    }
}

/// Runs fio with `args` and reads the `direction` side of its report.
fn run_fio(args: &[String], direction: Direction) -> Result<Outcome, String> {
    let out =
        Command::new("fio").args(args).output().map_err(|e| format!("cannot run fio: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Long arguments and output are cut: the report shows what failed, not every path.
        let shown: Vec<&str> = args.iter().map(|a| a.get(..200).unwrap_or(a)).collect();
        return Err(format!(
            "fio {} failed ({}): {}",
            shown.join(" "),
            out.status,
            cut(&last_lines(&format!("{stdout}{stderr}"), 5), 1000)
        ));
    }
    parse_outcome(&stdout, direction)
}

/// At most `max` bytes of `text` (on a character boundary), marked when cut.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let end = (0..=max).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
    format!("{}...", &text[..end])
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Reads `jobs[0].<write|read>` from fio's JSON report. fio may print notes before the JSON
/// object, so parsing starts at the first `{` of a line.
pub fn parse_outcome(stdout: &str, direction: Direction) -> Result<Outcome, String> {
    let start = stdout
        .match_indices('{')
        .map(|(i, _)| i)
        .find(|&i| i == 0 || stdout.as_bytes()[i - 1] == b'\n')
        .ok_or_else(|| "fio printed no JSON report".to_owned())?;
    let json: serde_json::Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<serde_json::Value>()
        .next()
        .ok_or_else(|| "fio printed no JSON report".to_owned())?
        .map_err(|e| format!("fio's JSON report does not parse: {e}"))?;
    let job = json
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or_else(|| "fio's report has no jobs[0]".to_owned())?;
    if let Some(code) = job.get("error").and_then(serde_json::Value::as_i64)
        && code != 0
    {
        return Err(format!("fio job failed with error {code}"));
    }
    let side = job
        .get(direction.rw())
        .ok_or_else(|| format!("fio's report has no jobs[0].{}", direction.rw()))?;
    let bw_bytes = side
        .get("bw_bytes")
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| format!("fio's report has no jobs[0].{}.bw_bytes", direction.rw()))?;
    let number = |name: &str| side.get(name).and_then(serde_json::Value::as_u64).unwrap_or(0);
    let percentile = |p: &str| {
        ["lat_ns", "clat_ns"].iter().find_map(|kind| {
            side.get(kind)
                .and_then(|c| c.get("percentile"))
                .and_then(|c| c.get(p))
                .and_then(serde_json::Value::as_u64)
        })
    };
    Ok(Outcome {
        bw_bytes,
        io_bytes: number("io_bytes"),
        runtime_ms: number("runtime"),
        lat_p50_ns: percentile("50.000000"),
        lat_p99_ns: percentile("99.000000"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_job_side_after_leading_notes() {
        let out = "fio: note, something\n{\n \"fio version\": \"fio-3.33\",\n \"jobs\": [ {\
                   \"jobname\": \"w\", \"error\": 0,\
                   \"read\": {\"io_bytes\": 0, \"bw_bytes\": 0, \"runtime\": 0},\
                   \"write\": {\"io_bytes\": 1048576, \"bw_bytes\": 2097152, \"runtime\": 500,\
                   \"clat_ns\": {\"percentile\": {\"50.000000\": 1000, \"99.000000\": 9000}}}\
                   } ] }\n";
        let w = parse_outcome(out, Direction::Write).expect("parses");
        let want = Outcome {
            bw_bytes: 2_097_152.0,
            io_bytes: 1 << 20,
            runtime_ms: 500,
            lat_p50_ns: Some(1000),
            lat_p99_ns: Some(9000),
        };
        assert_eq!(w, want);
        assert_eq!(parse_outcome(out, Direction::Read).expect("parses").bw_bytes, 0.0);
        assert!(parse_outcome("no json here", Direction::Read).is_err());
        assert!(parse_outcome("{\"jobs\": []}", Direction::Read).is_err());
    }

    #[test]
    fn files_job_reads_one_block_per_file() {
        let job = FilesJob {
            dir: Path::new("/d/blocks"),
            files: 2,
            ioengine: "io_uring",
            offset: 4096,
            block_bytes: 65536,
            queue_depth: 32,
            direct: true,
            loops: 5,
            runtime: Duration::from_secs(10),
        };
        let args = job.args();
        for want in [
            "--opendir=/d/blocks",
            "--rw=randread",
            "--bs=65536",
            "--offset=4096",
            "--size=131072",
            "--iodepth=32",
            "--direct=1",
            "--loops=5",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        assert_eq!(cut("abcdef", 4), "abcd...");
        assert_eq!(cut("abc", 4), "abc");
    }

    #[test]
    fn args_carry_the_shared_parameters() {
        let job = Job {
            file: Path::new("/d/f.dat"),
            direction: Direction::Write,
            ioengine: "io_uring",
            block_bytes: 1 << 20,
            total_bytes: 64 << 20,
            queue_depth: 32,
            direct: true,
            fsync_each: true,
            runtime: Duration::from_secs(5),
        };
        let args = job.args();
        for want in [
            "--rw=write",
            "--bs=1048576",
            "--size=67108864",
            "--iodepth=32",
            "--ioengine=io_uring",
            "--direct=1",
            "--fsync=1",
            "--output-format=json",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
    }
}
