//! A policy's parameters in the flat form the `CacheRoutingPolicy` and the
//! wire's `RoutingPolicy` carry them: a policy's name beside one field per
//! parameter any policy has, where [`PolicyConfig`] nests each policy's own
//! parameters under its name.
//!
//! 1. Reading ([`PolicyConfig::with_parameters`]): the policy by name with
//!    its defaults, then each parameter the policy has that is given; a
//!    parameter it does not have is ignored (a baseline ignores the latency
//!    slack). A load bound of 0 or less is not given: the wire's 0 means
//!    "the policy's default".
//! 2. Writing ([`PolicyConfig::parameters`]): the parameters the policy has,
//!    the others `None`. Writing then reading gives the policy back when
//!    its parameters are ones the flat form has (the other policies'
//!    parameters, such as a random policy's seed, take their defaults).
//!
//! Not here: checking the values ([`PolicyConfig::validate`] does).

use super::PolicyConfig;
use crate::load::PrefillModel;

/// A policy's parameters in flat form; `None`: the policy's default (or a
/// parameter the policy does not have).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PolicyParameters {
    /// The kvroute policy's latency slack.
    pub latency_slack: Option<f64>,
    /// ε of the rendezvous-bounded policy's in-flight bound: its slack is
    /// 1 + ε. Used only when above 0.
    pub load_bound: Option<f64>,
    /// The prefill rate of the kvroute and min-ttft policies' prefill
    /// model, tokens per second.
    pub prefill_tokens_per_second: Option<f64>,
    /// The fixed cost per prefill of the kvroute and min-ttft policies'
    /// prefill model, milliseconds.
    pub prefill_overhead_ms: Option<f64>,
}

impl PolicyParameters {
    /// `engine` with the prefill parameters that are given.
    fn apply_to(&self, engine: &mut PrefillModel) {
        if let Some(rate) = self.prefill_tokens_per_second {
            engine.prefill_tokens_per_second = rate;
        }
        if let Some(ms) = self.prefill_overhead_ms {
            engine.prefill_overhead_ms = ms;
        }
    }

    /// The prefill parameters of `engine`.
    fn of(engine: &PrefillModel) -> Self {
        PolicyParameters {
            prefill_tokens_per_second: Some(engine.prefill_tokens_per_second),
            prefill_overhead_ms: Some(engine.prefill_overhead_ms),
            ..PolicyParameters::default()
        }
    }
}

impl PolicyConfig {
    /// The policy's name, as in configuration: one of [`Self::NAMES`].
    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin => "round-robin",
            PolicyConfig::LeastLoaded => "least-loaded",
            PolicyConfig::Random(_) => "random",
            PolicyConfig::Modulo => "modulo",
            PolicyConfig::Rendezvous => "rendezvous",
            PolicyConfig::RendezvousBounded(_) => "rendezvous-bounded",
            PolicyConfig::ApproxPrefix(_) => "approx-prefix",
            PolicyConfig::ExactPrefixLoad(_) => "exact-prefix-load",
            PolicyConfig::MinTtft(_) => "min-ttft",
            PolicyConfig::Kvroute(_) => "kvroute",
        }
    }

    /// The policy `name` with `parameters` where it has them (rule 1 of the
    /// module docs); `None` for a name that is not a policy. Not validated.
    pub fn with_parameters(name: &str, parameters: &PolicyParameters) -> Option<Self> {
        let mut config = PolicyConfig::by_name(name)?;
        match &mut config {
            PolicyConfig::Kvroute(c) => {
                if let Some(slack) = parameters.latency_slack {
                    c.latency_slack = slack;
                }
                parameters.apply_to(&mut c.engine);
            }
            PolicyConfig::MinTtft(c) => parameters.apply_to(&mut c.engine),
            PolicyConfig::RendezvousBounded(c) => {
                if let Some(bound) = parameters.load_bound.filter(|&b| b > 0.0) {
                    c.slack = 1.0 + bound;
                }
            }
            _ => {}
        }
        Some(config)
    }

    /// The parameters this policy has, in flat form (rule 2 of the module
    /// docs).
    pub fn parameters(&self) -> PolicyParameters {
        match self {
            PolicyConfig::Kvroute(c) => PolicyParameters {
                latency_slack: Some(c.latency_slack),
                ..PolicyParameters::of(&c.engine)
            },
            PolicyConfig::MinTtft(c) => PolicyParameters::of(&c.engine),
            PolicyConfig::RendezvousBounded(c) => PolicyParameters {
                load_bound: Some(c.slack - 1.0),
                ..PolicyParameters::default()
            },
            _ => PolicyParameters::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_its_policys() {
        for name in PolicyConfig::NAMES {
            let config = PolicyConfig::by_name(name).unwrap();
            assert_eq!(config.name(), name);
            assert_eq!(
                PolicyConfig::with_parameters(name, &PolicyParameters::default()),
                Some(config)
            );
        }
        assert_eq!(
            PolicyConfig::with_parameters("fastest", &PolicyParameters::default()),
            None
        );
    }

    #[test]
    fn a_policy_takes_the_parameters_it_has() {
        let all = PolicyParameters {
            latency_slack: Some(2.5),
            load_bound: Some(0.5),
            prefill_tokens_per_second: Some(30_000.0),
            prefill_overhead_ms: None,
        };
        let PolicyConfig::Kvroute(c) = PolicyConfig::with_parameters("kvroute", &all).unwrap()
        else {
            panic!("kvroute expected")
        };
        assert_eq!(c.latency_slack, 2.5);
        assert_eq!(c.engine.prefill_tokens_per_second, 30_000.0);
        assert_eq!(c.engine.prefill_overhead_ms, 20.0);
        let PolicyConfig::RendezvousBounded(c) =
            PolicyConfig::with_parameters("rendezvous-bounded", &all).unwrap()
        else {
            panic!("rendezvous-bounded expected")
        };
        assert_eq!(c.slack, 1.5);
        assert_eq!(
            PolicyConfig::with_parameters("round-robin", &all),
            Some(PolicyConfig::RoundRobin)
        );
        for unset in [0.0, -1.0, f64::NAN] {
            let p = PolicyParameters {
                load_bound: Some(unset),
                ..all
            };
            assert_eq!(
                PolicyConfig::with_parameters("rendezvous-bounded", &p),
                PolicyConfig::by_name("rendezvous-bounded"),
                "{unset}"
            );
        }
    }

    #[test]
    fn written_parameters_read_back() {
        for name in PolicyConfig::NAMES {
            let config = PolicyConfig::by_name(name).unwrap();
            let read = PolicyConfig::with_parameters(name, &config.parameters());
            assert_eq!(read, Some(config), "{name}");
        }
        assert_eq!(
            PolicyConfig::RoundRobin.parameters(),
            PolicyParameters::default()
        );
    }
}
