//! The trace bench's table, JSON rows and chart.

use std::fmt::Write as _;

use serde_json::json;

use super::offline::Outcome;
use super::replay::Replay;
use super::row::Row;
use crate::service::report::{
    baseline, colour, escape, gridlines, legend_entry, nice_ceiling, svg_open,
};
use crate::stats::cell;

/// One line per row: trace, capacity (and its blocks), policy, hit ratio, Belady, LRU-offline,
/// ratio to the best of the reference policies, GET GB/s, requests/s and the replay's seconds.
pub(super) fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let trace_w = rows.iter().map(|r| r.trace.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        s,
        "{:<trace_w$}  {:>16}  {:<8}  {:>9}  {:>7}  {:>11}  {:>7}  {:>9}  {:>9}  {:>7}",
        "trace",
        "capacity",
        "policy",
        "hit ratio",
        "Belady",
        "LRU-offline",
        "vs best",
        "GET GB/s",
        "req/s",
        "seconds"
    );
    for r in rows {
        let capacity = match r.capacity_blocks {
            Some(b) => format!("{} ({b})", r.capacity),
            None => r.capacity.clone(),
        };
        let rep = r.replay.as_ref();
        let _ = writeln!(
            s,
            "{:<trace_w$}  {:>16}  {:<8}  {:>9}  {:>7}  {:>11}  {:>7}  {:>9}  {:>9}  {:>7}",
            r.trace,
            capacity,
            r.policy.as_deref().unwrap_or("(offline)"),
            cell(rep.map(Replay::ratio), 4),
            cell(r.belady.map(Outcome::ratio), 4),
            cell(r.lru_offline.map(Outcome::ratio), 4),
            cell(r.vs_best, 3),
            cell(rep.map(Replay::get_gbps), 2),
            cell(rep.map(Replay::requests_per_second), 0),
            cell(rep.map(|r| r.seconds), 1),
        );
    }
    s
}

pub(super) fn row_json(r: &Row) -> serde_json::Value {
    let outcome = |o: Option<Outcome>| {
        o.map(|o| json!({ "hits": o.hits, "refs": o.refs, "hit_ratio": o.ratio() }))
    };
    json!({
        "trace": r.trace,
        "capacity": r.capacity,
        "capacity_blocks": r.capacity_blocks,
        "policy": r.policy,
        "hit_ratio": r.replay.as_ref().map(Replay::ratio),
        "belady": outcome(r.belady),
        "lru_offline": outcome(r.lru_offline),
        "vs_best": r.vs_best,
        "get_gbps": r.replay.as_ref().map(Replay::get_gbps),
        "requests_per_second": r.replay.as_ref().map(Replay::requests_per_second),
        "replay": r.replay,
        "tiers": r.tiers,
    })
}

const PANEL_W: f64 = 760.0;
const PANEL_H: f64 = 280.0;
const MARGIN: f64 = 55.0;
const LEGEND_W: f64 = 110.0;
const LEGEND_H: f64 = 18.0;
/// Legend entries on one line: as many as fit the panel's width.
const LEGEND_PER_LINE: usize = 5;

/// Hit ratio against capacity: one panel per trace, the `capacities` (labels, in order) evenly
/// along x, one line per policy replayed plus `belady` and `lru-offline`. Each point is a
/// `<circle class="point">` with `data-trace`, `data-series`, `data-capacity` and `data-ratio`
/// and a `<title>` tooltip; a series keeps its colour in every panel.
pub(super) fn svg(rows: &[Row], capacities: &[String], title: &str) -> String {
    let mut traces: Vec<&str> = Vec::new();
    let mut series: Vec<String> = Vec::new();
    for r in rows.iter().filter(|r| capacities.contains(&r.capacity)) {
        if !traces.contains(&r.trace.as_str()) {
            traces.push(&r.trace);
        }
        if let (Some(p), Some(_)) = (&r.policy, &r.replay)
            && !series.contains(p)
        {
            series.push(p.clone());
        }
    }
    series.push("belady".into());
    series.push("lru-offline".into());
    // The ratio of `name` for `trace` at capacity `cap`.
    let value = |trace: &str, name: &str, cap: &str| -> Option<f64> {
        let at = rows.iter().filter(|r| r.trace == trace && r.capacity == cap);
        match name {
            "belady" => at.filter_map(|r| r.belady).map(Outcome::ratio).next(),
            "lru-offline" => at.filter_map(|r| r.lru_offline).map(Outcome::ratio).next(),
            _ => at
                .filter(|r| r.policy.as_deref() == Some(name))
                .filter_map(|r| r.replay.as_ref().map(Replay::ratio))
                .next(),
        }
    };
    let width = MARGIN + PANEL_W + MARGIN;
    let per_line = LEGEND_PER_LINE;
    let legend_h = series.len().div_ceil(per_line) as f64 * LEGEND_H + 12.0;
    let height = 40.0 + legend_h + traces.len().max(1) as f64 * (PANEL_H + 2.0 * MARGIN);
    let mut s = String::new();
    svg_open(&mut s, width, height, title);
    for (i, name) in series.iter().enumerate() {
        let x = MARGIN + (i % per_line) as f64 * LEGEND_W;
        let y = 36.0 + (i / per_line) as f64 * LEGEND_H;
        legend_entry(&mut s, x, y, colour(i), name);
    }
    for (row, trace) in traces.iter().enumerate() {
        let x0 = MARGIN;
        let y0 = 40.0 + legend_h + row as f64 * (PANEL_H + 2.0 * MARGIN) + MARGIN;
        let max = series
            .iter()
            .flat_map(|n| capacities.iter().filter_map(move |c| value(trace, n, c)))
            .fold(0.0_f64, f64::max);
        let top = nice_ceiling(max);
        let _ = writeln!(
            s,
            "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\" font-size=\"13\">{} — hit \
             ratio against capacity (share of distinct blocks)</text>",
            x0 + PANEL_W / 2.0,
            y0 - 10.0,
            escape(trace)
        );
        gridlines(&mut s, (x0, y0), (PANEL_W, PANEL_H), top);
        let step = PANEL_W / capacities.len().max(1) as f64;
        let x_of = |i: usize| x0 + step * (i as f64 + 0.5);
        for (i, c) in capacities.iter().enumerate() {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                x_of(i),
                y0 + PANEL_H + 16.0,
                escape(c)
            );
        }
        for (k, name) in series.iter().enumerate() {
            let points: Vec<(usize, f64)> = capacities
                .iter()
                .enumerate()
                .filter_map(|(i, c)| value(trace, name, c).map(|v| (i, v)))
                .collect();
            let y_of = |v: f64| y0 + PANEL_H - if top > 0.0 { PANEL_H * v / top } else { 0.0 };
            let line: Vec<String> =
                points.iter().map(|&(i, v)| format!("{:.1},{:.1}", x_of(i), y_of(v))).collect();
            let dash = if k + 2 >= series.len() { " stroke-dasharray=\"5,3\"" } else { "" };
            let _ = writeln!(
                s,
                "<polyline class=\"series\" data-series=\"{}\" points=\"{}\" fill=\"none\" \
                 stroke=\"{}\" stroke-width=\"2\"{dash}/>",
                escape(name),
                line.join(" "),
                colour(k)
            );
            for &(i, v) in &points {
                let _ = writeln!(
                    s,
                    "<circle class=\"point\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{}\" \
                     data-trace=\"{}\" data-series=\"{}\" data-capacity=\"{}\" \
                     data-ratio=\"{v:.4}\"><title>{} {} at {}: {v:.4}</title></circle>",
                    x_of(i),
                    y_of(v),
                    colour(k),
                    escape(trace),
                    escape(name),
                    escape(&capacities[i]),
                    escape(trace),
                    escape(name),
                    escape(&capacities[i])
                );
            }
        }
        baseline(&mut s, (x0, y0), (PANEL_W, PANEL_H));
    }
    s.push_str("</svg>\n");
    s
}
