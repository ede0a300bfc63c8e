//! `grpc.health.v1.Health`, as the endpoint-picker protocol asks: `liveness` is
//! serving while the process answers; `readiness`, the empty name and the ext_proc
//! service are serving while every model has a worker able to take requests.

use crate::server::Gateway;
use std::sync::Arc;
use std::time::Duration;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::ServingStatus;

/// The ext_proc service's full name, a health-check service name of its own.
const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// How often readiness is re-read from the snapshot.
const REFRESH: Duration = Duration::from_millis(200);

/// The health service, kept current by a task that follows the snapshot.
pub fn service(gw: Arc<Gateway>) -> HealthServer<impl Health> {
    let (reporter, server) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        reporter
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        let mut last = None;
        let mut tick = tokio::time::interval(REFRESH);
        loop {
            tick.tick().await;
            let ready = gw.routes.snapshot().is_ready();
            if last == Some(ready) {
                continue;
            }
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for name in ["readiness", "", EXT_PROC] {
                reporter.set_service_status(name, status).await;
            }
            last = Some(ready);
        }
    });
    server
}
