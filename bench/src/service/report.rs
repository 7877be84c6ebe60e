//! The report of `gpucache-bench service`: the ratio table, the aims at 1 MiB, and a grouped
//! bar chart as hand-written SVG.

use std::fmt::Write as _;

use serde::Serialize;

use super::load::{PhaseStats, PointResult};
use crate::stats::cell;
use gpucache_service::units::{MIB, size_label};

/// Which table of the report a row belongs to: the in-memory stores and their network and
/// memory ceilings, or the stores that write to disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Table {
    Memory,
    File,
}

impl Table {
    pub(super) const BOTH: [Table; 2] = [Table::Memory, Table::File];

    /// The peers each of our rows in this table is compared with, in column order.
    pub(super) fn references(self) -> &'static [&'static str] {
        match self {
            Table::Memory => &REFERENCES,
            Table::File => &FILE_REFERENCES,
        }
    }

    fn title(self) -> &'static str {
        match self {
            Table::Memory => "in memory",
            Table::File => "on disk",
        }
    }
}

/// What one peer gave: its points, or why it did not run.
#[derive(Debug, Clone, Serialize)]
pub(super) struct PeerRun {
    /// `ours-tcp`, `ours-shm`, `raw-socket`, `redis`, `mooncake`, `iperf3`, `memcpy`,
    /// `ours-file-*`, `redis-aof-*`.
    pub name: String,
    /// The table the row is in.
    pub table: Table,
    /// Whether this row is our service (one row per transport).
    pub ours: bool,
    /// Whether this row is our shared-memory transport (compared with memcpy).
    pub shared_memory: bool,
    pub version: Option<String>,
    /// `Some(why)` when the peer did not run at all.
    pub skipped: Option<String>,
    pub note: Option<String>,
    pub points: Vec<PointResult>,
}

impl PeerRun {
    pub(super) fn point(&self, size: u64, clients: usize) -> Option<&PointResult> {
        self.points.iter().find(|p| p.size == size && p.clients == clients)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Op {
    Get,
    Put,
}

impl Op {
    pub(super) const BOTH: [Op; 2] = [Op::Get, Op::Put];
    pub(super) fn name(self) -> &'static str {
        match self {
            Op::Get => "GET",
            Op::Put => "PUT",
        }
    }
    fn of(self, p: &PointResult) -> Option<&PhaseStats> {
        match self {
            Op::Get => p.get.as_ref(),
            Op::Put => p.put.as_ref(),
        }
    }
}

/// The phase's throughput when it moved any bytes.
pub(super) fn gbps(run: &PeerRun, size: u64, clients: usize, op: Op) -> Option<f64> {
    run.point(size, clients).and_then(|p| op.of(p)).map(PhaseStats::gbps).filter(|g| *g > 0.0)
}

fn p99_ms(run: &PeerRun, size: u64, clients: usize, op: Op) -> Option<f64> {
    run.point(size, clients).and_then(|p| op.of(p)).and_then(|s| s.p99_us).map(|us| us / 1e3)
}

/// ours / peer for one point and operation.
pub(super) fn ratio(
    ours: &PeerRun,
    peer: &PeerRun,
    size: u64,
    clients: usize,
    op: Op,
) -> Option<f64> {
    Some(gbps(ours, size, clients, op)? / gbps(peer, size, clients, op)?)
}

/// The comparison peers of the in-memory table, in column order.
pub(super) const REFERENCES: [&str; 5] = ["iperf3", "raw-socket", "redis", "mooncake", "memcpy"];
/// The comparison peers of the on-disk table.
pub(super) const FILE_REFERENCES: [&str; 2] = ["redis-aof-always", "redis-aof-everysec"];
/// The fair pairs of the on-disk table: ours at a durability, Redis at the one that promises
/// as much (acknowledged once flushed; acknowledged before a flush).
pub(super) const FILE_PAIRS: [(&str, &str); 4] = [
    ("ours-file-durable", "redis-aof-always"),
    ("ours-log-durable", "redis-aof-always"),
    ("ours-file-none", "redis-aof-everysec"),
    ("ours-log-none", "redis-aof-everysec"),
];

/// One aim of the benchmark: at 1 MiB with one client, ours / `peer` at least `need`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct Aim {
    pub ours: String,
    pub peer: &'static str,
    pub op: Op,
    pub need: f64,
    pub ratio: Option<f64>,
    /// `None` when it could not be judged (a side missing); `why` says which.
    pub met: Option<bool>,
    pub why: Option<String>,
}

/// Value size and client count the aims are judged at.
pub(super) const AIM_SIZE: u64 = MIB;
pub(super) const AIM_CLIENTS: usize = 1;

/// The aims: every TCP-like row against iperf3 (0.9x), the raw socket (0.9x), Redis (1.5x) and
/// Mooncake (2x); the shared-memory row against memcpy (0.7x), or a line saying it was not run;
/// each warm file row that ran against its Redis pair in [`FILE_PAIRS`] (1.0x).
pub(super) fn aims(runs: &[PeerRun]) -> Vec<Aim> {
    let find = |name: &str| runs.iter().find(|r| r.name == name);
    let mut out = Vec::new();
    let mut judge = |ours: &PeerRun, peer: &'static str, need: f64| {
        for op in Op::BOTH {
            let (ratio, why) = match find(peer) {
                None => (None, Some(format!("{peer} not run"))),
                Some(p) if p.skipped.is_some() => (
                    None,
                    Some(format!("{peer} skipped: {}", p.skipped.clone().unwrap_or_default())),
                ),
                Some(p) => match ratio(ours, p, AIM_SIZE, AIM_CLIENTS, op) {
                    Some(r) => (Some(r), None),
                    None => (None, Some("a side has no measurement at 1 MiB, 1 client".into())),
                },
            };
            out.push(Aim {
                ours: ours.name.clone(),
                peer,
                op,
                need,
                ratio,
                met: ratio.map(|r| r >= need),
                why,
            });
        }
    };
    let ours: Vec<&PeerRun> =
        runs.iter().filter(|r| r.ours && r.skipped.is_none() && r.table == Table::Memory).collect();
    for o in ours.iter().filter(|o| !o.shared_memory) {
        judge(o, "iperf3", 0.9);
        judge(o, "raw-socket", 0.9);
        judge(o, "redis", 1.5);
        judge(o, "mooncake", 2.0);
    }
    let shm: Vec<&&PeerRun> = ours.iter().filter(|o| o.shared_memory).collect();
    for o in &shm {
        judge(o, "memcpy", 0.7);
    }
    for (name, peer) in FILE_PAIRS {
        if let Some(o) = runs.iter().find(|r| r.name == name && r.skipped.is_none()) {
            judge(o, peer, 1.0);
        }
    }
    if shm.is_empty() {
        for op in Op::BOTH {
            out.push(Aim {
                ours: "ours-shm".into(),
                peer: "memcpy",
                op,
                need: 0.7,
                ratio: None,
                met: None,
                why: Some("ours-shm not run (add it to --peers)".into()),
            });
        }
    }
    out
}

/// One ratio cell of the report: ours / peer at a point, `None` when a side has no figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(super) struct RatioCell {
    pub ours: String,
    pub peer: &'static str,
    pub size: u64,
    pub clients: usize,
    pub op: Op,
    pub ratio: Option<f64>,
}

/// Our rows of `table` that ran.
fn ours_in(runs: &[PeerRun], table: Table) -> Vec<&PeerRun> {
    runs.iter().filter(|r| r.ours && r.skipped.is_none() && r.table == table).collect()
}

/// The references of `table` that are in the run (ran or skipped; not those left out of
/// --peers).
fn references_in(runs: &[PeerRun], table: Table) -> Vec<&'static str> {
    table.references().iter().copied().filter(|p| runs.iter().any(|r| r.name == *p)).collect()
}

/// Every ratio the tables show, for the JSON.
pub(super) fn ratios(runs: &[PeerRun], sizes: &[u64], clients: &[usize]) -> Vec<RatioCell> {
    let find = |name: &str| runs.iter().find(|r| r.name == name && r.skipped.is_none());
    let mut out = Vec::new();
    for table in Table::BOTH {
        let refs = references_in(runs, table);
        for o in ours_in(runs, table) {
            for &size in sizes {
                for &c in clients {
                    for op in Op::BOTH {
                        for &peer in &refs {
                            out.push(RatioCell {
                                ours: o.name.clone(),
                                peer,
                                size,
                                clients: c,
                                op,
                                ratio: find(peer).and_then(|r| ratio(o, r, size, c, op)),
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// GB/s with its p99 in ms after it, when both were measured.
fn gbps_p99_cell(g: Option<f64>, p99: Option<f64>) -> String {
    match (g, p99) {
        (Some(_), Some(ms)) => format!("{} ({ms:.2})", cell(g, 2)),
        _ => cell(g, 2),
    }
}

/// The report's tables in Markdown: the in-memory one, and the on-disk one when any of our file
/// rows ran, each under a heading.
pub(super) fn tables(runs: &[PeerRun], sizes: &[u64], clients: &[usize]) -> String {
    let mut s = String::new();
    let with_rows: Vec<Table> =
        Table::BOTH.into_iter().filter(|&t| !ours_in(runs, t).is_empty()).collect();
    // With none of our rows at all, the (empty) in-memory table still shows the columns.
    let shown = if with_rows.is_empty() { vec![Table::Memory] } else { with_rows };
    for t in shown {
        if !s.is_empty() {
            s.push('\n');
        }
        let _ = writeln!(s, "## {}\n", t.title());
        s.push_str(&table(runs, sizes, clients, t));
    }
    s
}

/// One ratio table in Markdown: one row per (size, clients, operation, our row of `table`),
/// GB/s with p99 in ms for it and each reference in the run, then ours / each reference.
pub(super) fn table(runs: &[PeerRun], sizes: &[u64], clients: &[usize], table: Table) -> String {
    let find = |name: &str| runs.iter().find(|r| r.name == name && r.skipped.is_none());
    let ours = ours_in(runs, table);
    let refs = references_in(runs, table);
    let mut s = String::new();
    let _ = write!(s, "| size | clients | op | ours |");
    let _ = write!(s, " ours GB/s (p99 ms) |");
    for p in &refs {
        let _ = write!(s, " {p} GB/s (p99 ms) |");
    }
    for p in &refs {
        let _ = write!(s, " ours/{p} |");
    }
    s.push('\n');
    s.push_str(&"|---".repeat(5 + 2 * refs.len()));
    s.push_str("|\n");
    for &size in sizes {
        for &c in clients {
            for op in Op::BOTH {
                for o in &ours {
                    let _ = write!(
                        s,
                        "| {} | {c} | {} | {} | {} |",
                        size_label(size),
                        op.name(),
                        o.name,
                        gbps_p99_cell(gbps(o, size, c, op), p99_ms(o, size, c, op))
                    );
                    for p in &refs {
                        let v = find(p)
                            .map(|r| gbps_p99_cell(gbps(r, size, c, op), p99_ms(r, size, c, op)));
                        let _ = write!(s, " {} |", v.unwrap_or_else(|| "-".into()));
                    }
                    for p in &refs {
                        let r = find(p).and_then(|r| ratio(o, r, size, c, op));
                        let _ = write!(s, " {} |", cell(r, 2));
                    }
                    s.push('\n');
                }
            }
        }
    }
    s
}

/// The aims as a Markdown table.
pub(super) fn aims_table(aims: &[Aim]) -> String {
    let mut s = String::from(
        "| aim (1 MiB, 1 client) | op | need | measured | met |\n|---|---|---|---|---|\n",
    );
    for a in aims {
        let met = match (a.met, &a.why) {
            (Some(true), _) => "yes".to_owned(),
            (Some(false), _) => "**no**".to_owned(),
            (None, Some(why)) => format!("not judged: {why}"),
            (None, None) => "not judged".to_owned(),
        };
        let _ = writeln!(
            s,
            "| {} / {} | {} | >= {:.1}x | {} | {met} |",
            a.ours,
            a.peer,
            a.op.name(),
            a.need,
            a.ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}x"))
        );
    }
    s
}

/// Fill colour per peer, by its place among the rows that ran (ours first): distinct for the
/// first [`COLOURS`] rows.
pub(crate) fn colour(i: usize) -> &'static str {
    COLOURS[i % COLOURS.len()]
}

const COLOURS: [&str; 14] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#7f7f7f", "#ff7f0e", "#8c564b", "#e377c2",
    "#17becf", "#bcbd22", "#393b79", "#ad494a", "#637939", "#843c39",
];

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

const PANEL_W: f64 = 520.0;
const PANEL_H: f64 = 260.0;
const MARGIN: f64 = 50.0;
/// Width and height of one legend entry.
const LEGEND_W: f64 = 165.0;
const LEGEND_H: f64 = 18.0;
/// Legend entries on one line: as many as fit the two panels' width.
const LEGEND_PER_LINE: usize = 6;

/// A grouped bar chart: one panel per (table, client count, operation), value sizes along x,
/// one bar per row of that table in each group, GB/s on y; the on-disk panels only when a file
/// row ran. Each bar is a `<rect class="bar">` carrying `data-peer`, `data-op`, `data-size`,
/// `data-clients` and `data-gbps`, with a `<title>` tooltip. The legend wraps; a peer keeps its
/// colour in every panel.
pub(super) fn svg(runs: &[PeerRun], sizes: &[u64], clients: &[usize], title: &str) -> String {
    let peers: Vec<(usize, &PeerRun)> =
        runs.iter().filter(|r| r.skipped.is_none()).enumerate().collect();
    let tables: Vec<Table> = Table::BOTH
        .into_iter()
        .filter(|&t| peers.iter().any(|(_, p)| p.table == t))
        .filter(|&t| t == Table::Memory || !ours_in(runs, t).is_empty())
        .collect();
    let cols = Op::BOTH.len() as f64;
    let width = MARGIN + cols * (PANEL_W + MARGIN);
    let per_line = LEGEND_PER_LINE;
    let legend_lines = peers.len().div_ceil(per_line).max(1);
    let legend_h = legend_lines as f64 * LEGEND_H + 12.0;
    let panel_rows: Vec<(Table, usize)> =
        tables.iter().flat_map(|&t| clients.iter().map(move |&c| (t, c))).collect();
    let rows = panel_rows.len().max(1) as f64;
    let height = 40.0 + legend_h + rows * (PANEL_H + 2.0 * MARGIN);
    let mut s = String::new();
    svg_open(&mut s, width, height, title);
    for (n, (i, p)) in peers.iter().enumerate() {
        let x = MARGIN + (n % per_line) as f64 * LEGEND_W;
        let y = 36.0 + (n / per_line) as f64 * LEGEND_H;
        legend_entry(&mut s, x, y, colour(*i), &p.name);
    }
    for (row, &(table, c)) in panel_rows.iter().enumerate() {
        let in_table: Vec<&(usize, &PeerRun)> =
            peers.iter().filter(|(_, p)| p.table == table).collect();
        for (col, op) in Op::BOTH.into_iter().enumerate() {
            let x0 = MARGIN + col as f64 * (PANEL_W + MARGIN);
            let y0 = 40.0 + legend_h + row as f64 * (PANEL_H + 2.0 * MARGIN) + MARGIN;
            let max = sizes
                .iter()
                .flat_map(|&z| in_table.iter().filter_map(move |(_, p)| gbps(p, z, c, op)))
                .fold(0.0_f64, f64::max);
            let top = nice_ceiling(max);
            let _ = writeln!(
                s,
                "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\" font-size=\"13\">{} {} — \
                 {c} client{} (GB/s)</text>",
                x0 + PANEL_W / 2.0,
                y0 - 10.0,
                table.title(),
                op.name(),
                if c == 1 { "" } else { "s" }
            );
            gridlines(&mut s, (x0, y0), (PANEL_W, PANEL_H), top);
            let group_w = PANEL_W / sizes.len().max(1) as f64;
            let bar_w = (group_w * 0.8) / in_table.len().max(1) as f64;
            for (g, &size) in sizes.iter().enumerate() {
                let gx = x0 + g as f64 * group_w + group_w * 0.1;
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                    gx + group_w * 0.4,
                    y0 + PANEL_H + 16.0,
                    size_label(size)
                );
                for (slot, (i, p)) in in_table.iter().enumerate() {
                    let Some(v) = gbps(p, size, c, op) else { continue };
                    let h = if top > 0.0 { PANEL_H * v / top } else { 0.0 };
                    let x = gx + slot as f64 * bar_w;
                    let y = y0 + PANEL_H - h;
                    let _ = writeln!(
                        s,
                        "<rect class=\"bar\" x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" \
                         height=\"{h:.1}\" fill=\"{}\" data-peer=\"{}\" data-op=\"{}\" \
                         data-size=\"{size}\" data-clients=\"{c}\" data-gbps=\"{v:.3}\"><title>{} \
                         {} {} x{c}: {v:.2} GB/s</title></rect>",
                        (bar_w - 1.0).max(1.0),
                        colour(*i),
                        escape(&p.name),
                        op.name(),
                        escape(&p.name),
                        op.name(),
                        size_label(size),
                    );
                }
            }
            baseline(&mut s, (x0, y0), (PANEL_W, PANEL_H));
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The start of a chart: the `<svg>` element, a white background and the title, centred.
pub(crate) fn svg_open(s: &mut String, width: f64, height: f64, title: &str) {
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         viewBox=\"0 0 {width:.0} {height:.0}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{:.0}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>",
        width / 2.0,
        escape(title)
    );
}

/// One legend entry at (`x`, `y`): a swatch of `fill` and `name`.
pub(crate) fn legend_entry(s: &mut String, x: f64, y: f64, fill: &str, name: &str) {
    let _ = writeln!(
        s,
        "<rect class=\"legend\" x=\"{x:.0}\" y=\"{y:.0}\" width=\"12\" height=\"12\" \
         fill=\"{fill}\"/><text x=\"{:.0}\" y=\"{:.0}\">{}</text>",
        x + 16.0,
        y + 10.0,
        escape(name)
    );
}

/// Gridlines with their values at quarters of `top`, over the panel whose top left corner is
/// `origin` and whose size is `size`.
pub(crate) fn gridlines(s: &mut String, origin: (f64, f64), size: (f64, f64), top: f64) {
    let ((x0, y0), (w, h)) = (origin, size);
    for q in 0..=4 {
        let v = top * f64::from(q) / 4.0;
        let y = y0 + h - h * f64::from(q) / 4.0;
        let _ = writeln!(
            s,
            "<line x1=\"{x0:.0}\" y1=\"{y:.1}\" x2=\"{:.0}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.0}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            x0 + w,
            x0 - 4.0,
            y + 4.0,
            tick(v)
        );
    }
}

/// The x axis: a black line along the bottom of the panel.
pub(crate) fn baseline(s: &mut String, origin: (f64, f64), size: (f64, f64)) {
    let ((x0, y0), (w, h)) = (origin, size);
    let _ = writeln!(
        s,
        "<line x1=\"{x0:.0}\" y1=\"{:.1}\" x2=\"{:.0}\" y2=\"{:.1}\" stroke=\"black\"/>",
        y0 + h,
        x0 + w,
        y0 + h
    );
}

/// An axis label: as few decimals as the quarter-steps of a [`nice_ceiling`] top need.
fn tick(v: f64) -> String {
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0');
    text.strip_suffix('.').unwrap_or(text).to_owned()
}

/// A round number at or above `x` for the top of an axis (1, 2, 2.5 or 5 times a power of ten).
pub(crate) fn nice_ceiling(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return 1.0;
    }
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * p).find(|v| *v >= x).unwrap_or(10.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn phase(gbps: f64) -> PhaseStats {
        PhaseStats {
            ops: 100,
            bytes: (gbps * 1e9) as u64,
            seconds: 1.0,
            p50_us: Some(400.0),
            p99_us: Some(1500.0),
            errors: 0,
        }
    }

    fn run(name: &str, ours: bool, points: &[(u64, usize, f64, f64)]) -> PeerRun {
        PeerRun {
            name: name.into(),
            table: if name.contains("file") || name.contains("aof") {
                Table::File
            } else {
                Table::Memory
            },
            ours,
            shared_memory: false,
            version: None,
            skipped: None,
            note: None,
            points: points
                .iter()
                .map(|&(size, clients, get, put)| PointResult {
                    size,
                    clients,
                    put: Some(phase(put)),
                    get: Some(phase(get)),
                    verified: 1,
                    mismatches: 0,
                    error: None,
                })
                .collect(),
        }
    }

    fn sample() -> Vec<PeerRun> {
        let mut redis = run("redis", false, &[(MIB, 1, 1.0, 2.0), (64 << 10, 1, 0.5, 0.5)]);
        redis.version = Some("7.0.15".into());
        let mut mooncake = run("mooncake", false, &[]);
        mooncake.skipped = Some("venv missing".into());
        vec![
            run("ours-tcp", true, &[(MIB, 1, 2.0, 2.0), (64 << 10, 1, 1.0, 0.25)]),
            redis,
            mooncake,
            run("iperf3", false, &[(MIB, 1, 2.0, 2.0), (64 << 10, 1, 2.0, 2.0)]),
            run("raw-socket", false, &[(MIB, 1, 4.0, 4.0), (64 << 10, 1, 2.0, 1.0)]),
        ]
    }

    #[test]
    fn ratios_and_aims_are_judged_at_one_mib() {
        let runs = sample();
        let a = aims(&runs);
        let find = |peer: &str, op| a.iter().find(|x| x.peer == peer && x.op == op).expect("aim");
        // GET: 2.0 / 2.0 iperf3 = 1.0 >= 0.9; 2.0 / 1.0 redis = 2.0 >= 1.5.
        assert_eq!(find("iperf3", Op::Get).met, Some(true));
        assert_eq!(find("redis", Op::Get).ratio, Some(2.0));
        assert_eq!(find("redis", Op::Get).met, Some(true));
        // PUT: 2.0 / 2.0 redis = 1.0 < 1.5.
        assert_eq!(find("redis", Op::Put).met, Some(false));
        let m = find("mooncake", Op::Put);
        assert_eq!(m.met, None);
        assert!(m.why.as_deref().is_some_and(|w| w.contains("venv missing")), "{m:?}");
        let shm = find("memcpy", Op::Get);
        assert_eq!(shm.met, None);
        assert!(shm.why.as_deref().is_some_and(|w| w.contains("ours-shm not run")));
        let t = aims_table(&a);
        assert!(t.contains("| ours-tcp / redis | PUT | >= 1.5x | 1.00x | **no** |"), "{t}");
        // The raw socket: 2.0 / 4.0 = 0.5 < 0.9.
        let raw = a.iter().find(|x| x.peer == "raw-socket" && x.op == Op::Get).expect("aim");
        assert_eq!((raw.ratio, raw.met), (Some(0.5), Some(false)));
        assert!(t.contains("| ours-tcp / raw-socket | GET | >= 0.9x | 0.50x | **no** |"), "{t}");
        // No file row ran: no on-disk aims.
        assert!(!a.iter().any(|x| x.peer.starts_with("redis-aof")), "{a:?}");
    }

    fn with_shm() -> Vec<PeerRun> {
        let mut runs = sample();
        let mut shm = run("ours-shm", true, &[(MIB, 1, 8.0, 4.0)]);
        shm.shared_memory = true;
        runs.insert(1, shm);
        runs.push(run("memcpy", false, &[(MIB, 1, 10.0, 10.0)]));
        runs
    }

    #[test]
    fn the_shared_memory_row_is_judged_against_memcpy_only() {
        let a = aims(&with_shm());
        let shm: Vec<&Aim> = a.iter().filter(|x| x.ours == "ours-shm").collect();
        // GET 8 / 10 = 0.8 >= 0.7; PUT 4 / 10 = 0.4 < 0.7; no TCP aims for the shm row.
        assert_eq!(shm.len(), 2, "{shm:?}");
        assert!(shm.iter().all(|x| x.peer == "memcpy"));
        assert_eq!(shm[0].op, Op::Get);
        assert_eq!(shm[0].met, Some(true));
        assert_eq!(shm[1].met, Some(false));
        assert!((shm[1].ratio.unwrap_or(0.0) - 0.4).abs() < 1e-9);
        // The TCP row is still judged against iperf3, Redis and Mooncake, not memcpy.
        assert!(!a.iter().any(|x| x.ours == "ours-tcp" && x.peer == "memcpy"));
        let t = aims_table(&a);
        assert!(t.contains("| ours-shm / memcpy | GET | >= 0.7x | 0.80x | yes |"), "{t}");
        assert!(t.contains("| ours-shm / memcpy | PUT | >= 0.7x | 0.40x | **no** |"), "{t}");
    }

    #[test]
    fn the_shared_memory_row_has_its_memcpy_and_iperf3_ratios() {
        let t = table(&with_shm(), &[MIB], &[1], Table::Memory);
        // ours-shm GET 8.0: /iperf3 2.0 = 4.00, /raw-socket 4.0 = 2.00, /redis 1.0 = 8.00,
        // mooncake skipped, /memcpy 0.80.
        assert!(
            t.contains(
                "| 1M | 1 | GET | ours-shm | 8.00 (1.50) | 2.00 (1.50) | 4.00 (1.50) | 1.00 (1.50) \
                 | - | 10.00 (1.50) | 4.00 | 2.00 | 8.00 | - | 0.80 |"
            ),
            "{t}"
        );
        assert!(t.contains("| 1M | 1 | PUT | ours-tcp | 2.00 (1.50) |"), "{t}");
    }

    #[test]
    fn the_table_has_cells_and_ratios() {
        let t = table(&sample(), &[64 << 10, MIB], &[1], Table::Memory);
        // Columns: ours, iperf3, raw-socket, redis, mooncake (skipped; memcpy, not in the run,
        // has none), then the ratios. 64K PUT: ours 0.25 against iperf3 2.0 (0.125), the raw
        // socket 1.0 (0.25) and redis 0.5 (0.5).
        assert!(
            t.starts_with(
                "| size | clients | op | ours | ours GB/s (p99 ms) | iperf3 GB/s (p99 ms) | \
                 raw-socket GB/s (p99 ms) | redis GB/s (p99 ms) | mooncake GB/s (p99 ms) | \
                 ours/iperf3 | ours/raw-socket | ours/redis | ours/mooncake |\n"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "| 64K | 1 | PUT | ours-tcp | 0.25 (1.50) | 2.00 (1.50) | 1.00 (1.50) | 0.50 (1.50) \
                 | - | 0.12 | 0.25 | 0.50 | - |"
            ),
            "{t}"
        );
        assert!(t.contains("| 1M | 1 | GET | ours-tcp | 2.00 (1.50) |"), "{t}");
    }

    #[test]
    fn the_svg_is_well_formed_and_holds_every_bar() {
        let runs = sample();
        let s = svg(&runs, &[64 << 10, MIB], &[1], "ours & peers <test>");
        assert!(s.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(s.trim_end().ends_with("</svg>"));
        assert!(s.contains("ours &amp; peers &lt;test&gt;"));
        // 4 peers that ran x 2 sizes x 2 operations x 1 client count.
        assert_eq!(s.matches("class=\"bar\"").count(), 16);
        assert!(!s.contains("on disk"), "no file row ran: no on-disk panels");
        assert!(s.contains(
            "data-peer=\"redis\" data-op=\"PUT\" data-size=\"1048576\" data-clients=\"1\" \
             data-gbps=\"2.000\""
        ));
        assert!(!s.contains("data-peer=\"mooncake\""));
        // Tags balance: every opened element is closed or self-closing.
        let opens =
            s.matches("<rect").count() + s.matches("<text").count() + s.matches("<line").count();
        let closes =
            s.matches("/>").count() + s.matches("</rect>").count() + s.matches("</text>").count();
        assert_eq!(opens, closes, "{s}");
        assert_eq!(s.matches("<title>").count(), s.matches("</title>").count());
    }

    /// The in-memory sample plus the on-disk rows at 1 MiB, one client.
    fn with_files() -> Vec<PeerRun> {
        let mut runs = with_shm();
        runs.push(run("ours-file-none", true, &[(MIB, 1, 3.0, 1.5)]));
        runs.push(run("ours-file-none-cold", true, &[(MIB, 1, 0.5, 1.5)]));
        runs.push(run("ours-file-durable", true, &[(MIB, 1, 3.0, 0.2)]));
        runs.push(run("redis-aof-always", false, &[(MIB, 1, 1.0, 0.1)]));
        runs.push(run("redis-aof-everysec", false, &[(MIB, 1, 1.0, 1.0)]));
        runs
    }

    #[test]
    fn the_file_rows_have_a_table_of_their_own_and_fair_pairs() {
        let runs = with_files();
        let all = tables(&runs, &[MIB], &[1]);
        let (memory, file) = all.split_once("## on disk").expect("two tables");
        assert!(memory.starts_with("## in memory"), "{all}");
        assert!(!memory.contains("ours-file"), "{memory}");
        assert!(!file.contains("| ours-tcp |"), "{file}");
        // ours-file-durable PUT 0.2: / always 0.1 = 2.00, / everysec 1.0 = 0.20.
        assert!(
            file.contains(
                "| 1M | 1 | PUT | ours-file-durable | 0.20 (1.50) | 0.10 (1.50) | 1.00 (1.50) | \
                 2.00 | 0.20 |"
            ),
            "{file}"
        );
        let a = aims(&runs);
        let pair = |ours: &str, op| {
            a.iter().find(|x| x.ours == ours && x.op == op).map(|x| (x.peer, x.ratio, x.met))
        };
        assert_eq!(
            pair("ours-file-durable", Op::Put),
            Some(("redis-aof-always", Some(2.0), Some(true)))
        );
        assert_eq!(
            pair("ours-file-none", Op::Put),
            Some(("redis-aof-everysec", Some(1.5), Some(true)))
        );
        assert_eq!(pair("ours-file-none", Op::Get).map(|p| p.1), Some(Some(3.0)));
        assert_eq!(pair("ours-file-none-cold", Op::Get), None, "a cold row has no aim");
        // The file rows are not judged against the in-memory peers.
        assert!(!a.iter().any(|x| x.ours.starts_with("ours-file") && x.peer == "iperf3"));
        let r = ratios(&runs, &[MIB], &[1]);
        let cell = r
            .iter()
            .find(|c| c.ours == "ours-tcp" && c.peer == "raw-socket" && c.op == Op::Put)
            .expect("cell");
        assert_eq!(cell.ratio, Some(0.5));
        let cold = r
            .iter()
            .find(|c| c.ours == "ours-file-none-cold" && c.peer == "redis-aof-everysec")
            .expect("cell");
        assert_eq!((cold.op, cold.ratio), (Op::Get, Some(0.5)));
        assert!(!r.iter().any(|c| c.ours.starts_with("ours-file") && c.peer == "redis"));
    }

    #[test]
    fn the_svg_has_on_disk_panels_a_wrapped_legend_and_a_colour_per_peer() {
        let runs = with_files();
        let s = svg(&runs, &[MIB], &[1, 8], "t");
        // 11 rows ran (mooncake was skipped): 11 legend entries, each its own colour.
        assert_eq!(s.matches("class=\"legend\"").count(), 11);
        let fills: std::collections::HashSet<&str> = s
            .split("class=\"legend\"")
            .skip(1)
            .filter_map(|t| t.split("fill=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(fills.len(), 11, "{fills:?}");
        // Panels: (in memory, on disk) x (1, 8 clients) x (GET, PUT).
        assert_eq!(s.matches("on disk GET").count(), 2);
        assert_eq!(s.matches("in memory PUT").count(), 2);
        // Bars at 1 MiB, one client: 6 in-memory rows and 5 on-disk rows, 2 operations each.
        assert_eq!(s.matches("class=\"bar\"").count(), 22);
        // The legend's entries stay inside the chart's width.
        let width: f64 = s
            .split("width=\"")
            .nth(1)
            .and_then(|t| t.split('"').next())
            .and_then(|w| w.parse().ok())
            .expect("width");
        for t in s.split("class=\"legend\" x=\"").skip(1) {
            let x: f64 = t.split('"').next().and_then(|x| x.parse().ok()).expect("x");
            assert!(x + LEGEND_W <= width, "{x}");
        }
    }

    #[test]
    fn axis_ticks_keep_their_quarter_steps() {
        assert_eq!(tick(1.25), "1.25");
        assert_eq!(tick(0.625), "0.625");
        assert_eq!(tick(2.5), "2.5");
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(20.0), "20");
    }

    #[test]
    fn a_table_without_our_rows_is_left_out() {
        let runs: Vec<PeerRun> =
            with_files().into_iter().filter(|r| !r.name.starts_with("ours-file")).collect();
        let t = tables(&runs, &[MIB], &[1]);
        assert!(t.starts_with("## in memory") && !t.contains("## on disk"), "{t}");
        let only_peers: Vec<PeerRun> = runs.into_iter().filter(|r| !r.ours).collect();
        let t = tables(&only_peers, &[MIB], &[1]);
        assert!(t.starts_with("## in memory\n\n| size |") && !t.contains("| 1M |"), "{t}");
    }

    #[test]
    fn axis_tops_are_round() {
        assert_eq!(nice_ceiling(2.3), 2.5);
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
    }
}
