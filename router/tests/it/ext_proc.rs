//! The endpoint picker (Envoy ext_proc) driven by a tonic client playing
//! Envoy: whole exchanges over engine sims, compared with what the HTTP
//! proxy decides for the same request and state.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::support::{Stack, chat, eventually, long_text, sum_of};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    body_mutation::Mutation, processing_request::Request as Message,
    processing_response::Response as Answer,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

/// One `Process` stream, as Envoy drives it.
struct Envoy {
    to: Option<mpsc::Sender<ProcessingRequest>>,
    from: Streaming<ProcessingResponse>,
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    })
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

/// `envoy.lb`-style metadata: `namespace` → `key` → `value`.
fn metadata(namespace: &str, key: &str, value: Value) -> Option<Metadata> {
    let mut filter_metadata = HashMap::new();
    filter_metadata.insert(
        namespace.to_owned(),
        Struct {
            fields: [(key.to_owned(), value)].into(),
        },
    );
    Some(Metadata {
        filter_metadata,
        ..Metadata::default()
    })
}

impl Envoy {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Envoy {
        let (to, rx) = mpsc::channel(1024);
        let from = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("the stream opens")
            .into_inner();
        Envoy { to: Some(to), from }
    }

    async fn send(&self, request: Message, metadata_context: Option<Metadata>) {
        self.to
            .as_ref()
            .unwrap()
            .send(ProcessingRequest {
                request: Some(request),
                metadata_context,
                ..ProcessingRequest::default()
            })
            .await
            .unwrap();
    }

    /// Request headers of a POST to `path`, more to come.
    async fn request_headers(&self, path: &str, extra: &[(&str, &str)], hint: Option<Metadata>) {
        let mut pairs = vec![
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ];
        pairs.extend_from_slice(extra);
        let h = HttpHeaders {
            headers: headers(&pairs),
            end_of_stream: false,
            ..HttpHeaders::default()
        };
        self.send(Message::RequestHeaders(h), hint).await;
    }

    /// A stream that has sent a POST to the chat path (with `extra` headers
    /// and the `hint` metadata) and `body` in chunks of `sizes`.
    async fn chat(
        client: &mut ExternalProcessorClient<Channel>,
        extra: &[(&str, &str)],
        hint: Option<Metadata>,
        body: &[u8],
        sizes: &[usize],
    ) -> Envoy {
        let envoy = Envoy::open(client).await;
        envoy
            .request_headers("/v1/chat/completions", extra, hint)
            .await;
        envoy.request_body(body, sizes, false).await;
        envoy
    }

    /// The body in chunks of the given sizes (cycled), the last with
    /// `end_of_stream` unless `trailers`.
    async fn request_body(&self, body: &[u8], sizes: &[usize], trailers: bool) {
        let mut at = 0;
        let mut i = 0;
        while at < body.len() {
            let n = sizes[i % sizes.len()].min(body.len() - at);
            i += 1;
            let end = at + n == body.len();
            self.send(
                Message::RequestBody(HttpBody {
                    body: body[at..at + n].to_vec(),
                    end_of_stream: end && !trailers,
                    ..HttpBody::default()
                }),
                None,
            )
            .await;
            at += n;
        }
        if trailers {
            self.send(
                Message::RequestTrailers(HttpTrailers {
                    trailers: headers(&[("x-done", "1")]),
                }),
                None,
            )
            .await;
        }
    }

    async fn next(&mut self) -> Answer {
        let m = tokio::time::timeout(Duration::from_secs(20), self.from.message())
            .await
            .expect("an answer in time")
            .expect("no gRPC error")
            .expect("the stream is open");
        m.response.expect("an answer")
    }

    /// The decision: the destination header, the `envoy.lb` metadata's
    /// value, and the body sent back (with whether its last chunk ended
    /// the stream).
    async fn decision(&mut self) -> Decision {
        let m = tokio::time::timeout(Duration::from_secs(20), self.from.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let Some(Answer::RequestHeaders(h)) = m.response else {
            panic!("expected the request headers answer, got {:?}", m.response);
        };
        let common = h.response.unwrap();
        assert!(common.clear_route_cache);
        let mutation = common.header_mutation.unwrap();
        let removed = mutation.remove_headers;
        let set: HashMap<String, String> = mutation
            .set_headers
            .into_iter()
            .map(|o| {
                let h = o.header.unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect();
        let lb = &m.dynamic_metadata.unwrap().fields["envoy.lb"];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("envoy.lb is not a struct")
        };
        let Some(Kind::StringValue(meta)) = &lb.fields["x-gateway-destination-endpoint"].kind
        else {
            panic!("the metadata value is not a string")
        };
        let header = set["x-gateway-destination-endpoint"].clone();
        assert_eq!(&header, meta, "header and metadata agree");
        let mut body = Vec::new();
        let mut ended = false;
        let length = set.get("content-length").cloned();
        while length
            .as_deref()
            .is_some_and(|l| body.len() < l.parse().unwrap())
        {
            let Answer::RequestBody(b) = self.next().await else {
                panic!("expected body chunks")
            };
            let Some(Mutation::StreamedResponse(chunk)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("expected a streamed body response")
            };
            assert!(chunk.body.len() <= 62_000);
            assert!(!ended, "a chunk after the end");
            body.extend(chunk.body);
            ended = chunk.end_of_stream;
        }
        Decision {
            endpoints: header.split(',').map(|s| s.parse().unwrap()).collect(),
            body,
            ended,
            request_id: set["x-request-id"].clone(),
            prefiller: set.get("x-prefiller-host-port").cloned(),
            removed,
        }
    }

    /// Response headers with `status`, the served endpoint in `envoy.lb`;
    /// returns the headers the picker sets on them.
    async fn response_headers(
        &mut self,
        status: &str,
        content_type: &str,
        served: Option<SocketAddr>,
    ) -> HashMap<String, String> {
        let md = served.and_then(|s| {
            metadata(
                "envoy.lb",
                "x-gateway-destination-endpoint-served",
                string(&s.to_string()),
            )
        });
        let h = HttpHeaders {
            headers: headers(&[(":status", status), ("content-type", content_type)]),
            end_of_stream: false,
            ..HttpHeaders::default()
        };
        self.send(Message::ResponseHeaders(h), md).await;
        let Answer::ResponseHeaders(h) = self.next().await else {
            panic!("expected the response headers answer")
        };
        (h.response.and_then(|r| r.header_mutation))
            .map(|m| m.set_headers)
            .unwrap_or_default()
            .into_iter()
            .map(|o| {
                let h = o.header.unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect()
    }

    /// Sends response body chunks and returns what came back.
    async fn response_body(&mut self, chunks: &[&str]) -> Vec<u8> {
        let mut back = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let end = i + 1 == chunks.len();
            self.send(
                Message::ResponseBody(HttpBody {
                    body: c.as_bytes().to_vec(),
                    end_of_stream: end,
                    ..HttpBody::default()
                }),
                None,
            )
            .await;
            let Answer::ResponseBody(b) = self.next().await else {
                panic!("expected a response body answer")
            };
            let Some(Mutation::StreamedResponse(chunk)) =
                b.response.unwrap().body_mutation.unwrap().mutation
            else {
                panic!("expected the chunk back")
            };
            assert_eq!(chunk.end_of_stream, end);
            back.extend(chunk.body);
        }
        back
    }

    /// The immediate response that refuses the request: status, headers,
    /// body.
    async fn refusal(&mut self) -> (u32, HashMap<String, String>, serde_json::Value) {
        let Answer::ImmediateResponse(r) = self.next().await else {
            panic!("expected an immediate response")
        };
        let set = r
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|o| {
                let h = o.header.unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect();
        (
            r.status.unwrap().code as u32,
            set,
            serde_json::from_slice(&r.body).unwrap(),
        )
    }
}

struct Decision {
    endpoints: Vec<SocketAddr>,
    body: Vec<u8>,
    ended: bool,
    /// The `x-request-id` set on the request.
    request_id: String,
    /// The headers removed from the request.
    removed: Vec<String>,
    /// `x-prefiller-host-port`, when set.
    prefiller: Option<String>,
}

async fn picker(
    name: &str,
    n: usize,
    exact: bool,
    config: impl FnOnce(&mut kvroute_router::Config),
) -> (Stack, ExternalProcessorClient<Channel>) {
    let stack = Stack::start(
        name,
        n,
        exact,
        |_| {},
        |c| {
            c.ext_proc = Some(kvroute_router::config::ExtProc {
                listen: "127.0.0.1:0".parse().unwrap(),
                ..Default::default()
            });
            config(c);
        },
    )
    .await;
    if exact {
        stack.wait_live().await;
    }
    eventually("endpoints are routable", || {
        stack.router.pool.routable() == n
    })
    .await;
    let addr = stack.router.ext_proc_addr.unwrap();
    let client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (stack, client)
}

/// The HTTP proxy's ranking for `body` (`/debug/explain`), as addresses.
async fn explained(stack: &Stack, body: &serde_json::Value) -> Vec<SocketAddr> {
    let r: serde_json::Value = stack
        .client
        .post(format!("http://{}/debug/explain", stack.router.admin_addr))
        .json(&json!({"path": "/v1/chat/completions", "body": body}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let addrs: HashMap<String, SocketAddr> = stack.router.pool.members().into_iter().collect();
    r["decision"]["ranked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| addrs[n.as_str().unwrap()])
        .collect()
}

fn in_flight(stack: &Stack, addr: SocketAddr) -> u32 {
    stack
        .router
        .pool
        .status()
        .into_iter()
        .find(|e| e.http == addr.to_string())
        .unwrap()
        .in_flight
}

#[tokio::test]
async fn picks_as_the_proxy_does_and_follows_the_response() {
    let (stack, mut client) = picker("xp-pick", 3, true, |_| {}).await;
    let system = format!("{} — café, naïve, 東京 ✓", long_text(1));
    let holder = stack.warm(&system).await;
    let holder: SocketAddr = stack
        .router
        .pool
        .members()
        .into_iter()
        .find(|(n, _)| *n == holder)
        .unwrap()
        .1;
    let request = chat(&system, "second question", 4);
    let body = serde_json::to_vec(&request).unwrap();
    let expected = explained(&stack, &request).await;
    let missed_before = sum_of(&stack.metrics().await, "kvroute_missed_prompt_tokens_total");

    let mut envoy = Envoy::open(&mut client).await;
    envoy
        .request_headers(
            "/v1/chat/completions?x=1",
            &[("x-request-id", "pick-1")],
            None,
        )
        .await;
    // Chunks of 1, 3 and 7 bytes split multi-byte characters and JSON
    // strings anywhere.
    envoy.request_body(&body, &[1, 3, 7, 250], false).await;
    let d = envoy.decision().await;
    assert_eq!(d.endpoints, expected, "the same ranking as the HTTP proxy");
    assert_eq!(d.endpoints[0], holder, "the warm endpoint first");
    assert_eq!(
        d.endpoints.len(),
        3,
        "every endpoint, as the fallback order"
    );
    assert_eq!(d.body, body, "the body goes back whole");
    assert!(d.ended);
    assert_eq!(in_flight(&stack, holder), 1, "the pick carries the load");
    assert_eq!(d.request_id, "pick-1", "the engine gets the request's id");

    let set = envoy
        .response_headers("200", "text/event-stream", Some(holder))
        .await;
    assert_eq!(set["x-request-id"], "pick-1", "and so does the client");
    let events = [
        "data: {\"choices\":[{\"delta\":{\"content\":\"h\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1,",
        "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n",
    ];
    let back = envoy.response_body(&events).await;
    assert_eq!(
        back,
        events.concat().into_bytes(),
        "streamed back unchanged"
    );
    assert_eq!(in_flight(&stack, holder), 0, "the end releases the load");
    let metrics = stack.metrics().await;
    assert!(sum_of(&metrics, "kvroute_observed_cached_tokens_total") >= 32.0);
    assert!(metrics.contains("kvroute_requests_total{model=\"kvroute-sim\",status=\"200\"}"));
    // Its 8 missed tokens are attributed (the engine counted another
    // prompt than the router read: unknown, but the last block).
    let missed = sum_of(&metrics, "kvroute_missed_prompt_tokens_total");
    assert_eq!(missed - missed_before, 8.0);
    let url = format!("http://{}/debug/requests/pick-1", stack.router.admin_addr);
    let record: serde_json::Value = reqwest::get(&url).await.unwrap().json().await.unwrap();
    let missed: Vec<(String, u64)> = serde_json::from_value(record["missed"].clone()).unwrap();
    assert_eq!(missed.iter().map(|m| m.1).sum::<u64>(), 8, "{record}");
    stack.stop().await;
}

#[tokio::test]
async fn multi_megabyte_bodies_and_trailers() {
    let (stack, mut client) = picker("xp-large", 2, false, |_| {}).await;
    let text: String = "é a ✓ routing text ".repeat(150_000); // ~3.4 MB
    let request = chat(&text, "summarize", 1);
    let body = serde_json::to_vec(&request).unwrap();
    assert!(body.len() > 3_000_000);

    let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[65_537, 1, 16_383]).await;
    let d = envoy.decision().await;
    assert_eq!(d.body, body);
    assert!(d.ended);
    assert_eq!(d.endpoints.len(), 2);

    // A body that ends with trailers: the last chunk does not end the
    // stream, the trailers answer follows.
    let small = serde_json::to_vec(&chat("short", "hi", 1)).unwrap();
    drop(envoy);
    let mut envoy = Envoy::open(&mut client).await;
    envoy
        .request_headers("/v1/chat/completions", &[], None)
        .await;
    envoy.request_body(&small, &[5], true).await;
    let d = envoy.decision().await;
    assert_eq!(d.body, small);
    assert!(!d.ended, "trailers end the body, not its last chunk");
    assert!(matches!(envoy.next().await, Answer::RequestTrailers(_)));

    // A non-streaming response, passed back; then trailers.
    envoy
        .response_headers("200", "application/json", None)
        .await;
    let back = envoy.response_body(&["{\"choices\":[", "]}"]).await;
    assert_eq!(back, b"{\"choices\":[]}");
    stack.stop().await;
}

#[tokio::test]
async fn subset_hints_restrict_the_choice() {
    let (stack, mut client) = picker("xp-subset", 3, true, |_| {}).await;
    let system = long_text(2);
    let holder_name = stack.warm(&system).await;
    let members = stack.router.pool.members();
    let holder = members.iter().find(|(n, _)| *n == holder_name).unwrap().1;
    let others: Vec<SocketAddr> = members
        .iter()
        .map(|(_, a)| *a)
        .filter(|a| *a != holder)
        .collect();
    let body = serde_json::to_vec(&chat(&system, "again", 2)).unwrap();

    // A hint that excludes the warm endpoint: the choice is among the rest.
    let hint = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: others.iter().map(|a| string(&a.to_string())).collect(),
        })),
    };
    let mut envoy = Envoy::chat(
        &mut client,
        &[],
        metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            hint,
        ),
        &body,
        &[100],
    )
    .await;
    let d = envoy.decision().await;
    assert!(!d.endpoints.contains(&holder));
    assert_eq!(d.endpoints.len(), 2);

    // A bare IP matches that pod's ports; the header form works too.
    drop(envoy);
    let mut envoy = Envoy::open(&mut client).await;
    let ip_only = others[0].ip().to_string();
    envoy
        .request_headers(
            "/v1/chat/completions",
            &[(
                "x-gateway-destination-endpoint-subset",
                &others[1].to_string(),
            )],
            None,
        )
        .await;
    envoy.request_body(&body, &[100], false).await;
    let d = envoy.decision().await;
    assert_eq!(d.endpoints, vec![others[1]]);
    // (every sim is on 127.0.0.1, so an IP allows them all)
    drop(envoy);
    let mut envoy = Envoy::chat(
        &mut client,
        &[],
        metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            string(&ip_only),
        ),
        &body,
        &[100],
    )
    .await;
    assert_eq!(envoy.decision().await.endpoints[0], holder);

    // A hint that names no known endpoint: 503.
    drop(envoy);
    let mut envoy = Envoy::chat(
        &mut client,
        &[],
        metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            string("10.9.9.9:8000"),
        ),
        &body,
        &[100],
    )
    .await;
    let (status, headers, error) = envoy.refusal().await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(error["error"]["code"], "no_ready_endpoint");
    drop(envoy);
    stack.stop().await;
}

#[tokio::test]
async fn the_served_endpoint_takes_the_load() {
    let (stack, mut client) = picker("xp-served", 2, false, |_| {}).await;
    let body = serde_json::to_vec(&chat(&long_text(3), "q", 2)).unwrap();
    let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[4096]).await;
    let d = envoy.decision().await;
    let (pick, other) = (d.endpoints[0], d.endpoints[1]);
    assert_eq!((in_flight(&stack, pick), in_flight(&stack, other)), (1, 0));
    envoy
        .response_headers("200", "text/event-stream", Some(other))
        .await;
    assert_eq!((in_flight(&stack, pick), in_flight(&stack, other)), (0, 1));

    // The gateway drops the stream mid-response (the client went away):
    // the load is released.
    drop(envoy);
    eventually("the load is released", || in_flight(&stack, other) == 0).await;

    // The policy learnt the served endpoint: the same prompt goes there.
    let explain_body = chat(&long_text(3), "q", 2);
    assert_eq!(explained(&stack, &explain_body).await[0], other);
    stack.stop().await;
}

#[tokio::test]
async fn a_clients_router_headers_are_removed_before_the_engine() {
    let (stack, mut client) = picker("xp-own-headers", 1, false, |_| {}).await;
    let body = serde_json::to_vec(&chat("s", "u", 1)).unwrap();
    let extra = [
        ("x-kvroute-admit-within-ms", "0"),
        ("x-kvroute-cache-sampled", "1"),
        ("x-prefiller-host-port", "169.254.169.254:80"),
        ("x-kept", "1"),
    ];
    let mut envoy = Envoy::chat(&mut client, &extra, None, &body, &[64]).await;
    let d = envoy.decision().await;
    let mut removed = d.removed;
    removed.sort();
    assert_eq!(
        removed,
        [
            "x-kvroute-admit-within-ms",
            "x-kvroute-cache-sampled",
            "x-prefiller-host-port",
            "x-prefiller-url"
        ]
    );
    assert_eq!(d.prefiller, None);
    drop(envoy);
    stack.stop().await;
}

#[tokio::test]
async fn refusals_are_immediate_responses() {
    let (stack, mut client) = picker("xp-refuse", 1, false, |c| {
        c.limits.endpoint_concurrency = 1;
        c.flow_control.max_queued = 0;
    })
    .await;
    // Unparseable JSON: 400.
    let mut envoy = Envoy::chat(&mut client, &[], None, b"{\"model\": ", &[3]).await;
    let (status, headers, error) = envoy.refusal().await;
    assert_eq!(status, 400);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(error["error"]["type"], "invalid_request_error");

    // A path that is not proxied: 404, at the headers.
    drop(envoy);
    let mut envoy = Envoy::open(&mut client).await;
    envoy.request_headers("/admin/secret", &[], None).await;
    assert_eq!(envoy.refusal().await.0, 404);

    // The one endpoint is busy with an exchange in flight: 429 with
    // Retry-After (the queue holds none).
    let body = serde_json::to_vec(&chat("s", "u", 1)).unwrap();
    let mut first = Envoy::chat(&mut client, &[], None, &body, &[64]).await;
    first.decision().await;
    let mut second = Envoy::chat(&mut client, &[], None, &body, &[64]).await;
    let (status, headers, error) = second.refusal().await;
    assert_eq!(status, 429);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(error["error"]["type"], "rate_limit_error");
    drop(first);
    stack.stop().await;
}

#[tokio::test]
async fn many_streams_share_one_connection() {
    let (stack, client) = picker("xp-many", 3, false, |_| {}).await;
    let mut tasks = Vec::new();
    for i in 0..64 {
        // Clones share the channel: one HTTP/2 connection.
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            let body = serde_json::to_vec(&chat(&long_text(i), "q", 1)).unwrap();
            let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[777]).await;
            let d = envoy.decision().await;
            assert_eq!(d.body, body);
            envoy
                .response_headers("200", "application/json", None)
                .await;
            envoy.response_body(&["{}"]).await;
            d.endpoints[0]
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let metrics = stack.metrics().await;
    assert_eq!(
        sum_of(&metrics, "kvroute_requests_total"),
        64.0,
        "each exchange counted once"
    );
    for (_, addr) in stack.router.pool.members() {
        assert_eq!(in_flight(&stack, addr), 0);
    }
    stack.stop().await;
}

#[tokio::test]
async fn health_services_report_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let (stack, _client) = picker("xp-health", 1, false, |_| {}).await;
    let addr = stack.router.ext_proc_addr.unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let what = format!("{service} serving");
        kvroute_testkit::eventually(&what, Duration::from_secs(10), || {
            let mut health = health.clone();
            async move {
                let status = health
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .status();
                (status == ServingStatus::Serving).then_some(())
            }
        })
        .await;
    }
    let ready =
        crate::support::get_text(&format!("http://{}/readyz", stack.router.admin_addr)).await;
    assert!(ready.starts_with("ready: 1"), "{ready}");
    stack.stop().await;
}

#[tokio::test]
async fn the_picker_speaks_mutual_tls() {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let fixture = |name: &str| {
        std::fs::read(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tls")
                .join(name),
        )
        .unwrap()
    };
    let path = |name: &str| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tls")
            .join(name)
    };
    let stack = Stack::start(
        "xp-tls",
        1,
        false,
        |_| {},
        |c| {
            c.ext_proc = Some(kvroute_router::config::ExtProc {
                listen: "127.0.0.1:0".parse().unwrap(),
                tls: Some(kvroute_router::config::Tls {
                    cert_file: path("server.crt"),
                    key_file: path("server.key"),
                    client_ca_file: Some(path("ca.crt")),
                }),
                ..Default::default()
            });
        },
    )
    .await;
    let addr = stack.router.ext_proc_addr.unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(fixture("ca.crt")))
        .identity(Identity::from_pem(
            fixture("client.crt"),
            fixture("client.key"),
        ))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let live = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "liveness".into(),
        })
        .await;
    assert!(live.is_ok(), "{live:?}");
    // Plaintext gRPC is not served on a TLS listener.
    let plain = async {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await?;
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: "liveness".into(),
            })
            .await
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    let plain = tokio::time::timeout(Duration::from_secs(5), plain).await;
    assert!(!matches!(plain, Ok(Ok(()))), "plaintext was served");
    stack.stop().await;
}

#[tokio::test]
async fn salted_tenancy_rewrites_the_body_and_checks_keys() {
    let dir = crate::support::temp_dir("xp-salted-secrets");
    std::fs::write(dir.join("keys.yaml"), "k-alice: alice\n").unwrap();
    std::fs::write(dir.join("secret"), "s3cret").unwrap();
    let (stack, mut client) = picker("xp-salted", 2, false, |c| {
        c.tenancy.mode = kvroute_router::config::TenancyMode::Salted;
        c.tenancy.api_keys_file = Some(dir.join("keys.yaml"));
        c.tenancy.secret_file = Some(dir.join("secret"));
    })
    .await;
    let body = serde_json::to_vec(&chat("system", "hello", 1)).unwrap();

    // No key: 401 at the headers, before any body.
    let mut envoy = Envoy::open(&mut client).await;
    envoy
        .request_headers("/v1/chat/completions", &[], None)
        .await;
    let (status, _, error) = envoy.refusal().await;
    assert_eq!(status, 401);
    assert_eq!(error["error"]["type"], "authentication_error");
    drop(envoy);

    // With a key: the body goes back with the tenant's cache_salt, and its
    // length in the headers answer.
    let mut envoy = Envoy::chat(
        &mut client,
        &[("authorization", "Bearer k-alice")],
        None,
        &body,
        &[9],
    )
    .await;
    let d = envoy.decision().await;
    let sent: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
    let salt = sent["cache_salt"].as_str().expect("a salt was set");
    assert!(!salt.is_empty());
    assert_eq!(sent["messages"], chat("system", "hello", 1)["messages"]);
    drop(envoy);
    stack.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

impl Envoy {
    /// The gRPC error that ended the stream.
    async fn error(&mut self) -> tonic::Status {
        match tokio::time::timeout(Duration::from_secs(20), self.from.message()).await {
            Ok(Err(status)) => status,
            other => panic!("expected a gRPC error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn declared_lengths_reserve_nothing_on_the_picker() {
    let (stack, mut client) = picker("xp-declared", 2, false, |c| {
        c.limits.body_min_bytes_per_s = 1;
    })
    .await;
    // 16 streams each declaring 32 MiB and sending one byte: old code
    // reserved 512 MiB, the whole budget.
    let mut held = Vec::new();
    for _ in 0..16 {
        let envoy = Envoy::open(&mut client).await;
        envoy
            .request_headers(
                "/v1/chat/completions",
                &[("content-length", "33554432")],
                None,
            )
            .await;
        envoy
            .send(
                Message::RequestBody(HttpBody {
                    body: b" ".to_vec(),
                    end_of_stream: false,
                    ..HttpBody::default()
                }),
                None,
            )
            .await;
        held.push(envoy);
    }
    let body = serde_json::to_vec(&chat("honest", "q", 1)).unwrap();
    let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[64]).await;
    let d = envoy.decision().await;
    assert_eq!(d.body, body);
    let metrics = stack.metrics().await;
    assert!(
        sum_of(&metrics, "kvroute_request_body_bytes") <= 17.0 * 1024.0,
        "{metrics}"
    );
    drop((held, envoy));
    stack.stop().await;
}

#[tokio::test]
async fn silent_streams_and_missing_response_headers_time_out() {
    let (stack, mut client) = picker("xp-deadlines", 1, false, |c| {
        let picker = c.ext_proc.as_mut().unwrap();
        picker.first_message_timeout_ms = 300;
        c.limits.first_byte_timeout_ms = 300;
    })
    .await;
    // A stream that never sends a message is ended.
    let mut silent = Envoy::open(&mut client).await;
    let status = silent.error().await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    // A pick whose response headers never come releases its load.
    let body = serde_json::to_vec(&chat("s", "u", 1)).unwrap();
    let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[64]).await;
    let d = envoy.decision().await;
    assert_eq!(in_flight(&stack, d.endpoints[0]), 1);
    let status = envoy.error().await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    eventually("the load is released", || {
        in_flight(&stack, d.endpoints[0]) == 0
    })
    .await;
    let metrics = stack.metrics().await;
    assert!(metrics.contains("status=\"504\"} 1"), "{metrics}");
    // The defaults end a silent stream within a minute.
    let defaults = kvroute_router::config::ExtProc::default();
    assert!(defaults.first_message_timeout_ms <= 60_000);
    stack.stop().await;
}

#[tokio::test]
async fn oversized_and_malformed_messages_get_a_grpc_error() {
    let (stack, mut client) = picker("xp-malformed", 1, false, |c| {
        c.limits.max_body_bytes = 64 << 10;
    })
    .await;
    // A chunk over the decode limit (the body limit and some room).
    let envoy = Envoy::open(&mut client).await;
    envoy
        .request_headers("/v1/chat/completions", &[], None)
        .await;
    let mut envoy = envoy;
    envoy
        .send(
            Message::RequestBody(HttpBody {
                body: vec![b' '; 1 << 20],
                end_of_stream: false,
                ..HttpBody::default()
            }),
            None,
        )
        .await;
    let status = envoy.error().await;
    assert_ne!(status.code(), tonic::Code::Ok, "{status}");
    assert!(status.message().contains("too large"), "{status}");
    // Bytes that are no ProcessingRequest, sent as a gRPC message.
    let status = raw_grpc(stack.router.ext_proc_addr.unwrap(), &[0xff; 7]).await;
    assert_ne!(status, "0", "a malformed message is not a success");
    stack.stop().await;
}

/// Sends `message` as one gRPC message on a `Process` stream, over a bare
/// HTTP/2 connection, and returns the `grpc-status` that ended it.
async fn raw_grpc(addr: SocketAddr, message: &[u8]) -> String {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    let request = hyper::Request::post(format!(
        "http://{addr}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(http_body_util::Full::new(bytes::Bytes::from(frame)))
    .unwrap();
    let response = send.send_request(request).await.unwrap();
    if let Some(status) = response.headers().get("grpc-status") {
        return status.to_str().unwrap().to_owned();
    }
    let collected = tokio::time::timeout(Duration::from_secs(20), response.into_body().collect())
        .await
        .unwrap()
        .unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    trailers
        .get("grpc-status")
        .map(|s| s.to_str().unwrap().to_owned())
        .unwrap_or_else(|| "none".into())
}

/// Statuses a gateway reports feed ejection only from a trusted picker:
/// anyone who reaches an untrusted one could eject healthy endpoints.
#[tokio::test]
async fn only_a_trusted_picker_reports_statuses_that_eject() {
    for trusted in [false, true] {
        let (stack, mut client) = picker("xp-trust", 4, false, |c| {
            c.resilience.health_check = None;
            c.ext_proc.as_mut().unwrap().trusted_network = trusted;
        })
        .await;
        let body = serde_json::to_vec(&chat("s", "u", 1)).unwrap();
        for _ in 0..12 {
            let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[64]).await;
            let d = envoy.decision().await;
            envoy
                .response_headers("503", "application/json", Some(d.endpoints[0]))
                .await;
            envoy.response_body(&["{}"]).await;
        }
        let ejected = stack
            .router
            .pool
            .status()
            .iter()
            .filter(|e| e.ejected)
            .count();
        if trusted {
            assert!(ejected > 0, "a trusted picker's 503s eject");
        } else {
            assert_eq!(ejected, 0, "an untrusted picker's 503s eject nothing");
        }
        stack.stop().await;
    }
}

/// One message a gateway might send, in any order: (kind, body size,
/// end_of_stream).
fn any_message() -> impl proptest::strategy::Strategy<Value = (u8, usize, bool)> {
    use proptest::prelude::*;
    (
        0u8..6,
        prop_oneof![0usize..64, 64usize..4096, 60_000usize..400_000],
        any::<bool>(),
    )
}

fn message_of((kind, size, end): (u8, usize, bool), body: &[u8]) -> Message {
    let chunk = || HttpBody {
        body: body.iter().copied().cycle().take(size).collect(),
        end_of_stream: end,
        ..HttpBody::default()
    };
    match kind {
        0 => Message::RequestHeaders(HttpHeaders {
            headers: headers(&[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
            ]),
            end_of_stream: end,
            ..HttpHeaders::default()
        }),
        1 => Message::RequestBody(chunk()),
        2 => Message::RequestTrailers(HttpTrailers {
            trailers: headers(&[("x-done", "1")]),
        }),
        3 => Message::ResponseHeaders(HttpHeaders {
            headers: headers(&[(":status", if end { "503" } else { "200" })]),
            end_of_stream: false,
            ..HttpHeaders::default()
        }),
        4 => Message::ResponseBody(chunk()),
        _ => Message::ResponseTrailers(HttpTrailers::default()),
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 4, ..Default::default() })]

    /// Random message orders and sizes (over and under the limits): every
    /// stream ends once the gateway closes its side, an error is never a
    /// gRPC OK, and nothing is left held: no load, no body budget.
    #[test]
    fn any_message_order_ends_and_releases_everything(
        streams in proptest::collection::vec(proptest::collection::vec(any_message(), 0..8), 24)
    ) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let (stack, client) = picker("xp-prop", 2, false, |c| {
                c.limits.max_body_bytes = 64 << 10;
                c.limits.first_byte_timeout_ms = 2_000;
            })
            .await;
            let body = serde_json::to_vec(&chat("prop", "q", 1)).unwrap();
            let runs = streams.into_iter().map(|messages| {
                let mut client = client.clone();
                let body = body.clone();
                async move {
                    let mut envoy = Envoy::open(&mut client).await;
                    for m in messages {
                        let sent = envoy.to.as_ref().unwrap().send(ProcessingRequest {
                            request: Some(message_of(m, &body)),
                            ..ProcessingRequest::default()
                        });
                        if sent.await.is_err() {
                            break;
                        }
                    }
                    envoy.to = None;
                    loop {
                        let next = tokio::time::timeout(Duration::from_secs(20), envoy.from.message())
                            .await
                            .expect("the stream ends once the gateway closes its side");
                        match next {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(status) => {
                                assert_ne!(status.code(), tonic::Code::Ok, "{status}");
                                break;
                            }
                        }
                    }
                }
            });
            futures_util::future::join_all(runs).await;
            eventually("no load left", || {
                stack.router.pool.status().iter().all(|e| e.in_flight == 0 && e.prefill_tokens == 0)
            })
            .await;
            kvroute_testkit::eventually(
                "no body budget left held",
                Duration::from_secs(10),
                || async {
                    let held = sum_of(&stack.metrics().await, "kvroute_request_body_bytes");
                    (held == 0.0).then_some(())
                },
            )
            .await;
            stack.stop().await;
        });
    }
}

#[tokio::test]
async fn a_disaggregated_request_names_its_prefill_endpoint_to_llm_ds_sidecar() {
    use kvroute_core::spec::{Disaggregation, DisaggregationMode};
    let mut sims = Vec::new();
    for _ in 0..2 {
        let config = kvroute_engine_sim::Config::test();
        sims.push(kvroute_engine_sim::start(config).await.unwrap());
    }
    let dir = crate::support::temp_dir("xp-split");
    std::fs::write(
        dir.join("endpoints.yaml"),
        format!(
            "endpoints:\n  - {{name: p, address: '{}', role: prefill}}\n  - {{name: d, address: '{}', role: decode}}\n",
            sims[0].http_addr, sims[1].http_addr
        ),
    )
    .unwrap();
    let mut config = crate::support::router_config(&dir);
    config.ext_proc = Some(kvroute_router::config::ExtProc {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    });
    config.routing.disaggregation = Disaggregation {
        mode: DisaggregationMode::Auto,
        min_uncached_tokens: 64,
    };
    let router = kvroute_router::start(config).await.unwrap();
    eventually("endpoints are routable", || router.pool.routable() == 2).await;
    let addr = router.ext_proc_addr.unwrap();
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap();

    // A long prompt: the decode endpoint, and the prefill one named.
    let body = serde_json::to_vec(&chat(&long_text(1), "u", 1)).unwrap();
    let mut envoy = Envoy::chat(&mut client, &[], None, &body, &[4096]).await;
    let d = envoy.decision().await;
    assert_eq!(d.endpoints, [sims[1].http_addr]);
    assert_eq!(d.prefiller, Some(sims[0].http_addr.to_string()));
    drop(envoy);
    // A short one: the decode endpoint alone, the client's header removed.
    let body = serde_json::to_vec(&chat("s", "u", 1)).unwrap();
    let extra = [("x-prefiller-host-port", "10.0.0.1:80")];
    let mut envoy = Envoy::chat(&mut client, &extra, None, &body, &[64]).await;
    let d = envoy.decision().await;
    assert_eq!(d.endpoints, [sims[1].http_addr]);
    assert_eq!(d.prefiller, None);
    assert!(d.removed.contains(&"x-prefiller-host-port".to_owned()));
    drop(envoy);
    router.shutdown().await;
    for sim in sims {
        sim.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(dir);
}
