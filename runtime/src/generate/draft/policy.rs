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
    /// Per rows of a pass (index rows - 1), the passes and their seconds:
    /// what a pass of k+1 rows costs against one of a single row.
    pub rows_passes: [u64; ROWS_REPORTED],
    pub rows_seconds: [f64; ROWS_REPORTED],
}

/// Pass sizes a [`DraftReport`] times: every one a draft may make.
pub const ROWS_REPORTED: usize = DraftPolicy::MAX_LEN + 1;

/// Counts of two runs together (a benchmark's prompts).
impl std::ops::AddAssign for DraftReport {
    fn add_assign(&mut self, other: DraftReport) {
        self.passes += other.passes;
        self.drafted_passes += other.drafted_passes;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.propose_seconds += other.propose_seconds;
        for i in 0..ROWS_REPORTED {
            self.rows_passes[i] += other.rows_passes[i];
            self.rows_seconds[i] += other.rows_seconds[i];
        }
    }
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
            rows_passes: std::array::from_fn(|i| self.rows_passes[i] - earlier.rows_passes[i]),
            rows_seconds: std::array::from_fn(|i| self.rows_seconds[i] - earlier.rows_seconds[i]),
        }
    }

    /// Mean seconds of a pass of `rows` rows (`None`: none ran).
    pub fn mean_pass_seconds(&self, rows: usize) -> Option<f64> {
        let i = rows.checked_sub(1)?;
        let n = *self.rows_passes.get(i)?;
        (n > 0).then(|| self.rows_seconds[i] / n as f64)
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
    /// the estimate says drafting does not pay; the wait doubles after each
    /// try that did not pay (up to [`PROBE_MAX`](Self::PROBE_MAX)).
    since_draft: usize,
    probe_every: usize,
    /// Whether the last pass that drafted was a probe.
    probing: bool,
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
    /// Passes without drafting before `auto` tries one token again, at first
    /// and at most.
    const PROBE_EVERY: usize = 32;
    const PROBE_MAX: usize = 1024;

    pub fn new(len: DraftLen) -> Self {
        Self {
            len,
            // A prior of one accepted in two.
            accepted: 1.0,
            tried: 2.0,
            pass_seconds: Vec::new(),
            propose_seconds: 0.0,
            since_draft: 0,
            probe_every: Self::PROBE_EVERY,
            probing: false,
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
                self.probing = k == 0 && self.since_draft >= self.probe_every && limit > 0;
                if self.probing {
                    1
                } else {
                    if k > 0 {
                        self.probe_every = Self::PROBE_EVERY;
                    }
                    k
                }
            }
        };
        k.min(limit)
    }

    /// The length that maximises expected tokens per second: with each
    /// draft token accepted with probability a (independently), a pass of k
    /// drafts yields (1 - a^(k+1)) / (1 - a) tokens. Lengths grow one past
    /// the longest pass timed so far, so a length is tried only after the
    /// shorter ones paid.
    fn best(&self, max: usize) -> usize {
        let a = self.acceptance().clamp(0.0, 0.999);
        let Some(&one) = self.pass_seconds.first().filter(|&&s| s > 0.0) else {
            return 0; // A plain pass is timed first: the yardstick.
        };
        let longest = self.pass_seconds.iter().rposition(|&s| s > 0.0).unwrap_or(0);
        let mut best = (1.0 / one, 0);
        for k in 1..=max.min(longest + 1) {
            let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
            let cost = self.pass_cost(k + 1) + k as f64 * self.propose_seconds;
            if tokens / cost > best.0 {
                best = (tokens / cost, k);
            }
        }
        best.1
    }

    /// A pass of `rows` rows: measured, else extrapolated along the line
    /// through the two longest passes timed below it (flat from a single
    /// one: optimistic, as where the reads dominate, so the length gets
    /// tried and timed).
    fn pass_cost(&self, rows: usize) -> f64 {
        if let Some(&s) = self.pass_seconds.get(rows - 1).filter(|&&s| s > 0.0) {
            return s;
        }
        let mut timed = self.pass_seconds[..(rows - 1).min(self.pass_seconds.len())]
            .iter()
            .enumerate()
            .rev()
            .filter(|&(_, &s)| s > 0.0);
        match (timed.next(), timed.next()) {
            (Some((r1, &t1)), Some((r0, &t0))) => t1 + (t1 - t0).max(0.0) / (r1 - r0) as f64 * (rows - 1 - r1) as f64,
            (Some((_, &t1)), None) => t1,
            _ => 0.0,
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
        if rows <= ROWS_REPORTED {
            r.rows_passes[rows - 1] += 1;
            r.rows_seconds[rows - 1] += seconds;
        }
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
        if self.probing {
            self.probe_every = (self.probe_every * 2).min(Self::PROBE_MAX);
        }
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
