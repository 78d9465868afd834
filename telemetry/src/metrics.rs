//! What every binary's `/metrics` shares: the OpenMetrics text format of
//! `prometheus-client`, and one exposition from several registries (each
//! binary keeps its counters in one registry and builds its scrape-time
//! gauges in another).

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
}
