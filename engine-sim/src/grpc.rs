//! The WatchCache gRPC server: each subscriber gets the engine's snapshot,
//! then its cache changes in order, and load reports.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use kvroute_proto::v1::cache_reporter_server::CacheReporter;
use kvroute_proto::v1::{self, cache_update::Update};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::engine::{CacheBody, CacheMessage, Engine, LoadReport};

/// Serves `CacheReporter` for one engine.
#[derive(Debug, Clone)]
pub struct Reporter {
    engine: Arc<Engine>,
}

impl Reporter {
    /// A server for `engine`.
    pub fn new(engine: Arc<Engine>) -> Self {
        Reporter { engine }
    }

    fn to_proto(&self, m: CacheMessage) -> v1::CacheUpdate {
        let c = self.engine.config();
        let load = |l: LoadReport| v1::LoadReport {
            waiting: l.waiting,
            running: l.running,
            kv_usage: l.kv_usage,
            used_blocks: l.used_blocks,
            queued_prefill_tokens: Some(l.queued_prefill_tokens),
            prefill_tokens_per_s: l.prefill_tokens_per_s,
        };
        let update = match m.body {
            CacheBody::Snapshot { hashes, load: l } => Update::Snapshot(v1::CacheSnapshot {
                config: Some(v1::CacheConfig {
                    block_size: c.block_size,
                    hash_algorithm: v1::HashAlgorithm::from(c.hash_algo).into(),
                    hash_seed_set: c.hash_seed.is_some(),
                    capacity_blocks: c.num_gpu_blocks,
                    model: c.model.clone(),
                    none_hash: Some(self.engine.hasher().none_hash().to_u64()),
                }),
                block_hashes: hashes.to_vec(),
                load: Some(load(l)),
            }),
            CacheBody::Stored { hashes, parent } => Update::Stored(v1::BlocksStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: parent,
            }),
            CacheBody::Removed(hashes) => Update::Removed(v1::BlocksRemoved {
                block_hashes: hashes.to_vec(),
            }),
            CacheBody::Cleared => Update::Cleared(v1::AllBlocksCleared {}),
            CacheBody::Load(l) => Update::Load(load(l)),
        };
        v1::CacheUpdate {
            incarnation: m.incarnation.to_string(),
            sequence: m.sequence,
            update: Some(update),
        }
    }
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<v1::CacheUpdate, Status>> + Send>>;

#[tonic::async_trait]
impl CacheReporter for Reporter {
    type WatchCacheStream = UpdateStream;

    async fn watch_cache(
        &self,
        request: Request<v1::WatchCacheRequest>,
    ) -> Result<Response<Self::WatchCacheStream>, Status> {
        tracing::debug!(subscriber = %request.get_ref().subscriber, "WatchCache subscriber");
        let this = self.clone();
        let stream =
            ReceiverStream::new(self.engine.subscribe()).map(move |m| Ok(this.to_proto(m)));
        Ok(Response::new(Box::pin(stream)))
    }
}
