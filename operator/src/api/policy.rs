//! `CacheRoutingPolicy` (`kvroute.dev/v1alpha1`, short name `crp`): how
//! kvroute routes one `InferencePool`, attached Gateway API style through
//! `spec.targetRef`.
//!
//! Every field but the target has a default, written into the schema so the
//! API server fills it in and `kubectl get -o yaml` shows the effective value;
//! the same defaults apply when deserializing in Rust. They are the core's
//! ([`RoutingSpec::default`], and the kvroute policy's own for its
//! parameters), as are the operator's defaults for a pool with no policy.
//! The tenancy mode is the core's [`TenancyMode`], spelled as the CRD spells
//! it (`Shared`) by serde attributes (`api/spelling.rs`).
//!
//! Not here: which policy wins when several target one pool, whether the
//! target exists (the index decides both and reports them as the
//! `TargetFound` and `Conflicted` conditions).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use kvroute_core::spec::{DisaggregationMode, RoutingSpec, TenancyMode};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::validation::{
    HEADER_NAME_PATTERN, ValidationError, check_range, check_string, is_header_name,
};

/// API group a policy's target must be in.
pub const TARGET_GROUP: &str = "inference.networking.k8s.io";
/// Kind a policy's target must be.
pub const TARGET_KIND: &str = "InferencePool";
/// Most tokens a prefix key may cover.
pub const MAX_PREFIX_TOKENS: i32 = 65536;
/// Largest ε of the rendezvous-bounded policy's in-flight bound.
pub const MAX_LOAD_BOUND: f64 = 10.0;
/// Largest latency slack of the kvroute policy (far past where it is
/// longest-prefix routing).
pub const MAX_LATENCY_SLACK: f64 = 1000.0;
/// Largest prefill overhead, milliseconds.
pub const MAX_PREFILL_OVERHEAD_MS: f64 = 60_000.0;
/// Largest engine block size in tokens.
pub const MAX_BLOCK_SIZE: i32 = 4096;

/// Condition types of `status.conditions`.
pub mod conditions {
    /// The policy is valid and in effect for its target.
    pub const ACCEPTED: &str = "Accepted";
    /// The targeted `InferencePool` exists.
    pub const TARGET_FOUND: &str = "TargetFound";
    /// Another policy targets the same pool and takes precedence (the older
    /// one wins).
    pub const CONFLICTED: &str = "Conflicted";
    /// The target's engines that the operator probed hash their blocks as
    /// the policy says; present once one was probed.
    pub const ENGINES_CONSISTENT: &str = "EnginesConsistent";
    /// Every prefix of `spec.warmup` is resolved (its ConfigMap key
    /// exists) and sent to the routers; present when the policy has
    /// warm-ups and is in effect.
    pub const WARMUP_READY: &str = "WarmupReady";
}

/// Desired routing of one `InferencePool`.
// Clippy reads the printer columns' repeated `type_ = "string"` as duplicated
// attributes; they are arguments of different columns.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kvroute.dev",
    version = "v1alpha1",
    kind = "CacheRoutingPolicy",
    namespaced,
    status = "CacheRoutingPolicyStatus",
    shortname = "crp",
    derive = "PartialEq",
    doc = "CacheRoutingPolicy configures how kvroute routes the requests of one InferencePool: routing keys, the routing policy and its latency slack, the engines' cache layout and prefill speed, and tenancy.",
    printcolumn(
        name = "Target",
        type_ = "string",
        description = "The InferencePool this policy configures.",
        json_path = ".spec.targetRef.name"
    ),
    printcolumn(
        name = "Policy",
        type_ = "string",
        description = "The routing policy.",
        json_path = ".spec.policy"
    ),
    printcolumn(
        name = "Slack",
        type_ = "number",
        description = "The kvroute policy's latency slack.",
        json_path = ".spec.latencySlack"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        description = "Endpoints of the target that can serve.",
        json_path = ".status.readyEndpoints"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        description = "Whether the policy is in effect.",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CacheRoutingPolicySpec {
    /// The InferencePool, in the policy's namespace, that this policy
    /// configures.
    pub target_ref: PolicyTargetReference,

    /// What routing keys are derived from.
    #[serde(default)]
    pub routing_key: RoutingKey,

    /// The routing policy: kvroute (the default: the longest cached prefix
    /// among endpoints whose predicted time to first token is within the
    /// latency slack of the fastest, rendezvous hashing for cold keys) or a
    /// baseline.
    #[serde(default)]
    pub policy: PolicyName,

    /// The kvroute policy's latency slack: seconds of extra predicted time
    /// to first token a request may take, against the fastest endpoint, per
    /// second of prefill its cached prefix saves there (plus one prefill
    /// overhead). 0: always the fastest endpoint (min-ttft); 1 (the
    /// default): break even; large: always the longest prefix. 0 to 1000.
    #[serde(default = "default_latency_slack")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub latency_slack: f64,

    /// ε of the rendezvous-bounded policy's in-flight bound: an endpoint may
    /// hold at most (1 + ε) times the pool's mean requests in flight. A
    /// ratio, 0 to 10; absent: 0.25. Other policies ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub load_bound: Option<f64>,

    /// What a block an engine keeps offloaded (vLLM KV offloading to CPU
    /// memory or disk) is worth in a cached prefix, as a share of a block in
    /// its GPU cache: loading it back is cheaper than computing it, not
    /// free. 0 to 1; absent: 0.5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub offload_weight: Option<f64>,

    /// How the engines lay out and hash their prefix cache; must match the
    /// engines' own configuration.
    #[serde(default)]
    pub engine: Engine,

    /// Whether tenants share cached prefixes.
    #[serde(default)]
    pub tenancy: Tenancy,

    /// Slow start: seconds over which a pod that became ready (its Ready
    /// condition's lastTransitionTime) ramps up to its full share of new
    /// keys, so a scale-out sends no burst to an empty cache; warm prefixes
    /// stay where they are cached. 0 turns it off; 0 to 3600; default 30.
    #[serde(default = "default_slow_start_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub slow_start_seconds: i32,

    /// Prefill/decode disaggregation: a request is prefilled on a pod
    /// labelled kvroute.dev/role=prefill and decoded on another, which
    /// reads its KV blocks (vLLM's kv_transfer_params). Default: Disabled.
    #[serde(default)]
    pub disaggregation: Disaggregation,

    /// Named prefixes kept warm on their owners (docs/warmup.md): the
    /// core's type, with its own rules (checked by the operator, reported
    /// in the Accepted condition) and this schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "warmup_schema")]
    pub warmup: Option<kvroute_core::warmup::Warmup>,
}

/// The schema of `spec.warmup` ([`kvroute_core::warmup::Warmup`]).
fn warmup_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let w = kvroute_core::warmup::Warmup::default();
    schemars::json_schema!({
        "description": "Named prefixes kept warm on their owners: each prefix is sent once a period as a one-token request to the first `owners` ready endpoints in the rendezvous order of the routing key a request starting with it gets. Of the pool's routers (pods labelled kvroute.dev/router-for), one sends each prefix's warm-ups to each owner. See docs/warmup.md.",
        "type": "object",
        "required": ["prefixes"],
        "properties": {
            "everySeconds": {"description": "Each prefix is warmed once per this many seconds, at its own offset into the period. At least 1.", "type": "integer", "minimum": 1, "default": w.every_seconds},
            "owners": {"description": "How many endpoints keep each prefix warm. At least 1.", "type": "integer", "minimum": 1, "maximum": 1024, "default": w.owners},
            "maxShareOfPrefill": {"description": "Warm-ups' prefill over the last 10 minutes stays at most this share of all prefill, (0, 1]; a prefix's first warm-up is always sent.", "type": "number", "minimum": 0, "maximum": 1, "default": w.max_share_of_prefill},
            "prefixes": {
                "description": "1 to 64 prefixes, unique by name.",
                "type": "array", "minItems": 1, "maxItems": kvroute_core::warmup::MAX_PREFIXES,
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"description": "Its name in kvroute_warmups_total{prefix}: 1 to 63 letters, digits, '.', '_' or '-'.", "type": "string", "minLength": 1, "maxLength": kvroute_core::warmup::MAX_NAME_BYTES, "pattern": "^[A-Za-z0-9._-]+$"},
                        "model": {"description": "The model it is sent to; default: the one model the endpoints serve.", "type": "string"},
                        "tenant": {"description": "The tenant it is warmed for; required under Salted tenancy.", "type": "string"},
                        "messages": {"description": "Chat messages, sent to /v1/chat/completions. Exactly one of messages, prompt and configMapRef.", "type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                        "prompt": {"description": "A prompt, sent to /v1/completions.", "type": "string"},
                        "configMapRef": {
                            "description": "A key of a ConfigMap in the policy's namespace, labelled kvroute.dev/warmup=true, whose text is the content of the prefix's one system message.",
                            "type": "object",
                            "required": ["name", "key"],
                            "properties": {"name": {"type": "string", "minLength": 1}, "key": {"type": "string", "minLength": 1}}
                        }
                    }
                }
            }
        }
    })
}

/// Prefill/decode disaggregation.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Disaggregation {
    /// Disabled (the default: pods labelled prefill take no requests) or
    /// Auto.
    #[serde(default, with = "super::spelling::pascal_case")]
    #[schemars(schema_with = "super::spelling::disaggregation_mode")]
    pub mode: DisaggregationMode,

    /// With Auto, a request is disaggregated when it would prefill at
    /// least this many uncached tokens on its decode pod. 0 to 10000000;
    /// default 256.
    #[serde(default = "default_min_uncached_tokens")]
    #[schemars(range(min = 0, max = 10_000_000))]
    pub min_uncached_tokens: i64,
}

impl Default for Disaggregation {
    fn default() -> Self {
        Disaggregation {
            mode: DisaggregationMode::Disabled,
            min_uncached_tokens: default_min_uncached_tokens(),
        }
    }
}

/// The core's default threshold.
fn default_min_uncached_tokens() -> i64 {
    let core = kvroute_core::spec::Disaggregation::default();
    i64::try_from(core.min_uncached_tokens).expect("the default fits the CRD")
}

/// The core's default window ([`RoutingSpec::default`]).
fn default_slow_start_seconds() -> i32 {
    i32::try_from(RoutingSpec::default().slow_start_seconds).expect("the default fits the CRD")
}

/// The kvroute policy's own default ([`kvroute_core::policy::KvrouteConfig`]).
fn default_latency_slack() -> f64 {
    kvroute_core::policy::KvrouteConfig::default().latency_slack
}

/// A reference to the `InferencePool` a policy attaches to (Gateway API
/// policy attachment, local to the policy's namespace).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyTargetReference {
    /// API group of the target: inference.networking.k8s.io (the default).
    #[serde(default = "default_target_group")]
    #[schemars(extend("enum" = [TARGET_GROUP]))]
    pub group: String,

    /// Kind of the target: InferencePool (the default).
    #[serde(default = "default_target_kind")]
    #[schemars(extend("enum" = [TARGET_KIND]))]
    pub kind: String,

    /// Name of the target InferencePool.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

fn default_target_group() -> String {
    TARGET_GROUP.to_owned()
}

fn default_target_kind() -> String {
    TARGET_KIND.to_owned()
}

/// How routing keys are derived from requests.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RoutingKey {
    /// What a key is: Conversation (the default: the conversation key when
    /// the request has one, else the prompt prefix), Prefix (always the
    /// prompt prefix) or Tenant (the tenant when known, else the prompt
    /// prefix).
    #[serde(default)]
    pub mode: KeyMode,

    /// How many leading prompt tokens a prefix key covers, 1 to 65536;
    /// default 256.
    #[serde(default = "default_prefix_tokens")]
    #[schemars(range(min = 1, max = 65536))]
    pub prefix_tokens: i32,
}

impl Default for RoutingKey {
    fn default() -> Self {
        Self {
            mode: KeyMode::default(),
            prefix_tokens: default_prefix_tokens(),
        }
    }
}

/// The core's default prefix length ([`RoutingSpec::default`]).
fn default_prefix_tokens() -> i32 {
    i32::try_from(RoutingSpec::default().key.prefix_tokens).expect("the default fits the CRD")
}

/// What routing keys are derived from.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyMode {
    /// The conversation key when the request has one, else the prompt prefix
    /// (the default).
    Conversation,
    /// Always the prompt prefix.
    Prefix,
    /// The authenticated tenant when known, else the prompt prefix.
    Tenant,
}

impl Default for KeyMode {
    /// The core's ([`RoutingSpec::default`]).
    fn default() -> Self {
        RoutingSpec::default().key.mode.into()
    }
}

impl From<KeyMode> for kvroute_core::keys::KeyMode {
    fn from(mode: KeyMode) -> Self {
        match mode {
            KeyMode::Conversation => Self::Conversation,
            KeyMode::Prefix => Self::Prefix,
            KeyMode::Tenant => Self::Tenant,
        }
    }
}

impl From<kvroute_core::keys::KeyMode> for KeyMode {
    fn from(mode: kvroute_core::keys::KeyMode) -> Self {
        use kvroute_core::keys::KeyMode as Core;
        match mode {
            Core::Conversation => KeyMode::Conversation,
            Core::Prefix => KeyMode::Prefix,
            Core::Tenant => KeyMode::Tenant,
        }
    }
}

/// A routing policy, by the name kvroute's policies go by.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// `kvroute`: warm prefix first within a latency slack, rendezvous for
    /// cold keys (the default).
    Kvroute,
    /// `round-robin`: each endpoint in turn.
    RoundRobin,
    /// `least-loaded`: the endpoint with the least work.
    LeastLoaded,
    /// `random`: uniformly at random.
    Random,
    /// `modulo`: key modulo the endpoint count.
    Modulo,
    /// `rendezvous`: rendezvous hash of the key, ignoring load.
    Rendezvous,
    /// `rendezvous-bounded`: rendezvous hash, skipping endpoints over a
    /// bound on in-flight requests.
    RendezvousBounded,
    /// `approx-prefix`: longest prefix from the router's own history.
    ApproxPrefix,
    /// `exact-prefix-load`: longest reported prefix with a load penalty.
    ExactPrefixLoad,
    /// `min-ttft`: lowest predicted time to first token.
    MinTtft,
}

impl Default for PolicyName {
    /// The core's ([`RoutingSpec::default`]).
    fn default() -> Self {
        let name = RoutingSpec::default().policy.name();
        PolicyName::ALL
            .into_iter()
            .find(|p| p.as_str() == name)
            .expect("every core policy has a CRD name")
    }
}

impl PolicyName {
    /// Every policy, in the core's order
    /// ([`kvroute_core::policy::PolicyConfig::NAMES`]).
    pub const ALL: [PolicyName; 10] = [
        PolicyName::Kvroute,
        PolicyName::RoundRobin,
        PolicyName::LeastLoaded,
        PolicyName::Random,
        PolicyName::Modulo,
        PolicyName::Rendezvous,
        PolicyName::RendezvousBounded,
        PolicyName::ApproxPrefix,
        PolicyName::ExactPrefixLoad,
        PolicyName::MinTtft,
    ];

    /// The name as written in manifests and understood by
    /// `kvroute_core::policy::PolicyConfig::by_name`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::Kvroute => "kvroute",
            PolicyName::RoundRobin => "round-robin",
            PolicyName::LeastLoaded => "least-loaded",
            PolicyName::Random => "random",
            PolicyName::Modulo => "modulo",
            PolicyName::Rendezvous => "rendezvous",
            PolicyName::RendezvousBounded => "rendezvous-bounded",
            PolicyName::ApproxPrefix => "approx-prefix",
            PolicyName::ExactPrefixLoad => "exact-prefix-load",
            PolicyName::MinTtft => "min-ttft",
        }
    }
}

/// The engines' prefix-cache layout, which routers must reproduce to compute
/// the same block hashes, and how fast they prefill.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Engine {
    /// Tokens per cache block, 1 to 4096; default 16 (vLLM's default). Must
    /// equal the engines' block size.
    #[serde(default = "default_block_size")]
    #[schemars(range(min = 1, max = 4096))]
    pub block_size: i32,

    /// The engines' block hash: sha256 (the default, vLLM's), sha256_cbor or
    /// xxhash_cbor.
    #[serde(default)]
    pub hash_algorithm: HashAlgorithm,

    /// The engines' PYTHONHASHSEED, as given to them; absent when they run
    /// without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_seed: Option<String>,

    /// The port of the WatchCache gRPC service on the engine pods, 1 to
    /// 65535. Absent: the engines report no cache and routers estimate its
    /// contents (approximate routing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub cache_port: Option<i32>,

    /// Prompt tokens an engine prefills per second, for a pool whose engines
    /// report none of their own over WatchCache; default 10000. The kvroute
    /// and min-ttft policies predict time to first token at one rate per
    /// pool: the median of the rates its engines report, else this one.
    #[serde(default = "default_prefill_tokens_per_second")]
    #[schemars(range(min = 1.0, max = 1.0e9))]
    pub prefill_tokens_per_second: f64,

    /// The engines' fixed cost of one prefill (scheduling, launches), in
    /// milliseconds, 0 to 60000; default 20.
    #[serde(default = "default_prefill_overhead_ms")]
    #[schemars(range(min = 0.0, max = 60000.0))]
    pub prefill_overhead_ms: f64,
}

impl Default for Engine {
    fn default() -> Self {
        Self {
            block_size: default_block_size(),
            hash_algorithm: HashAlgorithm::default(),
            hash_seed: None,
            cache_port: None,
            prefill_tokens_per_second: default_prefill_tokens_per_second(),
            prefill_overhead_ms: default_prefill_overhead_ms(),
        }
    }
}

/// The core's default block size ([`RoutingSpec::default`]).
fn default_block_size() -> i32 {
    i32::try_from(RoutingSpec::default().hash.block_size).expect("the default fits the CRD")
}

/// The core's prefill model's default ([`kvroute_core::load::PrefillModel`]).
fn default_prefill_tokens_per_second() -> f64 {
    kvroute_core::load::PrefillModel::default().prefill_tokens_per_second
}

/// The core's prefill model's default ([`kvroute_core::load::PrefillModel`]).
fn default_prefill_overhead_ms() -> f64 {
    kvroute_core::load::PrefillModel::default().prefill_overhead_ms
}

/// A block hash algorithm of vLLM's prefix cache.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgorithm {
    /// `sha256`: SHA-256 over pickled block tuples (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 over canonical CBOR.
    Sha256Cbor,
    /// `xxhash_cbor`: XXH3-128 over canonical CBOR.
    XxhashCbor,
}

impl Default for HashAlgorithm {
    /// The core's ([`RoutingSpec::default`]).
    fn default() -> Self {
        RoutingSpec::default().hash.algo.into()
    }
}

impl From<kvroute_core::hash::HashAlgo> for HashAlgorithm {
    fn from(algo: kvroute_core::hash::HashAlgo) -> Self {
        use kvroute_core::hash::HashAlgo;
        match algo {
            HashAlgo::Sha256 => HashAlgorithm::Sha256,
            HashAlgo::Sha256Cbor => HashAlgorithm::Sha256Cbor,
            HashAlgo::XxhashCbor => HashAlgorithm::XxhashCbor,
        }
    }
}

impl From<HashAlgorithm> for kvroute_core::hash::HashAlgo {
    fn from(algorithm: HashAlgorithm) -> Self {
        match algorithm {
            HashAlgorithm::Sha256 => Self::Sha256,
            HashAlgorithm::Sha256Cbor => Self::Sha256Cbor,
            HashAlgorithm::XxhashCbor => Self::XxhashCbor,
        }
    }
}

/// Whether and how tenants share cached prefixes.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Tenancy {
    /// Shared (the default: all tenants share cached prefixes) or Salted
    /// (routers salt each request's cache with its tenant, so tenants never
    /// share blocks or routing keys).
    #[serde(default, with = "super::spelling::pascal_case")]
    #[schemars(schema_with = "super::spelling::tenancy_mode")]
    pub mode: TenancyMode,

    /// The request header carrying the authenticated tenant, set by a
    /// trusted gateway; absent: no tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), pattern(HEADER_NAME_PATTERN))]
    pub tenant_header: Option<String>,
}

/// Observed state of a `CacheRoutingPolicy`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CacheRoutingPolicyStatus {
    /// The metadata.generation this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,

    /// Conditions, one per type: Accepted, TargetFound, Conflicted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,

    /// Endpoints (pod and target port) of the target that can serve now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ready_endpoints: Option<i32>,

    /// The warm-ups the routers sent for `spec.warmup`'s prefixes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<WarmupStatus>,
}

/// The warm-ups the routers sent, as they reported them to the operator.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WarmupStatus {
    /// Each prefix of `spec.warmup.prefixes` sent at least once, in its
    /// order.
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub prefixes: Vec<PrefixWarmupStatus>,
}

/// One prefix's last warm-ups.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PrefixWarmupStatus {
    /// The prefix's name.
    #[schemars(length(max = 63))]
    pub name: String,
    /// When it was last sent to any owner.
    #[schemars(schema_with = "super::schema::date_time")]
    pub last_sent_time: Time,
    /// Its owners' last warm-ups, newest first; at most 16.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub owners: Vec<OwnerWarmupStatus>,
}

/// One owner's last warm-up of a prefix.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OwnerWarmupStatus {
    /// The owner endpoint (`<pod>:<port>`).
    #[schemars(length(max = 256))]
    pub endpoint: String,
    /// When the warm-up was sent.
    #[schemars(schema_with = "super::schema::date_time")]
    pub last_sent_time: Time,
    /// The router (pod name) that sent it.
    #[schemars(length(max = 253))]
    pub sent_by: String,
}

impl CacheRoutingPolicy {
    /// Checks the spec against the rules of the CRD schema; see
    /// [`CacheRoutingPolicySpec::validate`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.spec.validate()
    }
}

impl CacheRoutingPolicySpec {
    /// Checks the rules the CRD schema expresses: the target is an
    /// InferencePool by a non-empty name, and every number is within its
    /// bounds. The error names the first offending field (as a path from the
    /// object's root) and its value.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let target = &self.target_ref;
        if target.group != TARGET_GROUP {
            return Err(ValidationError::new(
                "spec.targetRef.group",
                format!("{:?}", target.group),
                format!("must be {TARGET_GROUP:?}"),
            ));
        }
        if target.kind != TARGET_KIND {
            return Err(ValidationError::new(
                "spec.targetRef.kind",
                format!("{:?}", target.kind),
                format!("must be {TARGET_KIND:?}"),
            ));
        }
        check_string(
            "spec.targetRef.name",
            &target.name,
            1,
            253,
            super::validation::any,
            "",
        )?;
        check_range(
            "spec.routingKey.prefixTokens",
            self.routing_key.prefix_tokens,
            1,
            MAX_PREFIX_TOKENS,
        )?;
        check_range(
            "spec.latencySlack",
            self.latency_slack,
            0.0,
            MAX_LATENCY_SLACK,
        )?;
        if let Some(bound) = self.load_bound {
            check_range("spec.loadBound", bound, 0.0, MAX_LOAD_BOUND)?;
        }
        if let Some(weight) = self.offload_weight {
            check_range("spec.offloadWeight", weight, 0.0, 1.0)?;
        }
        check_range(
            "spec.slowStartSeconds",
            self.slow_start_seconds,
            0,
            kvroute_core::slow_start::MAX_WINDOW_SECONDS as i32,
        )?;
        check_range(
            "spec.disaggregation.minUncachedTokens",
            self.disaggregation.min_uncached_tokens,
            0,
            kvroute_core::spec::MAX_MIN_UNCACHED_TOKENS as i64,
        )?;
        check_range(
            "spec.engine.prefillTokensPerSecond",
            self.engine.prefill_tokens_per_second,
            1.0,
            1.0e9,
        )?;
        check_range(
            "spec.engine.prefillOverheadMs",
            self.engine.prefill_overhead_ms,
            0.0,
            MAX_PREFILL_OVERHEAD_MS,
        )?;
        check_range(
            "spec.engine.blockSize",
            self.engine.block_size,
            1,
            MAX_BLOCK_SIZE,
        )?;
        if let Some(port) = self.engine.cache_port {
            check_range("spec.engine.cachePort", port, 1, 65535)?;
        }
        if let Some(header) = &self.tenancy.tenant_header {
            check_string(
                "spec.tenancy.tenantHeader",
                header,
                1,
                256,
                is_header_name,
                "an HTTP header name (RFC 7230 token characters)",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_are_the_core_crates() {
        let names: Vec<&str> = PolicyName::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(names, kvroute_core::policy::PolicyConfig::NAMES);
        for policy in PolicyName::ALL {
            assert_eq!(
                serde_json::to_value(policy).unwrap(),
                serde_json::json!(policy.as_str())
            );
        }
    }

    #[test]
    fn hash_algorithm_names_are_the_core_crates() {
        for algorithm in [
            HashAlgorithm::Sha256,
            HashAlgorithm::Sha256Cbor,
            HashAlgorithm::XxhashCbor,
        ] {
            let core: kvroute_core::hash::HashAlgo = algorithm.into();
            assert_eq!(
                serde_json::to_value(algorithm).unwrap(),
                serde_json::json!(core.as_str())
            );
        }
    }

    #[test]
    fn a_target_alone_gets_every_default() {
        let spec: CacheRoutingPolicySpec =
            serde_json::from_value(serde_json::json!({"targetRef": {"name": "pool"}})).unwrap();
        assert_eq!(spec.target_ref.group, TARGET_GROUP);
        assert_eq!(spec.target_ref.kind, TARGET_KIND);
        assert_eq!(spec.routing_key, RoutingKey::default());
        assert_eq!(spec.routing_key.prefix_tokens, 256);
        assert_eq!(spec.policy, PolicyName::Kvroute);
        assert_eq!(spec.latency_slack, 1.0);
        assert_eq!(spec.load_bound, None);
        assert_eq!(spec.engine.prefill_tokens_per_second, 10_000.0);
        assert_eq!(spec.engine, Engine::default());
        assert_eq!(spec.engine.block_size, 16);
        assert_eq!(spec.tenancy, Tenancy::default());
        assert_eq!(spec.slow_start_seconds, 30);
        assert_eq!(spec.validate(), Ok(()));
    }

    #[test]
    fn validate_names_the_field_and_value() {
        let mut spec: CacheRoutingPolicySpec =
            serde_json::from_value(serde_json::json!({"targetRef": {"name": "pool"}})).unwrap();
        spec.load_bound = Some(11.0);
        let err = spec.validate().unwrap_err();
        assert_eq!(
            (err.field.as_str(), err.value.as_str()),
            ("spec.loadBound", "11")
        );
        spec.load_bound = None;
        spec.slow_start_seconds = 3601;
        let err = spec.validate().unwrap_err();
        assert_eq!(
            (err.field.as_str(), err.value.as_str()),
            ("spec.slowStartSeconds", "3601")
        );
        spec.slow_start_seconds = 0;
        assert_eq!(spec.validate(), Ok(()), "0 turns slow start off");
        spec.latency_slack = f64::NAN;
        let err = spec.validate().unwrap_err();
        assert_eq!(err.field, "spec.latencySlack");
        spec.latency_slack = 1.0;
        spec.engine.prefill_tokens_per_second = 0.0;
        let err = spec.validate().unwrap_err();
        assert_eq!(err.field, "spec.engine.prefillTokensPerSecond");
        spec.engine.prefill_tokens_per_second = 5000.0;
        spec.engine.cache_port = Some(0);
        let err = spec.validate().unwrap_err();
        assert_eq!(err.field, "spec.engine.cachePort");

        spec.engine.cache_port = None;
        spec.target_ref.kind = "Service".into();
        let err = spec.validate().unwrap_err();
        assert_eq!(err.field, "spec.targetRef.kind");
    }
}
