//! Connection set-up and frame reading shared by publishers and subscribers.

use crate::{Error, Result};
use embarcadero_wire::{
    BatchOk, ErrorFrame, FrameHeader, FrameKind, Hello, HelloOk, FRAME_HEADER_LEN,
    MAX_ERROR_TEXT_LEN,
};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a handshake ended: accepted, or refused with the broker's error frame (whose
/// fields, such as a fenced session's high-water mark, the caller may need).
pub enum Handshake {
    Accepted(TcpStream, HelloOk),
    Refused(ErrorFrame),
}

/// Connects, tunes the socket and completes the handshake; a refusal is an error.
pub fn open(addr: &str, hello: &Hello, extra: &[u8]) -> Result<(TcpStream, HelloOk)> {
    match handshake(addr, hello, extra)? {
        Handshake::Accepted(stream, ok) => Ok((stream, ok)),
        Handshake::Refused(e) => Err(broker_error(addr, e)),
    }
}

/// Connects, tunes the socket and sends the hello; returns the broker's answer.
pub fn handshake(addr: &str, hello: &Hello, extra: &[u8]) -> Result<Handshake> {
    embarcadero_wire::validate_topic_name(&hello.topic)
        .map_err(|e| Error::Config(e.to_string()))?;
    let connect_err = |message: String| Error::Connect {
        what: "broker",
        addr: addr.to_string(),
        message,
    };
    let sock_addr = addr
        .to_socket_addrs()
        .map_err(|e| connect_err(e.to_string()))?
        .next()
        .ok_or_else(|| connect_err("address resolves to nothing".into()))?;
    let mut stream = TcpStream::connect_timeout(&sock_addr, CONNECT_TIMEOUT)
        .map_err(|e| connect_err(e.to_string()))?;
    let sock = socket2::SockRef::from(&stream);
    let _ = sock.set_nodelay(true);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let mut first = hello.encode().to_vec();
    first.extend_from_slice(extra);
    stream
        .write_all(&first)
        .map_err(|e| connect_err(e.to_string()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| connect_err(e.to_string()))?;
    let frame = read_frame(&mut stream, addr, 1024)?;
    stream
        .set_read_timeout(None)
        .map_err(|e| connect_err(e.to_string()))?;
    match frame {
        Frame::HelloOk(ok) => Ok(Handshake::Accepted(stream, ok)),
        Frame::Error(e) => Ok(Handshake::Refused(e)),
        other => Err(Error::Protocol {
            peer: addr.to_string(),
            message: format!("expected HelloOk, got {other:?}"),
        }),
    }
}

pub fn broker_error(addr: &str, e: ErrorFrame) -> Error {
    Error::Broker {
        broker: addr.to_string(),
        code: e.code,
        message: e.message,
    }
}

/// A control frame (deliveries are read by the subscriber itself).
#[derive(Debug)]
pub enum Frame {
    HelloOk(HelloOk),
    Ack {
        count: u64,
    },
    Error(ErrorFrame),
    BatchOk {
        count: u64,
        discard_rest: bool,
    },
    /// Header of a delivery whose body (`body_len` bytes) is still in the socket.
    Delivery(FrameHeader),
}

/// Reads one frame; bodies other than deliveries are limited to `max_body` bytes.
pub fn read_frame(stream: &mut TcpStream, peer: &str, max_body: u32) -> Result<Frame> {
    let lost = |e: std::io::Error| Error::ConnectionLost {
        broker: peer.to_string(),
        message: e.to_string(),
    };
    let mut raw = [0u8; FRAME_HEADER_LEN];
    stream.read_exact(&mut raw).map_err(lost)?;
    let header = FrameHeader::decode(&raw, u32::MAX).map_err(|e| Error::Protocol {
        peer: peer.to_string(),
        message: e.to_string(),
    })?;
    if header.kind == FrameKind::Delivery {
        return Ok(Frame::Delivery(header));
    }
    let limit = max_body.max(8 + MAX_ERROR_TEXT_LEN as u32);
    if header.body_len > limit {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            message: format!("{:?} frame body of {} bytes", header.kind, header.body_len),
        });
    }
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body).map_err(lost)?;
    let protocol = |e: embarcadero_wire::WireError| Error::Protocol {
        peer: peer.to_string(),
        message: e.to_string(),
    };
    Ok(match header.kind {
        FrameKind::HelloOk => Frame::HelloOk(HelloOk::decode(&body).map_err(protocol)?),
        FrameKind::Ack => Frame::Ack { count: header.arg },
        FrameKind::Error => Frame::Error(ErrorFrame::decode(&header, &body).map_err(protocol)?),
        FrameKind::BatchOk => Frame::BatchOk {
            count: header.arg,
            discard_rest: header.flags & BatchOk::DISCARD_REST != 0,
        },
        FrameKind::Delivery => unreachable!("returned above"),
    })
}
