//! A self-contained SVG chart of a replay: context tokens per step in the three lanes
//! (without compactd, OpenCode's prune only, prune plus strategies), the bands between
//! them shaded by the layer that saved them, the overflow threshold and the compaction
//! points. No script, no external resource: it opens in any browser or Markdown viewer.

use std::fmt::Write;

use super::replay::Report;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 60.0;

/// The chart as an SVG document.
pub fn svg(report: &Report, title: &str) -> String {
    let rows = &report.rows;
    let steps = rows.len().max(1);
    let top = rows
        .iter()
        .map(|r| r.baseline.max(r.prune_only).max(r.pruned))
        .chain([report.threshold])
        .max()
        .unwrap_or(1)
        .max(1);
    let y_max = nice_ceiling(top as f64 * 1.05);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |i: usize| {
        if steps == 1 {
            LEFT + plot_w / 2.0
        } else {
            LEFT + plot_w * i as f64 / (steps - 1) as f64
        }
    };
    let y = |v: f64| TOP + plot_h * (1.0 - v / y_max);

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    // Grid and axis labels.
    for k in 0..=5 {
        let v = y_max * k as f64 / 5.0;
        let yy = y(v);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            yy + 4.0,
            thousands(v as u64)
        );
    }
    let ticks = steps.min(10);
    for k in 0..ticks {
        let i = if ticks == 1 {
            0
        } else {
            k * (steps - 1) / (ticks - 1)
        };
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            x(i),
            HEIGHT - BOTTOM + 16.0,
            i + 1
        );
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">step (finished assistant message)</text>"##,
        LEFT + plot_w / 2.0,
        HEIGHT - BOTTOM + 34.0
    );
    let _ = writeln!(
        out,
        r##"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle" fill="#555">context tokens</text>"##,
        TOP + plot_h / 2.0
    );

    // Bands: what prune saved (baseline → prune-only), what the strategies saved
    // (prune-only → compactd).
    let lane = |f: &dyn Fn(&super::replay::Row) -> u64| -> Vec<(f64, f64)> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| (x(i), y(f(r) as f64)))
            .collect()
    };
    let baseline = lane(&|r| r.baseline);
    let prune_only = lane(&|r| r.prune_only);
    let compactd = lane(&|r| r.pruned);
    band(&mut out, &baseline, &prune_only, "#cfe0f7");
    band(&mut out, &prune_only, &compactd, "#cdebd3");

    // Threshold.
    let ty = y(report.threshold as f64);
    let _ = writeln!(
        out,
        r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#d33" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#d33">overflow threshold {}</text>"##,
        WIDTH - RIGHT,
        WIDTH - RIGHT - 4.0,
        ty - 5.0,
        thousands(report.threshold)
    );

    polyline(&mut out, &baseline, "#888", "4 3");
    polyline(&mut out, &prune_only, "#2b6cb0", "");
    polyline(&mut out, &compactd, "#2f855a", "");

    // Compaction points on the compactd lane.
    for (i, r) in rows.iter().enumerate() {
        if let Some(c) = &r.compaction {
            let color = if c.error.is_none() { "#6b46c1" } else { "#d33" };
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="5" fill="{color}"><title>step {}: compaction {} -> {}</title></circle>"#,
                x(i),
                y(r.pruned as f64),
                i + 1,
                c.tokens_before,
                c.tokens_after
            );
        }
    }

    // Legend.
    let legend = [
        ("#888", "no compactd"),
        ("#2b6cb0", "OpenCode prune only"),
        ("#2f855a", "prune + strategies"),
        ("#6b46c1", "compaction"),
    ];
    let mut lx = LEFT;
    let ly = HEIGHT - 10.0;
    for (color, label) in legend {
        let _ = writeln!(
            out,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{color}"/><text x="{:.1}" y="{ly:.1}">{label}</text>"#,
            ly - 6.0,
            lx + 18.0
        );
        lx += 36.0 + 7.0 * label.len() as f64;
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="36" text-anchor="end" fill="#555">bands: saved by prune (blue), by strategies (green)</text>"##,
        WIDTH - RIGHT
    );
    out.push_str("</svg>\n");
    out
}

/// The chart wrapped in a minimal HTML page.
pub fn html(report: &Report, title: &str) -> String {
    format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{}</title></head><body>\n{}</body></html>\n",
        escape(title),
        svg(report, title)
    )
}

fn band(out: &mut String, upper: &[(f64, f64)], lower: &[(f64, f64)], fill: &str) {
    if upper.len() < 2 {
        return;
    }
    let mut d = String::new();
    for (i, (px, py)) in upper.iter().enumerate() {
        let _ = write!(d, "{}{px:.1},{py:.1} ", if i == 0 { "M" } else { "L" });
    }
    for (px, py) in lower.iter().rev() {
        let _ = write!(d, "L{px:.1},{py:.1} ");
    }
    let _ = writeln!(out, r#"<path d="{}Z" fill="{fill}" stroke="none"/>"#, d);
}

fn polyline(out: &mut String, points: &[(f64, f64)], color: &str, dash: &str) {
    let pts: Vec<String> = points
        .iter()
        .map(|(px, py)| format!("{px:.1},{py:.1}"))
        .collect();
    let dash = if dash.is_empty() {
        String::new()
    } else {
        format!(r#" stroke-dasharray="{dash}""#)
    };
    let _ = writeln!(
        out,
        r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
        pts.join(" ")
    );
}

/// A round axis maximum (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten), at
/// least `v`.
fn nice_ceiling(v: f64) -> f64 {
    let v = v.max(1.0);
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * magnitude)
}

fn thousands(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_maxima_are_round() {
        assert_eq!(nice_ceiling(93_000.0), 100_000.0);
        assert_eq!(nice_ceiling(121_000.0), 150_000.0);
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(escape("<a&b>"), "&lt;a&amp;b&gt;");
    }
}
