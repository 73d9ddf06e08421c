//! `bench --plot FILE.png`: one PNG with two panels drawn from the runs' JSON figures:
//! (a) MB/s of every run as bars, (b) append-to-ack p50 and p99 (log scale) against the
//! offered load of the `--rate` runs, one colour per order. Works the same on figures
//! just measured and on saved `--json` outputs (`--from-json`).

use super::canvas::{Canvas, Rgb, BLACK, WHITE};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Height of the image, and width of panel (b) (and the least width of panel (a)).
const HEIGHT: usize = 760;
const PANEL_WIDTH: usize = 800;
const GRID: Rgb = [225, 225, 225];
const MINOR_GRID: Rgb = [242, 242, 242];
const GREY: Rgb = [90, 90, 90];

/// A short name for a run: order, acknowledgement level and mode, then whatever else
/// sets it apart (replication, publishers, offered load), e.g. "o2 ack1 publish @200".
pub fn label(run: &Value) -> String {
    label_parts(run)
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The parts of a label, always in the same slots (order, ack, mode, rf, publishers,
/// rate), so the parts every run shares can be told apart from those that differ.
fn label_parts(run: &Value) -> [Option<String>; 6] {
    [
        Some(format!("o{}", run["order"])),
        Some(format!("ack{}", run["ack"])),
        Some(run["mode"].as_str().unwrap_or("?").to_string()),
        run["rf"]
            .as_u64()
            .filter(|&rf| rf >= 2)
            .map(|rf| format!("rf{rf}")),
        run["publishers"]
            .as_u64()
            .filter(|&p| p > 1)
            .map(|p| format!("p{p}")),
        run["rate_mb_per_s"]
            .as_f64()
            .map(|rate| format!("@{}", trim_number(rate))),
    ]
}

/// Bar labels without the parts every run shares (a line per part), and those shared
/// parts, said once for the whole panel.
fn distinct_labels(runs: &[Value]) -> (Vec<Vec<String>>, Vec<String>) {
    let parts: Vec<_> = runs.iter().map(label_parts).collect();
    let shared: Vec<bool> = (0..6)
        .map(|slot| runs.len() > 1 && parts.iter().all(|p| p[slot] == parts[0][slot]))
        .collect();
    // Where only some runs had a rate, the others ran as fast as possible: say so.
    let rate_slot = 5;
    let labels = parts
        .iter()
        .map(|p| {
            p.iter()
                .enumerate()
                .filter(|&(slot, _)| !shared[slot])
                .filter_map(|(slot, part)| match part {
                    None if slot == rate_slot && parts.iter().any(|q| q[slot].is_some()) => {
                        Some("max".to_string())
                    }
                    other => other.clone(),
                })
                .collect()
        })
        .collect();
    let common = parts
        .first()
        .map(|p| {
            p.iter()
                .zip(&shared)
                .filter(|(_, &s)| s)
                .filter_map(|(part, _)| part.clone())
                .collect()
        })
        .unwrap_or_default();
    (labels, common)
}

/// Renders the runs and writes the PNG to `path`.
pub fn write_png(path: &Path, runs: &[Value]) -> Result<(), String> {
    let png = render(runs).to_png()?;
    std::fs::write(path, png).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Both panels on one canvas; panel (a) widens with the number of runs, so each bar's
/// label fits under it at the larger text size (up to a limit).
pub fn render(runs: &[Value]) -> Canvas {
    let bars_width = throughput_panel_width(runs);
    let mut canvas = Canvas::new(bars_width + PANEL_WIDTH, HEIGHT, WHITE);
    let h = HEIGHT as i64;
    throughput_panel(&mut canvas, (0, 0, bars_width as i64, h), runs);
    latency_panel(
        &mut canvas,
        (bars_width as i64, 0, PANEL_WIDTH as i64, h),
        runs,
    );
    canvas
}

/// Room for the axis and margins of panel (a), and its widest allowed size.
const BARS_MARGIN: usize = 110;
const MAX_BARS_WIDTH: usize = 2400;

fn throughput_panel_width(runs: &[Value]) -> usize {
    let (labels, _) = distinct_labels(runs);
    let widest = labels
        .iter()
        .flatten()
        .map(|l| Canvas::text_width(l, 2) as usize)
        .max()
        .unwrap_or(0);
    let slot = (widest + 14).max(60);
    (BARS_MARGIN + runs.len() * slot).clamp(PANEL_WIDTH, MAX_BARS_WIDTH)
}

/// Colour of an order's bars and lines.
fn order_color(order: u64) -> Rgb {
    match order {
        0 => [31, 119, 180],
        1 => [148, 103, 189],
        2 => [214, 39, 40],
        5 => [44, 160, 44],
        _ => [127, 127, 127],
    }
}

/// The plotting area of a panel and its axes' value ranges.
struct Frame {
    left: i64,
    top: i64,
    right: i64,
    bottom: i64,
}

impl Frame {
    fn width(&self) -> i64 {
        self.right - self.left
    }

    fn height(&self) -> i64 {
        self.bottom - self.top
    }
}

/// Panel title, centred above the plotting area.
fn title(canvas: &mut Canvas, (x, y, w, _): (i64, i64, i64, i64), text: &str) {
    let tw = Canvas::text_width(text, 2);
    canvas.text(x + (w - tw) / 2, y + 16, text, BLACK, 2);
}

/// Left axis title, turned to read upwards, centred on the plotting area.
fn y_title(canvas: &mut Canvas, x: i64, frame: &Frame, text: &str) {
    let tw = Canvas::text_width(text, 2);
    canvas.text_up(x, frame.top + (frame.height() + tw) / 2, text, BLACK, 2);
}

/// The side of the plotting area where an axis's values are written.
#[derive(Clone, Copy)]
enum Edge {
    /// Values up the left side, at horizontal grid lines.
    Left,
    /// Values along the bottom, under vertical grid lines.
    Bottom,
}

/// A grid line across the plotting area at `at` (pixels along the axis of `edge`), and
/// its value `text` beside the axis.
fn grid_line(canvas: &mut Canvas, frame: &Frame, edge: Edge, at: i64, text: &str) {
    let tw = Canvas::text_width(text, 2);
    match edge {
        Edge::Left => {
            canvas.line((frame.left, at), (frame.right, at), GRID, 1);
            canvas.text(frame.left - 8 - tw, at - 7, text, BLACK, 2);
        }
        Edge::Bottom => {
            canvas.line((at, frame.top), (at, frame.bottom), GRID, 1);
            canvas.text(at - tw / 2, frame.bottom + 8, text, BLACK, 2);
        }
    }
}

/// The grid of a linear axis from 0 to `top`, a labelled line every `step` (from
/// [`nice_axis`]), `to_pixel` placing a value: panel (a)'s MB/s and (b)'s offered load.
fn linear_axis(
    canvas: &mut Canvas,
    frame: &Frame,
    edge: Edge,
    (step, top): (f64, f64),
    to_pixel: impl Fn(f64) -> i64,
) {
    let mut tick = 0.0;
    while tick <= top + step / 2.0 {
        grid_line(
            canvas,
            frame,
            edge,
            to_pixel(tick),
            &format_tick(tick, step),
        );
        tick += step;
    }
}

/// The grid of panel (b)'s latency axis, from 10^`decades.0` to 10^`decades.1` us,
/// `to_y` placing a latency.
fn log_axis(canvas: &mut Canvas, frame: &Frame, decades: (i32, i32), to_y: impl Fn(f64) -> i64) {
    // Minor grid at 2x and 5x each decade, major at the decades (labelled).
    for decade in decades.0..=decades.1 {
        let base = 10f64.powi(decade);
        for minor in [2.0, 5.0] {
            if decade < decades.1 {
                let ty = to_y(base * minor);
                canvas.line((frame.left, ty), (frame.right, ty), MINOR_GRID, 1);
            }
        }
        grid_line(canvas, frame, Edge::Left, to_y(base), &format_us(base));
    }
}

fn throughput_panel(canvas: &mut Canvas, panel: (i64, i64, i64, i64), runs: &[Value]) {
    let (x, y, w, h) = panel;
    title(canvas, panel, "(a) Throughput per run");
    let (labels, common) = distinct_labels(runs);
    if !common.is_empty() {
        let note = format!("every run: {}", common.join(" "));
        let tw = Canvas::text_width(&note, 2);
        canvas.text(x + (w - tw) / 2, y + 38, &note, GREY, 2);
    }
    let lines = labels.iter().map(Vec::len).max().unwrap_or(1) as i64;
    let (label_scale, line_height) = bar_label_size(&labels, w);
    let frame = Frame {
        left: x + 90,
        top: y + 70,
        right: x + w - 20,
        bottom: y + h - 20 - lines * line_height,
    };
    let mb_s: Vec<f64> = runs
        .iter()
        .map(|r| r["mb_per_s"].as_f64().unwrap_or(0.0))
        .collect();
    let (step, top) = nice_axis(mb_s.iter().copied().fold(0.0, f64::max) * 1.1);
    let to_y = |v: f64| frame.bottom - (v / top * frame.height() as f64).round() as i64;
    linear_axis(canvas, &frame, Edge::Left, (step, top), to_y);
    y_title(canvas, x + 14, &frame, "MB/s of payload");
    if runs.is_empty() {
        centred_note(canvas, &frame, "no runs");
    }
    let slot = frame.width() as f64 / runs.len().max(1) as f64;
    let bar = (slot * 0.6).min(90.0) as i64;
    for (i, (run, value)) in runs.iter().zip(&mb_s).enumerate() {
        let centre = frame.left + (slot * (i as f64 + 0.5)).round() as i64;
        let bar_top = to_y(*value);
        let color = order_color(run["order"].as_u64().unwrap_or(u64::MAX));
        canvas.fill_rect(
            centre - bar / 2,
            bar_top,
            bar,
            frame.bottom - bar_top,
            color,
        );
        let text = format!("{value:.0}");
        let value_scale = if Canvas::text_width(&text, 2) <= slot as i64 - 6 {
            2
        } else {
            1
        };
        let tw = Canvas::text_width(&text, value_scale);
        let th = Canvas::text_height(value_scale);
        canvas.text(centre - tw / 2, bar_top - th - 4, &text, BLACK, value_scale);
        for (l, line) in labels[i].iter().enumerate() {
            let tw = Canvas::text_width(line, label_scale);
            canvas.text(
                centre - tw / 2,
                frame.bottom + 8 + l as i64 * line_height,
                line,
                BLACK,
                label_scale,
            );
        }
    }
    axes(canvas, &frame);
}

/// The scale and line height of panel (a)'s bar labels. The plotting area makes room
/// for them, so the slot under each bar is guessed from the panel's width `w`.
fn bar_label_size(labels: &[Vec<String>], w: i64) -> (usize, i64) {
    let slot_guess = (w - BARS_MARGIN as i64) / labels.len().max(1) as i64;
    let widest = labels
        .iter()
        .flatten()
        .map(|l| Canvas::text_width(l, 2))
        .max()
        .unwrap_or(0);
    // Labels at the larger size when every line fits under its bar.
    let label_scale = if widest + 8 <= slot_guess { 2 } else { 1 };
    let line_height = Canvas::text_height(label_scale) + 2 * label_scale as i64 + 1;
    (label_scale, line_height)
}

/// p50 and p99 of append-to-ack at each offered load, per order.
type Series = BTreeMap<u64, Vec<(f64, f64, f64)>>;

fn latency_series(runs: &[Value]) -> Series {
    let mut series = Series::new();
    for run in runs {
        let (Some(rate), Some(order)) = (run["rate_mb_per_s"].as_f64(), run["order"].as_u64())
        else {
            continue;
        };
        let latency = &run["append_to_ack_us"];
        let (Some(p50), Some(p99)) = (latency["p50"].as_f64(), latency["p99"].as_f64()) else {
            continue;
        };
        series
            .entry(order)
            .or_default()
            .push((rate, p50.max(1.0), p99.max(1.0)));
    }
    for points in series.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    series
}

fn latency_panel(canvas: &mut Canvas, panel: (i64, i64, i64, i64), runs: &[Value]) {
    let (x, y, w, h) = panel;
    title(canvas, panel, "(b) Append-to-ack latency vs offered load");
    let frame = Frame {
        left: x + 110,
        top: y + 70,
        right: x + w - 30,
        bottom: y + h - 70,
    };
    let series = latency_series(runs);
    let points = series.values().flatten();
    let max_rate = points.clone().map(|p| p.0).fold(0.0, f64::max);
    let lowest = points.clone().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let highest = points.map(|p| p.2).fold(0.0, f64::max);
    let (x_step, x_top) = nice_axis(max_rate * 1.05);
    let decades = if series.is_empty() {
        (2, 5)
    } else {
        let low = lowest.log10().floor() as i32;
        (low, (highest.log10().ceil() as i32).max(low + 1))
    };
    let to_x = |v: f64| frame.left + (v / x_top * frame.width() as f64).round() as i64;
    let to_y = |us: f64| {
        let span = (decades.1 - decades.0) as f64;
        let at = (us.log10() - decades.0 as f64) / span;
        frame.bottom - (at * frame.height() as f64).round() as i64
    };
    log_axis(canvas, &frame, decades, to_y);
    linear_axis(canvas, &frame, Edge::Bottom, (x_step, x_top), to_x);
    let x_label = "offered load, MB/s (--rate)";
    let tw = Canvas::text_width(x_label, 2);
    canvas.text(
        frame.left + (frame.width() - tw) / 2,
        frame.bottom + 36,
        x_label,
        BLACK,
        2,
    );
    y_title(canvas, x + 14, &frame, "append to ack (log scale)");
    if series.is_empty() {
        centred_note(canvas, &frame, "no --rate runs to plot");
    }
    for (order, points) in &series {
        let color = order_color(*order);
        for (pick, dash) in [(1usize, None), (2, Some((8, 6)))] {
            let at: Vec<(i64, i64)> = points
                .iter()
                .map(|p| (to_x(p.0), to_y(if pick == 1 { p.1 } else { p.2 })))
                .collect();
            for pair in at.windows(2) {
                canvas.dashed_line(pair[0], pair[1], color, 2, dash);
            }
            for &(px, py) in &at {
                marker(canvas, px, py, color, dash.is_none());
            }
        }
    }
    legend(canvas, &frame, &series);
    axes(canvas, &frame);
}

/// A square marker: filled for p50, hollow for p99.
fn marker(canvas: &mut Canvas, x: i64, y: i64, color: Rgb, filled: bool) {
    if filled {
        canvas.fill_rect(x - 4, y - 4, 9, 9, color);
    } else {
        canvas.fill_rect(x - 4, y - 4, 9, 9, WHITE);
        canvas.stroke_rect(x - 4, y - 4, 9, 9, color);
        canvas.stroke_rect(x - 3, y - 3, 7, 7, color);
    }
}

/// Which colour and stroke is which order and percentile, in the top-left corner.
fn legend(canvas: &mut Canvas, frame: &Frame, series: &Series) {
    if series.is_empty() {
        return;
    }
    let entries: Vec<(String, Rgb, bool)> = series
        .keys()
        .flat_map(|&order| {
            let color = order_color(order);
            [
                (format!("order {order} p50"), color, true),
                (format!("order {order} p99"), color, false),
            ]
        })
        .collect();
    let row = 22;
    let text_w = entries
        .iter()
        .map(|e| Canvas::text_width(&e.0, 2))
        .max()
        .unwrap_or(0);
    let (bx, by) = (frame.left + 12, frame.top + 12);
    let (bw, bh) = (60 + text_w + 12, entries.len() as i64 * row + 12);
    canvas.fill_rect(bx, by, bw, bh, WHITE);
    canvas.stroke_rect(bx, by, bw, bh, GREY);
    for (i, (text, color, solid)) in entries.iter().enumerate() {
        let cy = by + 6 + i as i64 * row + row / 2;
        let dash = if *solid { None } else { Some((8, 6)) };
        canvas.dashed_line((bx + 10, cy), (bx + 50, cy), *color, 2, dash);
        marker(canvas, bx + 30, cy, *color, *solid);
        canvas.text(bx + 60, cy - 7, text, BLACK, 2);
    }
}

fn centred_note(canvas: &mut Canvas, frame: &Frame, text: &str) {
    let tw = Canvas::text_width(text, 2);
    canvas.text(
        frame.left + (frame.width() - tw) / 2,
        frame.top + frame.height() / 2,
        text,
        GREY,
        2,
    );
}

/// The two axis lines, drawn last so bars and grid do not cover them.
fn axes(canvas: &mut Canvas, frame: &Frame) {
    canvas.line(
        (frame.left, frame.top),
        (frame.left, frame.bottom),
        BLACK,
        2,
    );
    canvas.line(
        (frame.left, frame.bottom),
        (frame.right, frame.bottom),
        BLACK,
        2,
    );
}

/// A tick step of 1, 2 or 5 times a power of ten giving about five ticks up to `max`,
/// and the axis end (a whole number of steps at or above `max`).
fn nice_axis(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    (step, (max / step).ceil() * step)
}

/// A tick value with as many decimals as its step needs.
fn format_tick(value: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{value:.decimals$}")
}

/// Microseconds as a tick label: "100 us", "1 ms", "10 s".
fn format_us(us: f64) -> String {
    if us >= 1e6 {
        format!("{} s", trim_number(us / 1e6))
    } else if us >= 1e3 {
        format!("{} ms", trim_number(us / 1e3))
    } else {
        format!("{} us", trim_number(us))
    }
}

/// A number without a needless ".0".
fn trim_number(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(order: u8, rate: Option<f64>, mb_s: f64, p50: u64, p99: u64) -> Value {
        json!({
            "mode": "publish", "order": order, "ack": 1, "rf": 1, "publishers": 1,
            "rate_mb_per_s": rate, "mb_per_s": mb_s,
            "append_to_ack_us": { "p50": p50, "p99": p99 },
        })
    }

    #[test]
    fn labels_name_order_ack_mode_and_rate() {
        assert_eq!(label(&run(2, None, 1.0, 1, 1)), "o2 ack1 publish");
        assert_eq!(
            label(&run(5, Some(200.0), 1.0, 1, 1)),
            "o5 ack1 publish @200"
        );
        assert_eq!(
            label(&run(0, Some(12.5), 1.0, 1, 1)),
            "o0 ack1 publish @12.5"
        );
    }

    #[test]
    fn bar_labels_keep_what_differs_and_the_panel_says_what_is_shared() {
        let runs = [
            run(0, Some(100.0), 1.0, 1, 1),
            run(2, Some(100.0), 1.0, 1, 1),
        ];
        let (labels, common) = distinct_labels(&runs);
        assert_eq!(labels, [vec!["o0".to_string()], vec!["o2".to_string()]]);
        assert_eq!(common, ["ack1", "publish", "@100"]);
        let mixed = [run(2, Some(100.0), 1.0, 1, 1), run(2, None, 1.0, 1, 1)];
        let (labels, _) = distinct_labels(&mixed);
        assert_eq!(labels, [vec!["@100".to_string()], vec!["max".to_string()]]);
        let (labels, common) = distinct_labels(&runs[..1]);
        assert_eq!(labels[0], ["o0", "ack1", "publish", "@100"]);
        assert!(common.is_empty(), "a single run keeps its whole label");
    }

    #[test]
    fn nice_axes_end_on_a_whole_step_above_the_maximum() {
        assert_eq!(nice_axis(1776.0), (500.0, 2000.0));
        assert_eq!(nice_axis(0.0), (0.2, 1.0));
        assert_eq!(nice_axis(830.0), (200.0, 1000.0));
        assert_eq!(format_us(1000.0), "1 ms");
        assert_eq!(format_us(100.0), "100 us");
    }

    /// Renders a sweep, decodes the PNG with the `png` crate, and finds the image's size,
    /// a bar of each order's colour in panel (a) and both orders' lines in panel (b).
    #[test]
    fn a_rendered_sweep_decodes_with_bars_and_lines_in_each_order_colour() {
        let mut runs = vec![
            run(0, None, 2000.0, 5000, 20000),
            run(2, None, 1800.0, 6000, 24000),
        ];
        for (rate, p50, p99) in [(100.0, 300, 900), (400.0, 450, 2500), (800.0, 700, 9000)] {
            runs.push(run(0, Some(rate), rate, p50, p99));
            runs.push(run(2, Some(rate), rate, p50 * 2, p99 * 3));
        }
        let png = render(&runs).to_png().unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(png));
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut pixels).unwrap();
        let bars_width = throughput_panel_width(&runs);
        let width = bars_width + PANEL_WIDTH;
        assert_eq!((info.width, info.height), (width as u32, HEIGHT as u32));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let count = |color: Rgb, panel: usize| {
            let columns = [0..bars_width, bars_width..width][panel].clone();
            let mut n = 0;
            for y in 0..HEIGHT {
                for x in columns.clone() {
                    let at = (y * width + x) * 3;
                    if pixels[at..at + 3] == color {
                        n += 1;
                    }
                }
            }
            n
        };
        for order in [0, 2] {
            assert!(count(order_color(order), 0) > 1000, "order {order} bars");
            assert!(count(order_color(order), 1) > 200, "order {order} lines");
        }
        assert!(count(BLACK, 0) > 1000, "axes and text in panel (a)");
        assert!(count(BLACK, 1) > 1000, "axes and text in panel (b)");
    }
}
