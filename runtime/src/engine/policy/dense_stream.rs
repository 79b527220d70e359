//! `dense-stream`: every bundle of every layer each token, through the I/O
//! thread, layer l+1 requested while layer l computes; the neuron cache
//! serves what it holds.

use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::stream::Want;
use crate::engine::tail::{Select, Source, Tail};
use crate::Result;

pub(crate) struct DenseStream;

impl FfnPolicy for DenseStream {
    fn kind(&self) -> Policy {
        Policy::DenseStream
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        let s = streamer(source)?;
        s.ensure(call.layer, Want::All)?;
        s.prefetch(call.next_layer(), Want::All)?;
        Ok(Plan::new(Select::Threshold(call.threshold), None))
    }
}
