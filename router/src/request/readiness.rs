//! Whether the router can serve (`/readyz`, the picker's gRPC health):
//! the tenancy the pool's policy asks for, a routable endpoint, and at
//! startup every engine's first cache snapshot (the pool's `startup`
//! rules), whose bounded wait running out is logged and counted here.

use super::Service;

impl Service {
    /// Whether the router can serve: routable endpoints (their number),
    /// the tenancy the pool's policy asks for, and at startup the engines'
    /// first snapshots; else why not.
    pub fn readiness(&self) -> Result<usize, String> {
        // Checked first, so the wait's end is noticed on every call.
        let (snapshots, gave_up) = self.pool.startup();
        if let Some(g) = gave_up {
            self.accounting.metrics.snapshot_waits_expired.inc();
            tracing::warn!(
                missing = %g,
                waited_ms = g.waited.as_millis() as u64,
                "ready without every engine's cache snapshot: resilience.snapshotWaitMs passed; \
                 requests for their prefixes route cold until their snapshots arrive"
            );
        }
        self.tenancy_check(&self.pool.settings())
            .map_err(|e| e.to_string())?;
        let n = match self.pool.routable() {
            0 => return Err("no routable endpoint".into()),
            n => n,
        };
        snapshots.map_err(|w| w.to_string())?;
        Ok(n)
    }
}
