//! Broker-to-client frames as a client decodes them: `FrameHeader`, then by kind the
//! `HelloOk`, `ErrorFrame` or `DeliveryHeader` body (and the delivery's messages), each
//! with the round trip decode -> encode -> decode.
use embarcadero_wire::{
    DeliveryHeader, ErrorFrame, FrameHeader, FrameKind, HelloOk, MessageIter, FRAME_HEADER_LEN,
    MAX_ERROR_TEXT_LEN,
};

fn main() {
    afl::fuzz!(|data: &[u8]| {
        // A subscriber bounds nothing (u32::MAX); try a tight bound too.
        let _ = FrameHeader::decode(data, (MAX_ERROR_TEXT_LEN + 8) as u32);
        let Ok(header) = FrameHeader::decode(data, u32::MAX) else {
            return;
        };
        assert_eq!(
            FrameHeader::decode(&header.encode(), u32::MAX).unwrap(),
            header
        );
        let body = &data[FRAME_HEADER_LEN..];
        let body = &body[..body.len().min(header.body_len as usize)];
        match header.kind {
            FrameKind::HelloOk => {
                if let Ok(ok) = HelloOk::decode(body) {
                    assert_eq!(HelloOk::decode(&ok.encode()).unwrap(), ok);
                }
            }
            FrameKind::Error => {
                if let Ok(e) = ErrorFrame::decode(&header, body) {
                    let bytes = e.encode();
                    let h2 = FrameHeader::decode(&bytes, u32::MAX).unwrap();
                    assert_eq!(h2.body_len as usize, bytes.len() - FRAME_HEADER_LEN);
                    let e2 = ErrorFrame::decode(&h2, &bytes[FRAME_HEADER_LEN..]).unwrap();
                    assert_eq!(e2, e);
                }
            }
            FrameKind::Delivery => {
                if let Ok(d) = DeliveryHeader::decode(body) {
                    assert_eq!(DeliveryHeader::decode(&d.encode()).unwrap(), d);
                    let payload = &body[64..];
                    let payload = &payload[..payload.len().min(d.payload_len as usize)];
                    let mut n = 0u32;
                    for m in MessageIter::new(payload, d.num_msg) {
                        let Ok(m) = m else { break };
                        assert_eq!(m.payload.len(), m.header.size as usize);
                        n += 1;
                    }
                    assert!(n <= d.num_msg);
                }
            }
            FrameKind::Ack | FrameKind::BatchOk => {}
        }
    });
}
