//! Stop strings over streamed text: text is passed on as soon as no stop
//! string can begin in it, so a client never sees part of a stop string.

#[derive(Debug, Default)]
pub struct StopScan {
    stops: Vec<String>,
    /// Text that may be the start of a stop string.
    held: String,
}

impl StopScan {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds `piece`; answers the text now safe to pass on and whether a stop
    /// string was reached (the text before it is all that is passed on).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self.partial_suffix();
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// What was held back, once no more text will come.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes of the longest tail of `held` that begins some stop string.
    fn partial_suffix(&self) -> usize {
        let h = &self.held;
        (1..=h.len())
            .rev()
            .filter(|&n| h.is_char_boundary(h.len() - n))
            .find(|&n| {
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(&h[h.len() - n..]))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopScan::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, hit) = s.push(p);
            out += &text;
            if hit {
                return (out, true);
            }
        }
        out += &s.finish();
        (out, false)
    }

    #[test]
    fn a_stop_split_across_pieces_is_caught_and_not_shown() {
        assert_eq!(run(&["\n\n"], &["Hello", "\n", "\nmore"]), ("Hello".into(), true));
        assert_eq!(run(&["END"], &["abE", "N", "D tail"]), ("ab".into(), true));
    }

    #[test]
    fn held_text_that_is_not_a_stop_is_released() {
        let mut s = StopScan::new(vec!["END".into()]);
        assert_eq!(s.push("abE"), ("ab".into(), false));
        assert_eq!(s.push("x"), ("Ex".into(), false));
        assert_eq!(run(&["END"], &["a", "EN"]), ("aEN".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_stays_whole() {
        assert_eq!(run(&["zz", "b"], &["a b zz"]), ("a ".into(), true));
        assert_eq!(run(&["éx"], &["café", "!"]), ("café!".into(), false));
        assert_eq!(run(&[], &["any", "thing"]), ("anything".into(), false));
    }
}
