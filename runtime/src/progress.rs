//! One way to make a progress bar: shown only when asked (a terminal), with
//! a template fixed at the call site.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `len` steps drawn with `template` (indicatif's syntax), or a
/// hidden one when `show` is false.
pub fn bar(len: u64, show: bool, template: &'static str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb
}
