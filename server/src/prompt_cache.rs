//! Prompt prefixes kept across requests, as llama-server's RAM cache keeps
//! them: the keys and values of earlier requests' tokens, so a request that
//! begins as one of them did (a shared system prompt, the next turn of a
//! conversation) runs only what is new. Bounded in bytes; the least recently
//! used entry goes first.

use leanstream_runtime::model::{KvCache, KvPrefix};

pub struct PromptCache {
    entries: Vec<Entry>,
    max_bytes: usize,
    clock: u64,
}

struct Entry {
    tokens: Vec<u32>,
    kv: KvPrefix,
    used: u64,
}

/// Leading tokens `a` and `b` share.
pub fn shared(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            entries: Vec::new(),
            max_bytes,
            clock: 0,
        }
    }

    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.kv.bytes()).sum()
    }

    /// The entry sharing the longest prefix with `ids`, and how many tokens.
    pub fn best(&self, ids: &[u32]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, shared(&e.tokens, ids)))
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n > 0)
    }

    /// Writes entry `i` into `kv`; answers the tokens the cache then holds.
    pub fn restore(&mut self, i: usize, kv: &mut KvCache) -> leanstream_runtime::Result<Vec<u32>> {
        self.clock += 1;
        let e = &mut self.entries[i];
        e.used = self.clock;
        kv.restore_prefix(&e.kv)?;
        Ok(e.tokens[..e.kv.len()].to_vec())
    }

    /// Keeps the keys and values of `tokens` (positions `0..tokens.len()` of
    /// `kv`), replacing entries it extends and evicting the least recently
    /// used beyond the byte bound.
    pub fn insert(&mut self, tokens: &[u32], kv: &KvCache) {
        if self.max_bytes == 0 || tokens.is_empty() {
            return;
        }
        self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        if self.entries.iter().any(|e| e.tokens.starts_with(tokens)) {
            return;
        }
        // A sliding-window ring that wrapped no longer holds the prefix in place.
        let Some(prefix) = kv.save_prefix(tokens.len()) else {
            return;
        };
        if prefix.bytes() > self.max_bytes {
            return;
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            kv: prefix,
            used: self.clock,
        });
        while self.bytes() > self.max_bytes {
            let oldest = (0..self.entries.len())
                .min_by_key(|&i| self.entries[i].used)
                .unwrap_or(0);
            self.entries.swap_remove(oldest);
        }
    }
}

/// How many prompt tokens `kv`, holding `cached`, can skip for `ids`; an
/// earlier prompt of `cache` that shares more is put back into `kv` first
/// (a restore that fails has written nothing). `cached` then holds the
/// prefix kept.
pub(crate) fn reuse_prefix(kv: &mut KvCache, cached: &mut Vec<u32>, ids: &[u32], cache: &mut PromptCache) -> usize {
    let mut reused = shared(cached, ids);
    if !kv.resumable(reused) {
        // A sliding-window ring that wrapped no longer holds what the shared
        // prefix's successors would see: run the prompt whole.
        reused = 0;
    }
    if let Some((i, n)) = cache.best(ids).filter(|&(_, n)| n > reused) {
        if let Ok(tokens) = cache.restore(i, kv) {
            *cached = tokens;
            reused = n;
        }
    }
    // Until it ends well, the state holds this prompt's prefix at most.
    cached.truncate(reused);
    reused
}
