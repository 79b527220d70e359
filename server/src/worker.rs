//! The one engine: a thread that owns the model (and its flash engine and
//! memory budget, or its copy on a CUDA device), takes generation jobs from
//! a bounded queue one at a time and streams each job's text back over its
//! own channel. A job whose channel is closed (its client went away) is
//! skipped or stopped after the token in progress, so the engine is free
//! again at once.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use leanstream_cuda::engine::GpuModel;
use leanstream_cuda::model::DeviceModel;
use leanstream_runtime::engine::Policy;
use leanstream_runtime::generate::batch::Batch;
use leanstream_runtime::generate::draft::{self, DraftKind, DraftLen, Drafting};
use leanstream_runtime::generate::{ChatTemplate, CpuDecoder, Decoder, Sampler};
use leanstream_runtime::model::{KvCache, Model, RunState};
use leanstream_runtime::session::{Session, StreamSettings};
use leanstream_runtime::RuntimeError;
use tokio::sync::mpsc;

use crate::metrics::{EngineSnapshot, Metrics};
use crate::prompt_cache::{reuse_prefix, PromptCache};
use crate::reply::Reply;
use crate::request::{check_request, Event, GenRequest, Job};
use crate::ServerError;

/// How to open the engine.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub model: PathBuf,
    pub settings: StreamSettings,
    /// Context in tokens (prompt and completion); default 2048, at most the model's.
    pub ctx: Option<usize>,
    /// Requests that may wait while one runs; more are refused (503).
    pub queue: usize,
    /// Compute threads (default: one per core).
    pub threads: Option<usize>,
    /// CUDA device ordinal: the dense engine of a GGUF model on that device
    /// (no prompt reuse: its KV cache lives on the device). `None`: the CPU.
    pub device: Option<usize>,
    /// Reuse the KV cache of the longest prompt prefix a request shares with
    /// the tokens of the one before (as llama-server does): a conversation's
    /// next turn and a shared system prompt are not run again. The reused
    /// prefix's logits then come from single-row passes rather than one
    /// batch, so greedy text may differ from `run`'s in the last bits.
    pub prompt_cache: bool,
    /// Bytes of earlier prompts' keys and values kept beyond the state's own
    /// (see [`PromptCache`]); 0 keeps none. Default 16 MiB, or 0 under a
    /// memory budget (`settings.mem_budget`), which they would exceed.
    pub prompt_cache_bytes: Option<usize>,
    /// What drafts tokens for each request (checked several per pass,
    /// streamed as they are accepted), and how many a pass.
    pub draft: DraftKind,
    pub draft_len: DraftLen,
    /// Requests generating together on the CPU engine, each with its own
    /// KV cache counted in the memory budget (continuous batching). `None`:
    /// 4, or under `--mem-budget` as many (1 to 4) as a quarter of the
    /// budget holds the caches of.
    pub parallel: Option<usize>,
    /// Requests generating together share the batched matrix kernels:
    /// faster where compute binds, but a request's greedy text may then
    /// differ in the last bits from its text served alone.
    pub batched_kernels: bool,
}

/// Requests generating together when `--parallel` is not given.
const DEFAULT_PARALLEL: usize = 4;

impl EngineOptions {
    /// Requests that generate together for a model of `config` with a
    /// context of `ctx`.
    fn parallel(&self, config: &leanstream_runtime::model::Config, ctx: usize) -> usize {
        if let Some(n) = self.parallel {
            return n.max(1);
        }
        if self.device.is_some() || self.draft != DraftKind::None {
            return 1;
        }
        match self.settings.mem_budget {
            None => DEFAULT_PARALLEL,
            Some(budget) => {
                // Keys and values in f16 for every layer and position.
                let per = 4 * config.n_layer as u64 * ctx.div_ceil(64) as u64 * 64 * config.kv_dim() as u64;
                (budget / 4 / per.max(1)).clamp(1, DEFAULT_PARALLEL as u64) as usize
            }
        }
    }

    fn prompt_cache_bytes(&self) -> usize {
        match (self.prompt_cache, self.prompt_cache_bytes, self.settings.mem_budget) {
            _ if self.device.is_some() => 0,
            (false, _, _) => 0,
            (true, Some(b), _) => b,
            (true, None, Some(_)) => 0,
            (true, None, None) => 16 << 20,
        }
    }
}

/// What clients and templates need to know of the model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id `/v1/models` lists: the file's stem.
    pub name: String,
    pub ctx: usize,
    /// The GGUF's `tokenizer.chat_template`.
    pub chat_template: Option<String>,
    /// The template family the runtime recognises (the fallback).
    pub family: Option<ChatTemplate>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
    /// Whether the tokenizer puts BOS before every prompt itself.
    pub adds_bos: bool,
    /// When the server started (seconds since the epoch), for `created`.
    pub created: u64,
}

/// A handle on the engine thread; cheap to share behind an `Arc`.
pub struct Engine {
    jobs: Option<SyncSender<Job>>,
    queued: Arc<AtomicUsize>,
    capacity: usize,
    info: ModelInfo,
    metrics: Arc<Metrics>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Events a job may have unread before the engine waits for its client.
const EVENT_BUFFER: usize = 256;

impl Engine {
    /// Opens the model on the engine thread and returns once it is loaded
    /// (or with the error that stopped it).
    pub fn start(opts: EngineOptions) -> Result<Self, ServerError> {
        if opts.settings.policy() == Policy::Oracle {
            return Err(ServerError::bad_param(
                "policy",
                "the oracle policy replays a recorded run of tokens known in advance; a server's are not: choose another policy",
            ));
        }
        if opts.parallel.is_some_and(|n| n > 1) {
            if opts.device.is_some() {
                return Err(ServerError::bad_param(
                    "parallel",
                    "requests generate together on the CPU engine; the CUDA engine serves one at a time (--parallel 1)",
                ));
            }
            if opts.draft != DraftKind::None {
                return Err(ServerError::bad_param(
                    "parallel",
                    "drafting checks one request's tokens a pass and does not yet share passes with other requests: \
                     give --parallel 1 with --draft",
                ));
            }
        }
        if opts.device.is_some() && opts.draft != DraftKind::None {
            return Err(ServerError::bad_param(
                "draft",
                "drafting runs on the CPU engine; the CUDA engine verifies one token a pass",
            ));
        }
        let capacity = opts.queue.max(1);
        let (jobs, rx) = sync_channel::<Job>(capacity);
        let (ready_tx, ready_rx) = sync_channel::<Result<ModelInfo, ServerError>>(1);
        let queued = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(Metrics::default());
        let (q, m) = (queued.clone(), metrics.clone());
        let thread = std::thread::Builder::new()
            .name("leanstream-engine".into())
            .spawn(move || {
                // The engine runs inside its own compute pool: a caller
                // outside one hands every matrix product over and sleeps,
                // and the caller's pool has a thread parked in the HTTP stack.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(opts.threads.unwrap_or(0))
                    .thread_name(|i| format!("leanstream-compute-{i}"))
                    .build();
                let pool = match pool {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = ready_tx.send(Err(std::io::Error::other(format!("compute threads: {e}")).into()));
                        return;
                    }
                };
                pool.install(|| {
                    // Loaded here, before the backend that borrows it.
                    let model;
                    let backend = match opts.device {
                        None => open(&opts),
                        Some(n) => match DeviceModel::load(&opts.model, &opts.settings) {
                            Ok(m) => {
                                model = m;
                                open_device(&opts, n, &model)
                            }
                            Err(e) => Err(device_error(e)),
                        },
                    };
                    let ready = backend.and_then(|b| {
                        let info = model_info(&opts, b.model(), b.ctx())?;
                        let drafting = Drafting::new(&opts.draft, opts.draft_len, b.ctx(), b.model().config.n_vocab)?;
                        Ok((info, b, drafting))
                    });
                    match ready {
                        Ok((info, backend, drafting)) => {
                            let _ = ready_tx.send(Ok(info));
                            let cache = PromptCache::new(opts.prompt_cache_bytes());
                            serve_jobs(backend, drafting, rx, &q, &m, &opts, cache);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                })
            })?;
        let info = ready_rx.recv().map_err(|_| ServerError::EngineGone)??;
        Ok(Self {
            jobs: Some(jobs),
            queued,
            capacity,
            info,
            metrics,
            thread: Some(thread),
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Requests waiting for the engine (not counting the one running).
    pub fn queue_len(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub fn queue_capacity(&self) -> usize {
        self.capacity
    }

    /// Queues `request`; its events arrive on the returned channel. Dropping
    /// the receiver cancels the job.
    pub fn submit(&self, request: GenRequest) -> Result<mpsc::Receiver<Event>, ServerError> {
        let (events, rx) = mpsc::channel(EVENT_BUFFER);
        let jobs = self.jobs.as_ref().ok_or(ServerError::EngineGone)?;
        self.queued.fetch_add(1, Ordering::Relaxed);
        match jobs.try_send(Job { request, events }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                match e {
                    TrySendError::Full(_) => {
                        self.metrics.count_queue_full();
                        Err(ServerError::QueueFull(self.capacity))
                    }
                    TrySendError::Disconnected(_) => Err(ServerError::EngineGone),
                }
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the job it is running.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where generation runs: the CPU session (a GGUF model, or a `.lsflash`
/// one streaming its FFN) with its run state, or a CUDA device's engine (a
/// GGUF's, or a `.lsflash` model's, resident or streaming under its policy).
// One per server, on the engine thread's stack: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Backend<'m> {
    Cpu { session: Session, st: RunState },
    Cuda { model: &'m Model, gpu: GpuModel },
}

impl<'m> Backend<'m> {
    fn model(&self) -> &Model {
        match self {
            Self::Cpu { session, .. } => session.model(),
            Self::Cuda { model, .. } => model,
        }
    }

    fn ctx(&self) -> usize {
        match self {
            Self::Cpu { st, .. } => st.ctx,
            Self::Cuda { gpu, .. } => gpu.ctx,
        }
    }

    /// The KV cache a prompt's shared prefix can be reused from (the CPU's).
    fn reusable_kv(&mut self) -> Option<&mut KvCache> {
        match self {
            Self::Cpu { st, .. } => Some(&mut st.kv),
            Self::Cuda { .. } => None,
        }
    }

    /// The model and the generation loop's decoder over it.
    fn decoder(&mut self) -> Result<(&Model, Box<dyn Decoder + '_>), ServerError> {
        match self {
            Self::Cpu { session, st } => {
                let (model, hook) = session.parts()?;
                Ok((model, Box::new(CpuDecoder { model, st, hook })))
            }
            Self::Cuda { model, gpu } => Ok((*model, Box::new(gpu))),
        }
    }
}

fn open(opts: &EngineOptions) -> Result<Backend<'static>, ServerError> {
    let (session, st) = Session::open(&opts.model, &opts.settings, |model| {
        let ctx = context(opts, model);
        let rows = Drafting::rows(&opts.draft, opts.draft_len);
        let parallel = opts.parallel(&model.config, ctx);
        let batch = ctx.min(512).max(rows).max(parallel);
        // Batched logits take a vocabulary's row of floats per request: not
        // under a memory budget, which they would take from the cache.
        let logit_rows = if opts.batched_kernels && opts.settings.mem_budget.is_none() {
            parallel
        } else {
            1
        };
        Ok(model
            .new_state(ctx, batch, logit_rows)
            .with_sequences(&model.config, parallel))
    })?;
    Ok(Backend::Cpu { session, st })
}

/// `model` on CUDA device `ordinal`; "no CUDA device" where there is none.
fn open_device<'m>(opts: &EngineOptions, ordinal: usize, model: &'m DeviceModel) -> Result<Backend<'m>, ServerError> {
    let ctx = context(opts, model.model());
    let (gpu, _) = model.open(ordinal, ctx, ctx.min(512)).map_err(device_error)?;
    Ok(Backend::Cuda {
        model: model.model(),
        gpu,
    })
}

/// A device engine's error: a model's or its artifacts' as the runtime
/// says it, the rest (no device, the driver) as a device error.
fn device_error(e: leanstream_cuda::CudaError) -> ServerError {
    match e {
        leanstream_cuda::CudaError::Model(e) => e.into(),
        e => RuntimeError::Device(e.to_string()).into(),
    }
}

/// The context: `--ctx` (default 2048), at most the model's.
fn context(opts: &EngineOptions, model: &Model) -> usize {
    opts.ctx.unwrap_or(2048).clamp(2, model.config.context_length.max(2))
}

fn model_info(opts: &EngineOptions, model: &Model, ctx: usize) -> Result<ModelInfo, ServerError> {
    let tok = &model.tokenizer;
    let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).map(str::to_string);
    let chat_template = model.gguf.get_str("tokenizer.chat_template")?.map(str::to_string);
    let name = opts
        .model
        .file_stem()
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    Ok(ModelInfo {
        name,
        ctx,
        family: ChatTemplate::detect(chat_template.as_deref(), model.config.arch),
        chat_template,
        bos_text: text_of(tok.bos()),
        eos_text: text_of(tok.eot().or(tok.eos())),
        adds_bos: tok.add_bos(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

fn serve_jobs(
    mut backend: Backend<'_>,
    mut drafting: Drafting,
    rx: Receiver<Job>,
    queued: &AtomicUsize,
    metrics: &Metrics,
    opts: &EngineOptions,
    mut cache: PromptCache,
) {
    let prompt_cache = opts.prompt_cache;
    if let Backend::Cpu { session, st } = &mut backend {
        if st.sequences() > 1 {
            let mut batch = Batch::new(st);
            if opts.batched_kernels {
                batch = batch.with_batched_kernels();
            }
            return crate::batching::serve(session, st, batch, rx, queued, metrics, prompt_cache, &mut cache);
        }
    }
    // Tokens whose keys and values the state holds, from the last job.
    let mut cached: Vec<u32> = Vec::new();
    while let Ok(job) = rx.recv() {
        // Busy before the queue shrinks, so "idle and nothing queued" is never seen early.
        metrics.set_busy(true);
        queued.fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            metrics.count_cancelled();
            metrics.set_busy(false);
            continue;
        }
        run_job(&mut backend, &mut drafting, job, metrics, &mut cached, &mut cache);
        if !prompt_cache {
            cached.clear();
        }
        metrics.set_prompt_cache_bytes(cache.bytes());
        if let Backend::Cpu { session, st } = &backend {
            if let Some((fm, engine)) = session.flash() {
                metrics.set_engine(EngineSnapshot {
                    policy: engine.policy().to_string(),
                    stats: engine.stats(),
                    memory: fm.memory(st, engine),
                });
            }
        }
        metrics.set_busy(false);
    }
}

/// Runs `job`; `cached` is what the state's KV cache holds before and after.
fn run_job(
    backend: &mut Backend<'_>,
    drafting: &mut Drafting,
    job: Job,
    metrics: &Metrics,
    cached: &mut Vec<u32>,
    cache: &mut PromptCache,
) {
    let Job { request, events } = job;
    let fail = |e: ServerError| {
        metrics.count_failed(&e);
        let _ = events.blocking_send(Event::Failed(e));
    };
    let (ids, max_tokens) = match check_request(backend.model(), backend.ctx(), &request) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    if events
        .blocking_send(Event::Started {
            prompt_tokens: ids.len(),
        })
        .is_err()
    {
        metrics.count_cancelled();
        return;
    }
    let reused = match backend.reusable_kv() {
        Some(kv) => reuse_prefix(kv, cached, &ids, cache),
        None => 0,
    };
    let (model, mut dec) = match backend.decoder() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let mut sampler = Sampler::new(request.sampling, model.config.n_vocab);
    let mut reply = Reply::new(events.clone(), request.stop);
    let mut generated = Vec::new();
    let result = draft::decode(
        &mut *dec,
        &model.tokenizer,
        &ids,
        reused,
        max_tokens,
        &mut sampler,
        drafting,
        |tok| {
            generated.push(tok);
            let next = reply.token(&model.tokenizer, tok);
            Ok(if reply.flush_blocking() {
                next
            } else {
                ControlFlow::Break(())
            })
        },
    );
    // The decoder holds the backend; the KV cache is needed below.
    drop(dec);
    let stats = match result {
        Ok(s) => s,
        Err(e) => {
            cached.clear();
            return fail(e.into());
        }
    };
    // Every generated token but the last went through a forward pass.
    generated.pop();
    *cached = ids.clone();
    cached.extend_from_slice(&generated);
    if let Some(kv) = backend.reusable_kv() {
        cache.insert(cached, kv);
    }
    metrics.count_tokens(&stats);
    if reply.gone() {
        metrics.count_cancelled();
        return;
    }
    reply.finish(&stats);
    if reply.flush_blocking() {
        metrics.count_completed();
    } else {
        metrics.count_cancelled();
    }
}
