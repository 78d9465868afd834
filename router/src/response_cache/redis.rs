//! The Redis store: answers shared by every router of a pool, in one Redis
//! server (or a service speaking its protocol).
//!
//! Layout: an answer is the JSON of [`Answer`] under
//! `{keyPrefix}{model tag}:{key hex}`, set with `PX` `ttlS`. The model
//! tag is the first 16 hex digits of the SHA-256 of the model's name, so a
//! name of any length or character fits, and a purge of one model scans
//! its own prefix. A value that does not parse is a miss.
//!
//! Connecting: never at start, so the router starts while Redis is down.
//! The first operation connects, in a task of its own, within
//! `timeoutMs`: a caller that gives up leaves the attempt to finish. One
//! attempt at a time: an operation arriving meanwhile fails at once
//! rather than wait (a miss, and no mark against the breaker). Once
//! connected, one multiplexed connection (redis' `ConnectionManager`,
//! which reconnects by itself after an I/O error) serves every clone of
//! the store; when the breaker opens it is dropped, and the probe
//! connects afresh.
//!
//! Bounds: a `get` or a `put` takes at most `timeoutMs` in all,
//! connecting included ([`StoreError::Timeout`]). A purge takes at most
//! [`PURGE_LIMIT`] in all, scanning [`SCAN_COUNT`] keys a command, each
//! command bounded by `timeoutMs`; one that fails part-way has deleted
//! what it deleted.
//!
//! The circuit breaker (`super::breaker`): `get` and `put` ask it first
//! and are refused at once while it is open ([`StoreError::BreakerOpen`]);
//! an error or a timeout counts against it, any answer (a miss included)
//! for it. A purge, an operator's explicit act, neither asks it nor feeds
//! it. Each opening is counted in `breaker_opened`; errors are counted by
//! the caller, once, by [`StoreError::reason`].
//!
//! TLS (`rediss://`): rustls on the ring provider, the server verified
//! against the system's roots (which `SSL_CERT_FILE` and `SSL_CERT_DIR`
//! replace, as `rustls-native-certs` reads them). redis builds its rustls
//! configuration with `ClientConfig::builder()`, on the process's default
//! provider, which rustls picks from its crate features only when exactly
//! one provider is compiled in (and panics otherwise); so ring's is
//! installed, unless a provider already is, before connecting.
//!
//! Memory: nothing per answer in the router. In Redis an answer costs its
//! JSON, its key (`keyPrefix` and 81 bytes) and Redis' own overhead per
//! key (some 50 to 100 bytes); `maxBytes` does not bound it: give Redis
//! a `maxmemory` and an eviction policy (`allkeys-lru`), or a full Redis
//! refuses every `put`: errors, which open the breaker for lookups too.
//!
//! Not here: what is cached, and when ([`super`]); the breaker's rules
//! (`super::breaker`).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ConnectionAddr, RedisError};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use super::StoreError;
use super::answer::Answer;
use super::breaker::{self, Breaker, Event, Ticket};
use super::key::Key;
use super::metrics::CacheMetrics;
use crate::config::{ConfigError, ResponseCache as Config};

/// The longest a purge takes: it walks every key under its prefix, so it
/// is not held to `timeoutMs`.
pub const PURGE_LIMIT: Duration = Duration::from_secs(30);

/// Keys a purge's `SCAN` asks for at a time (and so deletes at a time).
pub const SCAN_COUNT: usize = 500;

/// Hex digits of the model tag.
const TAG_HEX: usize = 16;

/// The Redis store. See the module doc. Clones share one connection and
/// one breaker.
#[derive(Clone, Debug)]
pub struct RedisStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// Where to connect, with the password (its `Debug` redacts it).
    client: Client,
    /// `rediss://`.
    tls: bool,
    timeout: Duration,
    ttl_ms: u64,
    prefix: String,
    max_entry_bytes: usize,
    conn: Mutex<Conn>,
    breaker: Mutex<Breaker>,
    metrics: Arc<CacheMetrics>,
}

/// The connection's state.
#[derive(Debug)]
enum Conn {
    /// None, and no attempt running.
    Idle,
    /// An attempt is running.
    Connecting,
    /// Connected (or reconnecting by itself).
    Ready(ConnectionManager),
}

/// Why an operation got no answer.
#[derive(Debug)]
enum Failure {
    /// Another operation's connection attempt is running.
    Busy,
    /// Redis, or the connection to it, failed.
    Redis(RedisError),
    /// The connection attempt's task ended without a word.
    Lost,
    /// Past the operation's bound.
    Timeout,
}

impl Failure {
    /// As the caller sees it; `ms` is the bound the operation had.
    fn into_store_error(self, ms: u64) -> StoreError {
        match self {
            Failure::Busy => StoreError::Failed("still connecting to Redis".into()),
            Failure::Redis(e) if e.is_timeout() => StoreError::Timeout(ms),
            Failure::Redis(e) => StoreError::Failed(e.to_string()),
            Failure::Lost => StoreError::Failed("the connection attempt to Redis was lost".into()),
            Failure::Timeout => StoreError::Timeout(ms),
        }
    }
}

impl RedisStore {
    /// A store for `config`'s `url` and `passwordFile`, counting breaker
    /// openings into `metrics`. Connects to nothing (see the module doc):
    /// only the URL and the password file are checked.
    pub fn new(config: &Config, metrics: Arc<CacheMetrics>) -> Result<Self, ConfigError> {
        let url = config.url.as_deref().unwrap_or_default();
        let invalid = |reason| ConfigError::Invalid {
            field: "responseCache.url",
            value: redacted(url),
            reason,
        };
        let client = Client::open(url).map_err(|_| {
            invalid("is not a Redis URL: redis://[user:password@]host[:port][/db] or rediss://…")
        })?;
        let info = client.get_connection_info().clone();
        let tls = match info.addr() {
            ConnectionAddr::Tcp(..) => false,
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(invalid(
                    "#insecure is not supported: the server's certificate is always verified",
                ));
            }
            ConnectionAddr::TcpTls { .. } => true,
            _ => return Err(invalid("must be redis://host:port or rediss://host:port")),
        };
        let client = match &config.password_file {
            None => client,
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::file("responseCache.passwordFile", path, e))?;
                let password = text.trim_end_matches(['\n', '\r']);
                if password.is_empty() {
                    return Err(ConfigError::Invalid {
                        field: "responseCache.passwordFile",
                        value: path.display().to_string(),
                        reason: "the password must not be empty",
                    });
                }
                let settings = info.redis_settings().clone().set_password(password);
                Client::open(info.set_redis_settings(settings))
                    .map_err(|_| invalid("is not usable with the password file's password"))?
            }
        };
        Ok(RedisStore {
            shared: Arc::new(Shared {
                client,
                tls,
                timeout: Duration::from_millis(config.timeout_ms),
                ttl_ms: config.ttl_s.saturating_mul(1000),
                prefix: config.key_prefix.clone(),
                max_entry_bytes: config.max_entry_bytes,
                conn: Mutex::new(Conn::Idle),
                breaker: Mutex::new(Breaker::new(breaker::Config::default())),
                metrics,
            }),
        })
    }

    /// The answer under `key`: `None` when there is none, or it does not
    /// parse.
    pub async fn get(&self, key: &Key) -> Result<Option<Answer>, StoreError> {
        let name = self.shared.name(key);
        let value: Option<Vec<u8>> = self
            .guarded(|mut c| async move { redis::cmd("GET").arg(name).query_async(&mut c).await })
            .await?;
        Ok(value.and_then(|v| match serde_json::from_slice(&v) {
            Ok(answer) => Some(answer),
            Err(e) => {
                tracing::debug!(error = %e, "a response cache entry in Redis does not parse: a miss");
                None
            }
        }))
    }

    /// Stores `answer` under `key` for `ttlS`. One larger than
    /// `maxEntryBytes` is not written (the caller leaves those out first).
    pub async fn put(&self, key: &Key, answer: &Answer) -> Result<(), StoreError> {
        let value = serde_json::to_vec(answer).map_err(|e| StoreError::Failed(e.to_string()))?;
        if value.len() > self.shared.max_entry_bytes {
            return Ok(());
        }
        let (name, ttl_ms) = (self.shared.name(key), self.shared.ttl_ms);
        self.guarded(|mut c| async move {
            redis::cmd("SET")
                .arg(name)
                .arg(value)
                .arg("PX")
                .arg(ttl_ms)
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// Deletes every answer under `keyPrefix`, or `model`'s alone; how
    /// many. Bounded by [`PURGE_LIMIT`]; the breaker is not asked.
    pub async fn purge(&self, model: Option<&str>) -> Result<u64, StoreError> {
        let mut pattern = glob_escaped(&self.shared.prefix);
        if let Some(model) = model {
            pattern += &model_tag(model);
            pattern.push(':');
        }
        pattern.push('*');
        let shared = &self.shared;
        let walk = async {
            let mut conn = shared.connection().await?;
            let (mut cursor, mut deleted) = (0_u64, 0_u64);
            loop {
                let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .query_async(&mut conn)
                    .await
                    .map_err(Failure::Redis)?;
                if !keys.is_empty() {
                    // UNLINK counts the keys that still existed.
                    deleted += redis::cmd("UNLINK")
                        .arg(&keys)
                        .query_async::<u64>(&mut conn)
                        .await
                        .map_err(Failure::Redis)?;
                }
                if next == 0 {
                    return Ok::<u64, Failure>(deleted);
                }
                cursor = next;
            }
        };
        let ms = PURGE_LIMIT.as_millis() as u64;
        match tokio::time::timeout(PURGE_LIMIT, walk).await {
            Ok(Ok(deleted)) => Ok(deleted),
            Ok(Err(failure)) => Err(failure.into_store_error(ms)),
            Err(_) => Err(StoreError::Timeout(ms)),
        }
    }

    /// Starts connecting in the background (at the router's start), so the
    /// first requests find the connection made rather than fail while it
    /// is being made. A failure here is not held against the breaker: the
    /// first operation connects again.
    pub fn connect_soon(&self) {
        let shared = self.shared.clone();
        tokio::spawn(async move {
            if let Err(Failure::Redis(e)) = shared.connection().await {
                tracing::warn!(error = %e, "the response cache cannot reach Redis yet: requests go on uncached until it can");
            }
        });
    }

    /// Runs `op` on the connection, asking the breaker first and telling
    /// it the outcome, within `timeoutMs` in all.
    async fn guarded<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let shared = &self.shared;
        let ticket = (shared.lock_breaker().admit(now())).map_err(|_| StoreError::BreakerOpen)?;
        let pass = Pass {
            shared,
            ticket: Some(ticket),
        };
        let run = async {
            let conn = shared.connection().await?;
            op(conn).await.map_err(Failure::Redis)
        };
        let outcome =
            (tokio::time::timeout(shared.timeout, run).await).unwrap_or(Err(Failure::Timeout));
        let ms = shared.timeout.as_millis() as u64;
        match outcome {
            Ok(value) => {
                pass.finish(true);
                Ok(value)
            }
            // Neither for nor against Redis: the pass is abandoned.
            Err(Failure::Busy) => Err(Failure::Busy.into_store_error(ms)),
            Err(failure) => {
                tracing::debug!(error = ?failure, "a response cache operation on Redis failed");
                pass.finish(false);
                Err(failure.into_store_error(ms))
            }
        }
    }
}

impl Shared {
    /// The Redis key of `key`.
    fn name(&self, key: &Key) -> String {
        format!("{}{}:{}", self.prefix, model_tag(&key.model), key.hex())
    }

    /// The connection: the one there is, else a new one, connected by
    /// this call (see the module doc).
    async fn connection(self: &Arc<Self>) -> Result<ConnectionManager, Failure> {
        let answer = {
            let mut conn = self.lock_conn();
            match &*conn {
                Conn::Ready(manager) => return Ok(manager.clone()),
                Conn::Connecting => return Err(Failure::Busy),
                Conn::Idle => *conn = Conn::Connecting,
            }
            let (tell, answer) = oneshot::channel();
            let attempt = Attempt(self.clone());
            tokio::spawn(async move {
                let made = attempt.0.connect().await;
                if let Ok(manager) = &made {
                    *attempt.0.lock_conn() = Conn::Ready(manager.clone());
                }
                drop(attempt);
                let _ = tell.send(made);
            });
            answer
        };
        match answer.await {
            Ok(made) => made.map_err(Failure::Redis),
            Err(_) => Err(Failure::Lost),
        }
    }

    /// One connection attempt, within `timeoutMs`.
    async fn connect(&self) -> redis::RedisResult<ConnectionManager> {
        if self.tls {
            // Err: a provider is installed already, which redis then uses.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        // One attempt: the breaker, not the manager, decides when to try
        // again. The manager's timeouts bound each later reconnection and
        // command too.
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let connecting = ConnectionManager::new_with_config(self.client.clone(), config);
        match tokio::time::timeout(self.timeout, connecting).await {
            Ok(made) => made,
            Err(_) => Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()),
        }
    }

    /// Logs and counts a breaker event; an opening drops the connection.
    fn on(&self, event: Event) {
        match event {
            Event::Opened { until } => {
                self.metrics.breaker_opened.inc();
                tracing::warn!(
                    closed_for_ms = until.saturating_duration_since(now()).as_millis() as u64,
                    "the response cache's Redis circuit breaker opened: Redis is skipped"
                );
                let mut conn = self.lock_conn();
                if matches!(*conn, Conn::Ready(_)) {
                    *conn = Conn::Idle;
                }
            }
            Event::Closed => {
                tracing::info!("the response cache's Redis circuit breaker closed: Redis is used");
            }
        }
    }

    fn lock_conn(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_breaker(&self) -> MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running connection attempt: however its task ends (a panic, the
/// runtime shutting down), the next operation may connect again.
struct Attempt(Arc<Shared>);

impl Drop for Attempt {
    fn drop(&mut self) {
        let mut conn = self.0.lock_conn();
        if matches!(*conn, Conn::Connecting) {
            *conn = Conn::Idle;
        }
    }
}

/// An operation the breaker let through. Dropped unfinished (its caller
/// went away, or it never reached Redis), it is abandoned, so a probe
/// never holds the breaker half-open.
struct Pass<'a> {
    shared: &'a Shared,
    ticket: Option<Ticket>,
}

impl Pass<'_> {
    /// Tells the breaker the outcome; handles what it says.
    fn finish(mut self, ok: bool) {
        if let Some(ticket) = self.ticket.take() {
            let event = self.shared.lock_breaker().finished(ticket, ok, now());
            if let Some(event) = event {
                self.shared.on(event);
            }
        }
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.shared.lock_breaker().abandoned(ticket);
        }
    }
}

/// The breaker's clock (tokio's, so a paused test clock moves it).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The first [`TAG_HEX`] hex digits of the SHA-256 of `model`.
fn model_tag(model: &str) -> String {
    let digest = Sha256::digest(model.as_bytes());
    let mut tag: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    tag.truncate(TAG_HEX);
    tag
}

/// `s` matching itself alone in a `SCAN MATCH` pattern.
fn glob_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `url` without its user and password, for an error message.
fn redacted(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://…@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backend;

    fn config(url: &str) -> Config {
        Config {
            backend: Backend::Redis,
            url: Some(url.into()),
            ..Config::default()
        }
    }

    fn store(config: &Config) -> Result<RedisStore, ConfigError> {
        RedisStore::new(config, Arc::default())
    }

    fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
        let path =
            std::env::temp_dir().join(format!("kvroute-redis-store-{name}-{}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn new_connects_to_nothing_and_needs_no_runtime() {
        // Nothing listens on port 1, and there is no tokio runtime here.
        let s = store(&config("redis://127.0.0.1:1")).unwrap();
        assert!(matches!(*s.shared.lock_conn(), Conn::Idle));
    }

    #[test]
    fn a_bad_url_names_the_field_without_the_password() {
        for url in ["redis://:hunter2@[::1", "redis://:hunter2@host/notadb"] {
            let Err(ConfigError::Invalid { field, value, .. }) = store(&config(url)) else {
                panic!("{url} is refused");
            };
            assert_eq!(field, "responseCache.url");
            assert!(!value.contains("hunter2"), "{value}");
        }
    }

    #[test]
    fn an_insecure_tls_url_is_refused() {
        let Err(ConfigError::Invalid { reason, .. }) =
            store(&config("rediss://redis.example:6380/#insecure"))
        else {
            panic!("refused");
        };
        assert!(reason.contains("#insecure"), "{reason}");
        store(&config("rediss://redis.example:6380")).expect("verified TLS is fine");
    }

    #[test]
    fn the_password_file_replaces_the_urls_password_without_its_newline() {
        let path = temp_file("password", "s3cret\n");
        let mut c = config("redis://:old@127.0.0.1:6379/2");
        c.password_file = Some(path.clone());
        let s = store(&c).unwrap();
        let info = s.shared.client.get_connection_info();
        assert_eq!(info.redis_settings().password(), Some("s3cret"));
        assert_eq!(info.redis_settings().db(), 2);
        assert!(!format!("{s:?}").contains("s3cret"), "Debug redacts it");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn an_unreadable_or_empty_password_file_is_refused() {
        let mut c = config("redis://127.0.0.1:6379");
        c.password_file = Some("/nonexistent/kvroute/password".into());
        let Err(ConfigError::File { field, .. }) = store(&c) else {
            panic!("refused");
        };
        assert_eq!(field, "responseCache.passwordFile");
        let path = temp_file("empty-password", "\n");
        c.password_file = Some(path.clone());
        let Err(ConfigError::Invalid { field, .. }) = store(&c) else {
            panic!("refused");
        };
        assert_eq!(field, "responseCache.passwordFile");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn keys_are_prefix_model_tag_and_digest() {
        let s = store(&config("redis://127.0.0.1:6379")).unwrap();
        let key = Key {
            digest: [0xab; 32],
            model: "llama".into(),
        };
        let name = s.shared.name(&key);
        let tag = model_tag("llama");
        assert_eq!(tag.len(), 16);
        assert!(format!("{:x}", Sha256::digest(b"llama")).starts_with(&tag));
        assert_eq!(name, format!("kvroute:response:{tag}:{}", "ab".repeat(32)));
    }

    #[test]
    fn glob_metacharacters_are_escaped() {
        assert_eq!(glob_escaped(r"a*b?c[d]e\f:"), r"a\*b\?c\[d\]e\\f:");
        assert_eq!(glob_escaped("kvroute:response:"), "kvroute:response:");
    }

    #[tokio::test]
    async fn nothing_listening_fails_within_the_timeout_then_the_breaker_opens() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let metrics = Arc::new(CacheMetrics::default());
        let c = Config {
            timeout_ms: 200,
            ..config(&format!("redis://127.0.0.1:{port}"))
        };
        let s = RedisStore::new(&c, metrics.clone()).unwrap();
        let key = Key {
            digest: [1; 32],
            model: "m".into(),
        };
        for _ in 0..5 {
            let e = s.get(&key).await.unwrap_err();
            assert!(
                matches!(e, StoreError::Failed(_) | StoreError::Timeout(200)),
                "{e}"
            );
        }
        assert!(matches!(s.get(&key).await, Err(StoreError::BreakerOpen)));
        assert!(matches!(
            s.put(&key, &Answer::default()).await,
            Err(StoreError::BreakerOpen)
        ));
        assert_eq!(metrics.breaker_opened.get(), 1);
    }
}
