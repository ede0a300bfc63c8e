use super::*;
use std::sync::Arc;

fn queue(max_count: usize, max_bytes: u64, ttl_ms: u64) -> Arc<FlowQueue> {
    Arc::new(FlowQueue::new(
        "p".into(),
        QueueLimits {
            max_count,
            max_bytes,
            ttl: [Duration::from_millis(ttl_ms); 4],
            max_flows: 16,
            preemption: Preemption::Requeue,
        },
    ))
}

fn ticket(prio: Priority, flow: &str, cost: u64, bytes: u64) -> Ticket<'_> {
    Ticket {
        prio,
        flow,
        weight: 1.0,
        cost,
        bytes,
        front: false,
        declined: false,
    }
}

/// Spawn a waiter that records `name` when granted.
fn waiter(
    q: &Arc<FlowQueue>,
    order: &Arc<Mutex<Vec<&'static str>>>,
    name: &'static str,
    prio: Priority,
    flow: &'static str,
    cost: u64,
) -> tokio::task::JoinHandle<Result<(), QueueError>> {
    let (q, order) = (q.clone(), order.clone());
    tokio::spawn(async move {
        let mut place = None;
        q.wait(&ticket(prio, flow, cost, 10), &mut place, None)
            .await?;
        order.lock().push(name);
        q.dispatched(place);
        Ok(())
    })
}

#[tokio::test(start_paused = true)]
async fn classes_leave_in_strict_order_and_fairly_within_one() {
    let q = queue(16, 1 << 20, 10_000);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, prio, flow, cost) in [
        ("low", Priority::Low, "t", 10),
        ("heavy1", Priority::Normal, "heavy", 1000),
        ("heavy2", Priority::Normal, "heavy", 1000),
        ("light", Priority::Normal, "light", 100),
        ("critical", Priority::Critical, "t", 10),
        ("high", Priority::High, "t", 10),
    ] {
        tasks.push(waiter(&q, &order, name, prio, flow, cost));
        tokio::task::yield_now().await;
    }
    assert!(q.must_wait(Priority::Low) && q.must_wait(Priority::Critical));
    // One release: each dispatched waiter hands the turn on (room is unlimited here).
    q.release();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        *order.lock(),
        ["critical", "high", "light", "heavy1", "heavy2", "low"]
    );
    assert_eq!(q.depth(), 0);
    assert!(!q.must_wait(Priority::Low));
}

#[tokio::test(start_paused = true)]
async fn caps_refuse_or_shed_a_lower_class_and_ttl_expires() {
    let q = queue(2, 1 << 20, 100);
    let order = Arc::new(Mutex::new(Vec::new()));
    let low = waiter(&q, &order, "low", Priority::Low, "t", 1);
    let normal = waiter(&q, &order, "normal", Priority::Normal, "t", 1);
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    assert_eq!(q.depth(), 2);
    // Full: another low is refused; a high one sheds the low waiter.
    let mut place = None;
    assert_eq!(
        q.wait(&ticket(Priority::Low, "t", 1, 1), &mut place, None)
            .await,
        Err(QueueError::Full)
    );
    let high = waiter(&q, &order, "high", Priority::High, "t", 1);
    assert_eq!(low.await.unwrap(), Err(QueueError::Evicted));
    // Nobody releases: the rest time out.
    assert_eq!(normal.await.unwrap(), Err(QueueError::Timeout));
    assert_eq!(high.await.unwrap(), Err(QueueError::Timeout));
    assert_eq!(q.depth(), 0);
    assert!(!q.must_wait(Priority::Low));
}

#[tokio::test(start_paused = true)]
async fn byte_cap_counts_bodies() {
    let q = queue(100, 25, 100);
    let order = Arc::new(Mutex::new(Vec::new()));
    let a = waiter(&q, &order, "a", Priority::Normal, "t", 1);
    let b = waiter(&q, &order, "b", Priority::Normal, "t", 1);
    tokio::task::yield_now().await;
    let mut place = None;
    assert_eq!(
        q.wait(&ticket(Priority::Normal, "t", 1, 10), &mut place, None)
            .await,
        Err(QueueError::Full)
    );
    a.abort();
    b.abort();
}

#[tokio::test(start_paused = true)]
async fn a_waiter_keeps_its_place_and_a_new_wait_preempts_below() {
    let q = queue(8, 1 << 20, 10_000);
    let (_guard, preempted) = q.preemptible(Priority::Low);
    let q2 = q.clone();
    let t = tokio::spawn(async move {
        let mut place = None;
        q2.wait(&ticket(Priority::High, "t", 1, 1), &mut place, None)
            .await
    });
    // The high waiter's arrival cancels the low request in flight.
    preempted.await.unwrap();
    // A normal waiter granted then sent back keeps its tag ahead of newcomers.
    q.release();
    t.await.unwrap().unwrap();
    let q3 = q.clone();
    let w = tokio::spawn(async move {
        let mut place = None;
        q3.wait(&ticket(Priority::Normal, "t", 1, 1), &mut place, None)
            .await?;
        let tag = place.as_ref().unwrap().tag;
        q3.wait(&ticket(Priority::Normal, "t", 1, 1), &mut place, None)
            .await?;
        assert_eq!(place.as_ref().unwrap().tag, tag);
        q3.dispatched(place);
        Ok::<_, QueueError>(())
    });
    tokio::task::yield_now().await;
    q.release();
    tokio::task::yield_now().await;
    q.release();
    w.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_waiter_preempts_once_and_only_lower_classes() {
    let q = queue(8, 1 << 20, 10_000);
    let (_low, mut low_rx) = q.preemptible(Priority::Low);
    let (_normal, mut normal_rx) = q.preemptible(Priority::Normal);
    let (_high, mut high_rx) = q.preemptible(Priority::High);
    let q2 = q.clone();
    let w = tokio::spawn(async move {
        let mut place = None;
        q2.wait(&ticket(Priority::High, "t", 1, 1), &mut place, None)
            .await?;
        // Granted, found no room, back to its place: no second preemption.
        q2.wait(&ticket(Priority::High, "t", 1, 1), &mut place, None)
            .await
    });
    tokio::task::yield_now().await;
    // The lowest class goes first; the same class and above are never touched.
    assert!(low_rx.try_recv().is_ok());
    q.release();
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    assert!(normal_rx.try_recv().is_err(), "one preemption per waiter");
    assert!(high_rx.try_recv().is_err());
    q.release();
    w.await.unwrap().unwrap();
}

/// A waiter granted the turn is still waiting: while it picks again, the count
/// and byte caps still hold its place (the race `tests/flow_control.rs` hit).
#[tokio::test(start_paused = true)]
async fn the_waiter_holding_the_turn_still_counts_against_the_caps() {
    let q = queue(1, 1 << 20, 10_000);
    let t = ticket(Priority::Normal, "t", 10, 10);
    let mut place = None;
    let waiting = {
        let q = q.clone();
        tokio::spawn(async move {
            let mut place = None;
            q.wait(&ticket(Priority::Normal, "t", 10, 10), &mut place, None)
                .await?;
            // Holding the turn: a newcomer must find the queue full.
            let newcomer = q
                .wait(&ticket(Priority::Normal, "u", 10, 10), &mut None, None)
                .await;
            q.dispatched(place);
            newcomer
        })
    };
    while q.depth() == 0 {
        tokio::task::yield_now().await;
    }
    q.release();
    assert_eq!(waiting.await.unwrap(), Err(QueueError::Full));
    // Once it left, there is room again.
    let admitted =
        tokio::time::timeout(Duration::from_millis(1), q.wait(&t, &mut place, None)).await;
    assert!(admitted.is_err(), "queued, not refused");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_leaves_at_its_own_deadline_before_the_class_ttl() {
    let q = queue(4, 1 << 20, 10_000);
    let mut place = None;
    let by = crate::runtime::clock::now() + Duration::from_millis(300);
    let t0 = crate::runtime::clock::now();
    let r = q
        .wait(&ticket(Priority::Normal, "t", 1, 1), &mut place, Some(by))
        .await;
    assert_eq!(r, Err(QueueError::Objective));
    assert_eq!(
        t0.elapsed(),
        Duration::from_millis(300),
        "left at its deadline"
    );
    assert!(place.is_none() && q.depth() == 0, "and left the queue");
    // A deadline after the TTL changes nothing: the TTL ends the wait.
    let late = crate::runtime::clock::now() + Duration::from_secs(60);
    let r = q
        .wait(&ticket(Priority::Normal, "t", 1, 1), &mut place, Some(late))
        .await;
    assert_eq!(r, Err(QueueError::Timeout));
}

#[tokio::test(start_paused = true)]
async fn a_newcomer_is_offered_the_room_a_waiter_turned_down() {
    let q = queue(16, 1 << 20, 10_000);
    // The first waiter is granted a turn, finds only a worker it turns down
    // (too slow for it, or a slot kept for others) and goes back to wait.
    let granted = tokio::spawn({
        let q = q.clone();
        async move {
            let mut first = None;
            let heavy = ticket(Priority::Normal, "heavy", 1000, 10);
            q.wait(&heavy, &mut first, None).await.unwrap();
            let again = Ticket {
                declined: true,
                ..ticket(Priority::Normal, "heavy", 1000, 10)
            };
            let r = tokio::time::timeout(Duration::from_secs(1), q.wait(&again, &mut first, None));
            r.await.is_ok()
        }
    });
    tokio::task::yield_now().await;
    q.release(); // a slot frees: the only waiter gets the turn
    tokio::task::yield_now().await;
    // A newcomer joins with no release since: the room is offered to it (and
    // to the waiter at the head, before it).
    let mut place = None;
    let light = ticket(Priority::Normal, "light", 10, 10);
    let r = tokio::time::timeout(Duration::from_secs(1), q.wait(&light, &mut place, None)).await;
    assert!(matches!(r, Ok(Ok(()))), "the newcomer got a turn");
    q.dispatched(place);
    drop(granted);
}
