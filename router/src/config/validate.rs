//! Checking a parsed configuration for what its types cannot say: ranges,
//! URLs and fields that depend on each other. Every error names the field,
//! as written in YAML, and its value.

use super::{Config, ConfigError, Discovery, MAX_DURATION_MS, TenancyMode};

impl Config {
    /// Checks what types cannot: every duration and count in range, the
    /// URLs, and the fields that depend on each other. The error names the
    /// first bad field, as written in YAML, and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Err(reason) = self.routing.policy.validate() {
            return Err(ConfigError::Policy(reason));
        }
        self.validate_durations()?;
        self.validate_counts()?;
        self.validate_urls()?;
        self.flow_control.validate()?;
        if let Some(w) = &self.routing.warmup {
            super::warmup::validate(w, self.tenancy.mode == TenancyMode::Salted)?;
        }
        super::flow::validate_objectives(&self.objectives)?;
        let l = &self.limits;
        for (set, field, instead) in [
            (
                l.queue_size.is_some(),
                "limits.queueSize",
                "flowControl.maxQueued",
            ),
            (
                l.queue_timeout_ms.is_some(),
                "limits.queueTimeoutMs",
                "flowControl.maxWaitMs",
            ),
        ] {
            if set {
                return Err(ConfigError::Replaced { field, instead });
            }
        }
        if let Some(cache) = &self.response_cache {
            cache.validate()?;
        }
        if let Some(e) = &self.ext_proc
            && self.tenancy.mode == TenancyMode::Salted
            && self.tenancy.api_keys_file.is_none()
            && !e.trusted()
        {
            return Err(invalid(
                "extProc.trustedNetwork",
                &false,
                "salted tenancy with the tenant from tenancy.tenantHeader alone needs a trusted picker: set extProc.tls.clientCaFile (gateways authenticated by certificate) or extProc.trustedNetwork: true (only gateways reach the port), or tenancy.apiKeysFile",
            ));
        }
        let l = &self.limits;
        if l.max_body_bytes_in_flight < l.max_body_bytes {
            return Err(invalid(
                "limits.maxBodyBytesInFlight",
                &l.max_body_bytes_in_flight,
                "must be at least limits.maxBodyBytes",
            ));
        }
        if l.max_body_bytes_per_tenant < l.max_body_bytes {
            return Err(invalid(
                "limits.maxBodyBytesPerTenant",
                &l.max_body_bytes_per_tenant,
                "must be at least limits.maxBodyBytes",
            ));
        }
        let r = &self.resilience;
        if r.ejection_max_ms < r.ejection_base_ms {
            return Err(invalid(
                "resilience.ejectionMaxMs",
                &r.ejection_max_ms,
                "must be at least resilience.ejectionBaseMs",
            ));
        }
        if self.tls.is_some() && self.api_listen().is_none() {
            return Err(invalid(
                "tls",
                &"set",
                "configures the API listener, which does not run without listen when extProc is set",
            ));
        }
        if let Some(h) = &r.health_check
            && !h.path.starts_with('/')
        {
            return Err(invalid(
                "resilience.healthCheck.path",
                &h.path,
                "must start with /",
            ));
        }
        let multiple = self.resilience.hung_ttft_multiple;
        if !(multiple.is_finite() && multiple >= 1.0) {
            return Err(invalid(
                "resilience.hungTtftMultiple",
                &multiple,
                "must be a number of at least 1",
            ));
        }
        for path in &self.proxy.allowed_paths {
            if !path.starts_with("/v1/") || path.parse::<axum::http::Uri>().is_err() {
                return Err(invalid(
                    "proxy.allowedPaths",
                    path,
                    "must be a path under /v1/",
                ));
            }
        }
        if self.tenancy.mode == TenancyMode::Salted && self.tenancy.secret_file.is_none() {
            return Err(invalid(
                "tenancy.secretFile",
                &"none",
                "is required when tenancy.mode is salted",
            ));
        }
        if self.tenancy.mode == TenancyMode::Salted
            && self.tenancy.tenant_header.is_none()
            && self.tenancy.api_keys_file.is_none()
        {
            return Err(invalid(
                "tenancy.tenantHeader",
                &"none",
                "salted tenancy needs a tenant source: tenantHeader or apiKeysFile",
            ));
        }
        if let Some(t) = &self.grpc_tls
            && t.cert_file.is_some() != t.key_file.is_some()
        {
            return Err(invalid(
                "grpcTls.certFile",
                &"one of certFile and keyFile",
                "set both or neither",
            ));
        }
        if let Some((name, _)) = self
            .routing
            .lora_adapters
            .iter()
            .find(|(name, path)| name.is_empty() || path.is_empty())
        {
            return Err(invalid(
                "routing.loraAdapters",
                name,
                "needs a name and a path",
            ));
        }
        let weight = self.routing.offload_weight;
        if !(0.0..=1.0).contains(&weight) {
            return Err(invalid(
                "routing.offloadWeight",
                &weight.to_string(),
                "must be within 0..=1",
            ));
        }
        let slow_start = self.routing.slow_start_seconds;
        if slow_start > kvroute_core::slow_start::MAX_WINDOW_SECONDS {
            return Err(invalid(
                "routing.slowStartSeconds",
                &slow_start.to_string(),
                "must be within 0..=3600",
            ));
        }
        Ok(())
    }

    /// Every duration: at most [`MAX_DURATION_MS`], and at least 1 ms
    /// except where 0 has a meaning (no queueing; retry at once; no wait
    /// for snapshots).
    fn validate_durations(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let r = &self.resilience;
        let mut at_least_1 = vec![
            ("limits.headerReadTimeoutMs", l.header_read_timeout_ms),
            ("limits.idleTimeoutMs", l.idle_timeout_ms),
            ("limits.bodyReadTimeoutMs", l.body_read_timeout_ms),
            ("limits.connectTimeoutMs", l.connect_timeout_ms),
            ("limits.firstByteTimeoutMs", l.first_byte_timeout_ms),
            ("resilience.ejectionBaseMs", r.ejection_base_ms),
            ("resilience.ejectionMaxMs", r.ejection_max_ms),
            ("resilience.hungAfterMs", r.hung_after_ms),
        ];
        if let Discovery::Static(s) = &self.discovery {
            at_least_1.push(("discovery.static.reloadMs", s.reload_ms));
        }
        if let Some(e) = &self.ext_proc {
            at_least_1.push(("extProc.firstMessageTimeoutMs", e.first_message_timeout_ms));
            at_least_1.push(("extProc.idleTimeoutMs", e.idle_timeout_ms));
        }
        if let Some(h) = &r.health_check {
            at_least_1.push(("resilience.healthCheck.intervalMs", h.interval_ms));
            at_least_1.push(("resilience.healthCheck.timeoutMs", h.timeout_ms));
        }
        for (field, ms) in at_least_1 {
            if !(1..=MAX_DURATION_MS).contains(&ms) {
                return Err(invalid(field, &ms, "must be 1 to 86400000 (one day)"));
            }
        }
        for (field, ms) in [
            ("resilience.snapshotWaitMs", r.snapshot_wait_ms),
            ("limits.retryAfterS", l.retry_after_s.saturating_mul(1000)),
        ] {
            if ms > MAX_DURATION_MS {
                let value = if field.ends_with('S') {
                    l.retry_after_s
                } else {
                    ms
                };
                return Err(invalid(field, &value, "must be at most one day"));
            }
        }
        Ok(())
    }

    /// Every count and size that 0 would turn into "refuse everything" or
    /// "never": at least 1; and those with a hard ceiling.
    fn validate_counts(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let r = &self.resilience;
        let mut at_least_1: Vec<(&'static str, u64)> = vec![
            ("limits.maxBodyBytes", l.max_body_bytes as u64),
            (
                "limits.maxBodyBytesInFlight",
                l.max_body_bytes_in_flight as u64,
            ),
            ("limits.bodyMinBytesPerS", l.body_min_bytes_per_s),
            ("limits.tokenizeQueue", l.tokenize_queue as u64),
            ("limits.maxTokenizeBytes", l.max_tokenize_bytes as u64),
            ("limits.maxConnections", l.max_connections as u64),
            (
                "limits.maxIndexBlocksPerEndpoint",
                l.max_index_blocks_per_endpoint as u64,
            ),
            (
                "limits.http2MaxConcurrentStreams",
                u64::from(l.http2_max_concurrent_streams),
            ),
            (
                "limits.endpointConcurrency",
                u64::from(l.endpoint_concurrency),
            ),
            ("resilience.attempts", u64::from(r.attempts)),
            (
                "resilience.ejectAfterFailures",
                u64::from(r.eject_after_failures),
            ),
        ];
        if let Some(e) = &self.ext_proc {
            at_least_1.push(("extProc.maxConnections", e.max_connections as u64));
        }
        if let Some(h) = &r.health_check {
            at_least_1.push((
                "resilience.healthCheck.unhealthyThreshold",
                u64::from(h.unhealthy_threshold),
            ));
        }
        for (field, value) in at_least_1 {
            if value == 0 {
                return Err(invalid(field, &0, "must be at least 1"));
            }
        }
        let block_size = self.routing.block_size;
        if !(1..=kvroute_core::hash::MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(invalid(
                "routing.blockSize",
                &block_size,
                "must be 1 to 4096 (the engines' block size in tokens)",
            ));
        }
        if l.api_threads > 1024 {
            return Err(invalid(
                "limits.apiThreads",
                &l.api_threads,
                "must be at most 1024 (0: one per CPU)",
            ));
        }
        if r.max_ejected_percent > 100 {
            return Err(invalid(
                "resilience.maxEjectedPercent",
                &r.max_ejected_percent,
                "must be between 0 and 100",
            ));
        }
        Ok(())
    }

    /// The operator's URLs and the trace collector's.
    fn validate_urls(&self) -> Result<(), ConfigError> {
        if let Discovery::Operator(o) = &self.discovery {
            let urls = o.all_urls();
            if urls.is_empty() {
                return Err(invalid(
                    "discovery.operator.url",
                    &"",
                    "set url, urls or both",
                ));
            }
            for (i, url) in urls.iter().enumerate() {
                let field = if i == 0 && !o.url.is_empty() {
                    "discovery.operator.url"
                } else {
                    "discovery.operator.urls"
                };
                if kvroute_telemetry::check_http_url(url).is_err() {
                    return Err(invalid(
                        field,
                        &format!("{url:?}"),
                        "is not an http(s) URL with a host",
                    ));
                }
                if url.starts_with("https://") != self.grpc_tls.is_some() {
                    return Err(invalid(
                        field,
                        url,
                        "use https:// exactly when grpcTls is set",
                    ));
                }
            }
            for (field, value) in [
                ("discovery.operator.namespace", &o.namespace),
                ("discovery.operator.pool", &o.pool),
            ] {
                if value.is_empty() {
                    return Err(invalid(field, &"", "must not be empty"));
                }
            }
        }
        if let Some(url) = &self.telemetry.otlp_endpoint
            && kvroute_telemetry::check_http_url(url).is_err()
        {
            return Err(invalid(
                "telemetry.otlpEndpoint",
                &format!("{url:?}"),
                "is not an http(s) URL with a host",
            ));
        }
        if let Some(p) = &self.telemetry.pricing {
            if !(p.gpu_hour_cost.is_finite() && p.gpu_hour_cost > 0.0) {
                let reason = "must be a positive number";
                return Err(invalid(
                    "telemetry.pricing.gpuHourCost",
                    &p.gpu_hour_cost,
                    reason,
                ));
            }
            let c = &p.currency;
            if c.is_empty() || c.len() > 16 || !c.bytes().all(|b| b.is_ascii_alphanumeric()) {
                let reason = "must be 1 to 16 ASCII letters or digits";
                return Err(invalid(
                    "telemetry.pricing.currency",
                    &format!("{c:?}"),
                    reason,
                ));
            }
            if p.gpus_per_engine == 0 {
                return Err(invalid(
                    "telemetry.pricing.gpusPerEngine",
                    &0,
                    "must be at least 1",
                ));
            }
        }
        Ok(())
    }
}

pub(super) fn invalid(
    field: &'static str,
    value: &dyn std::fmt::Display,
    reason: &'static str,
) -> ConfigError {
    ConfigError::Invalid {
        field,
        value: value.to_string(),
        reason,
    }
}
