//! One worker's event stream: a ZeroMQ SUB socket on the engine's publisher and a
//! DEALER on its replay endpoint, feeding the pool's [`KvIndex`].
//!
//! A session connects both, forgets the worker's entries, replays the engine's
//! buffered history from sequence 0 (resync), then applies live batches in
//! sequence order: a gap is fetched from the replay endpoint, a sequence that
//! goes back means a new engine (resync). While the stream is quiet the replay
//! endpoint is probed for anything after the last batch, which catches lost
//! trailing batches and a dead or restarted engine (no answer: reconnect and
//! resync). On every batch and probe the engine's process start time, as its
//! `/metrics` last reported it, is compared too (`restart.rs`). Any error ends
//! the session; the next starts after a short pause.

use super::apply::{Applied, WorkerBlocks};
use super::index::{KvIndex, SlotState};
use super::restart::{EngineStart, Seen, StartWatch};
use super::sequence::{Sequencer, Step};
use super::wire::{self, Tier};
use crate::config::{KvEndpoints, KvEventsConfig};
use crate::telemetry::names;
use bytes::Bytes;
use metrics::{counter, gauge};
use std::sync::Arc;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Longest wait to connect, or for one reply frame of a replay.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause between sessions.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// The replay stream's end marker: sequence -1.
const END_SEQ: u64 = u64::MAX;

/// What a subscriber needs.
pub struct Subscriber {
    pub pool: Arc<str>,
    pub worker: Arc<str>,
    pub endpoints: KvEndpoints,
    pub cfg: KvEventsConfig,
    pub index: Arc<KvIndex>,
    /// The engine's process start time, written by the worker's stats poller.
    pub start: Arc<EngineStart>,
}

/// The state a session works on (survives across sessions).
struct State {
    sub: Subscriber,
    slot: u8,
    blocks: WorkerBlocks,
    seq: Sequencer,
    start: StartWatch,
    /// Set once the worker is refused: later events are counted, not applied.
    refused: bool,
}

impl Subscriber {
    /// Subscribe until the task is aborted. Entries are removed when it ends.
    pub async fn run(self) {
        let Some(slot) = self.index.claim(&self.worker) else {
            tracing::error!(pool = %self.pool, worker = %self.worker,
                "kv events: more than 64 workers in the pool; this worker is not indexed and the pool routes on the approximate index");
            return;
        };
        let _release = Release(self.index.clone(), slot);
        gauge!(names::KV_INDEX_CAPACITY_BLOCKS, names::L_POOL => self.pool.to_string())
            .set(self.cfg.max_blocks_per_worker as f64);
        let blocks = WorkerBlocks::new(slot, self.cfg.block_size, self.cfg.max_blocks_per_worker);
        let st = State {
            start: StartWatch::new(self.start.clone()),
            sub: self,
            slot,
            blocks,
            seq: Sequencer::default(),
            refused: false,
        };
        let (pool, worker) = (st.sub.pool.clone(), st.sub.worker.clone());
        let st = Arc::new(tokio::sync::Mutex::new(st));
        let mut reason = "start";
        loop {
            // zeromq's sockets panic when every peer is gone mid-receive: run each
            // session in its own task, so such a panic only ends the session (the
            // lock is released while unwinding; the next session resyncs).
            let s = st.clone();
            let session = AbortOnDrop(tokio::spawn(
                async move { s.lock().await.session(reason).await },
            ));
            let why = match (&mut { session }.0).await {
                Ok(Err(e)) => e,
                Ok(Ok(())) => "session ended".into(),
                Err(_) => "engine connection lost".into(),
            };
            tracing::warn!(pool = %pool, worker = %worker, reason = %why,
                "kv events: stream interrupted; reconnecting and resyncing");
            reason = "reconnect";
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }
}

/// Aborts a session task when the subscriber is aborted.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), String>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Clears and frees the worker's slot when the subscriber ends.
struct Release(Arc<KvIndex>, u8);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.clear_slot(self.1);
        self.0.release(self.1);
    }
}

impl State {
    fn labels(&self) -> [(&'static str, String); 2] {
        [
            (names::L_POOL, self.sub.pool.to_string()),
            (names::L_WORKER, self.sub.worker.to_string()),
        ]
    }

    fn count(&self, kind: &'static str, n: u64) {
        let l = self.labels();
        counter!(
            names::KV_EVENTS_TOTAL,
            &[
                (l[0].0, l[0].1.clone()),
                (l[1].0, l[1].1.clone()),
                (names::L_KIND, kind.to_string())
            ]
        )
        .increment(n);
    }

    fn set_state(&self, s: SlotState) {
        self.sub.index.set_state(self.slot, s);
        gauge!(names::KV_WORKER_STATE, &self.labels()).set(s as u8 as f64);
    }

    async fn session(&mut self, reason: &'static str) -> Result<(), String> {
        if !self.refused {
            self.set_state(SlotState::Syncing);
        }
        let mut sub = SubSocket::new();
        let ep = &self.sub.endpoints;
        timed(sub.connect(&ep.events), "connect to kv_events").await?;
        timed(sub.subscribe(&self.sub.cfg.topic), "subscribe").await?;
        let mut dealer = match &ep.replay {
            Some(r) => {
                let mut d = DealerSocket::new();
                timed(d.connect(r), "connect to kv_replay").await?;
                Some(d)
            }
            None => None,
        };
        self.resync(reason);
        if let Some(d) = dealer.as_mut() {
            self.replay(d, 0).await?;
            // Nothing buffered: the engine has published nothing yet, so
            // whatever comes first after sequence 0 is a gap to fetch.
            self.seq.expect(0);
        }
        if !self.refused {
            self.set_state(SlotState::Live);
        }
        loop {
            tokio::select! {
                m = sub.recv() => {
                    let m = m.map_err(|e| format!("receive: {e}"))?;
                    self.check_restart(dealer.as_mut()).await?;
                    self.on_live(m, dealer.as_mut()).await?;
                }
                _ = tokio::time::sleep(self.sub.cfg.probe_interval) => {
                    if self.check_restart(dealer.as_mut()).await? {
                        continue;
                    }
                    // Without a replay endpoint a quiet engine cannot be told
                    // from a dead one (documented in docs/routing.md).
                    if let Some(d) = dealer.as_mut() {
                        let from = self.seq.next().unwrap_or(0);
                        self.replay(d, from).await?;
                    }
                }
            }
        }
    }

    /// The engine's `/metrics` reports another process start time: a new
    /// engine, maybe one that has published nothing yet. Forget the worker and
    /// replay the new engine's history from scratch. Whether it restarted.
    async fn check_restart(&mut self, dealer: Option<&mut DealerSocket>) -> Result<bool, String> {
        let ms = match self.start.check() {
            Seen::Same => return Ok(false),
            Seen::Adopted(ms) => {
                self.publish_start(ms);
                return Ok(false);
            }
            Seen::Restarted(ms) => ms,
        };
        tracing::warn!(pool = %self.sub.pool, worker = %self.sub.worker, start_unix_ms = ms,
            "kv events: the engine restarted (its process start time changed); dropping its entries and resyncing");
        self.publish_start(ms);
        self.resync("restart");
        if let Some(d) = dealer {
            self.replay(d, 0).await?;
            self.seq.expect(0);
        }
        Ok(true)
    }

    /// Forget the worker's entries before rebuilding them.
    fn resync(&mut self, reason: &'static str) {
        self.blocks.clear(&self.sub.index);
        self.seq = Sequencer::default();
        self.start.rebase();
        let l = self.labels();
        counter!(
            names::KV_RESYNCS_TOTAL,
            &[
                (l[0].0, l[0].1.clone()),
                (l[1].0, l[1].1.clone()),
                ("reason", reason.to_string())
            ]
        )
        .increment(1);
        self.publish_blocks();
    }

    /// Handle one live message `[topic, seq, payload]`.
    async fn on_live(
        &mut self,
        m: ZmqMessage,
        dealer: Option<&mut DealerSocket>,
    ) -> Result<(), String> {
        self.count("received", 1);
        let frames = m.into_vec();
        let (Some(seq), Some(payload)) = (frames.get(1).and_then(seq_of), frames.get(2)) else {
            self.count("undecodable", 1);
            return Ok(());
        };
        match self.seq.on_live(seq) {
            Step::Apply => {}
            Step::Duplicate => {
                self.count("duplicate", 1);
                return Ok(());
            }
            Step::Gap { from } => match dealer {
                Some(d) => {
                    self.replay(d, from).await?;
                    match self.seq.next() {
                        Some(n) if n > seq => return Ok(()),
                        Some(n) if n < seq => self.count("lost", seq - n),
                        _ => {}
                    }
                }
                None => self.count("lost", seq - from),
            },
            Step::Reset => {
                self.resync("sequence_reset");
                return Err("the engine's sequence numbers went back (restart)".into());
            }
        }
        self.apply(payload);
        self.seq.applied(seq);
        Ok(())
    }

    /// Ask the replay endpoint for every batch from `from` on and apply them.
    async fn replay(&mut self, d: &mut DealerSocket, from: u64) -> Result<(), String> {
        let req = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        let req = ZmqMessage::try_from(req).map_err(|e| e.to_string())?;
        timed(d.send(req), "send a replay request").await?;
        let mut expect = from;
        loop {
            let m = timed(d.recv(), "replay answer").await?;
            let frames = m.into_vec();
            let n = frames.len();
            if n < 2 {
                return Err("replay: malformed answer".into());
            }
            let Some(seq) = seq_of(&frames[n - 2]) else {
                return Err("replay: malformed sequence number".into());
            };
            let payload = &frames[n - 1];
            if seq == END_SEQ || payload.is_empty() {
                return Ok(());
            }
            if seq < expect {
                continue;
            }
            if seq > expect && !(from == 0 && self.seq.next().is_none()) {
                // The engine's replay buffer no longer holds them.
                self.count("lost", seq - expect);
            }
            self.count("replayed", 1);
            self.apply(payload);
            self.seq.replayed(seq);
            expect = seq + 1;
        }
    }

    /// Decode and apply one batch.
    fn apply(&mut self, payload: &[u8]) {
        let batch = match wire::decode(payload) {
            Ok(b) => b,
            Err(e) => {
                self.count("undecodable", 1);
                tracing::debug!(worker = %self.sub.worker, error = %e, "kv events: undecodable batch");
                return;
            }
        };
        if self.refused {
            return;
        }
        let mut total = Applied::default();
        for ev in &batch.events {
            match self.blocks.apply(&self.sub.index, ev) {
                Ok(a) => {
                    total.unchained += a.unchained;
                    total.over_capacity += a.over_capacity;
                    if a.cleared {
                        let l = self.labels();
                        counter!(
                            names::KV_RESYNCS_TOTAL,
                            &[
                                (l[0].0, l[0].1.clone()),
                                (l[1].0, l[1].1.clone()),
                                ("reason", "cleared".to_string())
                            ]
                        )
                        .increment(1);
                    }
                }
                Err(r) => {
                    self.refuse(&r);
                    return;
                }
            }
        }
        self.count("applied", 1);
        let l = self.labels();
        for (reason, n) in [
            ("unchained", total.unchained),
            ("over_capacity", total.over_capacity),
        ] {
            if n > 0 {
                counter!(
                    names::KV_BLOCKS_SKIPPED_TOTAL,
                    &[
                        (l[0].0, l[0].1.clone()),
                        (l[1].0, l[1].1.clone()),
                        ("reason", reason.to_string())
                    ]
                )
                .increment(n);
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if batch.ts > 0.0 {
            gauge!(names::KV_INDEX_LAG_SECONDS, &l).set((now - batch.ts).max(0.0));
        }
        self.publish_blocks();
    }

    /// Refuse the worker: its entries go, the pool routes approximately.
    fn refuse(&mut self, r: &super::apply::Refusal) {
        tracing::error!(pool = %self.sub.pool, worker = %self.sub.worker, problem = %r,
            "kv events: refusing precise routing for this pool; routing on the approximate prefix index");
        let l = self.labels();
        counter!(
            names::KV_REFUSALS_TOTAL,
            &[
                (l[0].0, l[0].1.clone()),
                (l[1].0, l[1].1.clone()),
                ("reason", r.label().to_string())
            ]
        )
        .increment(1);
        self.refused = true;
        self.blocks.clear(&self.sub.index);
        self.set_state(SlotState::Refused);
        self.publish_blocks();
    }

    fn publish_start(&self, unix_ms: u64) {
        gauge!(names::KV_ENGINE_START_SECONDS, &self.labels()).set(unix_ms as f64 / 1000.0);
    }

    fn publish_blocks(&self) {
        let l = self.labels();
        for (t, n) in Tier::ALL.into_iter().zip(self.blocks.per_tier()) {
            gauge!(
                names::KV_INDEX_BLOCKS,
                &[
                    (l[0].0, l[0].1.clone()),
                    (l[1].0, l[1].1.clone()),
                    (names::L_MEDIUM, t.as_str().to_string())
                ]
            )
            .set(n as f64);
        }
    }
}

/// An 8-byte big-endian sequence number.
fn seq_of(b: &Bytes) -> Option<u64> {
    Some(u64::from_be_bytes(b.as_ref().try_into().ok()?))
}

async fn timed<T, E: std::fmt::Display>(
    f: impl std::future::Future<Output = Result<T, E>>,
    what: &str,
) -> Result<T, String> {
    match tokio::time::timeout(IO_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {IO_TIMEOUT:?}")),
    }
}
