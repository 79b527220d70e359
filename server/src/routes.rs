//! The HTTP surface: OpenAI's `/v1/chat/completions`, `/v1/completions`
//! (both with server-sent events when `stream` is set) and `/v1/models`,
//! plus `/health` and Prometheus `/metrics`.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{ChatRequest, CompletionRequest, Generation};
use crate::request::{Event, Finish, GenRequest, Prompt};
use crate::template::ChatFormat;
use crate::worker::Engine;
use crate::ServerError;

/// What every handler shares.
pub struct AppState {
    pub engine: Engine,
    pub format: ChatFormat,
    api_key: Option<String>,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(engine: Engine, api_key: Option<String>) -> Self {
        let format = ChatFormat::new(engine.info());
        Self {
            engine,
            format,
            api_key,
            next_id: AtomicU64::new(1),
        }
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ServerError> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Compared in full whatever the first difference, so timing tells nothing.
        let same = given.is_some_and(|g| {
            g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
        });
        if same {
            Ok(())
        } else {
            Err(ServerError::Unauthorized)
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = s.authorize(&headers).and_then(|()| {
        let req = ChatRequest::parse(&body)?;
        Ok((s.format.render(&req.messages)?, req.generation))
    });
    respond(&s, Kind::Chat, prepared).await
}

async fn completions(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = s.authorize(&headers).and_then(|()| {
        let req = CompletionRequest::parse(&body)?;
        Ok((Prompt::raw(req.prompt), req.generation))
    });
    respond(&s, Kind::Completion, prepared).await
}

async fn respond(s: &Arc<AppState>, kind: Kind, prepared: Result<(Prompt, Generation), ServerError>) -> Response {
    let (prompt, generation) = match prepared {
        Ok(p) => p,
        Err(e) => {
            s.engine.metrics().count_rejected();
            return e.into_response();
        }
    };
    generate(s, kind, prompt, generation)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn generate(s: &Arc<AppState>, kind: Kind, prompt: Prompt, g: Generation) -> Result<Response, ServerError> {
    let mut rx = s.engine.submit(GenRequest {
        prompt,
        max_tokens: g.max_tokens,
        sampling: g.sampling,
        stop: g.stop,
    })?;
    // The first event decides the status: the prompt may not fit.
    match rx.recv().await {
        Some(Event::Started { .. }) => {}
        Some(Event::Failed(e)) => return Err(e),
        _ => return Err(ServerError::EngineGone),
    }
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{n}"),
            Kind::Completion => format!("cmpl-{n}"),
        },
        created: now(),
        model: s.engine.info().name.clone(),
    };
    if g.stream {
        Ok(stream(reply, rx, g.include_usage).into_response())
    } else {
        collect(reply, rx).await
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The fixed parts of one response's objects.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

impl Reply {
    fn object(&self, choices: Value, usage: Option<Value>, stream: bool) -> Value {
        let object = match (self.kind, stream) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        };
        let mut v = json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// A stream chunk carrying `text` (chat: the delta's content; `role`
    /// opens a chat stream).
    fn chunk(&self, text: &str, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if role || !text.is_empty() {
                    delta["content"] = json!(text);
                }
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
            Kind::Completion => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish }),
        };
        self.object(json!([choice]), None, true)
    }

    fn whole(&self, text: &str, f: &Finish) -> Value {
        let reason = f.reason.as_str();
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": null,
                "finish_reason": reason,
            }),
            Kind::Completion => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": reason }),
        };
        self.object(json!([choice]), Some(usage(f)), false)
    }
}

async fn collect(reply: Reply, mut rx: mpsc::Receiver<Event>) -> Result<Response, ServerError> {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text += &t,
            Some(Event::Done(f)) => return Ok(Json(reply.whole(&text, &f)).into_response()),
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Started { .. }) => {}
            None => return Err(ServerError::EngineGone),
        }
    }
}

enum Phase {
    /// A chat stream opens with the assistant's role.
    Head,
    Body,
    /// `stream_options.include_usage`: a last chunk with the usage alone.
    Usage(Finish),
    Done,
    End,
}

/// Server-sent events in OpenAI's chunk format, ending with `[DONE]`. The
/// finishing chunk carries the usage unless the client asked for it apart.
/// Dropping the stream (the client went away) drops `rx`, which stops the job.
fn stream(reply: Reply, rx: mpsc::Receiver<Event>, include_usage: bool) -> impl IntoResponse {
    let phase = if reply.kind == Kind::Chat {
        Phase::Head
    } else {
        Phase::Body
    };
    let state = (reply, rx, phase);
    let events = futures_util::stream::unfold(state, move |(reply, mut rx, phase)| async move {
        let (data, next) = match phase {
            Phase::Head => (reply.chunk("", true, None), Phase::Body),
            Phase::Body => loop {
                match rx.recv().await {
                    Some(Event::Text(t)) => break (reply.chunk(&t, false, None), Phase::Body),
                    Some(Event::Done(f)) => {
                        let mut last = reply.chunk("", false, Some(f.reason.as_str()));
                        if include_usage {
                            break (last, Phase::Usage(f));
                        }
                        last["usage"] = usage(&f);
                        break (last, Phase::Done);
                    }
                    Some(Event::Failed(e)) => break (e.body(), Phase::Done),
                    Some(Event::Started { .. }) => continue,
                    None => break (ServerError::EngineGone.body(), Phase::Done),
                }
            },
            Phase::Usage(f) => (reply.object(json!([]), Some(usage(&f)), true), Phase::Done),
            Phase::Done => {
                let done = SseEvent::default().data("[DONE]");
                return Some((Ok::<_, Infallible>(done), (reply, rx, Phase::End)));
            }
            Phase::End => return None,
        };
        Some((Ok(SseEvent::default().data(data.to_string())), (reply, rx, next)))
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = s.authorize(&headers) {
        return e.into_response();
    }
    let info = s.engine.info();
    Json(json!({
        "object": "list",
        "data": [{ "id": info.name, "object": "model", "created": info.created, "owned_by": "leanstream" }],
    }))
    .into_response()
}

async fn health(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "status": "ok", "queue_length": s.engine.queue_len() }))
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let text = s
        .engine
        .metrics()
        .render(s.engine.queue_len(), s.engine.queue_capacity());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

async fn not_found(uri: Uri) -> Response {
    ServerError::NotFound(uri.path().to_string()).into_response()
}
