//! Active-set traces: which neurons each FFN call kept, call by call.
//!
//! A policy that computes every activation (`dense`, `dense-stream`) can
//! record the sets it kept; the `oracle` policy replays them, so it knows
//! each layer's true active set before the layer's input exists and can load
//! exactly those bundles one layer ahead. Because the replay computes the
//! same activations of the same bytes and sums them in the same order, its
//! outputs are bit-identical to the recording run's (tested), which is what
//! makes it an upper bound for any predictor rather than an approximation.

use crate::{Result, RuntimeError};

/// One FFN call: a layer over `rows` token rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Call {
    layer: u32,
    rows: u32,
    /// Index of the call's first row bitmap in `bits` (in rows).
    first_row: usize,
}

/// The sets kept by each FFN call of a run, as one bitmap of `n_ff` bits per
/// token row (1 = computed), in call order.
#[derive(Debug, Clone, Default)]
pub struct ActiveTrace {
    n_ff: usize,
    words: usize,
    calls: Vec<Call>,
    bits: Vec<u64>,
}

impl ActiveTrace {
    pub fn new(n_ff: usize) -> Self {
        Self {
            n_ff,
            words: n_ff.div_ceil(64),
            calls: Vec::new(),
            bits: Vec::new(),
        }
    }

    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    pub fn n_calls(&self) -> usize {
        self.calls.len()
    }

    /// Bytes held (bitmaps and call table).
    pub fn bytes(&self) -> u64 {
        (self.bits.capacity() * 8 + self.calls.capacity() * std::mem::size_of::<Call>()) as u64
    }

    /// Starts a call of `rows` rows of `layer`; returns the bitmaps of its rows
    /// (all zero) to fill.
    pub fn begin_call(&mut self, layer: usize, rows: usize) -> &mut [u64] {
        let first_row = self.bits.len() / self.words;
        self.calls.push(Call {
            layer: layer as u32,
            rows: rows as u32,
            first_row,
        });
        let start = self.bits.len();
        self.bits.resize(start + rows * self.words, 0);
        &mut self.bits[start..]
    }

    /// Call `k`'s layer and row bitmaps (`rows * words` words).
    pub fn call(&self, k: usize) -> Option<(usize, usize, &[u64])> {
        let c = self.calls.get(k)?;
        let start = c.first_row * self.words;
        Some((
            c.layer as usize,
            c.rows as usize,
            &self.bits[start..start + c.rows as usize * self.words],
        ))
    }

    /// Words per row bitmap.
    pub fn words(&self) -> usize {
        self.words
    }
}

/// Replays a trace, checking that the run follows it.
#[derive(Debug)]
pub struct TraceCursor {
    trace: ActiveTrace,
    next: usize,
    /// Union of the current call's rows (what is loaded).
    union: Vec<u64>,
}

impl TraceCursor {
    pub fn new(trace: ActiveTrace) -> Self {
        let words = trace.words;
        Self {
            trace,
            next: 0,
            union: vec![0; words],
        }
    }

    pub fn bytes(&self) -> u64 {
        self.trace.bytes() + self.union.len() as u64 * 8
    }

    /// Union of call `k`'s row sets, into `out`.
    fn union_of(&self, k: usize, out: &mut [u64]) -> Option<usize> {
        let (layer, rows, bits) = self.trace.call(k)?;
        out.fill(0);
        for r in 0..rows {
            for (o, &b) in out
                .iter_mut()
                .zip(&bits[r * self.trace.words..(r + 1) * self.trace.words])
            {
                *o |= b;
            }
        }
        Some(layer)
    }

    /// Takes the next call, which must be `layer` over `rows` rows, and
    /// returns its index (for [`rows`](Self::rows)); [`union`](Self::union)
    /// is then its rows' union.
    pub fn advance(&mut self, layer: usize, rows: usize) -> Result<usize> {
        let k = self.next;
        match self.trace.call(k) {
            Some((l, r, _)) if l == layer && r == rows => {}
            Some((l, r, _)) => {
                return Err(RuntimeError::Invalid(format!(
                    "oracle trace out of step at call {k}: it recorded layer {l} over {r} rows, \
                     the run asks for layer {layer} over {rows} rows (replay the exact recorded run)"
                )))
            }
            None => {
                return Err(RuntimeError::Invalid(format!(
                    "oracle trace exhausted after {k} calls (the run is longer than the recorded one)"
                )))
            }
        }
        let mut union = std::mem::take(&mut self.union);
        self.union_of(k, &mut union);
        self.union = union;
        self.next += 1;
        Ok(k)
    }

    /// Row bitmaps of call `k` (`rows * words` words).
    pub fn rows(&self, k: usize) -> &[u64] {
        self.trace.call(k).map_or(&[], |(_, _, bits)| bits)
    }

    /// Union of the rows of the call last taken by [`advance`](Self::advance).
    pub fn union(&self) -> &[u64] {
        &self.union
    }

    /// The call after the current one: its layer and union (for prefetching).
    pub fn peek_next(&self, out: &mut [u64]) -> Option<usize> {
        self.union_of(self.next, out)
    }

    /// Calls replayed so far.
    pub fn position(&self) -> usize {
        self.next
    }
}

/// Iterates the set bits of a bitmap in ascending order.
pub fn set_bits(bits: &[u64]) -> impl Iterator<Item = usize> + '_ {
    bits.iter().enumerate().flat_map(|(w, &word)| {
        let mut b = word;
        std::iter::from_fn(move || {
            if b == 0 {
                return None;
            }
            let i = w * 64 + b.trailing_zeros() as usize;
            b &= b - 1;
            Some(i)
        })
    })
}

/// The groups of `g` consecutive neurons (of `n_ff`) with a bit set in
/// `bits`: where neurons share down tiles, a wanted neuron brings its group.
pub fn groups_touched(bits: &[u64], n_ff: usize, g: usize) -> impl Iterator<Item = usize> + '_ {
    (0..n_ff / g).filter(move |grp| (grp * g..(grp + 1) * g).any(|i| bit_is_set(bits, i)))
}

/// `bits` widened to whole groups of `g` into `out` (cleared first): every
/// neuron of each group [`groups_touched`].
pub fn widen_to_groups(bits: &[u64], n_ff: usize, g: usize, out: &mut [u64]) {
    out.fill(0);
    for grp in groups_touched(bits, n_ff, g) {
        (grp * g..(grp + 1) * g).for_each(|i| set_bit(out, i));
    }
}

#[inline]
pub fn bit_is_set(bits: &[u64], i: usize) -> bool {
    bits[i / 64] & (1 << (i % 64)) != 0
}

#[inline]
pub fn set_bit(bits: &mut [u64], i: usize) {
    bits[i / 64] |= 1 << (i % 64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_replays_in_order() {
        let mut t = ActiveTrace::new(130);
        let rows = t.begin_call(0, 2);
        set_bit(&mut rows[..3], 1);
        set_bit(&mut rows[3..], 129);
        let rows = t.begin_call(1, 1);
        set_bit(rows, 64);
        let mut c = TraceCursor::new(t);
        let mut next = vec![0u64; 3];
        assert_eq!(c.peek_next(&mut next), Some(0));
        let k = c.advance(0, 2).unwrap();
        assert_eq!(set_bits(&c.rows(k)[..3]).collect::<Vec<_>>(), vec![1]);
        assert_eq!(set_bits(c.union()).collect::<Vec<_>>(), vec![1, 129]);
        assert_eq!(c.peek_next(&mut next), Some(1));
        assert_eq!(set_bits(&next).collect::<Vec<_>>(), vec![64]);
        let e = c.advance(2, 1).unwrap_err().to_string();
        assert!(e.contains("out of step") && e.contains("layer 1"), "{e}");
        c.advance(1, 1).unwrap();
        assert!(c.advance(0, 1).unwrap_err().to_string().contains("exhausted"));
    }
}
