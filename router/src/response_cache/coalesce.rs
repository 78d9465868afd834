//! Identical cacheable requests in flight at one router share one engine
//! call. The first to miss leads: it goes to an engine. Those after it,
//! until it ends, follow: they wait for its answer, at most
//! `responseCache.coalesceWaitMs`, and are served it as a hit. When the
//! leader ends without a storable answer (an error, a broken stream, a
//! client too slow to wait for), or the wait runs out, each follower goes
//! to an engine itself. A streamed request does not follow (its first
//! event must not wait for another's whole answer); it may lead. How the
//! leader reads its answer for the followers is
//! `crate::http::cached::record`'s.
//!
//! Only within a router: across routers sharing Redis, a lock in Redis
//! would cost every miss a round trip more, and a leader that dies holding
//! it would stall its followers until the lock expired.
//!
//! Memory: one entry per key being answered, so at most the requests in
//! flight, which the listeners bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::answer::Answer;

/// How a leader ended: its answer if it stored one.
type Ended = Option<Option<Arc<Answer>>>;

/// The keys being answered.
#[derive(Debug, Default)]
pub struct Inflight {
    leaders: Mutex<HashMap<[u8; 32], watch::Sender<Ended>>>,
}

/// A request's part in answering its key.
#[derive(Debug)]
pub enum Joined {
    /// The first: it goes to an engine, and tells the others how it ended.
    Lead(Leader),
    /// Another is answering it: wait for that answer.
    Follow(Follower),
}

/// The request answering a key; when dropped without an answer, its
/// followers go on alone.
#[derive(Debug)]
pub struct Leader {
    key: [u8; 32],
    inflight: Arc<Inflight>,
    tx: watch::Sender<Ended>,
}

/// A request waiting for a leader.
#[derive(Debug)]
pub struct Follower {
    rx: watch::Receiver<Ended>,
}

impl Inflight {
    /// Joins the requests answering `key`.
    pub fn join(self: &Arc<Self>, key: [u8; 32]) -> Joined {
        let mut leaders = self.leaders.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = leaders.get(&key) {
            return Joined::Follow(Follower { rx: tx.subscribe() });
        }
        let (tx, _) = watch::channel(None);
        leaders.insert(key, tx.clone());
        Joined::Lead(Leader {
            key,
            inflight: self.clone(),
            tx,
        })
    }

    /// Whether no key is being answered.
    pub fn is_empty(&self) -> bool {
        self.leaders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }
}

impl Leader {
    /// Completes when no follower waits for the answer (at once if none
    /// does; one may still join later, and then leads if this has ended).
    pub async fn unwanted(&self) {
        self.tx.closed().await;
    }

    /// Ends the lead with `answer` (stored, or `None`).
    pub fn end(self, answer: Option<Arc<Answer>>) {
        self.tx.send_replace(Some(answer));
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        let mut leaders = (self.inflight.leaders.lock()).unwrap_or_else(|e| e.into_inner());
        if leaders
            .get(&self.key)
            .is_some_and(|tx| tx.same_channel(&self.tx))
        {
            leaders.remove(&self.key);
        }
        drop(leaders);
        // Followers of a leader dropped without `end` go on alone.
        self.tx.send_if_modified(|ended| {
            let first = ended.is_none();
            if first {
                *ended = Some(None);
            }
            first
        });
    }
}

impl Follower {
    /// The leader's answer, if it stored one within `wait`.
    pub async fn answer(mut self, wait: std::time::Duration) -> Option<Arc<Answer>> {
        let ended = tokio::time::timeout(wait, self.rx.wait_for(Option::is_some)).await;
        match ended {
            Ok(Ok(ended)) => ended.clone().flatten(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn followers_get_the_leaders_answer_or_go_on_alone() {
        let inflight = Arc::new(Inflight::default());
        let Joined::Lead(leader) = inflight.join([1; 32]) else {
            panic!("the first leads")
        };
        let Joined::Follow(follower) = inflight.join([1; 32]) else {
            panic!("the second follows")
        };
        assert!(matches!(inflight.join([2; 32]), Joined::Lead(_)));
        let waiting = tokio::spawn(follower.answer(Duration::from_secs(5)));
        let answer = Arc::new(Answer {
            content: "4".into(),
            ..Answer::default()
        });
        leader.end(Some(answer.clone()));
        assert_eq!(waiting.await.unwrap(), Some(answer));
        assert!(inflight.is_empty(), "an ended lead leaves the map");

        // A leader dropped without an answer frees its followers at once.
        let Joined::Lead(leader) = inflight.join([3; 32]) else {
            panic!()
        };
        let Joined::Follow(follower) = inflight.join([3; 32]) else {
            panic!()
        };
        drop(leader);
        assert_eq!(follower.answer(Duration::from_secs(5)).await, None);

        // A wait that runs out.
        let Joined::Lead(_leader) = inflight.join([4; 32]) else {
            panic!()
        };
        let Joined::Follow(follower) = inflight.join([4; 32]) else {
            panic!()
        };
        let started = tokio::time::Instant::now();
        assert_eq!(follower.answer(Duration::from_secs(5)).await, None);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_knows_when_nobody_waits_for_its_answer() {
        let inflight = Arc::new(Inflight::default());
        let Joined::Lead(leader) = inflight.join([5; 32]) else {
            panic!()
        };
        leader.unwanted().await;
        let Joined::Follow(follower) = inflight.join([5; 32]) else {
            panic!()
        };
        let waiting = tokio::spawn(follower.answer(Duration::from_secs(5)));
        tokio::select! {
            () = leader.unwanted() => panic!("a follower waits"),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        assert_eq!(waiting.await.unwrap(), None, "its wait ran out");
        leader.unwanted().await;
    }
}
