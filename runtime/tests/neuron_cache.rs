//! The neuron cache: budgets, slots, the three eviction policies, pins, stats,
//! and a randomized check of LRU against a plain reference model.

use leanstream_kernels::GgmlType;
use leanstream_runtime::cache::{
    CacheShape, FfnBudget, Lru, NeuronCache, NeuronFreq, SlidingWindow, StaticHot, SLAB_ALIGN,
};
use leanstream_runtime::flash::{pack, DownType, LsFlash, PackOptions};
use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::synthetic::SyntheticSpec;

const BUNDLE: usize = 64;

fn shape(n_layer: usize, n_ff: usize) -> CacheShape {
    CacheShape::uniform(n_layer, n_ff, BUNDLE)
}

fn cache(
    n_layer: usize,
    n_ff: usize,
    slots: usize,
    policy: Box<dyn leanstream_runtime::cache::EvictionPolicy>,
) -> NeuronCache {
    NeuronCache::new(&shape(n_layer, n_ff), (slots * BUNDLE) as u64, policy).unwrap()
}

#[test]
fn budget_resolves_to_slot_count() {
    let s = shape(4, 100); // 400 neurons, 25600 bytes
    assert_eq!(s.total_ffn_bytes(), 25_600);
    for (text, slots) in [
        ("25%", 100),
        ("100%", 400),
        ("0%", 0),
        ("6400", 100),
        ("6399", 99),
        ("1KiB", 16),
        ("1GiB", 400),
    ] {
        let b = FfnBudget::parse(text).unwrap().resolve(s.total_ffn_bytes());
        let c = NeuronCache::new(&s, b, Box::new(Lru::new())).unwrap();
        assert_eq!(c.n_slots(), slots, "{text}");
        assert_eq!(c.free_slots(), slots);
        assert_eq!(c.slab_ptr() as usize % SLAB_ALIGN, 0, "{text}");
    }
    assert!(FfnBudget::parse("25 percent").is_err());
}

#[test]
fn slab_is_page_aligned() {
    for slots in [0, 1, 3, 1000] {
        let c = cache(2, 1000, slots, Box::new(Lru::new()));
        assert_eq!(c.slab_ptr() as usize % 4096, 0);
    }
}

#[test]
fn static_hot_set_keeps_hot_neurons_and_lru_for_the_rest() {
    // 8 slots, a quarter LRU: 6 hot slots, 2 LRU slots.
    let ranking: Vec<NeuronFreq> = (0..10u32)
        .map(|i| NeuronFreq {
            layer: i % 2,
            neuron: i,
            freq: i as f32,
        })
        .collect();
    let policy = StaticHot::new(ranking).with_lru_fraction(0.25);
    let mut c = cache(2, 32, 8, Box::new(policy));
    let hot = c.prefill_list();
    assert_eq!(hot, vec![(1, 9), (0, 8), (1, 7), (0, 6), (1, 5), (0, 4)]);
    for &(l, n) in &hot {
        c.insert(l as usize, n as usize).unwrap().fill(n as u8);
    }
    // Cold neurons churn through the two LRU slots.
    for n in 10..30 {
        assert!(c.insert(0, n).is_some());
        if n > 10 {
            assert!(c.contains(0, n - 1));
        }
        if n > 11 {
            assert!(!c.contains(0, n - 2));
        }
    }
    // LRU order among the cold ones: touching 28 makes 29 the victim.
    assert!(c.lookup(0, 28).is_some());
    c.insert(1, 30).unwrap();
    assert!(c.contains(0, 28) && !c.contains(0, 29));
    for &(l, n) in &hot {
        assert_eq!(c.peek(l as usize, n as usize).unwrap(), &[n as u8; BUNDLE][..]);
    }
    assert_eq!(c.stats().resident_slots, 8);
    // Both cold slots pinned: a cold insert is refused, hot ones stay put.
    assert!(c.pin(0, 28) && c.pin(1, 30));
    assert!(c.insert(0, 31).is_none());
    for &(l, n) in &hot {
        assert!(c.contains(l as usize, n as usize));
    }
}

#[test]
fn static_hot_set_without_lru_share_caches_only_hot_neurons() {
    let ranking = vec![
        NeuronFreq {
            layer: 0,
            neuron: 3,
            freq: 0.9,
        },
        NeuronFreq {
            layer: 0,
            neuron: 3,
            freq: 0.9,
        }, // duplicate counts once
        NeuronFreq {
            layer: 1,
            neuron: 1,
            freq: 0.5,
        },
    ];
    // 4 slots, 2 distinct ranked neurons: the 2 unused hot slots become LRU.
    let mut c = cache(2, 8, 4, Box::new(StaticHot::new(ranking.clone())));
    assert_eq!(c.prefill_list(), vec![(0, 3), (1, 1)]);
    c.insert(0, 3).unwrap();
    c.insert(1, 1).unwrap();
    for n in 4..8 {
        c.insert(0, n).unwrap();
    }
    assert!(c.contains(0, 3) && c.contains(1, 1) && c.contains(0, 6) && c.contains(0, 7));
    assert_eq!(c.stats().evictions, 2);
    // Full ranking, fraction 0: cold neurons are never cached.
    let mut c = cache(2, 8, 2, Box::new(StaticHot::new(ranking)));
    assert!(c.insert(0, 0).is_none());
    assert!(c.insert(0, 3).is_some() && c.insert(1, 1).is_some());
    assert!(c.insert(1, 2).is_none());
    assert_eq!(c.stats().rejections, 2);
    // Bad rankings are construction errors.
    let bad = vec![NeuronFreq {
        layer: 5,
        neuron: 0,
        freq: 1.0,
    }];
    let err = NeuronCache::new(&shape(2, 8), 1 << 10, Box::new(StaticHot::new(bad))).unwrap_err();
    assert!(err.to_string().contains("layer 5"), "{err}");
    let err = NeuronCache::new(
        &shape(2, 8),
        1 << 10,
        Box::new(StaticHot::new(vec![]).with_lru_fraction(1.5)),
    );
    assert!(err.is_err());
}

#[test]
fn sliding_window_evicts_expired_neurons_first() {
    let mut c = cache(1, 16, 6, Box::new(SlidingWindow::new(1)));
    for n in [0, 1, 2] {
        c.insert(0, n).unwrap();
    }
    assert_eq!(c.end_token(), 0);
    c.insert(0, 3).unwrap();
    c.insert(0, 4).unwrap();
    assert!(c.lookup(0, 0).is_some());
    assert_eq!(c.end_token(), 0, "lazy: nothing is freed");
    // Now 1 and 2 (not used in the last token) are out of the window.
    c.insert(0, 5).unwrap(); // the last free slot
    c.insert(0, 6).unwrap();
    assert!(!c.contains(0, 1));
    c.insert(0, 7).unwrap();
    assert!(!c.contains(0, 2));
    // No expired neuron left: LRU order among in-window ones (3 is oldest).
    c.insert(0, 8).unwrap();
    assert!(!c.contains(0, 3));
    for n in [0, 4, 5, 6, 7, 8] {
        assert!(c.contains(0, n), "{n}");
    }
    assert_eq!(c.stats().evictions, 3);
}

#[test]
fn sliding_window_eager_keeps_exactly_the_last_k_tokens() {
    let k = 3;
    let n_ff = 64;
    let mut c = cache(
        2,
        n_ff,
        2 * n_ff,
        Box::new(SlidingWindow::new(k).with_eager_release(true)),
    );
    let mut rng = Rng::new(7);
    let mut history: Vec<Vec<(usize, usize)>> = Vec::new();
    for _ in 0..200 {
        let used: Vec<(usize, usize)> = (0..10)
            .map(|_| ((rng.next_u64() % 2) as usize, (rng.next_u64() % n_ff as u64) as usize))
            .collect();
        for &(l, n) in &used {
            if c.lookup(l, n).is_none() {
                c.insert(l, n).unwrap();
            }
        }
        history.push(used);
        c.end_token();
        let mut window: Vec<(usize, usize)> = history.iter().rev().take(k).flatten().copied().collect();
        window.sort_unstable();
        window.dedup();
        assert_eq!(c.stats().resident_slots as usize, window.len());
        for &(l, n) in &window {
            assert!(c.contains(l, n));
        }
    }
    assert_eq!(c.stats().evictions, 0);
    assert!(c.stats().released > 0);
    // Pinned neurons outlive the window; unpinning restarts their clock.
    let mut c = cache(1, 8, 8, Box::new(SlidingWindow::new(1).with_eager_release(true)));
    c.insert(0, 1).unwrap();
    c.insert(0, 2).unwrap();
    assert!(c.pin(0, 1));
    assert_eq!(c.end_token(), 0, "the last token's neurons stay");
    assert_eq!(c.end_token(), 1);
    assert_eq!(c.end_token(), 0);
    assert!(c.contains(0, 1) && !c.contains(0, 2));
    assert!(c.unpin(0, 1));
    assert_eq!(c.end_token(), 0);
    assert!(c.contains(0, 1));
    assert_eq!(c.end_token(), 1);
    assert!(!c.contains(0, 1));
}

/// LRU as a Vec in recency order (front = least recent), with pin counts.
#[derive(Default)]
struct RefLru {
    order: Vec<(usize, usize, u32)>,
    cap: usize,
    hits: u64,
    misses: u64,
    evictions: u64,
    rejections: u64,
    inserts: u64,
}

impl RefLru {
    fn pos(&self, l: usize, n: usize) -> Option<usize> {
        self.order.iter().position(|e| e.0 == l && e.1 == n)
    }
    fn make_recent(&mut self, i: usize) {
        let e = self.order.remove(i);
        self.order.push(e);
    }
    fn lookup(&mut self, l: usize, n: usize) -> bool {
        match self.pos(l, n) {
            Some(i) => {
                self.hits += 1;
                self.make_recent(i);
                true
            }
            None => {
                self.misses += 1;
                false
            }
        }
    }
    /// Returns the evicted key, if any; Err when refused.
    fn insert(&mut self, l: usize, n: usize) -> Result<Option<(usize, usize)>, ()> {
        if let Some(i) = self.pos(l, n) {
            self.make_recent(i);
            return Ok(None);
        }
        let mut evicted = None;
        if self.order.len() == self.cap {
            let Some(i) = self.order.iter().position(|e| e.2 == 0) else {
                self.rejections += 1;
                return Err(());
            };
            let e = self.order.remove(i);
            evicted = Some((e.0, e.1));
            self.evictions += 1;
        }
        self.order.push((l, n, 0));
        self.inserts += 1;
        Ok(evicted)
    }
}

#[test]
fn lru_matches_reference_model_over_10k_operations() {
    let (n_layer, n_ff, cap) = (3, 20, 12);
    let mut c = cache(n_layer, n_ff, cap, Box::new(Lru::new()));
    let mut r = RefLru {
        cap,
        ..Default::default()
    };
    let mut rng = Rng::new(42);
    let fill = |l: usize, n: usize| (l * 31 + n * 7) as u8;
    for step in 0..10_000 {
        let l = (rng.next_u64() % n_layer as u64) as usize;
        let n = (rng.next_u64() % n_ff as u64) as usize;
        match rng.next_u64() % 100 {
            0..=39 => {
                let hit = r.lookup(l, n);
                let got = c.lookup(l, n).map(|b| b.to_vec());
                assert_eq!(got.is_some(), hit, "step {step}");
                if let Some(b) = got {
                    assert_eq!(b, vec![fill(l, n); BUNDLE], "step {step}");
                }
            }
            40..=74 => {
                let was_resident = c.contains(l, n);
                let expect = r.insert(l, n);
                match c.insert(l, n) {
                    Some(buf) => {
                        assert!(expect.is_ok(), "step {step}");
                        if !was_resident {
                            buf.fill(fill(l, n));
                        }
                    }
                    None => assert!(expect.is_err(), "step {step}"),
                }
                if let Ok(Some((el, en))) = expect {
                    assert!(!c.contains(el, en), "step {step}: evicted the wrong one");
                }
            }
            75..=84 => {
                let ok = match r.pos(l, n) {
                    Some(i) => {
                        r.order[i].2 += 1;
                        true
                    }
                    None => false,
                };
                assert_eq!(c.pin(l, n), ok, "step {step}");
            }
            85..=96 => {
                let ok = match r.pos(l, n) {
                    Some(i) if r.order[i].2 > 0 => {
                        r.order[i].2 -= 1;
                        if r.order[i].2 == 0 {
                            r.make_recent(i);
                        }
                        true
                    }
                    _ => false,
                };
                assert_eq!(c.unpin(l, n), ok, "step {step}");
            }
            _ => {
                let ok = match r.pos(l, n) {
                    Some(i) if r.order[i].2 == 0 => {
                        r.order.remove(i);
                        true
                    }
                    _ => false,
                };
                assert_eq!(c.remove(l, n), ok, "step {step}");
            }
        }
        let s = c.stats();
        assert_eq!(s.hits, r.hits);
        assert_eq!(s.misses, r.misses);
        assert_eq!(s.evictions, r.evictions);
        assert_eq!(s.rejections, r.rejections);
        assert_eq!(s.inserts, r.inserts);
        assert_eq!(s.resident_slots as usize, r.order.len());
        assert_eq!(s.resident_bytes as usize, r.order.len() * BUNDLE);
        assert_eq!(s.pinned_slots as usize, r.order.iter().filter(|e| e.2 > 0).count());
        assert_eq!(c.free_slots(), cap - r.order.len());
        for &(l, n, _) in &r.order {
            assert!(c.contains(l, n), "step {step}");
        }
    }
    // The run exercised every path.
    assert!(
        r.evictions > 100 && r.rejections > 0 && r.hits > 100,
        "{} {} {}",
        r.evictions,
        r.rejections,
        r.hits
    );
}

#[test]
fn caches_bundles_of_a_packed_model() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("neuron_cache");
    std::fs::create_dir_all(&dir).unwrap();
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    let src = dir.join("tiny.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let out = dir.join("tiny.lsflash");
    let opts = PackOptions {
        down: DownType::F16,
        ..PackOptions::default()
    };
    pack(&src, &out, &opts).unwrap();
    let f = LsFlash::open(&out).unwrap();
    let shape = CacheShape::from_flash(&f);
    assert_eq!((shape.n_layer(), shape.n_ff), (f.n_layer(), f.n_ff()));
    let budget = FfnBudget::parse("50%").unwrap().resolve(shape.total_ffn_bytes());
    let mut c = NeuronCache::new(&shape, budget, Box::new(Lru::new())).unwrap();
    assert!(c.n_slots() > 0 && c.capacity_bytes() <= budget);
    for l in 0..f.n_layer() {
        for n in 0..f.n_ff() {
            let bundle = f.read_bundle(l, n).unwrap();
            if let Some(slot) = c.insert(l, n) {
                slot.copy_from_slice(&bundle);
            }
        }
    }
    // The most recent n_slots bundles are resident, byte-exact and splittable.
    let mut found = 0;
    for l in 0..f.n_layer() {
        for n in 0..f.n_ff() {
            if let Some(b) = c.peek(l, n) {
                assert_eq!(b, &f.read_bundle(l, n).unwrap()[..]);
                assert!(f.layout(l).split(b).is_some());
                found += 1;
            }
        }
    }
    assert_eq!(found, c.n_slots());
}
