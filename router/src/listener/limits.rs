//! Each listener's connection limits, and fitting the connection caps to
//! the process's open-file limit.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{ExtProc, Limits};

/// The admin port's connection cap: probes and scrapes need few, and idle
/// ones make room for new ones.
pub const ADMIN_MAX_CONNECTIONS: usize = 128;
/// The admin port's time to receive a request's headers.
pub const ADMIN_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The admin port's idle timeout.
pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Connection limits of one listener.
#[derive(Clone, Debug)]
pub struct ConnLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// See `limits.headerReadTimeoutMs`.
    pub header_read_timeout: Duration,
    /// See `limits.idleTimeoutMs`.
    pub idle_timeout: Duration,
    /// See `limits.http2MaxConcurrentStreams`.
    pub h2_max_concurrent_streams: u32,
    /// See `limits.http2MaxPendingAcceptResetStreams`.
    pub h2_max_pending_accept_reset_streams: usize,
    /// See `limits.http2MaxLocalErrorResetStreams`.
    pub h2_max_local_error_reset_streams: usize,
    /// TLS for every connection; `None`: plaintext.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Threads for [`super::serve_on_threads`] (`limits.apiThreads` resolved).
    pub threads: usize,
}

impl ConnLimits {
    /// The API listener's limits with `max_connections` (see
    /// [`fit_to_open_files`]).
    pub fn api(limits: &Limits, max_connections: usize) -> Self {
        Self::with_max(limits, max_connections)
    }

    /// The endpoint picker's: its own cap and idle timeout, the API's
    /// HTTP/2 limits.
    pub fn picker(limits: &Limits, picker: &ExtProc, max_connections: usize) -> Self {
        ConnLimits {
            idle_timeout: Duration::from_millis(picker.idle_timeout_ms),
            ..Self::with_max(limits, max_connections)
        }
    }

    /// The admin listener's: a small cap of its own and short timeouts, so
    /// neither port can starve the other.
    pub fn admin(limits: &Limits) -> Self {
        ConnLimits {
            header_read_timeout: ADMIN_HEADER_READ_TIMEOUT,
            idle_timeout: ADMIN_IDLE_TIMEOUT,
            ..Self::with_max(limits, ADMIN_MAX_CONNECTIONS)
        }
    }

    fn with_max(limits: &Limits, max_connections: usize) -> Self {
        ConnLimits {
            max_connections,
            header_read_timeout: Duration::from_millis(limits.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(limits.idle_timeout_ms),
            h2_max_concurrent_streams: limits.http2_max_concurrent_streams,
            h2_max_pending_accept_reset_streams: limits.http2_max_pending_accept_reset_streams,
            h2_max_local_error_reset_streams: limits.http2_max_local_error_reset_streams,
            tls: None,
            threads: limits.api_threads(),
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logging what it
/// did; a failure leaves the limit as it was.
pub fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current >= limit.maximum {
        return;
    }
    let from = limit.current;
    limit.current = limit.maximum;
    match setrlimit(Resource::Nofile, limit) {
        Ok(()) => tracing::debug!(from = ?from, to = ?limit.current, "raised the open-file limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
    }
}

/// The soft `RLIMIT_NOFILE`; `None` when unlimited.
fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Connection caps that fit the open-file limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The API port's (two descriptors a connection: its own and one
    /// upstream).
    pub api: usize,
    /// The endpoint picker's (one a connection).
    pub picker: usize,
}

/// Fits the configured caps (0 for a listener not served) to the process's
/// open-file limit (see [`fit_caps`]), warning when it lowered them.
pub fn fit_to_open_files(api: usize, picker: usize) -> Caps {
    let wanted = Caps { api, picker };
    let Some(nofile) = open_file_limit() else {
        return wanted;
    };
    let caps = fit_caps(wanted, nofile);
    if caps != wanted {
        tracing::warn!(
            open_file_limit = nofile,
            api = caps.api,
            picker = caps.picker,
            "limits.maxConnections and extProc.maxConnections lowered to fit the open-file limit (raise the hard `ulimit -n` for more)"
        );
    }
    caps
}

/// The caps within `nofile` descriptors: a reserve (an eighth, at most
/// 1024) for upstream pools, WatchCache streams, files and logs, then
/// [`ADMIN_MAX_CONNECTIONS`], and what is left shared by the API and the
/// picker in proportion to what each wants (each keeps at least one).
pub fn fit_caps(wanted: Caps, nofile: u64) -> Caps {
    let reserve = (nofile / 8).min(1024) + ADMIN_MAX_CONNECTIONS as u64;
    let left = nofile.saturating_sub(reserve);
    let need = 2 * wanted.api as u64 + wanted.picker as u64;
    if need <= left {
        return wanted;
    }
    let scale = |n: usize| {
        let fitted = (n as u128 * left as u128 / need as u128) as usize;
        if n == 0 { 0 } else { fitted.max(1) }
    };
    Caps {
        api: scale(wanted.api),
        picker: scale(wanted.picker),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_fit_the_open_file_limit_in_proportion() {
        let wanted = Caps {
            api: 10_000,
            picker: 1024,
        };
        // Room enough: as configured.
        assert_eq!(fit_caps(wanted, 1 << 20), wanted);
        // 2,048 descriptors: 256 reserved, 128 for the admin port, the
        // 1,664 left shared as 2 × api + picker.
        let fitted = fit_caps(wanted, 2048);
        assert_eq!(
            fitted,
            Caps {
                api: 791,
                picker: 81
            }
        );
        assert!(2 * fitted.api + fitted.picker <= 2048 - 256 - 128);
        // A listener not served takes nothing; each served one keeps one.
        assert_eq!(
            fit_caps(
                Caps {
                    api: 10_000,
                    picker: 0
                },
                2048
            )
            .picker,
            0
        );
        assert_eq!(fit_caps(wanted, 10), Caps { api: 1, picker: 1 });
    }
}
