//! `oracle`: the true active set of every call is known in advance (replayed
//! from a recorded run of the same tokens, [`crate::engine::trace`]), so only
//! those bundles are read, one layer ahead: the bound for any predictor.

use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::stream::Want;
use crate::engine::tail::Tail;
use crate::engine::trace::TraceCursor;
use crate::Result;

pub(crate) struct Oracle {
    cursor: TraceCursor,
    /// Union of the next call's rows (what is prefetched).
    next_union: Vec<u64>,
}

impl Oracle {
    pub(crate) fn new(cursor: TraceCursor, words: usize) -> Self {
        Self {
            cursor,
            next_union: vec![0; words],
        }
    }
}

impl FfnPolicy for Oracle {
    fn kind(&self) -> Policy {
        Policy::Oracle
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        let s = streamer(source)?;
        let k = self.cursor.advance(call.layer, call.n)?;
        s.ensure(call.layer, Want::Set(self.cursor.union()))?;
        if let Some(next) = self.cursor.peek_next(&mut self.next_union) {
            s.prefetch(next, Want::Set(&self.next_union))?;
        }
        Ok(Plan::new(Select::Rows(self.cursor.rows(k)), Some(self.cursor.union())))
    }

    fn held_bytes(&self) -> u64 {
        self.cursor.bytes()
    }

    fn replayed_calls(&self) -> Option<usize> {
        Some(self.cursor.position())
    }
}
