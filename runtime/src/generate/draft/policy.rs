//! How many tokens to draft before each verification pass: fixed, or chosen
//! from what the run measures (the rate at which drafted tokens are
//! accepted, and the time of a pass by its rows), so that drafting turns
//! itself off where it does not pay: everything in memory and compute-bound
//! (a pass of k+1 rows costs about k+1 passes of one), or drafts rarely
//! accepted.

use serde::Serialize;

/// The draft length a user sets (`--draft-len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftLen {
    /// Always this many (where the proposer has them).
    Fixed(usize),
    /// Chosen each pass from the measured acceptance and costs, up to `max`.
    Auto { max: usize },
}

impl std::str::FromStr for DraftLen {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (auto, n) = match s.strip_prefix("auto") {
            Some("") => {
                return Ok(Self::Auto {
                    max: DraftPolicy::MAX_AUTO,
                })
            }
            Some(rest) => (true, rest.strip_prefix(':').unwrap_or("x")),
            None => (false, s),
        };
        let k: usize = n
            .parse()
            .map_err(|_| format!("draft length '{s}': a number of tokens, auto, or auto:MAX"))?;
        if k > DraftPolicy::MAX_LEN {
            return Err(format!("draft length {k}: at most {}", DraftPolicy::MAX_LEN));
        }
        Ok(if auto { Self::Auto { max: k } } else { Self::Fixed(k) })
    }
}

/// Counters of a run's drafting, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DraftReport {
    /// Verification passes of the decode (one token each without drafting).
    pub passes: u64,
    /// Of them, passes that checked at least one drafted token.
    pub drafted_passes: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Seconds spent proposing.
    pub propose_seconds: f64,
}

impl DraftReport {
    /// What was counted after `earlier` (a report of the same run).
    pub fn since(&self, earlier: &DraftReport) -> DraftReport {
        DraftReport {
            passes: self.passes - earlier.passes,
            drafted_passes: self.drafted_passes - earlier.drafted_passes,
            drafted: self.drafted - earlier.drafted,
            accepted: self.accepted - earlier.accepted,
            propose_seconds: self.propose_seconds - earlier.propose_seconds,
        }
    }

    /// Accepted share of the drafted tokens (0 without drafts).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// Chooses each pass's draft length and learns from the passes.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    len: DraftLen,
    /// Smoothed acceptance: accepted and tried draft tokens (a token after
    /// a refused one was not tried), decayed so the estimate follows the text.
    accepted: f64,
    tried: f64,
    /// Smoothed seconds of a pass by rows (index rows - 1; 0: not yet seen).
    pass_seconds: Vec<f64>,
    /// Smoothed seconds proposing one token.
    propose_seconds: f64,
    /// Passes since the last that drafted, to try again now and then when
    /// the estimate says drafting does not pay.
    since_draft: usize,
    pub report: DraftReport,
}

impl DraftPolicy {
    /// The longest draft `auto` takes by default.
    pub const MAX_AUTO: usize = 6;
    /// The longest draft a user may ask for: a verification pass's rows
    /// are run state the memory budget pays for.
    pub const MAX_LEN: usize = 15;
    /// Weight of the newest observation in the smoothed figures.
    const DECAY: f64 = 0.1;
    /// Passes without drafting before `auto` tries one token again.
    const PROBE_EVERY: usize = 32;

    pub fn new(len: DraftLen) -> Self {
        Self {
            len,
            // A prior of one accepted in two.
            accepted: 1.0,
            tried: 2.0,
            pass_seconds: Vec::new(),
            propose_seconds: 0.0,
            since_draft: 0,
            report: DraftReport::default(),
        }
    }

    /// The policy that never drafts.
    pub fn off() -> Self {
        Self::new(DraftLen::Fixed(0))
    }

    /// Smoothed acceptance of a drafted token.
    pub fn acceptance(&self) -> f64 {
        self.accepted / self.tried
    }

    /// Tokens to draft for the next pass, at most `limit` (what the
    /// verifier's rows, the context and the tokens still wanted allow).
    pub fn draft_len(&mut self, limit: usize) -> usize {
        let k = match self.len {
            DraftLen::Fixed(k) => k,
            DraftLen::Auto { max } => {
                let k = self.best(max.min(limit));
                if k == 0 && self.since_draft >= Self::PROBE_EVERY {
                    1
                } else {
                    k
                }
            }
        };
        k.min(limit)
    }

    /// The length that maximises expected tokens per second: with each
    /// draft token accepted with probability a (independently), a pass of k
    /// drafts yields (1 - a^(k+1)) / (1 - a) tokens.
    fn best(&self, max: usize) -> usize {
        let a = self.acceptance().clamp(0.0, 0.999);
        let Some(&one) = self.pass_seconds.first().filter(|&&s| s > 0.0) else {
            return 0; // A plain pass is timed first: the yardstick.
        };
        let mut best = (1.0 / one, 0);
        for k in 1..=max {
            let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
            let cost = self.pass_cost(k + 1, one) + k as f64 * self.propose_seconds;
            if tokens / cost > best.0 {
                best = (tokens / cost, k);
            }
        }
        best.1
    }

    /// A pass of `rows` rows: measured, else the longest measured pass
    /// extended by one single-row pass's compute share per extra row. Not yet
    /// measured, a pass is taken to cost what the nearest shorter one did
    /// (optimistic: the reads dominate), so a length gets tried and timed.
    fn pass_cost(&self, rows: usize, one: f64) -> f64 {
        match self.pass_seconds.get(rows - 1) {
            Some(&s) if s > 0.0 => s,
            _ => self.pass_seconds[..rows.min(self.pass_seconds.len())]
                .iter()
                .rev()
                .find(|&&s| s > 0.0)
                .copied()
                .unwrap_or(one),
        }
    }

    /// After a pass of `drafted` draft tokens of which `accepted` were
    /// accepted, which took `seconds` (the verification) and `propose`
    /// seconds proposing.
    pub fn observe(&mut self, drafted: usize, accepted: usize, seconds: f64, propose: f64) {
        let r = &mut self.report;
        r.passes += 1;
        r.drafted += drafted as u64;
        r.accepted += accepted as u64;
        r.propose_seconds += propose;
        let rows = drafted + 1;
        if self.pass_seconds.len() < rows {
            self.pass_seconds.resize(rows, 0.0);
        }
        let s = &mut self.pass_seconds[rows - 1];
        *s = if *s == 0.0 {
            seconds
        } else {
            *s + Self::DECAY * (seconds - *s)
        };
        if drafted == 0 {
            self.since_draft += 1;
            return;
        }
        r.drafted_passes += 1;
        self.since_draft = 0;
        let tried = (accepted + usize::from(accepted < drafted)) as f64;
        let keep = (1.0 - Self::DECAY).powf(tried);
        self.accepted = self.accepted * keep + accepted as f64;
        self.tried = self.tried * keep + tried;
        let per = propose / drafted as f64;
        self.propose_seconds = if self.propose_seconds == 0.0 {
            per
        } else {
            self.propose_seconds + Self::DECAY * (per - self.propose_seconds)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse() {
        assert_eq!("4".parse::<DraftLen>().unwrap(), DraftLen::Fixed(4));
        assert_eq!("auto".parse::<DraftLen>().unwrap(), DraftLen::Auto { max: 6 });
        assert_eq!("auto:3".parse::<DraftLen>().unwrap(), DraftLen::Auto { max: 3 });
        assert!("auto3".parse::<DraftLen>().is_err());
        assert!("-1".parse::<DraftLen>().is_err());
        assert_eq!("7".parse::<DraftLen>().unwrap(), DraftLen::Fixed(7));
        assert!("16".parse::<DraftLen>().unwrap_err().contains("at most 15"));
    }

    /// Passes whose cost grows with their rows as fast as the tokens they
    /// could yield: drafting does not pay, and auto stops, trying again
    /// only now and then.
    #[test]
    fn auto_turns_drafting_off_when_rows_cost_as_much_as_tokens() {
        let mut p = DraftPolicy::new(DraftLen::Auto { max: 4 });
        let mut drafted_passes = 0;
        for _ in 0..400 {
            let k = p.draft_len(4);
            // Half the drafts accepted; a pass of r rows costs r units.
            let acc = k / 2;
            p.observe(k, acc, (k + 1) as f64, 0.0);
            drafted_passes += usize::from(k > 0);
        }
        assert!(drafted_passes < 400 / 16, "drafted in {drafted_passes} of 400 passes");
    }

    /// Passes bound by reads (rows nearly free) and a draft mostly right:
    /// auto drafts long.
    #[test]
    fn auto_drafts_long_when_rows_are_nearly_free_and_drafts_good() {
        let mut p = DraftPolicy::new(DraftLen::Auto { max: 6 });
        let mut last = 0;
        for i in 0..200 {
            let k = p.draft_len(6);
            let acc = if i % 10 == 0 { k / 2 } else { k };
            p.observe(k, acc, 1.0 + 0.02 * k as f64, 0.001 * k as f64);
            last = k;
        }
        assert_eq!(last, 6, "acceptance {}", p.acceptance());
        assert!(p.report.acceptance() > 0.8);
    }

    #[test]
    fn fixed_lengths_are_capped_by_the_limit() {
        let mut p = DraftPolicy::new(DraftLen::Fixed(5));
        assert_eq!(p.draft_len(8), 5);
        assert_eq!(p.draft_len(2), 2);
        assert_eq!(DraftPolicy::off().draft_len(8), 0);
    }
}
