//! Where `pub`'s messages come from (generated, or one per line of stdin), numbered
//! from 0, with the unacknowledged ones kept so that a publisher made after the server
//! came back can send them again.
//!
//! Owns the stdin reader and the copies of lines not yet acknowledged; it never talks
//! to a server.

use std::collections::VecDeque;
use std::io::BufRead;

pub enum Source {
    /// `--count N --size S`: the same payload N times.
    Generated {
        payload: Vec<u8>,
        count: u64,
        /// The next message number to hand out.
        next: u64,
    },
    /// One message per line of stdin, without its line ending.
    Lines {
        input: Box<dyn BufRead>,
        /// Lines handed out and not known to be acknowledged, oldest first; the front
        /// is message number `kept_from`.
        kept: VecDeque<Vec<u8>>,
        kept_from: u64,
        /// Index in `kept` of the next line to hand out again (after a rewind);
        /// `kept.len()` when new lines come from `input`.
        replay: usize,
    },
}

impl Source {
    pub fn generated(size: usize, count: u64) -> Self {
        let payload = (0..size).map(|i| b'a' + (i % 26) as u8).collect();
        Source::Generated {
            payload,
            count,
            next: 0,
        }
    }

    pub fn lines(input: Box<dyn BufRead>) -> Self {
        Source::Lines {
            input,
            kept: VecDeque::new(),
            kept_from: 0,
            replay: 0,
        }
    }

    /// Whether the messages are stdin's lines (failures then name a line to resume at).
    pub fn is_lines(&self) -> bool {
        matches!(self, Source::Lines { .. })
    }

    /// The number of the next message `next` hands out.
    pub fn position(&self) -> u64 {
        match self {
            Source::Generated { next, .. } => *next,
            Source::Lines {
                kept_from, replay, ..
            } => kept_from + *replay as u64,
        }
    }

    /// The next message, `None` at the end; an error names the line that failed.
    pub fn next(&mut self) -> Result<Option<&[u8]>, String> {
        match self {
            Source::Generated {
                payload,
                count,
                next,
            } => {
                if *next >= *count {
                    return Ok(None);
                }
                *next += 1;
                Ok(Some(payload))
            }
            Source::Lines {
                input,
                kept,
                kept_from,
                replay,
            } => {
                if *replay == kept.len() && !read_line(input.as_mut(), kept, *kept_from)? {
                    return Ok(None);
                }
                *replay += 1;
                Ok(Some(&kept[*replay - 1]))
            }
        }
    }

    /// Forgets the copies of messages below `acked` (they are acknowledged).
    pub fn acknowledged(&mut self, acked: u64) {
        if let Source::Lines {
            kept,
            kept_from,
            replay,
            ..
        } = self
        {
            while *kept_from < acked && *replay > 0 {
                kept.pop_front();
                *kept_from += 1;
                *replay -= 1;
            }
        }
    }

    /// Hands out again every message from `acked` on (the first not acknowledged).
    pub fn rewind(&mut self, acked: u64) {
        assert!(
            acked <= self.position(),
            "acknowledged more than was handed out"
        );
        self.acknowledged(acked);
        match self {
            Source::Generated { next, .. } => *next = acked,
            Source::Lines {
                kept_from, replay, ..
            } => {
                assert_eq!(*kept_from, acked, "every unacknowledged line is kept");
                *replay = 0;
            }
        }
    }
}

/// Reads one line into `kept`; false at the end of the input.
fn read_line(
    input: &mut dyn BufRead,
    kept: &mut VecDeque<Vec<u8>>,
    from: u64,
) -> Result<bool, String> {
    let line_number = from + kept.len() as u64 + 1;
    let mut line = Vec::new();
    let read = input
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("cannot read line {line_number} of stdin: {e}"))?;
    if read == 0 {
        return Ok(false);
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    kept.push_back(line);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Source) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(m) = s.next().unwrap() {
            out.push(String::from_utf8(m.to_vec()).unwrap());
        }
        out
    }

    #[test]
    fn lines_not_acknowledged_are_handed_out_again_after_a_rewind() {
        let mut s = Source::lines(Box::new(&b"a\nb\r\nc\nd"[..]));
        assert_eq!(s.next().unwrap(), Some(&b"a"[..]));
        assert_eq!(s.next().unwrap(), Some(&b"b"[..]));
        assert_eq!(s.next().unwrap(), Some(&b"c"[..]));
        s.acknowledged(1);
        s.rewind(1);
        assert_eq!(s.position(), 1);
        assert_eq!(drain(&mut s), ["b", "c", "d"]);
        assert_eq!(s.position(), 4);
        s.acknowledged(4);
        assert!(matches!(&s, Source::Lines { kept, .. } if kept.is_empty()));
    }

    #[test]
    fn generated_messages_restart_at_the_first_unacknowledged() {
        let mut s = Source::generated(3, 5);
        assert_eq!(drain(&mut s).len(), 5);
        s.rewind(2);
        assert_eq!(drain(&mut s), ["abc", "abc", "abc"]);
    }

    #[test]
    #[should_panic(expected = "acknowledged more than was handed out")]
    fn acknowledging_what_was_never_sent_is_a_bug() {
        let mut s = Source::generated(3, 5);
        s.next().unwrap();
        s.rewind(2);
    }
}
