//! A request's count under `kvroute_requests_total`: exactly once, by the
//! model it named and its status.

use std::sync::Arc;

use super::Accounting;
use crate::metrics::{ModelStatus, ModelTenant};

/// Counts a request under `kvroute_requests_total` exactly once: with its
/// status when it is answered, else (the client went away while the router
/// worked) as 499 when dropped. The response body takes over the count
/// when it is streamed back ([`hand_over`](Self::hand_over)).
#[derive(Debug)]
pub(crate) struct Labels {
    accounting: Arc<Accounting>,
    pub(crate) model: String,
    /// The tenant, as a bounded label (see [`Accounting::tenant_label`]).
    pub(crate) tenant: String,
    counted: bool,
}

impl Labels {
    /// Labels of a request not yet counted nor analyzed.
    pub(crate) fn new(accounting: &Arc<Accounting>) -> Self {
        Labels {
            accounting: accounting.clone(),
            model: String::new(),
            tenant: String::new(),
            counted: false,
        }
    }

    /// Labels of a request never counted (an explain).
    pub(crate) fn uncounted(accounting: &Arc<Accounting>) -> Self {
        let mut labels = Labels::new(accounting);
        labels.counted = true;
        labels
    }

    /// Counts the request with `status`, unless it was counted; returns
    /// whether this call counted it.
    pub(crate) fn count(&mut self, status: &str) -> bool {
        let first = !std::mem::replace(&mut self.counted, true);
        if first {
            let labels = ModelStatus {
                model: self.model.clone(),
                status: status.to_owned(),
            };
            self.accounting
                .metrics
                .requests
                .get_or_create(&labels)
                .inc();
        }
        first
    }

    /// `{model, tenant}` for the token counters.
    pub(crate) fn model_tenant(&self) -> ModelTenant {
        ModelTenant {
            model: self.model.clone(),
            tenant: self.tenant.clone(),
        }
    }

    /// Hands the count over to the response body.
    pub(crate) fn hand_over(&mut self) -> Labels {
        self.counted = true;
        Labels {
            accounting: self.accounting.clone(),
            model: std::mem::take(&mut self.model),
            tenant: std::mem::take(&mut self.tenant),
            counted: false,
        }
    }

    /// Never counted: a decision only measured, not served
    /// ([`super::Service::measure`]).
    pub(crate) fn forget(mut self) {
        self.counted = true;
    }
}

impl Drop for Labels {
    fn drop(&mut self) {
        // 499: nginx's "client closed request".
        self.count("499");
    }
}
