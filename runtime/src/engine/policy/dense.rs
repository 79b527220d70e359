//! `dense`: every bundle held in memory (read once at open), every neuron
//! computed, kept above the layer's threshold. The reference the streaming
//! policies are compared with.

use super::{FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::tail::Tail;
use crate::Result;

pub(crate) struct Dense;

impl FfnPolicy for Dense {
    fn kind(&self) -> Policy {
        Policy::Dense
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, _source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        Ok(Plan::new(Select::Threshold(call.threshold), None))
    }
}
