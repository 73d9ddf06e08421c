//! Identifiers and clocks: random (version 4) UUIDs for tasks and workers, drawn from
//! the operating system's random source, and wall-clock milliseconds for timestamps.

/// A random UUID, formatted as usual (8-4-4-4-12 lowercase hex).
pub fn new_uuid() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    embarcadero_client::now_ns() / 1_000_000
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuids_look_like_uuids_and_differ() {
        let (a, b) = (super::new_uuid(), super::new_uuid());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
    }
}
