//! `kvroute-agent`: the sidecar that runs beside an unmodified vLLM
//! container, subscribes to its KV cache events over ZMQ and serves them as
//! kvroute's WatchCache stream, so routers can route exactly by what vLLM
//! holds.
//!
//! Built so far: decoding vLLM's event messages ([`events`]) and rebuilding
//! the resident set and the sequence state from them ([`resident`]). The
//! ZMQ subscriber, replay, the WatchCache server and the binary come next;
//! until then vLLM pods are routed in approximate mode.

pub mod events;
pub mod resident;
