//! A self-contained SVG chart of a replay, in two panels over the same steps: above, the
//! context tokens per step in every lane (none, opencode, masking-10, compactd), the bands
//! between none, opencode and compactd shaded by the layer that saved them, the overflow
//! threshold and the compaction points; below, on its own scale, what each request of each
//! lane cost under the replay's prompt-cache model (fresh-token units), so the price of a
//! cache rewrite shows as a spike. No script, no external resource: it opens in any
//! browser or Markdown viewer.

use std::fmt::Write;

use super::replay::{Report, Row};
use crate::config::CacheModel;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 680.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
/// The token panel: top and height.
const TOKENS_TOP: f64 = 48.0;
const TOKENS_H: f64 = 300.0;
/// The cost panel: top and height (below the token panel's step labels and its header).
const COST_TOP: f64 = 410.0;
const COST_H: f64 = 180.0;

/// One panel's vertical extent and scale.
#[derive(Clone, Copy)]
struct Panel {
    top: f64,
    height: f64,
    y_max: f64,
}

impl Panel {
    fn y(&self, v: f64) -> f64 {
        self.top + self.height * (1.0 - v / self.y_max)
    }

    fn bottom(&self) -> f64 {
        self.top + self.height
    }
}

/// Colour and dash pattern of a lane, by its name ([`super::lanes::LANES`]).
fn lane_style(name: &str) -> (&'static str, &'static str) {
    match name {
        "none" => ("#888", "4 3"),
        "opencode" => ("#2b6cb0", ""),
        "masking-10" => ("#dd6b20", "7 3"),
        "compactd" => ("#2f855a", ""),
        _ => ("#444", "2 2"),
    }
}

/// The chart as an SVG document; the cost panel prices every request under `model`.
pub fn svg(report: &Report, title: &str, model: CacheModel) -> String {
    let rows = &report.rows;
    let steps = rows.len().max(1);
    let plot_w = WIDTH - LEFT - RIGHT;
    let x = |i: usize| {
        if steps == 1 {
            LEFT + plot_w / 2.0
        } else {
            LEFT + plot_w * i as f64 / (steps - 1) as f64
        }
    };
    let top = rows
        .iter()
        .map(|r| r.baseline.max(r.prune_only).max(r.pruned).max(r.masking))
        .chain([report.threshold])
        .max()
        .unwrap_or(1)
        .max(1);
    let tokens = Panel {
        top: TOKENS_TOP,
        height: TOKENS_H,
        y_max: nice_ceiling(top as f64 * 1.05),
    };
    let costs: Vec<(&str, Vec<f64>)> = report
        .lanes
        .iter()
        .map(|l| (l.name.as_str(), l.costs(model, report.fixed_prefix)))
        .collect();
    let top_cost = costs
        .iter()
        .flat_map(|(_, c)| c.iter().copied())
        .fold(1.0f64, f64::max);
    let cost = Panel {
        top: COST_TOP,
        height: COST_H,
        y_max: nice_ceiling(top_cost * 1.05),
    };

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

    // ---- token panel ----
    grid(&mut out, tokens, "context tokens");
    step_labels(&mut out, steps, &x, tokens.bottom() + 16.0);
    // Bands: what prune saved (none → opencode), what the strategies saved
    // (opencode → compactd).
    let lane = |f: &dyn Fn(&Row) -> u64| -> Vec<(f64, f64)> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| (x(i), tokens.y(f(r) as f64)))
            .collect()
    };
    let baseline = lane(&|r| r.baseline);
    let prune_only = lane(&|r| r.prune_only);
    let masking = lane(&|r| r.masking);
    let compactd = lane(&|r| r.pruned);
    band(&mut out, &baseline, &prune_only, "#cfe0f7");
    band(&mut out, &prune_only, &compactd, "#cdebd3");

    // Threshold.
    let ty = tokens.y(report.threshold as f64);
    let _ = writeln!(
        out,
        r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#d33" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#d33">overflow threshold {}</text>"##,
        WIDTH - RIGHT,
        WIDTH - RIGHT - 4.0,
        ty - 5.0,
        thousands(report.threshold)
    );

    for (name, points) in [
        ("none", &baseline),
        ("opencode", &prune_only),
        ("masking-10", &masking),
        ("compactd", &compactd),
    ] {
        let (color, dash) = lane_style(name);
        polyline(&mut out, points, color, dash, name);
    }

    // Compaction points on the compactd lane.
    for (i, r) in rows.iter().enumerate() {
        if let Some(c) = &r.compaction {
            let color = if c.error.is_none() { "#6b46c1" } else { "#d33" };
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="5" fill="{color}"><title>step {}: compaction {} -> {}</title></circle>"#,
                x(i),
                tokens.y(r.pruned as f64),
                i + 1,
                c.tokens_before,
                c.tokens_after
            );
        }
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="36" text-anchor="end" fill="#555">bands: saved by prune (blue), by strategies (green)</text>"##,
        WIDTH - RIGHT
    );

    // ---- cost panel ----
    let _ = writeln!(
        out,
        r#"<text id="cost-panel" x="{LEFT}" y="{:.1}" font-weight="bold">cost per request, cache model {}</text>"#,
        COST_TOP - 12.0,
        escape(&model.to_string())
    );
    // The fidelity side of the same lanes: references the agent made that each lane's
    // prompt had hidden.
    let references: usize = report.references.iter().sum();
    let dangling: Vec<String> = report
        .lanes
        .iter()
        .map(|l| format!("{} {}", l.name, l.dangling.iter().sum::<usize>()))
        .collect();
    let _ = writeln!(
        out,
        r##"<text id="dangling" x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">dangling references (of {references}): {}</text>"##,
        WIDTH - RIGHT,
        COST_TOP - 12.0,
        escape(&dangling.join(", "))
    );
    grid(&mut out, cost, "cost per request");
    step_labels(&mut out, steps, &x, cost.bottom() + 16.0);
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">step (finished assistant message = one request)</text>"##,
        LEFT + plot_w / 2.0,
        cost.bottom() + 34.0
    );
    for (name, series) in &costs {
        let points: Vec<(f64, f64)> = series
            .iter()
            .enumerate()
            .map(|(i, c)| (x(i), cost.y(*c)))
            .collect();
        let (color, dash) = lane_style(name);
        polyline(&mut out, &points, color, dash, name);
    }

    // Legend: one entry per lane (both panels) with its total cost, then the compaction
    // marker.
    let mut lx = LEFT;
    let ly = HEIGHT - 12.0;
    for (name, series) in &costs {
        let total: f64 = series.iter().sum();
        let label = format!("{name} (cost {})", thousands(total.round() as u64));
        let (color, dash) = lane_style(name);
        let dash = if dash.is_empty() {
            String::new()
        } else {
            format!(r#" stroke-dasharray="{dash}""#)
        };
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"{dash}/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 4.0,
            lx + 18.0,
            ly - 4.0,
            lx + 22.0,
            escape(&label)
        );
        lx += 40.0 + 6.5 * label.len() as f64;
    }
    let _ = writeln!(
        out,
        r##"<circle cx="{:.1}" cy="{:.1}" r="5" fill="#6b46c1"/><text x="{:.1}" y="{ly:.1}">compaction</text>"##,
        lx + 6.0,
        ly - 4.0,
        lx + 16.0
    );
    out.push_str("</svg>\n");
    out
}

/// The chart wrapped in a minimal HTML page.
pub fn html(report: &Report, title: &str, model: CacheModel) -> String {
    format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{}</title></head><body>\n{}</body></html>\n",
        escape(title),
        svg(report, title, model)
    )
}

/// Horizontal grid lines with value labels and the panel's vertical axis title.
fn grid(out: &mut String, panel: Panel, label: &str) {
    for k in 0..=5 {
        let v = panel.y_max * k as f64 / 5.0;
        let yy = panel.y(v);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            yy + 4.0,
            thousands(v as u64)
        );
    }
    let _ = writeln!(
        out,
        r##"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle" fill="#555">{label}</text>"##,
        panel.top + panel.height / 2.0
    );
}

/// Up to ten step numbers along the x axis at height `y`.
fn step_labels(out: &mut String, steps: usize, x: &dyn Fn(usize) -> f64, y: f64) {
    let ticks = steps.min(10);
    for k in 0..ticks {
        let i = if ticks == 1 {
            0
        } else {
            k * (steps - 1) / (ticks - 1)
        };
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{y:.1}" text-anchor="middle" fill="#555">{}</text>"##,
            x(i),
            i + 1
        );
    }
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

fn polyline(out: &mut String, points: &[(f64, f64)], color: &str, dash: &str, lane: &str) {
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
        r#"<polyline data-lane="{}" points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}><title>{}</title></polyline>"#,
        escape(lane),
        pts.join(" "),
        escape(lane)
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
        if i > 0 && (s.len() - i).is_multiple_of(3) {
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

    fn replayed() -> Report {
        let export = crate::trace::parse_export(include_str!(
            "../../tests/data/traces/opencode-nimble-pixel.json"
        ))
        .expect("the trace parses");
        let limits = crate::domain::ModelLimits {
            context: 64_000,
            input: 0,
            output: 8_000,
        };
        crate::trace::replay::replay(&export, limits, &crate::config::EngineConfig::default())
    }

    /// The points of the polyline of `lane` in the panel starting at `top` (y within it).
    fn lane_points(svg: &str, lane: &str, top: f64, height: f64) -> Vec<(f64, f64)> {
        svg.lines()
            .filter(|l| l.starts_with(&format!(r#"<polyline data-lane="{lane}""#)))
            .filter_map(|l| {
                let pts = l.split(r#"points=""#).nth(1)?.split('"').next()?;
                let points: Vec<(f64, f64)> = pts
                    .split(' ')
                    .filter_map(|p| {
                        let (x, y) = p.split_once(',')?;
                        Some((x.parse().ok()?, y.parse().ok()?))
                    })
                    .collect();
                points
                    .iter()
                    .all(|(_, y)| (top..=top + height).contains(y))
                    .then_some(points)
            })
            .next()
            .unwrap_or_default()
    }

    #[test]
    fn the_chart_has_a_token_and_a_cost_panel_for_every_lane() {
        let report = replayed();
        let steps = report.rows.len();
        assert!(steps > 1, "the trace has several requests");
        let svg = svg(&report, "nimble-pixel", CacheModel::ANTHROPIC);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(
            !svg.contains("<script") && !svg.contains("href"),
            "self-contained"
        );
        assert!(
            svg.contains(r#"id="cost-panel""#),
            "the cost panel is there"
        );
        assert!(svg.contains("cost per request, cache model anthropic"));
        // Every lane: one line in each panel, its name in the legend.
        for lane in crate::trace::lanes::LANES {
            let lines = svg
                .matches(&format!(r#"<polyline data-lane="{lane}""#))
                .count();
            assert_eq!(lines, 2, "{lane}: a token line and a cost line");
            assert!(
                svg.contains(&format!(">{lane} (cost ")),
                "{lane} in the legend"
            );
            let tokens = lane_points(&svg, lane, TOKENS_TOP, TOKENS_H);
            let costs = lane_points(&svg, lane, COST_TOP, COST_H);
            assert_eq!(tokens.len(), steps, "{lane}: one token point per step");
            assert_eq!(costs.len(), steps, "{lane}: one cost point per request");
            // Same x axis in both panels.
            let xs = |p: &[(f64, f64)]| p.iter().map(|(x, _)| *x).collect::<Vec<_>>();
            assert_eq!(xs(&tokens), xs(&costs), "{lane}");
        }
        assert_eq!(svg.matches("<polyline").count(), 8);
        // The dangling references of every lane, against the references made.
        let made: usize = report.references.iter().sum();
        let line = svg
            .lines()
            .find(|l| l.contains(r#"id="dangling""#))
            .expect("a dangling line");
        assert!(
            line.contains(&format!("dangling references (of {made}): none 0")),
            "{line}"
        );
        for l in &report.lanes {
            let n: usize = l.dangling.iter().sum();
            assert!(line.contains(&format!("{} {n}", l.name)), "{line}");
        }

        // The cost panel plots the lane's own per-request costs: the costliest request
        // of the busiest lane sits highest.
        let none = &report.lanes[0];
        let series = none.costs(CacheModel::ANTHROPIC, report.fixed_prefix);
        let peak = series
            .iter()
            .enumerate()
            .fold(0, |best, (i, c)| if *c > series[best] { i } else { best });
        let points = lane_points(&svg, "none", COST_TOP, COST_H);
        let highest =
            points.iter().enumerate().fold(
                0,
                |best, (i, p)| if p.1 < points[best].1 { i } else { best },
            );
        assert_eq!(highest, peak);

        // Another cache model prices the same prompts differently and says so.
        let flat = super::svg(&report, "nimble-pixel", CacheModel::NONE);
        assert!(flat.contains("cost per request, cache model none"));
        let total: u64 = none
            .costs(CacheModel::NONE, report.fixed_prefix)
            .iter()
            .sum::<f64>()
            .round() as u64;
        let tokens = report.lane_figures(CacheModel::NONE)[0].1.prompt_tokens;
        assert_eq!(total, tokens, "without a cache the cost is the tokens sent");
        assert!(flat.contains(&format!(">none (cost {})", thousands(total))));
        assert_ne!(svg, flat);
        let page = html(&report, "a <b>", CacheModel::NONE);
        assert!(page.contains("<title>a &lt;b&gt;</title>") && page.contains("id=\"cost-panel\""));
    }
}
