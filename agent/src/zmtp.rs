//! The client side of ZMTP 3.0 over TCP, as far as the agent needs it: a
//! SUB or DEALER socket connecting to one peer, NULL security, message
//! frames read under a size and count limit. Not a ZMQ implementation: no
//! binding, no other transports, no CURVE, no ZMTP 3.1 commands beyond
//! PING (answered) and ERROR (fatal).
//!
//! Why it is written here rather than taken from a crate: the `zeromq`
//! crate (0.7, the pure-Rust implementation the agent used before) has no
//! maximum message size. Its decoder reserves the length a frame header
//! announces and gathers every frame of a multipart message before the
//! socket hands it over, so a peer that announces 600 MiB, or sends three
//! million empty frames, is buffered whole before anyone can refuse it
//! (820 MB and 157 MB resident, measured). The limit has to act where the
//! header is read, before the body, and nothing in that crate's API reaches
//! there. ZMTP's framing is small and fixed (RFC 23: a 64-byte greeting, a
//! READY command each way, then frames of a flags byte and a 1- or 8-byte
//! length), so the reader below is the whole protocol the agent speaks;
//! it is checked against libzmq by the pyzmq test in CI.
//!
//! The rules for what a peer sends:
//! 1. A message frame is read only if the message it belongs to stays
//!    within [`Limits::max_message_bytes`] and [`Limits::max_frames`];
//!    otherwise every remaining frame of that message is read past and
//!    dropped as it arrives (never held), and the message comes out as
//!    [`Received::Refused`]. The connection stays in step.
//! 2. A body's buffer grows as its bytes arrive, so an announced length
//!    costs nothing before the bytes do.
//! 3. Commands are at most [`MAX_COMMAND_BYTES`]; a larger one, a greeting
//!    or handshake that is not ZMTP 3 with NULL security, reserved flag
//!    bits, or an ERROR command end the connection (the caller reconnects).
//!
//! Nothing is cancel-safe: a `recv` dropped half-way leaves the connection
//! out of step, so drop the connection with it.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The largest command accepted (READY with its properties, PING).
pub const MAX_COMMAND_BYTES: u64 = 64 << 10;

/// How long connecting and the handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const MORE: u8 = 0b001;
const LONG: u8 = 0b010;
const COMMAND: u8 = 0b100;

/// What a message may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes, over all its frames.
    pub max_message_bytes: usize,
    /// The most frames.
    pub max_frames: usize,
}

/// The socket type announced, which decides the peers accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to a PUB (or XPUB).
    Sub,
    /// Talks to a ROUTER (or DEALER).
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => matches!(peer, b"PUB" | b"XPUB"),
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER"),
        }
    }
}

/// A message, or what was refused of one.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    /// Every frame, within the limits.
    Message(Vec<Bytes>),
    /// Over a limit: read past, not kept.
    Refused(Refusal),
}

/// Why a message was refused, and its size as read past.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The limit exceeded.
    pub over: Over,
    /// The frames the message had.
    pub frames: u64,
    /// The bytes its frames announced.
    pub bytes: u64,
}

/// Which limit a message exceeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Over {
    /// [`Limits::max_message_bytes`].
    Bytes,
    /// [`Limits::max_frames`].
    Frames,
}

/// Why a connection failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The endpoint is not `tcp://host:port`.
    #[error("{0:?} is not a tcp://host:port endpoint")]
    Endpoint(String),
    /// The socket failed, or the peer closed it.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("ZMTP: {0}")]
    Protocol(String),
    /// The handshake took longer than [`HANDSHAKE_TIMEOUT`].
    #[error("no ZMTP handshake within {HANDSHAKE_TIMEOUT:?}")]
    Timeout,
}

fn protocol(what: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(what.into())
}

/// One connection to one peer.
#[derive(Debug)]
pub struct Connection {
    stream: BufReader<TcpStream>,
    limits: Limits,
}

/// Connects to `endpoint` (`tcp://host:port`) as `socket`, and for a SUB
/// subscribes to `topic`.
pub async fn connect(
    endpoint: &str,
    socket: SocketType,
    topic: &[u8],
    limits: Limits,
) -> Result<Connection, ZmtpError> {
    let addr = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| ZmtpError::Endpoint(endpoint.to_owned()))?;
    let handshake = async {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let mut c = Connection {
            stream: BufReader::with_capacity(64 << 10, tcp),
            limits,
        };
        c.handshake(socket).await?;
        if socket == SocketType::Sub {
            // ZMTP 3.0's subscription: a message whose first byte is 1.
            let mut subscribe = Vec::with_capacity(1 + topic.len());
            subscribe.push(1);
            subscribe.extend_from_slice(topic);
            c.send(&[&subscribe]).await?;
        }
        Ok(c)
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| ZmtpError::Timeout)?
}

impl Connection {
    async fn handshake(&mut self, socket: SocketType) -> Result<(), ZmtpError> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        self.stream.write_all(&greeting).await?;
        let mut theirs = [0u8; 64];
        self.stream.read_exact(&mut theirs).await?;
        if theirs[0] != 0xff || theirs[9] & 1 != 1 || theirs[10] < 3 {
            return Err(protocol("the peer does not speak ZMTP 3"));
        }
        if theirs[12..32].split(|&b| b == 0).next() != Some(b"NULL") {
            return Err(protocol(
                "the peer asks for a security mechanism other than NULL",
            ));
        }
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(socket.name().len() as u32).to_be_bytes());
        ready.extend_from_slice(socket.name());
        self.write_frame(COMMAND, &ready).await?;
        self.stream.flush().await?;
        let (flags, len) = self.header().await?;
        if flags & COMMAND == 0 {
            return Err(protocol("a message before the peer's READY"));
        }
        let body = self.command(len).await?;
        let (name, mut properties) = split_command(&body)?;
        match name {
            b"READY" => {}
            b"ERROR" => {
                return Err(protocol(format!(
                    "the peer refused: {}",
                    error_reason(properties)
                )));
            }
            _ => return Err(protocol("the peer's first command is not READY")),
        }
        while !properties.is_empty() {
            let (key, value, rest) = split_property(properties)?;
            if key.eq_ignore_ascii_case(b"Socket-Type") && !socket.accepts(value) {
                return Err(protocol(format!(
                    "a {} socket cannot talk to a {}",
                    String::from_utf8_lossy(socket.name()),
                    String::from_utf8_lossy(value)
                )));
            }
            properties = rest;
        }
        Ok(())
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, frame) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(more, frame).await?;
        }
        self.stream.flush().await?;
        Ok(())
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        let w = self.stream.get_mut();
        match u8::try_from(body.len()) {
            Ok(short) => w.write_all(&[flags, short]).await?,
            Err(_) => {
                w.write_all(&[flags | LONG]).await?;
                w.write_all(&(body.len() as u64).to_be_bytes()).await?;
            }
        }
        w.write_all(body).await?;
        Ok(())
    }

    async fn header(&mut self) -> Result<(u8, u64), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(protocol(format!("reserved flag bits in {flags:#04x}")));
        }
        let len = if flags & LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        Ok((flags, len))
    }

    /// Reads `len` bytes into a buffer that grows as they arrive.
    async fn body(&mut self, len: u64) -> Result<Bytes, ZmtpError> {
        let mut buf = BytesMut::new();
        let mut left = len;
        while left > 0 {
            buf.reserve(left.min(1 << 20) as usize);
            let n = (&mut self.stream).take(left).read_buf(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            left -= n as u64;
        }
        Ok(buf.freeze())
    }

    /// Reads past `len` bytes, keeping none.
    async fn skip(&mut self, len: u64) -> Result<(), ZmtpError> {
        let mut left = len;
        while left > 0 {
            let available = self.stream.fill_buf().await?.len();
            if available == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            let n = available.min(usize::try_from(left).unwrap_or(usize::MAX));
            self.stream.consume(n);
            left -= n as u64;
        }
        Ok(())
    }

    async fn command(&mut self, len: u64) -> Result<Bytes, ZmtpError> {
        if len > MAX_COMMAND_BYTES {
            return Err(protocol(format!("a command of {len} bytes")));
        }
        self.body(len).await
    }

    /// The next message, or what was refused of it (see the module docs).
    pub async fn recv(&mut self) -> Result<Received, ZmtpError> {
        let mut frames = Vec::new();
        let mut bytes = 0u64;
        let mut count = 0u64;
        let mut over = None;
        loop {
            let (flags, len) = self.header().await?;
            if flags & COMMAND != 0 {
                let body = self.command(len).await?;
                let (name, context) = split_command(&body)?;
                match name {
                    b"PING" => {
                        // PING: TTL (2 bytes), then the context PONG echoes.
                        let context = context.get(2..).unwrap_or_default();
                        let mut pong = vec![4];
                        pong.extend_from_slice(b"PONG");
                        pong.extend_from_slice(context);
                        self.write_frame(COMMAND, &pong).await?;
                        self.stream.flush().await?;
                    }
                    b"ERROR" => {
                        return Err(protocol(format!(
                            "the peer failed: {}",
                            error_reason(context)
                        )));
                    }
                    _ => {}
                }
                continue;
            }
            count += 1;
            bytes = bytes.saturating_add(len);
            if over.is_none() {
                if count > self.limits.max_frames as u64 {
                    over = Some(Over::Frames);
                } else if bytes > self.limits.max_message_bytes as u64 {
                    over = Some(Over::Bytes);
                }
                if over.is_some() {
                    frames = Vec::new();
                }
            }
            if over.is_some() {
                self.skip(len).await?;
            } else {
                frames.push(self.body(len).await?);
            }
            if flags & MORE == 0 {
                return Ok(match over {
                    None => Received::Message(frames),
                    Some(over) => Received::Refused(Refusal {
                        over,
                        frames: count,
                        bytes,
                    }),
                });
            }
        }
    }
}

/// A command's name and the rest of its body.
fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let (&n, rest) = body
        .split_first()
        .ok_or_else(|| protocol("an empty command"))?;
    if rest.len() < usize::from(n) {
        return Err(protocol("a command name longer than its frame"));
    }
    Ok(rest.split_at(usize::from(n)))
}

/// One READY property's name and value, and the bytes after it.
type Property<'a> = (&'a [u8], &'a [u8], &'a [u8]);

/// One READY property: name, value, the rest.
fn split_property(p: &[u8]) -> Result<Property<'_>, ZmtpError> {
    let bad = || protocol("a READY property longer than its command");
    let (&n, rest) = p.split_first().ok_or_else(bad)?;
    let (key, rest) = rest.split_at_checked(usize::from(n)).ok_or_else(bad)?;
    let (len, rest) = rest.split_at_checked(4).ok_or_else(bad)?;
    let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
    let (value, rest) = rest.split_at_checked(len).ok_or_else(bad)?;
    Ok((key, value, rest))
}

fn error_reason(body: &[u8]) -> String {
    let reason = body
        .split_first()
        .and_then(|(&n, rest)| rest.get(..usize::from(n)))
        .unwrap_or_default();
    String::from_utf8_lossy(reason).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_and_properties_are_read_within_their_frame() {
        let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
        let (name, props) = split_command(ready).unwrap();
        assert_eq!(name, b"READY");
        let (k, v, rest) = split_property(props).unwrap();
        assert_eq!((k, v, rest), (&b"Socket-Type"[..], &b"PUB"[..], &b""[..]));
        assert!(split_command(b"\x09READY").is_err());
        assert!(split_property(b"\x0bSocket-Type\xff\xff\xff\xffPUB").is_err());
        assert!(split_property(b"\x0bSocket").is_err());
        assert_eq!(error_reason(b"\x03bad"), "bad");
        assert_eq!(error_reason(b"\xffbad"), "");
        assert!(SocketType::Sub.accepts(b"PUB") && !SocketType::Sub.accepts(b"ROUTER"));
    }
}
