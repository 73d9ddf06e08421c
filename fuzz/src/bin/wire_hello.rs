//! `Hello::decode` (the first 128 bytes a broker reads from any connection), and the
//! round trip decode -> encode -> decode.
use embarcadero_wire::{Hello, HELLO_LEN};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        if let Ok(hello) = Hello::decode(data) {
            let again = Hello::decode(&hello.encode()).expect("an encoded hello decodes");
            assert_eq!(again, hello);
            assert!(data.len() >= HELLO_LEN);
        }
    });
}
