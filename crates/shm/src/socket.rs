//! The handshake of a channel over a Unix-domain socket: where a broker listens, the
//! client's sealed memfd and its hello sent together (SCM_RIGHTS), the peer's uid
//! (SO_PEERCRED), and the broker's checks of the memfd before it maps it. For a
//! subscriber's feed also the broker's memfd sent back with HelloOk, and the
//! subscriber's checks of it (`create_feed`, `map_feed`, `create_cursor_page`,
//! `map_cursor_page`).
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
    send_with_fd(sock, hello, fd)
}

/// Sends `bytes` with `fd` attached to their first byte.
pub fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: &OwnedFd) -> io::Result<()> {
    let hello = bytes;
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let iov = [IoSlice::new(hello)];
    let sent = retry_interrupted(|| {
        sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
    })?;
    if sent < hello.len() {
        // The fd went with the first bytes; the rest follows as plain data.
        let mut rest = sock;
        io::Write::write_all(&mut rest, &hello[sent..])?;
    }
    Ok(())
}

/// Runs `call` again for as long as a signal handler interrupts it (EINTR), as std's
/// own socket calls do.
fn retry_interrupted<T>(mut call: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    loop {
        match call() {
            Err(nix::errno::Errno::EINTR) => continue,
            other => return other,
        }
    }
}

/// Receives a hello of `hello.len()` bytes and the one fd sent with it, within
/// `timeout`. More fds than one, or none, is an error (extra ones are closed).
pub fn recv_hello(sock: &UnixStream, hello: &mut [u8], timeout: Duration) -> io::Result<OwnedFd> {
    recv_with_fd(sock, hello, timeout)?.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "the hello must carry exactly one memfd, it carried 0",
        )
    })
}

/// Receives exactly `buf.len()` bytes within `timeout`, and the fd sent with their
/// first byte if any; more than one fd is an error (all are closed).
pub fn recv_with_fd(
    sock: &UnixStream,
    hello: &mut [u8],
    timeout: Duration,
) -> io::Result<Option<OwnedFd>> {
    sock.set_read_timeout(Some(timeout))?;
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let mut iov = [IoSliceMut::new(hello)];
    // A socket with a receive timeout is never restarted after a signal handler ran
    // (signal(7)), SA_RESTART or not: an interrupted wait is waited again.
    let msg = loop {
        match recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other?,
        }
    };
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
    if fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the hello must carry exactly one memfd, it carried {}",
                fds.len()
            ),
        ));
    }
    Ok(fds.pop())
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
    // Both ends write the channel: a memfd sealed against writing cannot be mapped
    // writable (EPERM, which said nothing of why).
    if seals.intersects(SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_FUTURE_WRITE) {
        return Err("the channel memfd is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE); both ends write a channel, so seal it only against shrinking and growing".into());
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

/// A memfd of `len` bytes, sealed against shrinking and growing, mapped writable.
fn sealed_memfd(name: &str, len: usize) -> io::Result<(OwnedFd, Mapping)> {
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)?;
    nix::unistd::ftruncate(&fd, len as i64)?;
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
    )?;
    let map = Mapping::map(&fd, len)?;
    Ok((fd, map))
}

/// Checks that `fd` is a memfd carrying at least `required` seals and exactly `len`
/// bytes long (`what` names it in the error).
fn check_sealed(fd: &OwnedFd, required: SealFlag, len: usize, what: &str) -> Result<(), String> {
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("the {what} fd is not a sealable memfd ({e})"))?;
    let seals = SealFlag::from_bits_truncate(seals);
    if !seals.contains(required) {
        return Err(format!(
            "the {what} memfd carries seals {seals:?}; it must carry {required:?}"
        ));
    }
    let size = nix::sys::stat::fstat(fd.as_fd())
        .map_err(|e| format!("fstat of the {what} memfd: {e}"))?
        .st_size as u64;
    if size != len as u64 {
        return Err(format!(
            "the {what} memfd is {size} bytes; it must be {len}"
        ));
    }
    Ok(())
}

/// The subscriber's cursor page: its ring consumer line, which the broker maps
/// read-only ([`map_cursor_page`]).
pub fn create_cursor_page() -> io::Result<(OwnedFd, Mapping)> {
    let (fd, map) = sealed_memfd("embarcadero-cursor", layout::CURSOR_PAGE_BYTES)?;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SEAL))?;
    map.u64_at(0).store(layout::CURSOR_MAGIC, Ordering::Release);
    Ok((fd, map))
}

/// The broker's checks of a subscriber's cursor page, and its read-only mapping.
pub fn map_cursor_page(fd: &OwnedFd) -> Result<Mapping, String> {
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
    check_sealed(fd, seals, layout::CURSOR_PAGE_BYTES, "cursor page")?;
    let map = Mapping::map_read_only(fd, layout::CURSOR_PAGE_BYTES).map_err(|e| e.to_string())?;
    let magic = map.u64_at(0).load(Ordering::Acquire);
    if magic != layout::CURSOR_MAGIC {
        return Err(format!("the cursor page has magic {magic:#x}"));
    }
    Ok(map)
}

/// The broker's feed for one subscriber, a ring of `capacity` bytes: mapped writable
/// here, then sealed so that no one can map it writable again (`F_SEAL_FUTURE_WRITE`:
/// the subscriber it is handed to can only read it).
pub fn create_feed(capacity: usize) -> io::Result<(OwnedFd, Mapping)> {
    check_data_capacity(capacity as u64)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let (fd, map) = sealed_memfd("embarcadero-feed", layout::feed_len(capacity))?;
    map.u64_at(layout::D_DATA_CAPACITY)
        .store(capacity as u64, Ordering::Relaxed);
    map.u32_at(layout::D_VERSION)
        .store(layout::VERSION, Ordering::Relaxed);
    map.u64_at(layout::D_MAGIC)
        .store(layout::FEED_MAGIC, Ordering::Release);
    let seals = SealFlag::F_SEAL_FUTURE_WRITE | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))?;
    Ok((fd, map))
}

/// The subscriber's checks of a feed and its read-only mapping, with the ring's
/// capacity: a memfd sealed against shrinking, growing and writable mappings, of the
/// length its descriptor implies, the descriptor copied out once.
pub fn map_feed(fd: &OwnedFd) -> Result<(Mapping, usize), String> {
    let size = nix::sys::stat::fstat(fd.as_fd())
        .map_err(|e| format!("fstat of the feed memfd: {e}"))?
        .st_size as u64;
    if size < layout::HEADER_BYTES as u64 {
        return Err(format!(
            "the feed memfd is {size} bytes, less than its header"
        ));
    }
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_FUTURE_WRITE;
    check_sealed(fd, seals, size as usize, "feed")?;
    let head = Mapping::map_read_only(fd, layout::HEADER_BYTES).map_err(|e| e.to_string())?;
    let magic = head.u64_at(layout::D_MAGIC).load(Ordering::Acquire);
    let version = head.u32_at(layout::D_VERSION).load(Ordering::Relaxed);
    let capacity = head.u64_at(layout::D_DATA_CAPACITY).load(Ordering::Relaxed);
    drop(head);
    if magic != layout::FEED_MAGIC || version != layout::VERSION {
        return Err(format!(
            "the feed has magic {magic:#x} version {version}; this client reads version {}",
            layout::VERSION
        ));
    }
    let capacity = check_data_capacity(capacity)?;
    if size != layout::feed_len(capacity) as u64 {
        return Err(format!(
            "the feed memfd is {size} bytes; its ring needs {}",
            layout::feed_len(capacity)
        ));
    }
    let map = Mapping::map_read_only(fd, size as usize).map_err(|e| e.to_string())?;
    Ok((map, capacity))
}
