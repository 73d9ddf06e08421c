//! The handshake of a channel over a Unix-domain socket: where a broker listens, the
//! client's sealed memfd and its hello sent together (SCM_RIGHTS), the peer's uid
//! (SO_PEERCRED), and the broker's checks of the memfd before it maps it.
//!
//! Owns: the socket names and these system calls. Touches: the sockets and fds given.

use crate::layout::{self, channel_len, check_data_capacity};
use crate::mapping::Mapping;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt::PeerCredentials, ControlMessage, ControlMessageOwned,
    MsgFlags,
};
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The abstract socket name a broker listening on `listen` serves channels on: its port,
/// and its address unless it listens on every address. Abstract names belong to the
/// network namespace, leave no file behind, and are found by clients that reach the
/// broker's TCP port on an address of this host (see [`names_for`]).
pub fn broker_name(listen: SocketAddr) -> String {
    if listen.ip().is_unspecified() {
        format!("embarcadero/broker/*:{}", listen.port())
    } else {
        format!("embarcadero/broker/{}:{}", listen.ip(), listen.port())
    }
}

/// The names a client tries, most specific first, for a broker it reaches at `target`:
/// none when `target` is not an address of this host (binding a socket to it fails).
pub fn names_for(target: SocketAddr) -> Vec<String> {
    let local = target.ip().is_loopback()
        || std::net::UdpSocket::bind(SocketAddr::new(target.ip(), 0)).is_ok();
    if !local {
        return Vec::new();
    }
    let any = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), target.port());
    vec![broker_name(target), broker_name(any)]
}

/// Listens on the abstract name `name`.
pub fn listen(name: &str) -> io::Result<UnixListener> {
    UnixListener::bind_addr(&UnixAddr::from_abstract_name(name)?)
}

/// Connects to the abstract name `name`.
pub fn connect(name: &str) -> io::Result<UnixStream> {
    UnixStream::connect_addr(&UnixAddr::from_abstract_name(name)?)
}

/// The uid of the process at the other end of `sock`, as the kernel recorded it at
/// connect time.
pub fn peer_uid(sock: &UnixStream) -> io::Result<u32> {
    Ok(getsockopt(sock, PeerCredentials)?.uid())
}

/// This process's effective uid.
pub fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Creates the memfd of a channel with a data ring of `data_capacity` bytes, maps it,
/// writes its descriptor and seals its size (a broker maps only a sealed channel: one
/// that could shrink would make its accesses fault).
pub fn create_channel(data_capacity: usize) -> io::Result<(OwnedFd, Mapping)> {
    check_data_capacity(data_capacity as u64)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let fd = memfd_create(
        "embarcadero-shm",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let len = channel_len(data_capacity);
    nix::unistd::ftruncate(&fd, len as i64)?;
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))?;
    let map = Mapping::map(&fd, len)?;
    map.u64_at(layout::D_DATA_CAPACITY)
        .store(data_capacity as u64, Ordering::Relaxed);
    map.u64_at(layout::D_ACK_CAPACITY)
        .store(layout::ACK_CAPACITY as u64, Ordering::Relaxed);
    map.u32_at(layout::D_VERSION)
        .store(layout::VERSION, Ordering::Relaxed);
    map.u64_at(layout::D_MAGIC)
        .store(layout::MAGIC, Ordering::Release);
    Ok((fd, map))
}

/// Sends the hello and the channel's fd in one message.
pub fn send_hello(sock: &UnixStream, hello: &[u8], fd: &OwnedFd) -> io::Result<()> {
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(hello)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent < hello.len() {
        // The fd went with the first bytes; the rest follows as plain data.
        let mut rest = sock;
        io::Write::write_all(&mut rest, &hello[sent..])?;
    }
    Ok(())
}

/// Receives a hello of `hello.len()` bytes and the one fd sent with it, within
/// `timeout`. More fds than one, or none, is an error (extra ones are closed).
pub fn recv_hello(sock: &UnixStream, hello: &mut [u8], timeout: Duration) -> io::Result<OwnedFd> {
    sock.set_read_timeout(Some(timeout))?;
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let mut iov = [IoSliceMut::new(hello)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let got = msg.bytes;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: the kernel just installed these fds in this process for us; each
            // is owned once, here.
            fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
        }
    }
    if got == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut rest = sock;
    rest.read_exact(&mut hello[got..])?;
    sock.set_read_timeout(None)?;
    if fds.len() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the hello must carry exactly one memfd, it carried {}",
                fds.len()
            ),
        ));
    }
    Ok(fds.pop().expect("one"))
}

/// Checks a client's channel fd and maps it: a memfd sealed against shrinking and
/// growing, exactly as long as its descriptor says, with a data ring the broker accepts
/// (at most `max_data_capacity`). Returns the mapping and the data ring's capacity.
pub fn map_client_channel(
    fd: &OwnedFd,
    max_data_capacity: usize,
) -> Result<(Mapping, usize), String> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("the channel fd is not a sealable memfd ({e})"))?;
    let seals = SealFlag::from_bits_truncate(seals);
    if !seals.contains(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW) {
        return Err("the channel memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)".into());
    }
    let size = nix::sys::stat::fstat(fd.as_fd())
        .map_err(|e| format!("fstat of the channel memfd: {e}"))?
        .st_size as u64;
    if size < layout::HEADER_BYTES as u64 {
        return Err(format!(
            "the channel memfd is {size} bytes, less than its header"
        ));
    }
    let head = Mapping::map(fd, layout::HEADER_BYTES).map_err(|e| e.to_string())?;
    // Copied out once: the client may change the descriptor later; only these copies count.
    let magic = head.u64_at(layout::D_MAGIC).load(Ordering::Acquire);
    let version = head.u32_at(layout::D_VERSION).load(Ordering::Relaxed);
    let data = head.u64_at(layout::D_DATA_CAPACITY).load(Ordering::Relaxed);
    let ack = head.u64_at(layout::D_ACK_CAPACITY).load(Ordering::Relaxed);
    drop(head);
    if magic != layout::MAGIC || version != layout::VERSION {
        return Err(format!(
            "the channel has magic {magic:#x} version {version}; this broker maps version {}",
            layout::VERSION
        ));
    }
    let data = check_data_capacity(data)?;
    if data > max_data_capacity {
        return Err(format!(
            "shared-memory ring of {data} bytes is above this broker's {max_data_capacity}"
        ));
    }
    if ack != layout::ACK_CAPACITY as u64 {
        return Err(format!(
            "ack ring of {ack} bytes; the layout has {}",
            layout::ACK_CAPACITY
        ));
    }
    if size != channel_len(data) as u64 {
        return Err(format!(
            "the channel memfd is {size} bytes; its rings need {}",
            channel_len(data)
        ));
    }
    let map = Mapping::map(fd, channel_len(data)).map_err(|e| e.to_string())?;
    Ok((map, data))
}
