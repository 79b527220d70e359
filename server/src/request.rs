//! What a request is and what it gets back: the generation asked for, the
//! events its channel carries, and the check of a request against the
//! model's context that both engine loops (one at a time, and batched) make.

use leanstream_runtime::generate::SamplerConfig;
use leanstream_runtime::model::Model;
use tokio::sync::mpsc;

use crate::ServerError;

/// One generation.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
}

/// A prompt as text, control tokens written as text (`<|im_start|>`), and
/// the byte ranges of it that are chat messages' own text: control tokens
/// written there stay text ([`Tokenizer::encode_chat`]), so a message cannot
/// end its turn or speak for another role. A completion's prompt has none:
/// the client writes all of it.
///
/// [`Tokenizer::encode_chat`]: leanstream_runtime::tokenizer::Tokenizer::encode_chat
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    pub text: String,
    pub content: Vec<std::ops::Range<usize>>,
}

impl Prompt {
    /// A prompt the client wrote whole (`/v1/completions`).
    pub fn raw(text: String) -> Self {
        Self {
            text,
            content: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a job's channel carries: `Started` or `Failed` first, then text
/// pieces, then `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    /// The prompt fits and generation begins.
    Started {
        prompt_tokens: usize,
    },
    Text(String),
    Done(Finish),
    Failed(ServerError),
}

pub(crate) struct Job {
    pub(crate) request: GenRequest,
    pub(crate) events: mpsc::Sender<Event>,
}

/// A request's prompt as tokens and the tokens it may generate, or why
/// this server's context cannot hold them.
pub(crate) fn check_request(model: &Model, ctx: usize, request: &GenRequest) -> Result<(Vec<u32>, usize), ServerError> {
    let ids = model
        .tokenizer
        .encode_chat(&request.prompt.text, &request.prompt.content);
    if ids.len() >= ctx {
        return Err(ServerError::BadRequest {
            message: format!(
                "the prompt is {} tokens; this server's context holds {ctx} tokens of prompt and completion (--ctx)",
                ids.len()
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    let room = ctx - ids.len();
    let max_tokens = match request.max_tokens {
        Some(n) if n > room => {
            return Err(ServerError::BadRequest {
                message: format!(
                "max_tokens {n} does not fit: the context holds {ctx} tokens and the prompt takes {}, leaving {room}",
                ids.len()
            ),
                param: Some("max_tokens".into()),
                code: Some("context_length_exceeded"),
            })
        }
        Some(n) => n,
        None => room,
    };
    Ok((ids, max_tokens))
}
