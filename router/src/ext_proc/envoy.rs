//! Envoy's `ext_proc` messages in and out: headers and metadata read from a
//! `ProcessingRequest`, and the `ProcessingResponse`s the picker sends. No
//! routing here; the exchange ([`super::exchange`]) decides what to send.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpValue, StatusCode};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation::Mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::errors::ApiError;
use crate::request::RequestId;
use crate::request::recent::REQUEST_ID;
use crate::request::split::{OLD_PREFILLER_HEADER, PREFILLER_HEADER};

/// The header and `envoy.lb` metadata key naming the picked endpoints,
/// `ip:port,ip:port,…` best first (the Gateway API Inference Extension's
/// endpoint picker protocol).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the pick and of the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key (metadata) and header: the endpoints the picker
/// may choose among.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The key (metadata or response header) naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// Largest body chunk sent back: Envoy recommends at most 64 KiB per
/// streamed chunk; this leaves margin, as the upstream picker does.
pub const CHUNK_BYTES: usize = 62_000;

/// A request's or response's headers, with the pseudo-headers Envoy sends
/// (`:path`, `:method`, `:status`) apart. Headers that are not valid HTTP
/// are skipped.
#[derive(Debug, Default)]
pub struct Headers {
    /// The regular headers.
    pub map: HeaderMap,
    /// `:path`, with its query.
    pub path: Option<String>,
    /// `:status`.
    pub status: Option<StatusCode>,
}

impl Headers {
    /// Reads Envoy's header map (values in `raw_value`, or `value`).
    pub fn read(headers: Option<&EnvoyHeaders>) -> Self {
        let mut out = Headers::default();
        for h in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
            let raw = if h.raw_value.is_empty() {
                h.value.as_bytes()
            } else {
                &h.raw_value
            };
            match h.key.as_str() {
                ":path" => out.path = std::str::from_utf8(raw).ok().map(str::to_owned),
                ":status" => {
                    out.status = std::str::from_utf8(raw)
                        .ok()
                        .and_then(|s| s.parse::<u16>().ok())
                        .and_then(|s| StatusCode::from_u16(s).ok());
                }
                k if k.starts_with(':') => {}
                k => {
                    if let (Ok(name), Ok(value)) = (
                        HeaderName::from_bytes(k.as_bytes()),
                        HttpValue::from_bytes(raw),
                    ) {
                        out.map.append(name, value);
                    }
                }
            }
        }
        out
    }
}

/// The endpoints a gateway's subset hint allows: `ip:port` entries match
/// that address, bare IPs any port of the pod.
#[derive(Clone, Debug, PartialEq)]
pub struct Subset(Vec<Entry>);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Entry {
    Addr(SocketAddr),
    Ip(IpAddr),
}

impl Subset {
    /// The hint in `metadata` (`envoy.lb.subset_hint`, a list of strings or
    /// one comma-separated string), else in the `headers`; `None` without
    /// one. Entries that are not addresses are ignored, so a hint naming
    /// nothing usable allows nothing.
    pub fn read(metadata: Option<&Metadata>, headers: &HeaderMap) -> Option<Self> {
        let hint = metadata
            .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
            .and_then(|s| s.fields.get(SUBSET));
        let listed: Vec<String> = match hint.map(|v| &v.kind) {
            Some(Some(Kind::ListValue(list))) => list
                .values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            Some(Some(Kind::StringValue(s))) => vec![s.clone()],
            Some(_) => Vec::new(),
            None if headers.contains_key(SUBSET) => headers
                .get_all(SUBSET)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::to_owned)
                .collect(),
            None => return None,
        };
        let entries = listed
            .iter()
            .flat_map(|s| s.split(','))
            .filter_map(|s| {
                let s = s.trim();
                s.parse()
                    .map(Entry::Addr)
                    .or_else(|_| s.parse().map(Entry::Ip))
                    .ok()
            })
            .collect();
        Some(Subset(entries))
    }

    /// Whether the hint allows the endpoint at `addr`.
    pub fn allows(&self, addr: &SocketAddr) -> bool {
        self.0.iter().any(|e| match e {
            Entry::Addr(a) => a == addr,
            Entry::Ip(ip) => *ip == addr.ip(),
        })
    }
}

/// The endpoint that served, from the response headers message's
/// `envoy.lb` metadata, else the response headers.
pub fn served(metadata: Option<&Metadata>, headers: &HeaderMap) -> Option<SocketAddr> {
    let from_metadata = metadata
        .and_then(|m| m.filter_metadata.get(LB_NAMESPACE))
        .and_then(|s| s.fields.get(SERVED))
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.as_str()),
            _ => None,
        });
    let text = from_metadata.or_else(|| headers.get(SERVED)?.to_str().ok())?;
    text.split(',').next()?.trim().parse().ok()
}

/// A header set, replacing any value the request had.
fn set(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The answer to the request headers once the picker has decided: the
/// destination header (and `content-length` of the body sent back, when
/// there is one), the same value in `envoy.lb` metadata, and a cleared
/// route cache so the gateway routes on them; `remove`d: the router's own
/// headers the client sent, which must not reach the engine.
pub fn destination(
    endpoints: &str,
    body_len: Option<usize>,
    id: &RequestId,
    (prefiller, mut remove): (Option<SocketAddr>, Vec<String>),
) -> ProcessingResponse {
    let mut set_headers = vec![
        set(DESTINATION, endpoints.as_bytes()),
        set(REQUEST_ID.as_str(), id.header().as_bytes()),
    ];
    // llm-d's routing sidecar runs a disaggregated request's prefill leg
    // on the endpoint this names; a client's own is never passed on.
    match prefiller {
        Some(addr) => set_headers.push(set(PREFILLER_HEADER, addr.to_string().as_bytes())),
        None => remove.push(PREFILLER_HEADER.to_owned()),
    }
    remove.push(OLD_PREFILLER_HEADER.to_owned());
    if let Some(len) = body_len {
        set_headers.push(set("content-length", len.to_string().as_bytes()));
    }
    let lb = Struct {
        fields: [(DESTINATION.to_owned(), string(endpoints))].into(),
    };
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: remove,
                }),
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        })),
        dynamic_metadata: Some(Struct {
            fields: [(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        }),
        ..ProcessingResponse::default()
    }
}

/// Which direction a body or headers answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// The client's request.
    Request,
    /// The engine's response.
    Response,
}

/// `body` sent back in chunks of at most [`CHUNK_BYTES`], `end_of_stream`
/// on the last when `end` (an empty body is one empty chunk).
pub fn body(direction: Direction, body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![body]
    } else {
        body.chunks(CHUNK_BYTES).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            body_answer(
                direction,
                Some(BodyMutation {
                    mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                        body: chunk.to_vec(),
                        end_of_stream: end && i == last,
                        ..StreamedBodyResponse::default()
                    })),
                }),
            )
        })
        .collect()
}

/// A body chunk acknowledged unchanged (body modes other than
/// `FULL_DUPLEX_STREAMED`, where Envoy keeps the body itself).
pub fn body_unchanged(direction: Direction) -> ProcessingResponse {
    body_answer(direction, None)
}

fn body_answer(direction: Direction, mutation: Option<BodyMutation>) -> ProcessingResponse {
    let answer = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: mutation,
            ..CommonResponse::default()
        }),
    };
    ProcessingResponse {
        response: Some(match direction {
            Direction::Request => Response::RequestBody(answer),
            Direction::Response => Response::ResponseBody(answer),
        }),
        ..ProcessingResponse::default()
    }
}

/// The engine's response headers with `set` set.
pub fn response_headers(set_headers: &[(HeaderName, HttpValue)]) -> ProcessingResponse {
    let set_headers = (set_headers.iter())
        .map(|(k, v)| set(k.as_str(), v.as_bytes()))
        .collect();
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

/// Headers passed on unchanged.
pub fn headers_unchanged(direction: Direction) -> ProcessingResponse {
    let answer = HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    ProcessingResponse {
        response: Some(match direction {
            Direction::Request => Response::RequestHeaders(answer),
            Direction::Response => Response::ResponseHeaders(answer),
        }),
        ..ProcessingResponse::default()
    }
}

/// Trailers passed on unchanged.
pub fn trailers_unchanged(direction: Direction) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    ProcessingResponse {
        response: Some(match direction {
            Direction::Request => Response::RequestTrailers(answer),
            Direction::Response => Response::ResponseTrailers(answer),
        }),
        ..ProcessingResponse::default()
    }
}

/// The gateway answers the client at once with `error`: its status, an
/// OpenAI-style JSON body and `Retry-After` where the error has one.
pub fn refusal(error: &ApiError) -> ProcessingResponse {
    let mut headers = vec![set("content-type", b"application/json")];
    if let Some(s) = error.retry_after() {
        headers.push(set("retry-after", s.to_string().as_bytes()));
    }
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(error.status().as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers: headers,
                remove_headers: Vec::new(),
            }),
            body: error.body().to_string().into_bytes(),
            details: format!("kvroute_{}", error.code()),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}
