//! The caller's end of an answer passed on as it is read, while a key is held: a bounded queue
//! that the caller's connection takes from, fed by the task that reads the upstream and keeps
//! the key's lease alive.
//!
//! That task must never wait on the caller for long: a caller that stopped reading (or reads far
//! slower than the upstream sends) would hold the key for as long as its connection stays open,
//! and an answer held back past the upstream timeout would break off, leaving the key to run
//! again after its lease. So the feeding waits for room in the queue for the caller's patience
//! at most, in all (the key's lease); a caller that used it up is let go: its body ends in an
//! error after what was queued (never as if it were whole), and the feeding goes on without it,
//! so that the answer is read to its end and the key settled.
//!
//! A body ends cleanly only when its feeding says so ([`CallerQueue::finish`]). A queue dropped
//! without it (the answer broke off, the feeding task panicked or was dropped with its runtime)
//! ends the body in an error, so a caller never takes a cut answer for a whole one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use onceguard_core::Scope;

/// A chunk of the caller's body, or the error it ends in.
pub type Chunk = Result<Bytes, std::io::Error>;

/// Chunks a queue holds before the feeding waits for the caller.
const QUEUED_CHUNKS: usize = 16;

/// How a body ends: in an error unless its feeding finished it ([`CallerQueue::finish`]).
const OPEN: u8 = 0;
const FINISHED: u8 = 1;
const LET_GO: u8 = 2;

/// The feeding end of a caller's body ([`caller_queue`]).
pub struct CallerQueue {
    tx: Option<mpsc::Sender<Chunk>>,
    patience: Duration,
    end: Arc<AtomicU8>,
    /// The key whose answer this is, named in the warning when the caller is let go.
    scope: Option<Scope>,
}

/// Why a chunk did not go to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// The caller left (its connection closed).
    Left,
    /// The caller held the feeding back for its patience in all, and was let go.
    LetGo,
}

/// A caller's queue, which waits for the caller `patience` at most in all, and the stream its
/// body is made of: the queued chunks, then an error unless the queue was finished.
pub fn caller_queue(patience: Duration) -> (CallerQueue, impl Stream<Item = Chunk> + Send + 'static) {
    let (tx, rx) = mpsc::channel::<Chunk>(QUEUED_CHUNKS);
    let end = Arc::new(AtomicU8::new(OPEN));
    let ended = end.clone();
    let last = futures::stream::once(async move { ended.load(Ordering::Acquire) }).filter_map(|end| async move {
        match end {
            FINISHED => None,
            LET_GO => Some(Err(std::io::Error::other("the caller took too long to read the answer and was let go"))),
            _ => Some(Err(std::io::Error::other("the answer broke off before its end"))),
        }
    });
    (CallerQueue { tx: Some(tx), patience, end, scope: None }, rx.chain(last))
}

impl CallerQueue {
    /// The same queue, naming `scope` in the warning logged when its caller is let go.
    pub fn for_key(mut self, scope: &Scope) -> Self {
        self.scope = Some(scope.clone());
        self
    }

    /// Queues `chunk`, waiting for room while the caller's patience lasts. `Err` once the caller
    /// has left or been let go (this time or before): the chunk is dropped, and so is every later one.
    pub async fn send(&mut self, chunk: Chunk) -> Result<(), Gone> {
        let Some(tx) = self.tx.as_mut() else {
            return Err(if self.end.load(Ordering::Acquire) == LET_GO { Gone::LetGo } else { Gone::Left });
        };
        let started = tokio::time::Instant::now();
        // Waits for room, then queues: never waits after queuing, as `SinkExt::send` would.
        let room = futures::future::poll_fn(|cx| tx.poll_ready(cx));
        match tokio::time::timeout(self.patience, room).await {
            Ok(Ok(())) if tx.start_send(chunk).is_ok() => {
                self.patience = self.patience.saturating_sub(started.elapsed());
                Ok(())
            }
            Ok(_) => {
                self.tx = None;
                Err(Gone::Left)
            }
            Err(_) => {
                let scope = self.scope.as_ref().map(tracing::field::display);
                tracing::warn!(
                    scope,
                    "a caller held the reading of its answer back for a lease's time: it is let go, and the answer is read to its end"
                );
                self.end.store(LET_GO, Ordering::Release);
                self.tx = None;
                Err(Gone::LetGo)
            }
        }
    }

    /// Ends the caller's body cleanly after what is queued: the answer was passed on whole (or,
    /// for an event stream, is to be resumed elsewhere). A caller already let go still gets the
    /// error it was let go with.
    pub fn finish(mut self) {
        let _ = self.end.compare_exchange(OPEN, FINISHED, Ordering::AcqRel, Ordering::Acquire);
        if let Some(tx) = self.tx.as_mut() {
            tx.close_channel();
        }
    }

    /// Whether the caller still takes the chunks: it has neither left nor been let go.
    pub fn is_connected(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| !tx.is_closed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a queue holds before a send waits: futures' channel keeps one more for its sender.
    const HELD: usize = QUEUED_CHUNKS + 1;

    /// A caller that takes nothing is let go once the feeding has waited its patience; its body
    /// then ends in an error after what was queued, and every later chunk is dropped at once.
    #[tokio::test(start_paused = true)]
    async fn a_caller_that_takes_nothing_is_let_go_after_its_patience() {
        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        for _ in 0..HELD {
            assert_eq!(queue.send(Ok(Bytes::from_static(b"x"))).await, Ok(()));
        }
        let started = tokio::time::Instant::now();
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Err(Gone::LetGo));
        assert_eq!(started.elapsed(), Duration::from_secs(2), "it waited its patience, no longer");
        assert_eq!(queue.send(Ok(Bytes::from_static(b"z"))).await, Err(Gone::LetGo), "no more waiting");
        assert!(!queue.is_connected());
        let got: Vec<Chunk> = body.collect().await;
        assert_eq!(got.len(), HELD + 1);
        assert!(got[..HELD].iter().all(|c| c.as_ref().is_ok_and(|b| &b[..] == b"x")));
        assert!(got[HELD].is_err(), "the body ends in an error, never as if it were whole");
    }

    /// The patience is spent in all, not per chunk: a caller that takes a chunk now and then,
    /// each just within the patience, is let go once the waits add up to it.
    #[tokio::test(start_paused = true)]
    async fn the_patience_is_spent_in_all() {
        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        let mut body = Box::pin(body);
        for _ in 0..HELD {
            queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        }
        let reader = tokio::spawn(async move {
            // Takes one chunk every 1.5 s.
            let mut taken = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                match body.next().await {
                    Some(Ok(_)) => taken += 1,
                    Some(Err(_)) => return (taken, true),
                    None => return (taken, false),
                }
            }
        });
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Ok(()), "1.5 s of 2");
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Err(Gone::LetGo), "1.5 s more: past 2 in all");
        drop(queue);
        let (taken, errored) = reader.await.unwrap();
        assert_eq!(taken, HELD + 1);
        assert!(errored);
    }

    /// A caller that reads keeps getting every chunk, and its body ends cleanly; one that left
    /// is told apart from one let go.
    #[tokio::test]
    async fn a_reading_caller_gets_everything_and_one_that_left_is_told_apart() {
        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        let reader = tokio::spawn(body.collect::<Vec<Chunk>>());
        for _ in 0..100 {
            queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        }
        queue.finish();
        let got = reader.await.unwrap();
        assert_eq!(got.len(), 100);
        assert!(got.iter().all(Result::is_ok));

        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        drop(body);
        assert_eq!(queue.send(Ok(Bytes::from_static(b"x"))).await, Err(Gone::Left));
        assert!(!queue.is_connected());
    }

    /// A caller that leaves while the feeding waits for room is told apart at once, not after
    /// the patience; a patience used up lets go only a caller whose queue is full; a queue closed
    /// on purpose ends the body cleanly.
    #[tokio::test(start_paused = true)]
    async fn a_caller_leaving_meanwhile_no_patience_left_and_a_closed_queue() {
        let (mut queue, body) = caller_queue(Duration::from_secs(60));
        for _ in 0..HELD {
            queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        }
        let leaves = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(body);
        });
        let started = tokio::time::Instant::now();
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Err(Gone::Left));
        assert_eq!(started.elapsed(), Duration::from_secs(1), "told when it left");
        leaves.await.unwrap();

        let (mut queue, body) = caller_queue(Duration::ZERO);
        assert_eq!(queue.send(Ok(Bytes::from_static(b"x"))).await, Ok(()), "room: no wait needed");
        for _ in 1..HELD {
            queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        }
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Err(Gone::LetGo), "full, and no patience left");
        drop(body);

        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        queue.finish();
        let got: Vec<Chunk> = body.collect().await;
        assert_eq!(got.len(), 1);
        assert!(got[0].is_ok(), "finished: the body ends cleanly");
    }

    /// A queue dropped unfinished (the answer broke off, or its feeding task panicked) ends the
    /// body in an error after what was queued; one let go keeps its own error when finished.
    #[tokio::test(start_paused = true)]
    async fn a_queue_dropped_unfinished_ends_the_body_in_an_error() {
        let (mut queue, body) = caller_queue(Duration::from_secs(2));
        queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        let feeding = tokio::spawn(async move {
            let _queue = queue;
            panic!("the feeding task fails");
        });
        assert!(feeding.await.is_err());
        let got: Vec<Chunk> = body.collect().await;
        assert_eq!(got.len(), 2);
        assert!(got[0].is_ok());
        let error = got[1].as_ref().expect_err("never as if it were whole");
        assert!(error.to_string().contains("broke off"), "{error}");

        let (mut queue, body) = caller_queue(Duration::ZERO);
        for _ in 0..HELD {
            queue.send(Ok(Bytes::from_static(b"x"))).await.unwrap();
        }
        assert_eq!(queue.send(Ok(Bytes::from_static(b"y"))).await, Err(Gone::LetGo));
        queue.finish();
        let got: Vec<Chunk> = body.collect().await;
        let error = got[HELD].as_ref().expect_err("let go, then finished: still an error");
        assert!(error.to_string().contains("let go"), "{error}");
    }
}
