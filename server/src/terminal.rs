//! `leanstream chat`: a conversation in the terminal with the same engine
//! and templates the server uses.

use std::io::{BufRead, Write};

use leanstream_runtime::generate::{ChatMessage, SamplerConfig};

use crate::request::{Event, GenRequest};
use crate::template::ChatFormat;
use crate::worker::Engine;
use crate::ServerError;

pub struct ChatOptions {
    pub sampling: SamplerConfig,
    /// Tokens per reply (default: up to the end of the context).
    pub max_tokens: Option<usize>,
    /// Show a prompt and hints (when input is a terminal).
    pub interactive: bool,
}

/// Reads one user message per line from `input` and streams each reply to
/// `out`. `/reset` forgets the conversation, `/quit` (or end of input) ends.
pub fn chat(engine: &Engine, input: impl BufRead, mut out: impl Write, opts: &ChatOptions) -> Result<(), ServerError> {
    let format = ChatFormat::new(engine.info());
    if !format.is_available() {
        return Err(ServerError::bad(
            "this model has no chat template LeanStream can use; try `leanstream run` with a plain prompt",
        ));
    }
    let prompt = |o: &ChatOptions| {
        if o.interactive {
            eprint!("> ");
        }
    };
    if opts.interactive {
        eprintln!(
            "chatting with {} (context {} tokens); /reset starts over, /quit or Ctrl-D ends",
            engine.info().name,
            engine.info().ctx
        );
    }
    prompt(opts);
    let mut history: Vec<ChatMessage> = Vec::new();
    for line in input.lines() {
        let line = line?;
        match line.trim() {
            "" => {
                prompt(opts);
                continue;
            }
            "/quit" | "/exit" => break,
            "/reset" => {
                history.clear();
                prompt(opts);
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", line));
        match reply(engine, &format, &history, opts, &mut out)? {
            Some(text) => history.push(ChatMessage::new("assistant", text)),
            None => {
                history.pop();
            }
        }
        prompt(opts);
    }
    Ok(())
}

/// Streams the reply to `history`; `None` when the engine refused it
/// (reported on stderr; the conversation goes on without that message).
fn reply(
    engine: &Engine,
    format: &ChatFormat,
    history: &[ChatMessage],
    opts: &ChatOptions,
    out: &mut impl Write,
) -> Result<Option<String>, ServerError> {
    let prompt = match format.render(history) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(None);
        }
    };
    let mut rx = engine.submit(GenRequest {
        prompt,
        max_tokens: opts.max_tokens,
        sampling: opts.sampling,
        stop: Vec::new(),
    })?;
    let mut text = String::new();
    loop {
        match rx.blocking_recv() {
            Some(Event::Started { .. }) => {}
            Some(Event::Text(t)) => {
                out.write_all(t.as_bytes())?;
                out.flush()?;
                text += &t;
            }
            Some(Event::Done(_)) => {
                writeln!(out)?;
                return Ok(Some(text));
            }
            Some(Event::Failed(e)) => {
                writeln!(out)?;
                eprintln!("error: {e} (/reset starts a new conversation)");
                return Ok(None);
            }
            None => return Err(ServerError::EngineGone),
        }
    }
}
