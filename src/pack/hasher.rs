//! SHA-256 of a pack, computed on a thread of its own while the pack is written.
//!
//! SHA-256 is the costliest per-byte work of the spool (about as slow as the disk). Done inline it adds to every
//! batch; here the writer hands each chunk over as it writes it (a reference-counted [`Bytes`], never a copy) and goes
//! on writing and fsyncing, while the hashing thread follows. Only sealing a pack waits for the hash.
//!
//! States: `running` (chunks are accepted in order; at most [`MAX_CHUNKS_IN_FLIGHT`] chunks wait, so the writer is
//! held back rather than memory growing when hashing falls behind) and `finished` ([`BackgroundHasher::finish`] has
//! joined the thread and returned the hash state). The hash covers exactly the chunks passed to
//! [`BackgroundHasher::update`], in the order passed.

use std::thread::JoinHandle;

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Bound of the queue to the hashing thread. The pack writer passes one write group (at most 1 MiB) per chunk, so at
/// most 32 MiB wait to be hashed: that much memory may be held here. Measured with `capstore bench spool`: a bound of
/// 16 held 4 MiB captures to 75-79% of dd, 32 lets them reach 79-97%, about the SHA-256 speed of one core.
const MAX_CHUNKS_IN_FLIGHT: usize = 32;

/// Pieces hashed in order as one unit of the queue.
type Chunk = Vec<Bytes>;

pub struct BackgroundHasher {
    chunks_tx: Option<flume::Sender<Chunk>>,
    thread: Option<JoinHandle<Sha256>>,
}

impl BackgroundHasher {
    /// Starts hashing from `state` (a fresh hasher, or the state of bytes already on disk).
    pub fn start(mut state: Sha256) -> BackgroundHasher {
        let (chunks_tx, chunks_rx) = flume::bounded::<Chunk>(MAX_CHUNKS_IN_FLIGHT);
        let thread = std::thread::Builder::new()
            .name("pack-hasher".into())
            .spawn(move || {
                for chunk in chunks_rx.iter() {
                    for piece in chunk {
                        state.update(&piece);
                    }
                }
                state
            })
            .expect("spawning the pack hashing thread");
        BackgroundHasher { chunks_tx: Some(chunks_tx), thread: Some(thread) }
    }

    /// Queues `pieces` for hashing, in order, after everything queued before; blocks while the queue is full.
    pub fn update(&mut self, pieces: Vec<Bytes>) {
        if let Some(chunks_tx) = &self.chunks_tx {
            // A send fails only if the thread is gone (it panicked); finish() reports that.
            let _ = chunks_tx.send(pieces);
        }
    }

    /// Waits until every queued chunk is hashed and returns the hash state. Later updates are ignored.
    pub fn finish(&mut self) -> std::io::Result<Sha256> {
        self.chunks_tx = None;
        let thread = self.thread.take().ok_or_else(|| std::io::Error::other("the pack hash was already finished"))?;
        thread.join().map_err(|_| std::io::Error::other("the pack hashing thread panicked"))
    }
}

impl Drop for BackgroundHasher {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has drained; joining keeps no thread behind.
        self.chunks_tx = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_equals_the_hash_of_the_concatenation_in_order() {
        let mut expected = Sha256::new();
        expected.update(b"prefix");
        let mut hasher = BackgroundHasher::start(expected.clone());
        let mut all = Vec::new();
        for size in [0usize, 1, 5000, 1 << 20, (3 << 20) + 17] {
            let chunk: Vec<u8> = (0..size).map(|i| (i * 31 + size) as u8).collect();
            all.extend_from_slice(&chunk);
            all.extend_from_slice(&chunk);
            hasher.update(vec![Bytes::from(chunk.clone()), Bytes::from(chunk)]);
        }
        expected.update(&all);
        assert_eq!(hasher.finish().unwrap().finalize(), expected.finalize());
    }
}
