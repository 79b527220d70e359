//! One request's answer as it is generated: tokens become text (held back
//! while it may begin a stop string), then the finish; the events wait in
//! an outbox until the client's channel takes them, so a slow client holds
//! back its own request and no other.

use std::collections::VecDeque;
use std::ops::ControlFlow;

use leanstream_runtime::generate::GenerationStats;
use leanstream_runtime::tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::{self, error::TrySendError};

use crate::request::{Event, Finish, FinishReason};
use crate::stop::StopScan;

pub(crate) struct Reply {
    events: mpsc::Sender<Event>,
    outbox: VecDeque<Event>,
    text: Option<StreamDecoder>,
    stops: StopScan,
    /// A stop string was reached.
    stopped: bool,
    /// The client went away.
    gone: bool,
}

impl Reply {
    pub(crate) fn new(events: mpsc::Sender<Event>, stops: Vec<String>) -> Self {
        Self {
            events,
            outbox: VecDeque::new(),
            text: Some(StreamDecoder::new()),
            stops: StopScan::new(stops),
            stopped: false,
            gone: false,
        }
    }

    /// Queues `event` to send.
    pub(crate) fn push(&mut self, event: Event) {
        self.outbox.push_back(event);
    }

    /// Turns `tok` into text to send; `Break` once a stop string is reached.
    pub(crate) fn token(&mut self, tokenizer: &Tokenizer, tok: u32) -> ControlFlow<()> {
        let piece = self.text.as_mut().map_or_else(String::new, |d| d.push(tokenizer, tok));
        let (text, hit) = self.stops.push(&piece);
        if !text.is_empty() {
            self.outbox.push_back(Event::Text(text));
        }
        self.stopped = hit;
        if hit || self.gone {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    /// Queues the text held back and the finish of a generation that ended
    /// with `stats`.
    pub(crate) fn finish(&mut self, stats: &GenerationStats) {
        if !self.stopped {
            let tail = self.text.take().map_or_else(String::new, StreamDecoder::finish);
            let (mut text, hit) = self.stops.push(&tail);
            self.stopped = hit;
            if !hit {
                text += &self.stops.finish();
            }
            if !text.is_empty() {
                self.outbox.push_back(Event::Text(text));
            }
        }
        let reason = if self.stopped || stats.stopped_on_eog {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        self.outbox.push_back(Event::Done(Finish {
            reason,
            prompt_tokens: stats.prompt_tokens,
            completion_tokens: stats.generated_tokens,
        }));
    }

    /// Sends what the client's channel takes now; false once the client
    /// is gone.
    pub(crate) fn flush(&mut self) -> bool {
        while let Some(event) = self.outbox.pop_front() {
            match self.events.try_send(event) {
                Ok(()) => {}
                Err(TrySendError::Full(event)) => {
                    self.outbox.push_front(event);
                    break;
                }
                Err(TrySendError::Closed(_)) => self.gone = true,
            }
        }
        self.gone |= self.events.is_closed();
        !self.gone
    }

    /// Sends everything, waiting for the client to read; false once the
    /// client is gone.
    pub(crate) fn flush_blocking(&mut self) -> bool {
        while let Some(event) = self.outbox.pop_front() {
            if self.events.blocking_send(event).is_err() {
                self.gone = true;
            }
        }
        self.gone |= self.events.is_closed();
        !self.gone
    }

    /// Events the client has not taken yet: its request waits for it.
    pub(crate) fn held(&self) -> bool {
        !self.outbox.is_empty()
    }

    pub(crate) fn gone(&self) -> bool {
        self.gone
    }
}
