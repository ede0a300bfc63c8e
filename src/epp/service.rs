//! The gRPC service `envoy.service.ext_proc.v3.ExternalProcessor/Process`: each
//! stream runs one [`Exchange`] in its own task, answers going out through a
//! small bounded channel (the data plane reads them as they come).

use super::exchange::{Exchange, Shared};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_util::Stream;
use std::pin::Pin;
use std::sync::Arc;
use tonic::{Request, Response, Status, Streaming};

/// Answers queued per stream before the picker waits for the data plane.
const ANSWERS_QUEUED: usize = 16;

pub struct Picker {
    pub shared: Arc<Shared>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let peer = request.remote_addr().map(|a| a.ip());
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(ANSWERS_QUEUED);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let mut ex = Exchange::new(shared, peer);
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "ext_proc stream ended with an error");
                        break;
                    }
                };
                for answer in ex.on_message(msg).await {
                    if tx.send(Ok(answer)).await.is_err() {
                        return;
                    }
                }
                if ex.is_closed() {
                    break;
                }
            }
        });
        let answers =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|a| (a, rx)) },
            );
        Ok(Response::new(Box::pin(answers)))
    }
}
