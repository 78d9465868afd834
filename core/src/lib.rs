//! kvroute's routing core: pure logic with no I/O.
//!
//! Everything that decides where a request goes lives here: vLLM-exact block
//! hashing ([`hash`]), routing keys ([`keys`]), rendezvous ranking
//! ([`rendezvous`]) and a new endpoint's ramp in it ([`slow_start`]), the
//! per-pool occupancy index ([`index`]), load accounting ([`load`]) with the blocks requests in flight
//! hold ([`pinned`]), the
//! routing policies ([`policy`]) and what a routing policy
//! says of a pool, with its defaults ([`spec`]); when named prefixes are
//! warmed ([`warmup`]); and the one model of an
//! engine's scheduler ([`engine`]) that the simulator and the replay run.
//! The router, the replay benchmark and the engine simulator all call this
//! crate, so a decision made in a benchmark is the decision the router makes.
//!
//! Not here: networking, clocks beyond `std::time`, Kubernetes, async runtimes.

pub mod admission;
pub mod contract;
pub mod engine;
pub mod evicted;
pub mod hash;
pub mod index;
pub mod keys;
pub mod load;
pub mod lru;
pub mod pinned;
pub mod policy;
pub mod rendezvous;
pub mod rng;
pub mod role;
pub mod slot;
pub mod slow_start;
pub mod spec;
pub mod tokenize;
pub mod warmup;
