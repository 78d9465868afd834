//! The agent binary against a hostile or broken vLLM, over real sockets: a
//! raw ZMTP peer (written here, byte by byte, so it can send what no ZMQ
//! library would) as the PUB and replay ROUTER, a scripted `/metrics`, and
//! the agent's memory read from `/proc/<pid>/status`.
//!
//! Each attack: the agent refuses it without keeping it, counts it, keeps
//! serving (the next good batch is applied, `/readyz` is 200), and its
//! memory stays within a generous bound of its level before.
//!
//! `KVROUTE_AGENT_BIN=path cargo test -p kvroute-agent --test it hostile:: --
//! --nocapture` runs another build of the binary (an older one, to see
//! what it did); each test prints the memory it measured.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MIB: u64 = 1 << 20;

/// A vLLM's HTTP side whose `/metrics` says what `text` holds.
async fn fake_vllm(text: Arc<Mutex<String>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/metrics",
            axum::routing::get(move || {
                let body = text.lock().unwrap().clone();
                async move { body }
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn cache_config(block_size: u32, blocks: u64) -> String {
    format!(
        "vllm:cache_config_info{{block_size=\"{block_size}\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
    )
}

/// The agent binary, killed on drop.
struct Agent {
    child: Child,
    admin: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn_agent(events: u16, replay: Option<u16>, engine_url: &str, load_interval_ms: u32) -> Agent {
    let admin = free_port();
    let bin = std::env::var("KVROUTE_AGENT_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvroute-agent").to_owned());
    let mut cmd = Command::new(bin);
    cmd.args(["--kv-events-endpoint", &format!("tcp://127.0.0.1:{events}")])
        .args(["--engine-url", engine_url])
        .args(["--listen", "127.0.0.1:0"])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--quiet-period-ms", "100"])
        .args(["--load-interval-ms", &load_interval_ms.to_string()])
        .args(["--log-format", "text"])
        .env_remove("PYTHONHASHSEED")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(replay) = replay {
        cmd.args([
            "--kv-events-replay-endpoint",
            &format!("tcp://127.0.0.1:{replay}"),
        ]);
    }
    Agent {
        child: cmd.spawn().expect("the agent binary starts"),
        admin: format!("http://127.0.0.1:{admin}"),
    }
}

impl Agent {
    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let r = reqwest::get(format!("{}{path}", self.admin)).await.ok()?;
        Some((r.status().as_u16(), r.text().await.ok()?))
    }

    async fn readyz(&self) -> (u16, String) {
        self.get("/readyz").await.unwrap_or((0, String::new()))
    }

    /// The sum of `family`'s samples, those with `kind="…"` if given.
    async fn counter(&self, family: &str, kind: Option<&str>) -> u64 {
        let text = self.get("/metrics").await.map(|r| r.1).unwrap_or_default();
        text.lines()
            .filter_map(kvroute_telemetry::metrics::parse_line)
            .filter(|s| s.name == family && kind.is_none_or(|k| s.label("kind") == Some(k)))
            .map(|s| s.value as u64)
            .sum()
    }

    /// `VmRSS` and `VmHWM` (peak), bytes.
    fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .expect("a /proc status field")
                * 1024
        };
        (field("VmRSS:"), field("VmHWM:"))
    }
}

/// Polls `check` until it holds (60 s at most: a debug build on a busy
/// machine).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    kvroute_testkit::eventually(what, Duration::from_secs(60), || {
        let holds = check();
        async move { holds.await.then_some(()) }
    })
    .await;
}

/// The ZMTP side of vLLM, spoken byte by byte.
struct Peer {
    tcp: TcpStream,
}

impl Peer {
    /// Accepts the agent's connection and does the handshake as `socket`
    /// (`PUB` or `ROUTER`).
    async fn accept(listener: &TcpListener, socket: &str) -> Peer {
        let (mut tcp, _) = listener.accept().await.unwrap();
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        greeting[32] = 1;
        tcp.write_all(&greeting).await.unwrap();
        let mut theirs = [0u8; 64];
        tcp.read_exact(&mut theirs).await.unwrap();
        assert_eq!((theirs[0], theirs[10]), (0xff, 3), "a ZMTP 3 greeting");
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY\x0bSocket-Type");
        ready.extend_from_slice(&(socket.len() as u32).to_be_bytes());
        ready.extend_from_slice(socket.as_bytes());
        let mut peer = Peer { tcp };
        peer.frame(0b100, &ready).await;
        let (flags, body) = peer.read_frame().await;
        assert_eq!((flags & 0b100, &body[..6]), (0b100, &b"\x05READY"[..]));
        peer
    }

    async fn header(&mut self, flags: u8, len: u64) {
        if len < 256 {
            self.tcp.write_all(&[flags, len as u8]).await.unwrap();
        } else {
            self.tcp.write_all(&[flags | 0b010]).await.unwrap();
            self.tcp.write_all(&len.to_be_bytes()).await.unwrap();
        }
    }

    async fn frame(&mut self, flags: u8, body: &[u8]) {
        self.header(flags, body.len() as u64).await;
        self.tcp.write_all(body).await.unwrap();
    }

    async fn send(&mut self, frames: &[&[u8]]) {
        for (i, f) in frames.iter().enumerate() {
            let more = u8::from(i + 1 < frames.len());
            self.frame(more, f).await;
        }
    }

    async fn read_frame(&mut self) -> (u8, Vec<u8>) {
        let flags = self.tcp.read_u8().await.unwrap();
        let len = if flags & 0b010 != 0 {
            self.tcp.read_u64().await.unwrap()
        } else {
            u64::from(self.tcp.read_u8().await.unwrap())
        };
        let mut body = vec![0; len as usize];
        self.tcp.read_exact(&mut body).await.unwrap();
        (flags, body)
    }

    async fn read_message(&mut self) -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        loop {
            let (flags, body) = self.read_frame().await;
            frames.push(body);
            if flags & 1 == 0 {
                return frames;
            }
        }
    }

    /// A live batch `seq`.
    async fn batch(&mut self, seq: u64, payload: &[u8]) {
        self.send(&[b"kv", &seq.to_be_bytes(), payload]).await;
    }
}

/// A batch of one `BlockStored` of `hashes`, blocks of `block_size`.
fn stored(hashes: impl IntoIterator<Item = u64>, block_size: u32) -> Vec<u8> {
    let event = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.into_iter().map(Value::from).collect()),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(Vec::new())),
        (Value::from("block_size"), Value::from(block_size)),
    ]);
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// An agent following a raw PUB (and a raw ROUTER when `replay`), ready,
/// with batch 0 applied.
async fn started(
    metrics: &str,
    replay: bool,
    load_interval_ms: u32,
) -> (Agent, Peer, Option<TcpListener>, Arc<Mutex<String>>) {
    let text = Arc::new(Mutex::new(metrics.to_owned()));
    let url = fake_vllm(text.clone()).await;
    let events = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = if replay {
        Some(TcpListener::bind("127.0.0.1:0").await.unwrap())
    } else {
        None
    };
    let agent = spawn_agent(
        events.local_addr().unwrap().port(),
        router.as_ref().map(|r| r.local_addr().unwrap().port()),
        &url,
        load_interval_ms,
    );
    let mut publisher = Peer::accept(&events, "PUB").await;
    assert_eq!(
        publisher.read_message().await,
        [b"\x01".to_vec()],
        "subscribed to all"
    );
    publisher.batch(0, &stored([1], 16)).await;
    until("batch 0 applied and ready", || async {
        agent.counter("kvroute_agent_batches_total", None).await == 1
            && agent.readyz().await.0 == 200
    })
    .await;
    (agent, publisher, router, text)
}

#[tokio::test]
async fn a_600_mib_frame_is_read_past_unkept_and_the_stream_goes_on() {
    let (agent, mut publisher, _, _) = started(&cache_config(16, 1000), false, 50).await;
    let (before, _) = agent.memory();
    publisher.frame(1, b"kv").await;
    publisher.frame(1, &1u64.to_be_bytes()).await;
    let len = 600 * MIB;
    publisher.header(0, len).await;
    let chunk = vec![0xc0u8; MIB as usize];
    for _ in 0..len / MIB {
        publisher.tcp.write_all(&chunk).await.unwrap();
    }
    // Batch 1 was the refused one: batch 2 shows a gap (no replay socket:
    // a new incarnation), and is applied.
    publisher.batch(2, &stored([2], 16)).await;
    until("the frame refused and batch 2 applied", || async {
        agent
            .counter("kvroute_agent_malformed_total", Some("oversized"))
            .await
            == 1
            && agent.counter("kvroute_agent_batches_total", None).await == 2
    })
    .await;
    let (_, peak) = agent.memory();
    eprintln!(
        "600 MiB frame: resident {} MiB before, peak {} MiB",
        before / MIB,
        peak / MIB
    );
    assert!(
        peak < before + 64 * MIB,
        "peak {peak} over {before} + 64 MiB: the frame was kept"
    );
    assert_eq!(agent.readyz().await.0, 200);
}

#[tokio::test]
async fn a_message_of_three_million_empty_frames_is_refused_unkept() {
    let (agent, mut publisher, _, _) = started(&cache_config(16, 1000), false, 50).await;
    let (before, _) = agent.memory();
    let frames = 3_000_000usize;
    let mut bytes = [1u8, 0].repeat(frames);
    bytes[2 * frames - 2] = 0; // the last frame ends the message
    publisher.tcp.write_all(&bytes).await.unwrap();
    publisher.batch(1, &stored([2], 16)).await;
    until("the flood refused and batch 1 applied", || async {
        agent
            .counter("kvroute_agent_malformed_total", Some("frames"))
            .await
            == 1
            && agent.counter("kvroute_agent_batches_total", None).await == 2
    })
    .await;
    let (_, peak) = agent.memory();
    eprintln!(
        "3M empty frames: resident {} MiB before, peak {} MiB",
        before / MIB,
        peak / MIB
    );
    assert!(
        peak < before + 64 * MIB,
        "peak {peak} over {before} + 64 MiB"
    );
    assert_eq!(agent.readyz().await.0, 200);
}

/// 60 MiB of one-byte msgpack integers (under the frame limit) would
/// decode into a tree of gigabytes: refused by counting, not decoding.
#[tokio::test]
async fn a_payload_of_tiny_values_is_refused_before_decoding() {
    let (agent, mut publisher, _, _) = started(&cache_config(16, 1000), false, 50).await;
    let (before, _) = agent.memory();
    let n = 60 * MIB as usize;
    let mut payload = vec![0xdd]; // array 32
    payload.extend_from_slice(&(n as u32).to_be_bytes());
    payload.resize(5 + n, 0x01);
    publisher.batch(1, &payload).await;
    publisher.batch(2, &stored([2], 16)).await;
    until("the payload refused and batch 2 applied", || async {
        agent
            .counter("kvroute_agent_malformed_total", Some("values"))
            .await
            == 1
            && agent.counter("kvroute_agent_batches_total", None).await == 2
    })
    .await;
    let (_, peak) = agent.memory();
    eprintln!(
        "60 MiB of one-byte values: resident {} MiB before, peak {} MiB",
        before / MIB,
        peak / MIB
    );
    assert!(
        peak < before + 160 * MIB,
        "peak {peak} over {before} + 160 MiB: the payload was decoded"
    );
    assert_eq!(agent.readyz().await.0, 200);
}

/// A batch of one `BlockStored` of block `hash` whose LoRA name is
/// `padding` bytes long: large, and cheap to decode.
fn padded(hash: u64, padding: usize) -> Vec<u8> {
    let event = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(hash)]),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(Vec::new())),
        (Value::from("block_size"), Value::from(16)),
        (Value::from("lora_id"), Value::from(1)),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("lora_name"), Value::from("x".repeat(padding))),
    ]);
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![event])]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

#[tokio::test]
async fn a_replay_flood_is_applied_as_it_comes_and_memory_goes_back() {
    const BATCHES: u64 = 60;
    const PADDING: usize = 10 << 20;
    let (agent, mut publisher, router, _) = started(&cache_config(16, 1000), true, 50).await;
    let (before, _) = agent.memory();
    // Batch BATCHES + 1 reveals a gap; the replay brings batches 1 to
    // BATCHES, 10 MiB each (600 MiB in all), as fast as the agent reads.
    publisher.batch(BATCHES + 1, &stored([u64::MAX], 16)).await;
    let mut replayer = Peer::accept(router.as_ref().unwrap(), "ROUTER").await;
    let request = replayer.read_message().await;
    assert_eq!(request, [Vec::new(), 1u64.to_be_bytes().to_vec()]);
    for seq in 1..=BATCHES {
        let payload = padded(seq, PADDING);
        replayer
            .send(&[b"", b"kv", &seq.to_be_bytes(), &payload])
            .await;
    }
    replayer.send(&[b"", b"", &[0xff; 8], b""]).await;
    until("the replay filled the gap", || async {
        agent
            .counter("kvroute_agent_replays_total", Some("filled"))
            .await
            == 1
    })
    .await;
    let (after, peak) = agent.memory();
    eprintln!(
        "replay flood of {BATCHES} batches of 10 MiB: resident {} MiB before, {} MiB after, \
         peak {} MiB",
        before / MIB,
        after / MIB,
        peak / MIB
    );
    // One batch in flight at a time, in a few copies (frame, msgpack
    // value, event), never the replay's 600 MiB.
    assert!(
        peak < before + 128 * MIB,
        "peak {peak} over {before} + 128 MiB: the replay was gathered"
    );
    assert_eq!(
        agent.counter("kvroute_agent_resident_blocks", None).await,
        BATCHES + 2
    );
    let since = std::time::Instant::now();
    until("resident memory back within 64 MiB of before", || async {
        agent.memory().0 < before + 64 * MIB
    })
    .await;
    eprintln!(
        "replay flood: resident {} MiB {:.1} s after it",
        agent.memory().0 / MIB,
        since.elapsed().as_secs_f64()
    );
    assert_eq!(agent.readyz().await.0, 200);
}

#[tokio::test]
async fn an_odd_block_size_stops_serving_until_the_engine_agrees_again() {
    // Scrapes a second apart, so the fault is seen before it clears.
    let (agent, mut publisher, _, text) = started(&cache_config(16, 1000), false, 1000).await;
    // One BlockStored of another size: skipped, and a fault, until a
    // scrape interval passes with none (the engine's config says 16).
    publisher.batch(1, &stored([2], 4)).await;
    until("the odd event faults", || async {
        let (status, body) = agent.readyz().await;
        status == 503 && body.contains("blocks of 4 tokens") && body.contains("--block-size 16")
    })
    .await;
    assert_eq!(
        agent
            .counter("kvroute_agent_malformed_total", Some("block_size"))
            .await,
        1
    );
    until("ready again", || async { agent.readyz().await.0 == 200 }).await;

    // The engine's config says another size: a fault while it says so.
    *text.lock().unwrap() = cache_config(4, 1000);
    until("the config faults", || async {
        let (status, body) = agent.readyz().await;
        status == 503 && body.contains("block_size 4")
    })
    .await;
    *text.lock().unwrap() = cache_config(16, 1000);
    until("ready again", || async { agent.readyz().await.0 == 200 }).await;
    // Still following: the next batch is applied.
    publisher.batch(2, &stored([3], 16)).await;
    until("batch 2 applied", || async {
        agent.counter("kvroute_agent_batches_total", None).await == 3
    })
    .await;
    let blocks = agent.counter("kvroute_agent_resident_blocks", None).await;
    assert_eq!(blocks, 2, "blocks 1 and 3, not the odd 2");
}
