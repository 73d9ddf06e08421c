//! Fitting a start position to its topic's order, before it is sent: orders 2 and 5
//! count one global position, orders 0 and 1 one position per broker. Every front end
//! (the CLI's `--from`, the SDKs' `start` / `from`, their `seek`) asks here, so that a
//! position of the wrong form gets the same explanation everywhere, in the front end's
//! own syntax, instead of the broker's refusal after a connection.
//!
//! Owns: [`CursorMismatch`] and [`Subscriber::fit`]. Touches: nothing but the
//! subscriber's order and broker count, as the broker reported them.

use crate::{Cursor, Subscriber};

/// Why a position does not fit its topic (see [`Subscriber::fit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CursorMismatch {
    /// One global position for a topic of order 0 or 1 (more than one broker, and not
    /// 0, which means the beginning of every broker's log); `example` has one per broker.
    NeedsPerBroker { order: u8, example: Vec<u64> },
    /// Per-broker positions for a topic of order 2 or 5; `example` is a global one.
    NeedsGlobal { order: u8, example: u64 },
    /// Per-broker positions, but not one for each of the topic's `brokers`.
    WrongCount { given: usize, brokers: usize },
}

impl CursorMismatch {
    /// What to tell the user about `topic`, whose start option is called `option` and
    /// whose positions `example` writes in the front end's syntax (`--from 0,0` or
    /// `start=[0, 0]`).
    pub fn explain(
        &self,
        topic: &str,
        option: &str,
        example: impl Fn(&Cursor) -> String,
    ) -> String {
        match self {
            Self::NeedsPerBroker { order, example: e } => format!(
                "topic {topic} has order {order}: positions are per broker; give one position \
                 per broker, e.g. {}",
                example(&Cursor::PerBroker(e.clone()))
            ),
            Self::NeedsGlobal { order, example: e } => format!(
                "topic {topic} has order {order}: positions are global; give one position, \
                 e.g. {}",
                example(&Cursor::Global(*e))
            ),
            Self::WrongCount { given, brokers } => format!(
                "{option} gives {given} positions; topic {topic} has {brokers} brokers: give \
                 one position per broker, e.g. {}",
                example(&Cursor::PerBroker(vec![0; *brokers]))
            ),
        }
    }
}

impl Subscriber {
    /// `cursor` in the form this subscriber's topic needs, or why it cannot be. A single
    /// 0 on a topic of order 0 or 1 means the start of every broker's log, and a single
    /// position on a one-broker server is that broker's; nothing else is converted.
    pub fn fit(&self, cursor: Cursor) -> Result<Cursor, CursorMismatch> {
        let order = self.order();
        let brokers = match self.position() {
            Cursor::PerBroker(v) => v.len(),
            Cursor::Global(_) => 1,
        };
        fit(cursor, order, brokers)
    }
}

/// [`Subscriber::fit`] for a topic of `order` on `brokers` brokers.
fn fit(cursor: Cursor, order: u8, brokers: usize) -> Result<Cursor, CursorMismatch> {
    let ordered = order >= 2;
    match (cursor, ordered) {
        (Cursor::Global(0), false) => Ok(Cursor::PerBroker(vec![0; brokers])),
        (Cursor::Global(p), false) if brokers == 1 => Ok(Cursor::PerBroker(vec![p])),
        (Cursor::Global(p), false) => Err(CursorMismatch::NeedsPerBroker {
            order,
            example: vec![p; brokers],
        }),
        (Cursor::PerBroker(v), true) => Err(CursorMismatch::NeedsGlobal {
            order,
            example: v.first().copied().unwrap_or(0),
        }),
        (Cursor::PerBroker(v), false) if v.len() != brokers => Err(CursorMismatch::WrongCount {
            given: v.len(),
            brokers,
        }),
        (c, _) => Ok(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(c: &Cursor) -> String {
        match c {
            Cursor::Global(p) => format!("--from {p}"),
            Cursor::PerBroker(v) => {
                let v: Vec<String> = v.iter().map(u64::to_string).collect();
                format!("--from {}", v.join(","))
            }
        }
    }

    #[test]
    fn positions_of_the_right_form_pass_unchanged() {
        assert_eq!(fit(Cursor::Global(7), 2, 4), Ok(Cursor::Global(7)));
        assert_eq!(fit(Cursor::Global(7), 5, 1), Ok(Cursor::Global(7)));
        let per = Cursor::PerBroker(vec![1, 2, 3]);
        assert_eq!(fit(per.clone(), 0, 3), Ok(per.clone()));
        assert_eq!(fit(per.clone(), 1, 3), Ok(per));
    }

    #[test]
    fn zero_and_a_one_broker_position_become_per_broker() {
        assert_eq!(
            fit(Cursor::Global(0), 1, 3),
            Ok(Cursor::PerBroker(vec![0; 3]))
        );
        assert_eq!(fit(Cursor::Global(9), 0, 1), Ok(Cursor::PerBroker(vec![9])));
    }

    #[test]
    fn each_mismatch_says_what_to_give_in_the_callers_syntax() {
        let global = fit(Cursor::PerBroker(vec![4, 5]), 2, 2).unwrap_err();
        assert_eq!(
            global,
            CursorMismatch::NeedsGlobal {
                order: 2,
                example: 4
            }
        );
        assert_eq!(
            global.explain("t", "--from", flag),
            "topic t has order 2: positions are global; give one position, e.g. --from 4"
        );
        let per = fit(Cursor::Global(3), 0, 2).unwrap_err();
        assert_eq!(
            per.explain("t", "--from", flag),
            "topic t has order 0: positions are per broker; give one position per broker, \
             e.g. --from 3,3"
        );
        let count = fit(Cursor::PerBroker(vec![1, 2]), 1, 4).unwrap_err();
        assert_eq!(
            count,
            CursorMismatch::WrongCount {
                given: 2,
                brokers: 4
            }
        );
        assert_eq!(
            count.explain("t", "--from", flag),
            "--from gives 2 positions; topic t has 4 brokers: give one position per broker, \
             e.g. --from 0,0,0,0"
        );
    }
}
