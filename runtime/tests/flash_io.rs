//! The flash I/O engine against real files: every byte checked, coalescing,
//! priorities, cancellation, ready-flag handoff across threads, and injected
//! failures and short reads. Each test runs on the pread pool and, where this
//! machine allows it, on io_uring.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use leanstream_runtime::flash::io::{
    make_backend, read_benchmark, BackendKind, Fault, FaultyBackend, IoConfig, IoEngine, ReadBench, ReadyFlags,
    Request, UringBackend,
};

/// The byte at file offset `i`.
fn byte(i: u64) -> u8 {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 32) as u8
}

fn make_file(dir: &Path, name: &str, len: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    let data: Vec<u8> = (0..len).map(byte).collect();
    std::fs::write(&path, data).unwrap();
    path
}

fn tmp_file(name: &str, len: u64) -> PathBuf {
    make_file(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("flash_io"), name, len)
}

fn check(r: &Request, data: &[u8]) {
    assert_eq!(data.len(), r.len as usize, "request {}", r.id);
    for (k, &b) in data.iter().enumerate() {
        assert_eq!(b, byte(r.offset + k as u64), "request {} byte {k}", r.id);
    }
}

/// The backends to test here: always the pread pool; io_uring when it works.
fn backends() -> Vec<BackendKind> {
    let mut v = vec![BackendKind::Pread];
    match UringBackend::new(8) {
        Ok(_) => v.push(BackendKind::Uring),
        Err(e) => eprintln!("SKIPPING io_uring backend: unavailable here ({e})"),
    }
    v
}

fn cfg(kind: BackendKind) -> IoConfig {
    IoConfig {
        backend: kind,
        ..IoConfig::default()
    }
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Reads everything; returns ids in completion order (failures panic).
fn drain(engine: &mut IoEngine, reqs: &[Request]) -> Vec<u32> {
    let mut order = Vec::new();
    while let Some(r) = engine.wait_next().unwrap() {
        let c = r.unwrap_or_else(|f| panic!("request {} failed: {}", f.id, f.error));
        let req = reqs.iter().find(|q| q.id == c.id).unwrap();
        check(req, c.data());
        order.push(c.id);
    }
    order
}

#[test]
fn random_reads_return_every_byte() {
    let len = 8 * 1024 * 1024 + 1234;
    let path = tmp_file("random.bin", len);
    for kind in backends() {
        let mut engine = IoEngine::open(
            &path,
            IoConfig {
                max_in_flight: 8,
                pool_buffers: 16,
                ..cfg(kind)
            },
        )
        .unwrap();
        eprintln!("backend {}, O_DIRECT {}", engine.backend_name(), engine.is_direct());
        let mut rng = Lcg(kind as u64 + 7);
        let mut reqs = Vec::new();
        for id in 0..400u32 {
            let l = 1 + rng.next() % 200_000;
            let offset = rng.next() % (len - l);
            let priority = (rng.next() % 100) as u32;
            reqs.push(Request {
                id,
                offset,
                len: l as u32,
                priority,
            });
        }
        // The unaligned tail of the file, and a one-byte read at the very end.
        reqs.push(Request {
            id: 400,
            offset: len - 5000,
            len: 5000,
            priority: 0,
        });
        reqs.push(Request {
            id: 401,
            offset: len - 1,
            len: 1,
            priority: 0,
        });
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        let order = drain(&mut engine, &reqs);
        assert_eq!(order.iter().copied().collect::<HashSet<_>>().len(), reqs.len());
        let s = engine.stats();
        assert_eq!(s.requests_completed, reqs.len() as u64);
        assert_eq!(s.bytes_requested, reqs.iter().map(|r| r.len as u64).sum::<u64>());
        // Overlapping requests share bytes, so bytes read may be fewer than requested.
        assert!(s.reads_issued <= reqs.len() as u64 && s.bytes_read > 0);
    }
}

fn run_reads(kind: BackendKind, path: &Path, c: IoConfig, reqs: &[Request]) -> leanstream_runtime::flash::io::IoStats {
    let mut engine = IoEngine::open(path, IoConfig { backend: kind, ..c }).unwrap();
    for r in reqs {
        engine.enqueue(*r).unwrap();
    }
    drain(&mut engine, reqs);
    engine.stats()
}

fn blocks(spec: &[(u32, u64, u32)]) -> Vec<Request> {
    spec.iter()
        .map(|&(id, offset, len)| Request {
            id,
            offset,
            len,
            priority: id,
        })
        .collect()
}

#[test]
fn coalescing_respects_gap_size_and_amplification() {
    let path = tmp_file("coalesce.bin", 1 << 20);
    for kind in backends() {
        // 16 adjacent blocks, enqueued out of order: one read.
        let reqs: Vec<Request> = blocks(
            &(0..16u32)
                .map(|i| (i, ((i * 7) % 16) as u64 * 4096, 4096))
                .collect::<Vec<_>>(),
        );
        let s = run_reads(kind, &path, IoConfig::default(), &reqs);
        assert_eq!((s.reads_issued, s.bytes_read, s.bytes_requested), (1, 65536, 65536));
        // Unaligned neighbours inside shared blocks also coalesce.
        let reqs = blocks(&[(0, 100, 3000), (1, 3100, 3000), (2, 6100, 5000)]);
        let s = run_reads(kind, &path, IoConfig::default(), &reqs);
        assert_eq!((s.reads_issued, s.bytes_read), (1, 3 * 4096));
        // Gap limit.
        let reqs = blocks(&[(0, 0, 4096), (1, 3 * 4096, 4096)]);
        let c = IoConfig {
            max_gap: 4096,
            ..IoConfig::default()
        };
        assert_eq!(run_reads(kind, &path, c.clone(), &reqs).reads_issued, 2);
        let c2 = IoConfig {
            max_gap: 8192,
            max_amplification: 2.0,
            ..c
        };
        let s = run_reads(kind, &path, c2, &reqs);
        assert_eq!((s.reads_issued, s.bytes_read), (1, 4 * 4096));
        // Amplification limit: the same gap is too costly at 1.5.
        let c3 = IoConfig {
            max_gap: 8192,
            max_amplification: 1.5,
            ..IoConfig::default()
        };
        assert_eq!(run_reads(kind, &path, c3, &reqs).reads_issued, 2);
        // Size limit: 8 adjacent blocks, 16 KiB reads.
        let reqs = blocks(&(0..8u32).map(|i| (i, i as u64 * 4096, 4096)).collect::<Vec<_>>());
        let c4 = IoConfig {
            max_read_bytes: 16384,
            ..IoConfig::default()
        };
        let s = run_reads(kind, &path, c4, &reqs);
        assert_eq!((s.reads_issued, s.bytes_read), (2, 8 * 4096));
    }
}

fn far_apart(n: u32) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            id: i,
            offset: i as u64 * 65536 + 17,
            len: 5000,
            priority: n - i,
        })
        .collect()
}

#[test]
fn most_urgent_requests_go_first() {
    let path = tmp_file("prio.bin", 4 << 20);
    for kind in backends() {
        let c = IoConfig {
            max_in_flight: 1,
            max_gap: 0,
            ..cfg(kind)
        };
        let mut engine = IoEngine::open(&path, c).unwrap();
        let mut reqs = far_apart(10);
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        // The first read is in flight (a fast read may already have completed
        // and let the next one go); a newcomer more urgent than the rest
        // overtakes every request still queued.
        engine.poll(false).unwrap();
        let urgent = Request {
            id: 99,
            offset: 3 << 20,
            len: 100,
            priority: 0,
        };
        engine.enqueue(urgent).unwrap();
        reqs.push(urgent);
        let order = drain(&mut engine, &reqs);
        let at = order.iter().position(|&id| id == 99).unwrap();
        assert!((1..=2).contains(&at), "urgent request completed at {at}: {order:?}");
        let rest: Vec<u32> = order.iter().copied().filter(|&id| id != 99).collect();
        assert_eq!(rest, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]);
    }
}

#[test]
fn cancelled_requests_never_complete() {
    let path = tmp_file("cancel.bin", 4 << 20);
    for kind in backends() {
        let c = IoConfig {
            max_in_flight: 2,
            max_gap: 0,
            ..cfg(kind)
        };
        let mut engine = IoEngine::open(&path, c).unwrap();
        let reqs = far_apart(20);
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        engine.poll(false).unwrap(); // Submits the two most urgent: 19 and 18.
        let mut cancelled = HashSet::new();
        for id in (0..20).step_by(3).chain([19, 18]) {
            if engine.cancel(id) {
                cancelled.insert(id);
            }
        }
        assert!(!cancelled.contains(&18) && !cancelled.contains(&19));
        assert_eq!(cancelled.len(), 6);
        assert!(!engine.cancel(3), "a second cancel finds nothing");
        let done: HashSet<u32> = drain(&mut engine, &reqs).into_iter().collect();
        let expected: HashSet<u32> = (0..20).filter(|i| !cancelled.contains(i)).collect();
        assert_eq!(done, expected);
        assert_eq!(engine.stats().requests_cancelled, 6);
    }
}

#[test]
fn ready_flags_hand_bundles_to_another_thread() {
    const N: u32 = 3000;
    const BUNDLE: u64 = 3000;
    let path = tmp_file("flags.bin", N as u64 * BUNDLE);
    for kind in backends() {
        let published = Arc::new(ReadyFlags::new(N as usize));
        let arrived = Arc::new(ReadyFlags::new(N as usize));
        let slots: Arc<Vec<Mutex<Option<_>>>> = Arc::new((0..N).map(|_| Mutex::new(None)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let consumer = {
            let (published, arrived, slots, stop) = (published.clone(), arrived.clone(), slots.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = vec![false; N as usize];
                let mut count = 0;
                // A lost hand-off fails the test instead of hanging it.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while count < N && !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                    for id in 0..N {
                        if published.take(id) {
                            assert!(!seen[id as usize], "bundle {id} seen twice");
                            seen[id as usize] = true;
                            count += 1;
                            assert!(arrived.is_ready(id), "engine flag of {id} not visible");
                            let c: leanstream_runtime::flash::io::Completed =
                                slots[id as usize].lock().unwrap().take().expect("bundle published");
                            let req = Request {
                                id,
                                offset: id as u64 * BUNDLE,
                                len: BUNDLE as u32,
                                priority: 0,
                            };
                            check(&req, c.data());
                        }
                    }
                    std::hint::spin_loop();
                }
                count
            })
        };
        let mut engine = IoEngine::open(
            &path,
            IoConfig {
                max_in_flight: 4,
                pool_buffers: 8,
                max_read_bytes: 64 * 1024,
                ..cfg(kind)
            },
        )
        .unwrap();
        engine.set_ready_flags(arrived.clone());
        let mut rng = Lcg(3);
        for id in 0..N {
            let priority = (rng.next() % 1000) as u32;
            engine
                .enqueue(Request {
                    id,
                    offset: id as u64 * BUNDLE,
                    len: BUNDLE as u32,
                    priority,
                })
                .unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !engine.is_idle() {
            if std::time::Instant::now() > deadline {
                stop.store(true, Ordering::Relaxed);
                panic!("{kind:?}: reads still outstanding after 60 s: a hand-off was lost");
            }
            // With every buffer held by the consumer, poll returns at once:
            // wait for it to release some.
            if engine.poll(true).unwrap() == 0 {
                std::thread::yield_now();
            }
            while let Some(r) = engine.pop() {
                let c = r.unwrap();
                let id = c.id;
                *slots[id as usize].lock().unwrap() = Some(c);
                published.set(id);
            }
        }
        let count = consumer.join().unwrap();
        assert_eq!(count, N, "{kind:?}: bundles handed over");
        assert!(engine.stats().reads_issued < N as u64, "neighbouring bundles coalesce");
    }
}

fn faulty_engine(kind: BackendKind, path: &Path, faults: Vec<(u64, Fault)>) -> IoEngine {
    let c = IoConfig {
        max_in_flight: 1,
        max_gap: 0,
        ..cfg(kind)
    };
    let inner = make_backend(&c).unwrap();
    IoEngine::with_backend(path, c, Box::new(FaultyBackend::new(inner, faults))).unwrap()
}

#[test]
fn failed_read_names_file_and_offset_and_spares_others() {
    let path = tmp_file("fail.bin", 4 << 20);
    for kind in backends() {
        // Reads go one at a time in priority order: read #2 is request 7.
        let mut engine = faulty_engine(kind, &path, vec![(2, Fault::Errno(libc::EIO))]);
        let reqs = far_apart(10);
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        let mut ok = HashSet::new();
        let mut failed = Vec::new();
        while let Some(r) = engine.wait_next().unwrap() {
            match r {
                Ok(c) => {
                    check(&reqs[c.id as usize], c.data());
                    ok.insert(c.id);
                }
                Err(f) => failed.push(f),
            }
        }
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].id, 7);
        let msg = failed[0].error.to_string();
        let offset = reqs[7].offset.to_string();
        assert!(
            msg.contains("fail.bin") && msg.contains(&offset) && msg.contains("5000"),
            "{msg}"
        );
        assert!(
            matches!(&failed[0].error, leanstream_runtime::RuntimeError::Read { source, .. }
            if source.raw_os_error() == Some(libc::EIO))
        );
        assert_eq!(ok.len(), 9);
        assert_eq!(engine.stats().requests_failed, 1);
    }
}

#[test]
fn eintr_and_eagain_are_retried() {
    let path = tmp_file("retry.bin", 4 << 20);
    for kind in backends() {
        let faults = vec![
            (0, Fault::Errno(libc::EINTR)),
            (1, Fault::Errno(libc::EAGAIN)),
            (3, Fault::Errno(libc::EINTR)),
        ];
        let mut engine = faulty_engine(kind, &path, faults);
        let reqs = far_apart(5);
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        assert_eq!(drain(&mut engine, &reqs).len(), 5);
        let s = engine.stats();
        assert_eq!((s.reads_issued, s.resubmits, s.requests_failed), (5, 3, 0));
    }
}

#[test]
fn short_reads_are_completed() {
    let path = tmp_file("short.bin", 4 << 20);
    for kind in backends() {
        // An aligned short read, an unaligned one, and one of a single byte.
        let faults = vec![(0, Fault::Short(4096)), (2, Fault::Short(1000)), (4, Fault::Short(1))];
        let mut engine = faulty_engine(kind, &path, faults);
        let reqs = blocks(&[(0, 0, 65536), (1, 1 << 20, 20000), (2, 2 << 20, 9000)]);
        for r in &reqs {
            engine.enqueue(*r).unwrap();
        }
        assert_eq!(drain(&mut engine, &reqs).len(), 3);
        let s = engine.stats();
        assert!(s.short_reads >= 3 && s.resubmits >= 3, "{s:?}");
        assert_eq!(s.requests_failed, 0);
    }
}

/// Whether an aligned O_DIRECT read of `path` succeeds, probed apart from the engine.
fn direct_read_works_here(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    else {
        return false;
    };
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    // SAFETY: a 4096-byte, 4096-aligned buffer, freed below.
    let buf = unsafe { std::alloc::alloc(layout) };
    assert!(!buf.is_null());
    // SAFETY: buf is valid for 4096 bytes.
    let n = unsafe { libc::pread(f.as_raw_fd(), buf.cast(), 4096, 0) };
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    n == 4096
}

#[test]
fn o_direct_falls_back_to_buffered_where_refused() {
    let len = 1 << 20;
    let mut places = vec![(Path::new(env!("CARGO_TARGET_TMPDIR")).join("flash_io"), "target tmp")];
    if Path::new("/dev/shm").is_dir() {
        places.push((PathBuf::from("/dev/shm/leanstream-flash-io-test"), "/dev/shm (tmpfs)"));
    }
    for (dir, what) in places {
        let path = make_file(&dir, "direct.bin", len);
        let direct_works = direct_read_works_here(&path);
        for kind in backends() {
            let mut engine = IoEngine::open(&path, cfg(kind)).unwrap();
            eprintln!("{what}: O_DIRECT {} ({})", engine.is_direct(), engine.backend_name());
            // O_DIRECT exactly where the filesystem takes it, buffered elsewhere.
            assert_eq!(engine.is_direct(), direct_works, "{what}");
            let reqs = far_apart(8);
            for r in &reqs {
                engine.enqueue(*r).unwrap();
            }
            assert_eq!(drain(&mut engine, &reqs).len(), 8);
            // Without O_DIRECT, buffered mode must be what the engine reports.
            let nodirect = IoEngine::open(
                &path,
                IoConfig {
                    direct: false,
                    ..cfg(kind)
                },
            )
            .unwrap();
            assert!(!nodirect.is_direct());
        }
        if what.starts_with("/dev/shm") {
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn bad_requests_are_refused() {
    let path = tmp_file("bad.bin", 100_000);
    let mut engine = IoEngine::open(&path, IoConfig::default()).unwrap();
    let r = |id, offset, len| Request {
        id,
        offset,
        len,
        priority: 0,
    };
    assert!(engine.enqueue(r(0, 99_000, 2000)).is_err(), "past the end");
    assert!(engine.enqueue(r(0, 0, 0)).is_err(), "empty");
    assert!(engine.enqueue(r(0, 0, 600_000)).is_err(), "larger than a buffer");
    engine.enqueue(r(1, 0, 10)).unwrap();
    assert!(engine.enqueue(r(1, 50, 10)).is_err(), "duplicate id");
    assert!(engine.wait_next().unwrap().unwrap().is_ok());
    assert!(engine.wait_next().unwrap().is_none());
}

/// The read benchmark (`leanstream bench-io`) keeps its depth of whole
/// requests going and counts what it read; bad settings are refused.
#[test]
fn read_benchmark_counts_whole_requests() {
    let path = tmp_file("bench.bin", 4 << 20);
    for kind in backends() {
        for sequential in [false, true] {
            let b = ReadBench {
                request_bytes: 8192,
                depth: 4,
                duration: std::time::Duration::from_millis(50),
                sequential,
                backend: kind,
                seed: 7,
            };
            let r = read_benchmark(&path, &b).unwrap();
            assert!(r.reads > 0, "{r:?}");
            assert_eq!(r.bytes, r.reads * 8192, "{r:?}");
            assert!(r.bytes_per_s > 0.0 && r.iops > 0.0, "{r:?}");
        }
    }
    let bad = ReadBench {
        request_bytes: 1000,
        depth: 4,
        duration: std::time::Duration::from_millis(10),
        sequential: false,
        backend: BackendKind::Pread,
        seed: 1,
    };
    let e = read_benchmark(&path, &bad).unwrap_err().to_string();
    assert!(e.contains("1000") && e.contains("4096"), "{e}");
    let small = tmp_file("bench_small.bin", 4096);
    let e = read_benchmark(
        &small,
        &ReadBench {
            request_bytes: 8192,
            ..bad
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("bench_small.bin"), "{e}");
}

/// A pool is cut into the largest power-of-two reads that still make a
/// dozen buffers (large reads serve fastest), never below 128 KiB a read
/// or two buffers, and never more reads in flight than buffers; a model's
/// default pool has the buffers for the default depth of 16.
#[test]
fn pools_are_cut_into_large_reads() {
    let cut = |c: IoConfig| (c.max_read_bytes, c.pool_buffers, c.max_in_flight);
    // SmolLM2's four 1.6 MB layers: 512 KiB reads, 16 of them.
    assert_eq!(cut(IoConfig::for_layer_bytes(1_600_000, 4)), (512 << 10, 16, 16));
    // Four 2.7 MB layers (about Gemma 3): 20 reads of 512 KiB.
    assert_eq!(cut(IoConfig::for_layer_bytes(2_700_000, 4)), (512 << 10, 20, 16));
    // A 7B layer: the 16 MiB cap in the default's 512 KiB reads.
    assert_eq!(cut(IoConfig::for_layer_bytes(130 << 20, 4)), (512 << 10, 32, 16));
    // A tiny model still gets 16 buffers of 128 KiB.
    assert_eq!(cut(IoConfig::for_layer_bytes(4096, 4)), (128 << 10, 16, 16));
    // Staging given in bytes: 256 KiB is two 128 KiB reads; 6 MiB twelve
    // of 512 KiB; 64 MiB 128 of them.
    assert_eq!(cut(IoConfig::for_pool_bytes(256 << 10)), (128 << 10, 2, 2));
    assert_eq!(cut(IoConfig::for_pool_bytes(6 << 20)), (512 << 10, 12, 12));
    assert_eq!(cut(IoConfig::for_pool_bytes(64 << 20)), (512 << 10, 128, 16));
}
