//! A blocking data-plane connection that can send anything: hand-built frames and requests, to
//! send what a correct client never would, and read the answers byte by byte.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use kvtier_proto::dataplane::{
    Hello, ItemStatus, Op, RequestHeader, ResponseHeader, Status, PROTOCOL_VERSION, RESPONSE_HEADER_LEN,
};
use kvtier_proto::{FrameHeader, NamespaceId};

/// A data-plane connection past its hello. `.0` is the socket itself, for raw bytes.
pub struct Raw(pub TcpStream);

impl Raw {
    /// A connection to the data plane at `addr` (no token).
    pub fn open(addr: SocketAddr) -> Raw {
        Raw::open_version(addr, PROTOCOL_VERSION).unwrap()
    }

    /// A connection whose hello says `version`; the refusal's status and message if it is refused.
    pub fn open_version(addr: SocketAddr, version: u16) -> Result<Raw, (u8, String)> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&Hello::encode(version, b"")).unwrap();
        let mut r = [0u8; 4];
        s.read_exact(&mut r).unwrap();
        let mut msg = vec![0u8; u16::from_le_bytes([r[2], r[3]]) as usize];
        s.read_exact(&mut msg).unwrap();
        let msg = String::from_utf8_lossy(&msg).into_owned();
        if r[0] != Status::Ok as u8 {
            return Err((r[0], msg));
        }
        Ok(Raw(s))
    }

    /// Sends a request header of `op` for `count` items (no namespace: the ops that name theirs
    /// per item, or a test that wants none).
    pub fn request(&mut self, op: Op, flags: u16, count: u32) {
        let h = RequestHeader { op, flags, request_id: 9, count, namespace: NamespaceId([0; 16]) };
        self.0.write_all(&h.encode()).unwrap();
    }

    pub fn put_header(&mut self, count: u32) {
        self.put_header_flags(count, 0);
    }

    pub fn put_header_flags(&mut self, count: u32, flags: u16) {
        self.request(Op::Put, flags, count);
    }

    pub fn send_frame(&mut self, header: &FrameHeader, payload: &[u8]) {
        self.0.write_all(&header.encode()).unwrap();
        self.0.write_all(payload).unwrap();
    }

    /// Reads a response header; on a request-level error returns its status and message.
    pub fn response(&mut self) -> Result<ResponseHeader, (Status, String)> {
        let mut rh = [0u8; RESPONSE_HEADER_LEN];
        self.0.read_exact(&mut rh).unwrap();
        let h = ResponseHeader::decode(&rh).unwrap();
        if h.status != Status::Ok {
            let mut msg = vec![0u8; h.msg_len as usize];
            self.0.read_exact(&mut msg).unwrap();
            return Err((h.status, String::from_utf8_lossy(&msg).into_owned()));
        }
        Ok(h)
    }

    /// Reads `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }

    pub fn statuses(&mut self, n: usize) -> Vec<ItemStatus> {
        self.bytes(n).into_iter().map(|s| ItemStatus::from_u8(s).unwrap()).collect()
    }

    /// True once the server has closed the connection.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}
