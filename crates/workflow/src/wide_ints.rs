//! Integers wider than 64 bits in JSON text from outside the engine (a task's context, a
//! step resolved by hand, a Python handler's result). `serde_json` reads such an integer
//! as the nearest `f64`, so `2**70` came back as `1.1805916207174113e+21` and a 30-digit
//! id lost its last digits, without a word. The engine refuses them instead and says
//! how to send such a number (as a string). Floats (with `.`, `e` or `E`) are floats
//! and pass; JavaScript's numbers are floats, so the TypeScript SDK does not check.
//!
//! Owns: the scan of JSON text. Touches nothing.

/// The first integer literal in the JSON `text` that fits neither `i64` nor `u64`, if
/// any. Strings are skipped (their escapes included); text that is not JSON is not
/// judged here (the parse after says what is wrong with it).
pub fn first_wide_integer(text: &[u8]) -> Option<&str> {
    let mut i = 0;
    while i < text.len() {
        match text[i] {
            b'"' => i = string_end(text, i + 1),
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < text.len()
                    && matches!(text[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                let token = std::str::from_utf8(&text[start..i]).ok()?;
                if is_wide_integer(token) {
                    return Some(token);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// The index just past the string whose contents start at `i` (past the closing quote,
/// or the end of the text).
fn string_end(text: &[u8], mut i: usize) -> usize {
    while i < text.len() {
        match text[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    text.len()
}

fn is_wide_integer(token: &str) -> bool {
    let integer = !token.contains(['.', 'e', 'E']) && !token.trim_start_matches('-').is_empty();
    integer && token.parse::<i64>().is_err() && token.parse::<u64>().is_err()
}

/// What to tell whoever sent `what` with the integer `token`.
pub fn wide_integer_message(what: &str, token: &str) -> String {
    format!(
        "{what} holds the integer {token}, wider than 64 bits: JSON numbers here are 64-bit \
         integers or floats, and it would be rounded to a float; send it as a string"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_past_64_bits_are_found_and_nothing_else() {
        let wide = br#"{"id": 123456789012345678901234567890, "n": 1}"#;
        assert_eq!(
            first_wide_integer(wide),
            Some("123456789012345678901234567890")
        );
        assert_eq!(
            first_wide_integer(b"[-9223372036854775809]"),
            Some("-9223372036854775809")
        );
        for fits in [
            &br#"{"max": 18446744073709551615, "min": -9223372036854775808}"#[..],
            br#"{"f": 1.1805916207174113e+21, "g": 1e400, "h": -0.5}"#,
            br#"{"s": "123456789012345678901234567890", "e": "a \" 99999999999999999999999"}"#,
            b"not json at all 12",
        ] {
            assert_eq!(
                first_wide_integer(fits),
                None,
                "{}",
                String::from_utf8_lossy(fits)
            );
        }
    }
}
