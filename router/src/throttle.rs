//! The router's repeated warnings ([`kvroute_telemetry::throttle`]): one
//! line per endpoint and reason per interval, on tokio's clock so tests
//! can pause it.

use kvroute_telemetry::throttle::Throttle;

/// A [`Throttle`] of endpoints and reasons shared by the request path.
#[derive(Debug, Default)]
pub struct Warnings(std::sync::Mutex<Throttle<(String, &'static str)>>);

impl Warnings {
    /// See [`Throttle::admit`].
    pub fn admit(&self, endpoint: &str, reason: &'static str) -> Option<u64> {
        let now = tokio::time::Instant::now().into_std();
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit((endpoint.to_owned(), reason), now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_telemetry::throttle::INTERVAL;

    #[tokio::test(start_paused = true)]
    async fn warnings_follow_the_paused_clock() {
        let w = Warnings::default();
        assert_eq!(w.admit("a", "status"), Some(1));
        assert_eq!(w.admit("a", "status"), None);
        tokio::time::advance(INTERVAL).await;
        assert_eq!(w.admit("a", "status"), Some(2));
    }
}
