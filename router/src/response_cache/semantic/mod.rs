//! The semantic response cache: a cacheable request whose exact key
//! misses may still be answered with the stored answer of a question that
//! means the same, when everything else in the request is identical. Its
//! last user message is embedded, and [`index`] finds the most similar
//! stored question of the same tenant and model whose rest of the request
//! (a context digest) is byte-identical; the caller serves that question's
//! answer from the exact store when the similarity reaches its threshold.
//!
//! Not here: the embeddings client, the configuration and the HTTP glue.

pub mod index;
