//! A minimal raw PostgreSQL protocol 3.0 client for tests that need exact control.
//!
//! Drivers hide the things some tests are about: tokio-postgres draws statement names from a
//! process-wide counter (so two of its connections never collide on a name), and it decides
//! where Syncs go. This client sends exactly the frontend messages a test writes and returns
//! every backend message, decoded into [`Backend`] values that are easy to assert on. Only
//! text-format parameters and results are supported. SCRAM-SHA-256 uses postgres-protocol's
//! implementation; md5, cleartext and trust are handled too.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a single receive may block before the client reports a hang.
const RECV_TIMEOUT: Duration = Duration::from_secs(20);

/// One step (an await on the proxy) of the tests that give it the wire client's whole receive
/// timeout, 20 s, rather than the usual [`super::sql::STEP`].
pub const STEP: Duration = Duration::from_secs(20);

/// One decoded backend message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    Authentication(i32, Vec<u8>),
    ParameterStatus(String, String),
    KeyData {
        pid: i32,
        key: Vec<u8>,
    },
    ReadyForQuery(u8),
    RowDescription(Vec<String>),
    DataRow(Vec<Option<String>>),
    CommandComplete(String),
    EmptyQueryResponse,
    Error {
        code: String,
        message: String,
    },
    Notice {
        code: String,
        message: String,
    },
    ParseComplete,
    BindComplete,
    CloseComplete,
    NoData,
    PortalSuspended,
    ParameterDescription(Vec<u32>),
    Notification {
        pid: i32,
        channel: String,
        payload: String,
    },
    CopyInResponse,
    CopyOutResponse,
    CopyData(Vec<u8>),
    CopyDone,
    NegotiateProtocolVersion,
    Other(u8),
}

impl Backend {
    /// The SQLSTATE of an ErrorResponse.
    pub fn error_code(&self) -> Option<&str> {
        match self {
            Backend::Error { code, .. } => Some(code),
            _ => None,
        }
    }
}

pub struct WireClient {
    stream: TcpStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// ParameterStatus values received so far.
    pub params: HashMap<String, String>,
    /// BackendKeyData (pid, secret key bytes) received at startup.
    pub key: Option<(i32, Vec<u8>)>,
}

impl WireClient {
    /// Connects, authenticates and waits for the first ReadyForQuery.
    pub async fn connect(
        addr: SocketAddr,
        user: &str,
        password: &str,
        db: &str,
    ) -> Result<WireClient, String> {
        Self::connect_with(addr, user, password, db, &[]).await
    }

    /// Like [`WireClient::connect`], with extra startup parameters (`application_name`,
    /// `TimeZone`, any GUC).
    pub async fn connect_with(
        addr: SocketAddr,
        user: &str,
        password: &str,
        db: &str,
        startup: &[(&str, &str)],
    ) -> Result<WireClient, String> {
        let stream = tokio::time::timeout(RECV_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connect to {addr} timed out"))?
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut client = WireClient {
            stream,
            rbuf: BytesMut::with_capacity(8192),
            wbuf: BytesMut::new(),
            params: HashMap::new(),
            key: None,
        };
        let mut body = BytesMut::new();
        body.put_i32(0x0003_0000);
        let base = [
            ("user", user),
            ("database", db),
            ("client_encoding", "UTF8"),
        ];
        for (k, v) in base.iter().chain(startup) {
            put_cstr(&mut body, k);
            put_cstr(&mut body, v);
        }
        body.put_u8(0);
        client.wbuf.put_i32(body.len() as i32 + 4);
        client.wbuf.put_slice(&body);
        client.send().await?;

        let mut scram: Option<ScramSha256> = None;
        loop {
            match client.recv().await? {
                Backend::Authentication(0, _) => {}
                Backend::Authentication(3, _) => {
                    client.password_message(password.as_bytes());
                    client.send().await?;
                }
                Backend::Authentication(5, salt) => {
                    let salt: [u8; 4] = salt
                        .as_slice()
                        .try_into()
                        .map_err(|_| "bad md5 salt".to_string())?;
                    let hash = postgres_protocol::authentication::md5_hash(
                        user.as_bytes(),
                        password.as_bytes(),
                        salt,
                    );
                    client.password_message(hash.as_bytes());
                    client.send().await?;
                }
                Backend::Authentication(10, mechanisms) => {
                    if !mechanisms.split(|b| *b == 0).any(|m| m == b"SCRAM-SHA-256") {
                        return Err(format!("server offers no SCRAM-SHA-256: {mechanisms:?}"));
                    }
                    let s = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
                    let mut body = BytesMut::new();
                    put_cstr(&mut body, "SCRAM-SHA-256");
                    body.put_i32(s.message().len() as i32);
                    body.put_slice(s.message());
                    client.message(b'p', &body);
                    client.send().await?;
                    scram = Some(s);
                }
                Backend::Authentication(11, data) => {
                    let s = scram.as_mut().ok_or("SASLContinue without SASL")?;
                    s.update(&data)
                        .map_err(|e| format!("SCRAM server-first: {e}"))?;
                    let msg = s.message().to_vec();
                    client.message(b'p', &msg);
                    client.send().await?;
                }
                Backend::Authentication(12, data) => {
                    let s = scram.as_mut().ok_or("SASLFinal without SASL")?;
                    s.finish(&data)
                        .map_err(|e| format!("SCRAM server-final: {e}"))?;
                }
                Backend::Authentication(other, _) => {
                    return Err(format!("unsupported auth request {other}"));
                }
                Backend::ReadyForQuery(_) => return Ok(client),
                Backend::Error { code, message } => return Err(format!("{code}: {message}")),
                _ => {}
            }
        }
    }

    fn password_message(&mut self, password: &[u8]) {
        let mut body = BytesMut::new();
        body.put_slice(password);
        body.put_u8(0);
        self.message(b'p', &body);
    }

    /// Appends one raw message (`tag`, `body`) to the send buffer.
    pub fn message(&mut self, tag: u8, body: &[u8]) -> &mut Self {
        self.wbuf.put_u8(tag);
        self.wbuf.put_i32(body.len() as i32 + 4);
        self.wbuf.put_slice(body);
        self
    }

    pub fn query(&mut self, sql: &str) -> &mut Self {
        let mut b = BytesMut::new();
        put_cstr(&mut b, sql);
        self.message(b'Q', &b)
    }

    /// Parse with no declared parameter types.
    pub fn parse(&mut self, name: &str, sql: &str) -> &mut Self {
        let mut b = BytesMut::new();
        put_cstr(&mut b, name);
        put_cstr(&mut b, sql);
        b.put_i16(0);
        self.message(b'P', &b)
    }

    /// Bind with text-format parameters and results.
    pub fn bind(&mut self, portal: &str, statement: &str, params: &[Option<&str>]) -> &mut Self {
        let mut b = BytesMut::new();
        put_cstr(&mut b, portal);
        put_cstr(&mut b, statement);
        b.put_i16(0);
        b.put_i16(params.len() as i16);
        for p in params {
            match p {
                Some(v) => {
                    b.put_i32(v.len() as i32);
                    b.put_slice(v.as_bytes());
                }
                None => b.put_i32(-1),
            }
        }
        b.put_i16(0);
        self.message(b'B', &b)
    }

    pub fn describe_statement(&mut self, name: &str) -> &mut Self {
        let mut b = BytesMut::new();
        b.put_u8(b'S');
        put_cstr(&mut b, name);
        self.message(b'D', &b)
    }

    pub fn describe_portal(&mut self, name: &str) -> &mut Self {
        let mut b = BytesMut::new();
        b.put_u8(b'P');
        put_cstr(&mut b, name);
        self.message(b'D', &b)
    }

    pub fn execute(&mut self, portal: &str, max_rows: i32) -> &mut Self {
        let mut b = BytesMut::new();
        put_cstr(&mut b, portal);
        b.put_i32(max_rows);
        self.message(b'E', &b)
    }

    pub fn close_statement(&mut self, name: &str) -> &mut Self {
        let mut b = BytesMut::new();
        b.put_u8(b'S');
        put_cstr(&mut b, name);
        self.message(b'C', &b)
    }

    pub fn sync(&mut self) -> &mut Self {
        self.message(b'S', &[])
    }

    pub fn terminate(&mut self) -> &mut Self {
        self.message(b'X', &[])
    }

    /// Writes everything buffered so far.
    pub async fn send(&mut self) -> Result<(), String> {
        let buf = self.wbuf.split();
        self.stream
            .write_all(&buf)
            .await
            .map_err(|e| format!("send: {e}"))
    }

    /// Bytes buffered and not yet sent.
    pub fn pending(&self) -> usize {
        self.wbuf.len()
    }

    /// Writes everything buffered so far in two writes, cut at byte `at`, a moment apart (so
    /// the reader sees a partial frame).
    pub async fn send_split(&mut self, at: usize) -> Result<(), String> {
        let buf = self.wbuf.split();
        let at = at.min(buf.len());
        for (i, part) in [&buf[..at], &buf[at..]].into_iter().enumerate() {
            if i == 1 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            self.stream
                .write_all(part)
                .await
                .map_err(|e| format!("send: {e}"))?;
        }
        Ok(())
    }

    /// Writes everything buffered so far but its last `keep_back` bytes (a truncated
    /// message, for clients that vanish mid-frame); the rest is discarded.
    pub async fn send_partial(&mut self, keep_back: usize) -> Result<(), String> {
        let buf = self.wbuf.split();
        let n = buf.len().saturating_sub(keep_back);
        self.stream
            .write_all(&buf[..n])
            .await
            .map_err(|e| format!("send: {e}"))
    }

    /// The next whole backend message, undecoded; `Err` on EOF, I/O error, a bad length or a
    /// 20 s silence.
    async fn next_frame(&mut self) -> Result<BytesMut, String> {
        loop {
            if self.rbuf.len() >= 5 {
                let len = i32::from_be_bytes(self.rbuf[1..5].try_into().expect("4 bytes"));
                if len < 4 {
                    return Err(format!("backend sent a message with length {len}"));
                }
                let total = len as usize + 1;
                if self.rbuf.len() >= total {
                    return Ok(self.rbuf.split_to(total));
                }
            }
            let read = tokio::time::timeout(RECV_TIMEOUT, self.stream.read_buf(&mut self.rbuf))
                .await
                .map_err(|_| format!("no backend message within {RECV_TIMEOUT:?}"))?
                .map_err(|e| format!("recv: {e}"))?;
            if read == 0 {
                return Err("connection closed by the server".to_string());
            }
        }
    }

    /// The next backend message; `Err` on EOF, I/O error or a 20 s silence.
    pub async fn recv(&mut self) -> Result<Backend, String> {
        let mut frame = self.next_frame().await?.freeze();
        let tag = frame.get_u8();
        frame.advance(4);
        let msg = decode(tag, frame)?;
        match &msg {
            Backend::ParameterStatus(k, v) => {
                self.params.insert(k.clone(), v.clone());
            }
            Backend::KeyData { pid, key } => self.key = Some((*pid, key.clone())),
            _ => {}
        }
        Ok(msg)
    }

    /// Messages up to and including the next ReadyForQuery.
    pub async fn until_ready(&mut self) -> Result<Vec<Backend>, String> {
        let mut out = Vec::new();
        loop {
            let msg = self.recv().await?;
            let done = matches!(msg, Backend::ReadyForQuery(_));
            out.push(msg);
            if done {
                return Ok(out);
            }
        }
    }

    /// The bytes of every message up to the next ReadyForQuery, undecoded (that message
    /// left out), and its status: what a test compares byte for byte.
    pub async fn until_ready_raw(&mut self) -> Result<(Vec<u8>, u8), String> {
        let mut out = Vec::new();
        loop {
            let frame = self.next_frame().await?;
            if frame[0] == b'Z' {
                return Ok((out, frame.get(5).copied().unwrap_or(0)));
            }
            out.extend_from_slice(&frame);
        }
    }

    /// Sends `sql` as a simple query and returns the first column of every DataRow; `Err`
    /// carries the SQLSTATE and message of an ErrorResponse.
    pub async fn simple(&mut self, sql: &str) -> Result<Vec<Option<String>>, String> {
        self.query(sql);
        self.send().await?;
        let msgs = self.until_ready().await?;
        if let Some(Backend::Error { code, message }) =
            msgs.iter().find(|m| m.error_code().is_some())
        {
            return Err(format!("{code}: {message}"));
        }
        Ok(first_column(&msgs))
    }
}

/// The first column of every DataRow in `msgs`.
pub fn first_column(msgs: &[Backend]) -> Vec<Option<String>> {
    msgs.iter()
        .filter_map(|m| match m {
            Backend::DataRow(cols) => Some(cols.first().cloned().flatten()),
            _ => None,
        })
        .collect()
}

fn put_cstr(buf: &mut BytesMut, s: &str) {
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
}

fn get_cstr(buf: &mut Bytes) -> Result<String, String> {
    let end = buf
        .iter()
        .position(|b| *b == 0)
        .ok_or("unterminated string in backend message")?;
    let s = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.advance(end + 1);
    Ok(s)
}

fn need(buf: &Bytes, n: usize) -> Result<(), String> {
    if buf.remaining() < n {
        Err(format!("backend message truncated (need {n} bytes)"))
    } else {
        Ok(())
    }
}

fn fields(mut body: Bytes) -> Result<(String, String), String> {
    let (mut code, mut message) = (String::new(), String::new());
    while body.has_remaining() {
        let kind = body.get_u8();
        if kind == 0 {
            break;
        }
        let value = get_cstr(&mut body)?;
        match kind {
            b'C' => code = value,
            b'M' => message = value,
            _ => {}
        }
    }
    Ok((code, message))
}

fn decode(tag: u8, mut body: Bytes) -> Result<Backend, String> {
    Ok(match tag {
        b'R' => {
            need(&body, 4)?;
            let code = body.get_i32();
            Backend::Authentication(code, body.to_vec())
        }
        b'S' => {
            let k = get_cstr(&mut body)?;
            let v = get_cstr(&mut body)?;
            Backend::ParameterStatus(k, v)
        }
        b'K' => {
            need(&body, 4)?;
            let pid = body.get_i32();
            Backend::KeyData {
                pid,
                key: body.to_vec(),
            }
        }
        b'Z' => {
            need(&body, 1)?;
            Backend::ReadyForQuery(body.get_u8())
        }
        b'T' => {
            need(&body, 2)?;
            let n = body.get_i16();
            let mut names = Vec::new();
            for _ in 0..n {
                names.push(get_cstr(&mut body)?);
                need(&body, 18)?;
                body.advance(18);
            }
            Backend::RowDescription(names)
        }
        b'D' => {
            need(&body, 2)?;
            let n = body.get_i16();
            let mut cols = Vec::new();
            for _ in 0..n {
                need(&body, 4)?;
                let len = body.get_i32();
                if len < 0 {
                    cols.push(None);
                } else {
                    need(&body, len as usize)?;
                    cols.push(Some(
                        String::from_utf8_lossy(&body.split_to(len as usize)).into_owned(),
                    ));
                }
            }
            Backend::DataRow(cols)
        }
        b'C' => Backend::CommandComplete(get_cstr(&mut body)?),
        b'I' => Backend::EmptyQueryResponse,
        b'E' => {
            let (code, message) = fields(body)?;
            Backend::Error { code, message }
        }
        b'N' => {
            let (code, message) = fields(body)?;
            Backend::Notice { code, message }
        }
        b'1' => Backend::ParseComplete,
        b'2' => Backend::BindComplete,
        b'3' => Backend::CloseComplete,
        b'n' => Backend::NoData,
        b's' => Backend::PortalSuspended,
        b't' => {
            need(&body, 2)?;
            let n = body.get_i16();
            let mut oids = Vec::new();
            for _ in 0..n {
                need(&body, 4)?;
                oids.push(body.get_u32());
            }
            Backend::ParameterDescription(oids)
        }
        b'A' => {
            need(&body, 4)?;
            let pid = body.get_i32();
            let channel = get_cstr(&mut body)?;
            let payload = get_cstr(&mut body)?;
            Backend::Notification {
                pid,
                channel,
                payload,
            }
        }
        b'G' => Backend::CopyInResponse,
        b'H' => Backend::CopyOutResponse,
        b'd' => Backend::CopyData(body.to_vec()),
        b'c' => Backend::CopyDone,
        b'v' => Backend::NegotiateProtocolVersion,
        other => Backend::Other(other),
    })
}

/// A FunctionCall body: function OID, no argument formats (text), the arguments, text result.
pub fn function_call(oid: u32, args: &[&str]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&oid.to_be_bytes());
    b.extend_from_slice(&0i16.to_be_bytes());
    b.extend_from_slice(&(args.len() as i16).to_be_bytes());
    for a in args {
        b.extend_from_slice(&(a.len() as i32).to_be_bytes());
        b.extend_from_slice(a.as_bytes());
    }
    b.extend_from_slice(&0i16.to_be_bytes());
    b
}
