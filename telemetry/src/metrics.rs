//! What every binary's `/metrics` shares: the OpenMetrics text format of
//! `prometheus-client`, and one exposition from several registries (each
//! binary keeps its counters in one registry and builds its scrape-time
//! gauges in another).
//!
//! Also reading it back: [`parse_line`] reads the sample lines of the
//! Prometheus and OpenMetrics text formats, and nothing else, by hand: the
//! maintained parser crates build a full model of the exposition with
//! timestamps (pulling in `chrono` and another `itertools`), where the
//! agent needs a handful of values every 200 ms and the suite a few
//! counters.

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::registry::Registry;

/// The HTTP content type of [`encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `registries` as one OpenMetrics exposition (a single `# EOF`).
pub fn encode(registries: &[&Registry]) -> String {
    let mut out = String::new();
    for r in registries {
        // Writing to a String cannot fail.
        let _ = encode_registry(&mut out, r);
    }
    let _ = encode_eof(&mut out);
    out
}

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample<'a> {
    /// The metric's name (with any `_total`, `_sum`, `_count` suffix).
    pub name: &'a str,
    /// Its labels, unescaped.
    pub labels: Vec<(&'a str, String)>,
    /// Its value.
    pub value: f64,
}

impl Sample<'_> {
    /// Label `name`'s value.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses one line; `None` for comments, blank and malformed lines.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(mut l) = rest.strip_prefix('{') {
        loop {
            l = l.trim_start_matches([',', ' ']);
            if let Some(after) = l.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = l.find('=')?;
            let key = l[..eq].trim();
            let mut chars = l[eq + 1..].trim_start().strip_prefix('"')?.char_indices();
            let mut value = String::new();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            let quoted = l[eq + 1..].trim_start();
            labels.push((key, value));
            l = &quoted[1 + end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;

    use super::*;

    #[test]
    fn registries_make_one_exposition() {
        let (mut a, mut b) = (Registry::default(), Registry::default());
        let counter = Counter::<u64>::default();
        counter.inc();
        a.register("kvroute_things", "Things seen", counter);
        let gauge = Gauge::<i64>::default();
        gauge.set(3);
        b.register("kvroute_level", "The level", gauge);
        assert_eq!(
            encode(&[&a, &b]),
            "# HELP kvroute_things Things seen.\n# TYPE kvroute_things counter\nkvroute_things_total 1\n\
             # HELP kvroute_level The level.\n# TYPE kvroute_level gauge\nkvroute_level 3\n# EOF\n"
        );
    }

    #[test]
    fn sample_lines_parse_with_escapes_and_both_formats() {
        let s = parse_line(
            r#"vllm:cache_config_info{block_size="16",x="a\"b\\c",num_gpu_blocks="4096"} 1.0"#,
        )
        .unwrap();
        assert_eq!(s.name, "vllm:cache_config_info");
        assert_eq!(s.label("x"), Some(r#"a"b\c"#));
        assert_eq!(s.label("num_gpu_blocks"), Some("4096"));
        assert_eq!(
            parse_line("vllm:x_total 12 1700000000").unwrap().value,
            12.0
        );
        assert_eq!(
            parse_line("le_bucket{le=\"+Inf\"} +Inf").unwrap().value,
            f64::INFINITY
        );
        for bad in ["# HELP x y", "", "x{a=\"1\" 2", "x notanumber", "x{a=1} 2"] {
            assert_eq!(parse_line(bad), None, "{bad}");
        }
    }
}
