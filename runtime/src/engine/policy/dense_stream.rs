//! `dense-stream`: every bundle of every layer each token, through the I/O
//! thread, the next layers requested while layer l computes (as many as the
//! streamer has stages; the pool bounds what they read ahead) so the device
//! never waits for a layer's compute to hear of the next; the neuron cache
//! serves what it holds.

use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::stream::{Want, STAGES};
use crate::engine::tail::Tail;
use crate::Result;

pub(crate) struct DenseStream;

impl FfnPolicy for DenseStream {
    fn kind(&self) -> Policy {
        Policy::DenseStream
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        let s = streamer(source)?;
        s.ensure(call.layer, Want::All)?;
        for ahead in 1..STAGES {
            s.prefetch(call.layer_ahead(ahead), Want::All)?;
        }
        Ok(Plan::new(Select::Threshold(call.threshold), None))
    }
}
