//! One progress display for the whole run: the bar is the budget's time,
//! the message the step, its share and the budget left.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::Step;

struct State {
    step: String,
    index: usize,
    steps: usize,
    step_start: Instant,
    step_budget_s: f64,
}

pub struct Display {
    bar: ProgressBar,
    budget_s: f64,
    state: Arc<Mutex<State>>,
    t0: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

fn fmt_s(s: f64) -> String {
    let s = s.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

impl Display {
    pub fn new(show: bool, budget_s: f64, pipeline: &'static [Step]) -> Self {
        let bar = if show {
            ProgressBar::with_draw_target(Some(budget_s.ceil() as u64), ProgressDrawTarget::stderr_with_hz(2))
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("tune [{elapsed_precise}] {bar:30} {msg}").expect("static template"),
        );
        let state = Arc::new(Mutex::new(State {
            step: String::new(),
            index: 0,
            steps: pipeline.len(),
            step_start: Instant::now(),
            step_budget_s: 0.0,
        }));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = Self {
            bar,
            budget_s,
            state,
            t0: Instant::now(),
            stop,
        };
        if show {
            // The steps run inside library calls that report nothing, so
            // a ticker keeps the clock, the step's time and the ETA moving.
            let (bar, state, stop, t0) = (d.bar.clone(), d.state.clone(), d.stop.clone(), d.t0);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(s) = state.lock() {
                        let elapsed = t0.elapsed().as_secs_f64();
                        let in_step = s.step_start.elapsed().as_secs_f64();
                        bar.set_position((elapsed.min(budget_s)) as u64);
                        // The steps after this one, at their shares.
                        let later: f64 = pipeline[(s.index + 1).min(pipeline.len())..]
                            .iter()
                            .map(|st| st.share() * budget_s)
                            .sum();
                        bar.set_message(format!(
                            "step {}/{} {} {} of ~{} · ETA {} · budget left {}",
                            s.index + 1,
                            s.steps,
                            s.step,
                            fmt_s(in_step),
                            fmt_s(s.step_budget_s),
                            fmt_s((s.step_budget_s - in_step).max(0.0) + later),
                            fmt_s(budget_s - elapsed),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            });
        }
        d
    }

    pub fn start_step(&self, index: usize, steps: usize, step: Step, budget_s: f64) {
        if let Ok(mut s) = self.state.lock() {
            *s = State {
                step: step.name().into(),
                index,
                steps,
                step_start: Instant::now(),
                step_budget_s: budget_s,
            };
        }
        if self.bar.is_hidden() {
            eprintln!(
                "tune: step {}/{steps} {} (share ~{})",
                index + 1,
                step.name(),
                fmt_s(budget_s)
            );
        }
    }

    pub fn finish_step(&self, step: Step, seconds: f64) {
        let line = format!("tune: {} done in {}", step.name(), fmt_s(seconds));
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }

    pub fn finish(&self, seconds: f64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.bar.finish_and_clear();
        eprintln!(
            "tune: finished in {} of a {} budget",
            fmt_s(seconds),
            fmt_s(self.budget_s)
        );
    }
}

impl Drop for Display {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
