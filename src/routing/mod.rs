//! Choosing a worker. A policy is a pure function of the request's features and the
//! route's workers: no I/O, no locks, no allocation per pick. The caller passes an
//! `accept` predicate that refuses workers already tried or unavailable.

mod baseline;
pub mod rendezvous;

pub use baseline::{RandomPolicy, RoundRobin};

use crate::api::RequestInfo;
use crate::config::PolicyKind;
use crate::pool::Worker;
use std::sync::Arc;

/// Why a worker was chosen; a low-cardinality metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    RoundRobin,
    Random,
    /// Disaggregation: the prefill worker answered for the client (its error).
    Prefill,
    /// Disaggregation: the decode worker, chosen by load.
    Decode,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::Prefill => "pd_prefill",
            Reason::Decode => "pd_decode",
        }
    }
}

/// A policy's choice: the index into the route's workers, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub index: usize,
    pub reason: Reason,
}

/// What a policy may look at besides the workers.
pub struct RouteRequest<'a> {
    pub info: &'a RequestInfo,
    /// `x-session-id` header, when present.
    pub session: Option<&'a str>,
}

/// A routing policy.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;

    /// Pick one of `workers` for which `accept(index)` holds, or `None` if none does.
    fn pick(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
    ) -> Option<Decision>;
}

/// Instantiate the policy a pool names.
pub fn build(kind: PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Random => Box::new(RandomPolicy),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn workers(n: usize) -> Vec<Arc<Worker>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Worker::new(
                        &format!("http://w{i}:80"),
                        Default::default(),
                        Default::default(),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }
}
