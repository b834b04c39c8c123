//! The SVG chart, written by hand (no plotting dependency): panels sharing the time axis —
//! arrival, admitted and refused+error rates per second; p50, p99 and critical-caller p99
//! latency and login p99 on a log scale; when the run has storm sessions (incident), the
//! sessions completed so far and per second; backend connections seen by the monitor. Missing points
//! (a slot with no completed statement, no monitor reading) break the line instead of
//! drawing a misleading zero.

use std::fmt::Write as _;

use super::record::Snapshot;

const W: f64 = 960.0;
const PANEL_H: f64 = 200.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const GAP: f64 = 50.0;

struct Series<'a> {
    name: &'a str,
    color: &'a str,
    points: Vec<Option<f64>>,
}

struct Panel<'a> {
    title: &'a str,
    log: bool,
    series: Vec<Series<'a>>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// "Nice" linear ticks from 0 to at least `max`.
fn linear_ticks(max: f64) -> (f64, Vec<f64>) {
    let max = if max > 0.0 { max } else { 1.0 };
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let top = (max / step).ceil() * step;
    let ticks = (0..=((top / step).round() as usize))
        .map(|i| i as f64 * step)
        .collect();
    (top, ticks)
}

fn fmt_tick(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

fn panel(o: &mut String, p: &Panel, y0: f64, dt: f64, n: usize) {
    let plot_w = W - LEFT - RIGHT;
    let x = |i: usize| LEFT + plot_w * (i as f64 + 0.5) / n.max(1) as f64;
    let values = p.series.iter().flat_map(|s| s.points.iter().flatten());
    let (lo, hi, ticks): (f64, f64, Vec<f64>) = if p.log {
        let max = values.clone().fold(0.1f64, |a, &b| a.max(b));
        let min = values.fold(f64::INFINITY, |a, &b| if b > 0.0 { a.min(b) } else { a });
        let lo = 10f64.powf(min.min(max).max(0.01).log10().floor());
        let hi = 10f64.powf(max.log10().ceil()).max(lo * 10.0);
        let mut t = Vec::new();
        let mut v = lo;
        while v <= hi * 1.0001 {
            t.push(v);
            v *= 10.0;
        }
        (lo, hi, t)
    } else {
        let (top, t) = linear_ticks(values.fold(0.0f64, |a, &b| a.max(b)));
        (0.0, top, t)
    };
    let y = |v: f64| {
        let f = if p.log {
            (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10())
        } else {
            (v - lo) / (hi - lo)
        };
        y0 + PANEL_H * (1.0 - f.clamp(0.0, 1.0))
    };
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{y0}" width="{plot_w}" height="{PANEL_H}" fill="#fafafa" stroke="#999"/>"##
    );
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="{:.1}" font-size="13" font-weight="bold">{}</text>"#,
        y0 - 8.0,
        esc(p.title)
    );
    for t in ticks {
        let ty = y(t);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{ty:.1}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            ty + 4.0,
            fmt_tick(t)
        );
    }
    // Time ticks: about ten, on whole seconds.
    let total = dt * n as f64;
    let step = [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0]
        .into_iter()
        .find(|s| total / s <= 12.0)
        .unwrap_or(300.0);
    let mut t = 0.0;
    while t <= total {
        let tx = LEFT + plot_w * t / total.max(f64::EPSILON);
        let _ = writeln!(
            o,
            r##"<line x1="{tx:.1}" x2="{tx:.1}" y1="{y0}" y2="{:.1}" stroke="#eee"/><text x="{tx:.1}" y="{:.1}" font-size="11" text-anchor="middle">{t:.0}s</text>"##,
            y0 + PANEL_H,
            y0 + PANEL_H + 14.0
        );
        t += step;
    }
    let mut lx = LEFT + plot_w;
    for s in p.series.iter().rev() {
        lx -= 8.0 * s.name.len() as f64 + 24.0;
        let _ = writeln!(
            o,
            r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            y0 - 14.0,
            s.color,
            lx + 18.0,
            y0 - 9.0,
            esc(s.name)
        );
    }
    for s in &p.series {
        let mut run: Vec<String> = Vec::new();
        let flush = |run: &mut Vec<String>, o: &mut String| {
            if run.len() > 1 {
                let _ = writeln!(
                    o,
                    r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                    s.color,
                    run.join(" ")
                );
            } else if let Some(pt) = run.first()
                && let Some((px, py)) = pt.split_once(',')
            {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{px}" cy="{py}" r="1.5" fill="{}"/>"#,
                    s.color
                );
            }
            run.clear();
        };
        for (i, v) in s.points.iter().enumerate() {
            match v {
                Some(v) if !p.log || *v > 0.0 => run.push(format!("{:.1},{:.1}", x(i), y(*v))),
                _ => flush(&mut run, o),
            }
        }
        flush(&mut run, o);
    }
}

pub fn svg(title: &str, snap: &Snapshot) -> String {
    let n = snap.slots.len().max(1);
    let dt = snap.slot.as_secs_f64();
    let per_s = 1.0 / dt;
    let ms = |v: Option<u64>| v.map(|us| us as f64 / 1e3);
    let col = |f: &dyn Fn(&super::record::Slot) -> Option<f64>| -> Vec<Option<f64>> {
        snap.slots.iter().map(f).collect()
    };
    let mut total = 0.0;
    let sessions_total: Vec<Option<f64>> = snap
        .slots
        .iter()
        .map(|s| {
            total += s.sessions as f64;
            Some(total)
        })
        .collect();
    let with_sessions = total > 0.0;
    let mut panels = vec![
        Panel {
            title: "statements and connection attempts per second",
            log: false,
            series: vec![
                Series {
                    name: "arrivals",
                    color: "#1f77b4",
                    points: col(&|s| Some(s.arrivals as f64 * per_s)),
                },
                Series {
                    name: "admitted",
                    color: "#2ca02c",
                    points: col(&|s| Some(s.admitted as f64 * per_s)),
                },
                Series {
                    name: "refused+errors",
                    color: "#d62728",
                    points: col(&|s| Some((s.refused + s.errors) as f64 * per_s)),
                },
            ],
        },
        Panel {
            title: "latency of admitted statements, ms (log scale)",
            log: true,
            series: vec![
                Series {
                    name: "p50",
                    color: "#2ca02c",
                    points: col(&|s| ms(s.latency.quantile(0.5))),
                },
                Series {
                    name: "p99",
                    color: "#ff7f0e",
                    points: col(&|s| ms(s.latency.quantile(0.99))),
                },
                Series {
                    name: "critical p99",
                    color: "#9467bd",
                    points: col(&|s| ms(s.critical.quantile(0.99))),
                },
                Series {
                    name: "login p99",
                    color: "#17becf",
                    points: col(&|s| ms(s.login.quantile(0.99))),
                },
            ],
        },
        Panel {
            title: "backend connections (pg_stat_activity)",
            log: false,
            series: vec![Series {
                name: "backends",
                color: "#8c564b",
                points: col(&|s| s.backends.map(|b| b as f64)),
            }],
        },
    ];
    if with_sessions {
        panels.insert(
            2,
            Panel {
                title: "storm sessions completed: so far, and per second",
                log: false,
                series: vec![
                    Series {
                        name: "completed",
                        color: "#2ca02c",
                        points: sessions_total,
                    },
                    Series {
                        name: "per second",
                        color: "#1f77b4",
                        points: col(&|s| Some(s.sessions as f64 * per_s)),
                    },
                ],
            },
        );
    }
    let h = TOP + panels.len() as f64 * (PANEL_H + GAP) + 10.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    for (i, p) in panels.iter().enumerate() {
        panel(&mut o, p, TOP + 12.0 + i as f64 * (PANEL_H + GAP), dt, n);
    }
    o.push_str("</svg>\n");
    o
}
