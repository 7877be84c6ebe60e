//! `gpucache fsck DIR [--repair]`: full verification of a FileStore directory.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpucache_storage::file::{FsckReport, fsck};

use gpucache_service::units::human_bytes;

/// Most paths listed per reason in the summary.
const PATHS_PER_REASON: usize = 5;

/// A one-line progress bar on stderr, redrawn in place with `\r` at most every `every`.
pub(crate) struct ProgressLine {
    label: &'static str,
    every: Duration,
    last: Option<Instant>,
    drawn: bool,
}

impl ProgressLine {
    const WIDTH: u64 = 30;

    pub(crate) fn new(label: &'static str) -> Self {
        Self { label, every: Duration::from_millis(100), last: None, drawn: false }
    }

    /// Records progress; draws when enough time passed since the last drawing, or at the end.
    pub(crate) fn update(&mut self, done: u64, total: u64) {
        let now = Instant::now();
        let due = self.last.is_none_or(|t| now.duration_since(t) >= self.every);
        if !due && done < total {
            return;
        }
        self.last = Some(now);
        self.drawn = true;
        let line = render(self.label, done, total, Self::WIDTH);
        let mut err = std::io::stderr().lock();
        // Progress is advisory: a closed stderr must not stop the check.
        let _ = write!(err, "\r{line}");
        let _ = err.flush();
    }

    /// Ends the line (if one was drawn) so later output starts on a fresh one.
    pub(crate) fn finish(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}

/// `label [#########.........]  30%  3/10 files`
fn render(label: &str, done: u64, total: u64, width: u64) -> String {
    let done = done.min(total);
    let (filled, percent) = match total {
        0 => (width, 100),
        t => (done.saturating_mul(width) / t, done.saturating_mul(100) / t),
    };
    let bar: String = (0..width).map(|i| if i < filled { '#' } else { '.' }).collect();
    format!("{label} [{bar}] {percent:>3}%  {done}/{total} files")
}

/// The report as text: counts, then each reason with up to [`PATHS_PER_REASON`] paths.
fn summary(dir: &Path, report: &FsckReport, repair: bool) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(s, "fsck {}", dir.display());
    let _ = writeln!(s, "  files:     {}", report.files);
    if report.records + report.torn_segments > 0 {
        let _ = writeln!(s, "  records:   {} (in the block log)", report.records);
        let _ =
            writeln!(s, "  torn log segment ends: {} (never acknowledged)", report.torn_segments);
    }
    let _ = writeln!(s, "  ok:        {} ({})", report.ok, human_bytes(report.ok_bytes));
    let _ = writeln!(s, "  bad:       {}", report.bad_count());
    for (reason, paths) in &report.bad {
        let _ = writeln!(s, "    {reason}: {}", paths.len());
        for p in paths.iter().take(PATHS_PER_REASON) {
            let _ = writeln!(s, "      {}", p.display());
        }
        if paths.len() > PATHS_PER_REASON {
            let _ = writeln!(s, "      ... and {} more", paths.len() - PATHS_PER_REASON);
        }
    }
    let _ = writeln!(s, "  tmp files: {}", report.tmp_files);
    if repair {
        let _ =
            writeln!(s, "  repaired:  {} (files removed, records marked removed)", report.repaired);
    }
    let verdict = match (report.bad_count(), repair) {
        (0, _) => "clean",
        (_, true) if report.repaired >= report.bad_count() => "bad files found and removed",
        (_, true) => "bad files found; some could not be removed",
        (_, false) => "bad files found (run again with --repair to remove them)",
    };
    let _ = write!(s, "  result:    {verdict}");
    s
}

pub(crate) fn run(dir: &Path, repair: bool) -> ExitCode {
    // The library treats a missing directory as an empty store; an operator who mistyped a
    // path should hear about it instead.
    if !dir.is_dir() {
        eprintln!("gpucache fsck: {} is not a directory", dir.display());
        return ExitCode::from(2);
    }
    if !dir.join("STORE").is_file() && !dir.join("blocks").is_dir() && !dir.join("log").is_dir() {
        eprintln!(
            "gpucache fsck: {} is not a FileStore directory (no STORE file, blocks/ or log/)",
            dir.display()
        );
        return ExitCode::from(2);
    }
    let mut progress = ProgressLine::new("fsck");
    let result = fsck(dir, repair, |done, total| progress.update(done, total));
    progress.finish();
    match result {
        Ok(report) => {
            #[allow(clippy::print_stdout)]
            {
                println!("{}", summary(dir, &report, repair));
            }
            if report.bad_count() == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) }
        }
        Err(e) => {
            eprintln!("gpucache fsck: {}: {e}", dir.display());
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn bar_renders_fraction_and_counts() {
        assert_eq!(render("fsck", 3, 10, 10), "fsck [###.......]  30%  3/10 files");
        assert_eq!(render("fsck", 0, 0, 4), "fsck [####] 100%  0/0 files");
        assert_eq!(render("fsck", 12, 10, 4), "fsck [####] 100%  10/10 files");
    }

    #[test]
    fn summary_caps_paths_per_reason() {
        let mut report = FsckReport { files: 8, ok: 1, ok_bytes: 4096, ..FsckReport::default() };
        report.bad.insert(
            "payload checksum mismatch".into(),
            (0..7).map(|i| PathBuf::from(format!("/s/blocks/aa/{i}.blk"))).collect(),
        );
        let text = summary(Path::new("/s"), &report, false);
        assert!(text.contains("payload checksum mismatch: 7"), "{text}");
        assert!(text.contains("/s/blocks/aa/4.blk") && !text.contains("/s/blocks/aa/5.blk"));
        assert!(text.contains("... and 2 more"), "{text}");
        assert!(text.contains("--repair"), "{text}");
    }
}
