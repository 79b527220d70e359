//! Drafting: several tokens per forward pass. Under a memory cap the engine
//! is bound by the disk, so a pass over a few rows reads each needed bundle
//! once for all of them and costs little more than a pass over one. A
//! [`Proposer`] guesses the next tokens without reading flash (n-grams of
//! the context, a small draft model); the verifier runs the last token and
//! the guesses as one batch through the running engine and keeps the longest
//! prefix the model agrees with, plus the model's own next token; the
//! [`DraftPolicy`] picks how many to draft from the acceptance and pass
//! costs it measures, drafting none where that does not pay; the driver
//! ([`decode`]) is the one generation loop, with or without a proposer.
//!
//! Named for the draft, not "speculate", which is the FFN policy that
//! predicts neurons: the two combine (a verified batch through `speculate`
//! reads the union of its rows' predicted sets).

mod driver;
mod policy;
mod proposer;
mod verifier;

pub use driver::{decode, Drafting};
pub use policy::{DraftLen, DraftPolicy, DraftReport, ROWS_REPORTED};
pub use proposer::{greedy_draft, DraftKind, ModelDraft, PromptLookup, Proposer};
pub use verifier::accept;
