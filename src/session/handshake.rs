//! Connection start: SSL/GSS negotiation (and direct TLS), the startup packet, protocol
//! version negotiation, CancelRequest (within the client address's cancel share), and client
//! authentication (SCRAM-SHA-256, with SCRAM-SHA-256-PLUS also offered over TLS; md5; trust).
//!
//! Everything here runs before the client is trusted, under the caller's handshake timeout:
//! packets are length-checked before they are read, and unknown users walk the same SCRAM
//! exchange as known ones against a mock verifier (with a salt of its own per name, see
//! `auth`), so both get the same 28P01 and the salt does not tell which users exist.
//!
//! Negotiation follows Postgres (`backend_startup.c`): each of SSLRequest and GSSENCRequest is
//! answered at most once with one byte, and a repeat is closed without a reply; bytes the
//! client pipelined behind either request are refused with 08P01 before any TLS is spoken
//! (CVE-2021-23214); direct TLS (first byte 0x16) must negotiate ALPN `postgresql`; with
//! `tls.mode: require` a plaintext StartupMessage is refused with 28000 before authentication.
//! Reads are buffered in the caller's `buf`, which keeps whatever followed the handshake.

use bytes::{Buf, BytesMut};
use pgwire::api::auth::sasl::scram::ScramServerAuth;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::app::App;
use crate::auth;
use crate::auth::channel_binding::{self, EndPoint};
use crate::cancel;
use crate::config::{AuthMethod, ClientTlsMode};
use crate::protocol::PgError;
use crate::protocol::framing::{self, Direction, SMALL_LIMIT};
use crate::protocol::messages::{self, NEWEST_MINOR, StartupPacket};
use crate::protocol::tag::frontend;
use crate::tls::{ALPN_POSTGRESQL, ClientStream};

use crate::protocol::params;

/// First byte of a TLS handshake record: a direct-TLS ClientHello.
const TLS_HANDSHAKE: u8 = 0x16;

/// A client that passed authentication.
#[derive(Debug, Clone)]
pub struct Login {
    pub user: String,
    pub database: String,
    /// GUC settings from the startup packet, sorted by name. Shared: the first login with
    /// these settings leaves its list with the pool's greeting, and the pool hands the later
    /// ones that list with it ([`crate::pool::Pool::greeting`]), so a backend's
    /// [`crate::pool::BackendConn::applied`] is found equal by pointer.
    pub settings: params::Shared,
    /// Negotiated protocol minor version (0 or 2).
    pub minor: u16,
}

impl Login {
    pub fn application_name(&self) -> Option<&str> {
        self.settings
            .iter()
            .find(|(k, _)| k == "application_name")
            .map(|(_, v)| v.as_str())
    }
}

/// A client that passed authentication, and what it has not been told yet.
pub struct Authenticated {
    pub login: Login,
    /// What the client is owed before its session parameters (AuthenticationOk and anything
    /// the authentication ended with): sent with the parameters in one write, so the client
    /// wakes once for its whole login answer.
    pub owed: BytesMut,
}

pub enum Start {
    Login(Authenticated),
    /// A CancelRequest was handled; close the connection.
    Cancelled,
}

/// Why a handshake ended without a login.
#[derive(Debug)]
pub enum Fail {
    /// Send this FATAL error, then close.
    Report(PgError),
    /// Close without a reply: negotiation abuse, a client that left, a failed TLS handshake.
    Silent(&'static str),
}

impl From<PgError> for Fail {
    fn from(e: PgError) -> Self {
        Fail::Report(e)
    }
}

async fn write<S: AsyncWrite + Unpin>(s: &mut S, out: &mut BytesMut) -> Result<(), PgError> {
    s.write_all(out).await.map_err(io_err)?;
    out.clear();
    Ok(())
}

fn io_err(e: std::io::Error) -> PgError {
    PgError::protocol_violation(format!("connection error during startup: {e}"))
}

/// Reads one startup-phase packet (length-prefixed, no type byte) from `buf`, reading more
/// as needed; bytes after it stay in `buf`.
async fn read_startup<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<StartupPacket, Fail> {
    loop {
        if buf.len() >= 4 {
            let len = messages::startup_len([buf[0], buf[1], buf[2], buf[3]])
                .map_err(|e| PgError::protocol_violation(e.to_string()))?;
            if buf.len() >= len {
                // Parsed in place and then consumed: splitting it off would turn `buf` into a
                // shared buffer (an allocation, and a costlier growth later).
                let packet = messages::parse_startup(&buf[4..len])
                    .map_err(|e| PgError::protocol_violation(e.to_string()));
                buf.advance(len);
                return Ok(packet?);
            }
        }
        fill(s, buf).await?;
    }
}

/// Reads more bytes into `buf`; a client that hangs up here is closed without a reply.
async fn fill<S: AsyncRead + Unpin>(s: &mut S, buf: &mut BytesMut) -> Result<(), Fail> {
    match s.read_buf(buf).await {
        Ok(0) | Err(_) => Err(Fail::Silent("client closed the connection during startup")),
        Ok(_) => Ok(()),
    }
}

/// Answers one negotiation request with a single byte.
async fn answer<S: AsyncWrite + Unpin>(s: &mut S, byte: u8) -> Result<(), Fail> {
    s.write_all(&[byte])
        .await
        .map_err(|_| Fail::Silent("client closed the connection during negotiation"))
}

/// Reads one regular message during authentication (small limit: SCRAM messages are tiny).
async fn read_auth_message<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<BytesMut, PgError> {
    loop {
        match framing::complete(buf, Direction::Frontend) {
            Ok(Some(h)) if h.tag == frontend::PASSWORD && h.total <= SMALL_LIMIT => {
                // Copied out (it is small): splitting it off would make `buf`, which the
                // session goes on to read into, a shared buffer for the rest of its life.
                let f = BytesMut::from(&buf[framing::HEADER_LEN..h.total]);
                buf.advance(h.total);
                return Ok(f);
            }
            Ok(Some(h)) if h.tag == frontend::PASSWORD => {
                return Err(PgError::protocol_violation(
                    "authentication message too long",
                ));
            }
            Ok(Some(h)) => {
                return Err(PgError::protocol_violation(format!(
                    "expected a password response, got message type '{}'",
                    char::from(h.tag)
                )));
            }
            Ok(None) => {
                if let Ok(Some(h)) = framing::header(buf, Direction::Frontend)
                    && (h.tag != frontend::PASSWORD || h.total > SMALL_LIMIT)
                {
                    return Err(PgError::protocol_violation(
                        "invalid message during authentication",
                    ));
                }
            }
            Err(e) => return Err(PgError::protocol_violation(e.to_string())),
        }
        if s.read_buf(buf).await.map_err(io_err)? == 0 {
            return Err(PgError::protocol_violation(
                "client closed the connection during authentication",
            ));
        }
    }
}

/// Startup up to and including authentication. `buf` keeps any bytes read past it; `peer`
/// is the client's address (a CancelRequest counts against its share).
pub async fn startup<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    s: &mut ClientStream<S>,
    buf: &mut BytesMut,
    peer: std::net::IpAddr,
) -> Result<Start, Fail> {
    // Sized for what a login writes: the authentication request, AuthenticationOk and, in
    // `session::greet`, the ParameterStatus list, BackendKeyData and ReadyForQuery.
    let mut out = BytesMut::with_capacity(1024);
    let tls = app.tls.client();
    if buf.is_empty() {
        fill(s, buf).await?;
    }
    if buf.first() == Some(&TLS_HANDSHAKE) {
        let Some(acceptor) = &tls.acceptor else {
            return Err(Fail::Silent("direct TLS connection while TLS is disabled"));
        };
        s.upgrade(acceptor, buf.split())
            .await
            .map_err(|_| Fail::Silent("direct TLS handshake failed"))?;
        if s.alpn() != Some(ALPN_POSTGRESQL) {
            return Err(PgError::protocol_violation(
                "received direct SSL connection request without ALPN protocol negotiation extension",
            )
            .into());
        }
    }
    let (mut ssl_done, mut gss_done) = (s.is_tls(), s.is_tls());
    let (major, minor, mut raw) = loop {
        match read_startup(s, buf).await? {
            StartupPacket::SslRequest if !ssl_done => {
                ssl_done = true;
                if !buf.is_empty() {
                    return Err(PgError::protocol_violation(
                        "received unencrypted data after SSL request",
                    )
                    .into());
                }
                match &tls.acceptor {
                    Some(acceptor) => {
                        answer(s, b'S').await?;
                        s.upgrade(acceptor, BytesMut::new())
                            .await
                            .map_err(|_| Fail::Silent("TLS handshake failed"))?;
                        // GSS encryption inside TLS makes no sense.
                        gss_done = true;
                    }
                    None => answer(s, b'N').await?,
                }
            }
            StartupPacket::GssEncRequest if !gss_done => {
                gss_done = true;
                if !buf.is_empty() {
                    return Err(PgError::protocol_violation(
                        "received unencrypted data after GSSAPI encryption request",
                    )
                    .into());
                }
                answer(s, b'N').await?;
            }
            StartupPacket::SslRequest | StartupPacket::GssEncRequest => {
                return Err(Fail::Silent("repeated SSL/GSS negotiation request"));
            }
            StartupPacket::Cancel { pid, secret } => {
                let config = app.config();
                let peers = app.cancel_peers(&config);
                let from = cancel::Source {
                    ip: peer,
                    cap: config.limits.max_cancels_per_address,
                };
                app.cancels.cancel(pid, &secret, &peers, Some(from)).await;
                return Ok(Start::Cancelled);
            }
            StartupPacket::Startup {
                major,
                minor,
                params,
            } => break (major, minor, params),
        }
    };
    if tls.mode == ClientTlsMode::Require && !s.is_tls() {
        return Err(PgError::fatal(
            "28000",
            "pgsluice: this server requires SSL/TLS (use sslmode=require)",
        )
        .into());
    }
    if major != 3 {
        return Err(PgError::fatal(
            "0A000",
            format!(
                "unsupported frontend protocol {major}.{minor}: server supports 3.0 to 3.{NEWEST_MINOR}"
            ),
        )
        .into());
    }
    // Taken out of the list (`client_settings` skips both names): no copies.
    let mut take = |name: &str| {
        raw.iter_mut()
            .find(|(k, _)| k == name)
            .map(|(_, v)| std::mem::take(v))
    };
    let user = take("user").filter(|u| !u.is_empty()).ok_or_else(|| {
        PgError::fatal(
            "28000",
            "no PostgreSQL user name specified in startup packet",
        )
    })?;
    let database = take("database")
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| user.clone());
    let (settings, unsupported) =
        params::client_settings(raw).map_err(|m| PgError::fatal("42704", m))?;
    let negotiated = minor.min(NEWEST_MINOR);
    if minor > NEWEST_MINOR || !unsupported.is_empty() {
        messages::negotiate_protocol_version(&mut out, negotiated, unsupported);
    }
    // A protocol-level minor of 1 does not exist; treat it like 3.0.
    let negotiated = if negotiated == NEWEST_MINOR {
        NEWEST_MINOR
    } else {
        0
    };

    // Channel binding only over TLS, with the binding of the certificate this connection
    // was shown (`tls` is the snapshot whose acceptor ran its handshake).
    let end_point = tls.end_point.as_ref().filter(|_| s.is_tls());
    authenticate(app, s, buf, &mut out, &user, end_point).await?;
    let login = Login {
        user,
        database,
        settings: settings.into(),
        minor: negotiated,
    };
    Ok(Start::Login(Authenticated { login, owed: out }))
}

/// Authenticates `user`; on success `out` ends with AuthenticationOk, not yet written.
/// `end_point` is the channel binding SCRAM-SHA-256-PLUS checks (a TLS connection whose
/// certificate has one); without it PLUS is not offered.
async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    s: &mut S,
    buf: &mut BytesMut,
    out: &mut BytesMut,
    user: &str,
    end_point: Option<&EndPoint>,
) -> Result<(), PgError> {
    let creds = app.creds();
    let looked_up;
    let known = match creds.user(user) {
        Some(u) => Some(u),
        None => {
            looked_up = super::auth_query::lookup(app, user).await?;
            looked_up.as_ref()
        }
    };
    let method = match known {
        Some(u) => u.method,
        None => creds.method_for_unknown(user, app.config().auth.method),
    };
    match method {
        AuthMethod::Trust if known.is_some() => {}
        AuthMethod::Trust => return Err(PgError::auth_failed(user)),
        AuthMethod::Md5 => {
            let salt: [u8; 4] = rand::random();
            messages::auth_md5(out, salt);
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let (resp, _) = messages::cstr(&body)
                .ok_or_else(|| PgError::protocol_violation("malformed password message"))?;
            let ok = known
                .and_then(|u| u.md5_inner.as_deref())
                .is_some_and(|inner| auth::md5_response_matches(inner, salt, resp));
            if !ok {
                return Err(PgError::auth_failed(user));
            }
        }
        AuthMethod::ScramSha256 => {
            let plus = end_point.is_some();
            messages::auth_sasl(out, channel_binding::mechanisms(plus));
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let (mech, rest) = messages::cstr(&body)
                .ok_or_else(|| PgError::protocol_violation("malformed SASLInitialResponse"))?;
            let bound = channel_binding::select(mech, plus)?;
            if rest.len() < 4 {
                return Err(PgError::protocol_violation("malformed SASLInitialResponse"));
            }
            let n = i32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let data = &rest[4..];
            if n < 0 || n as usize != data.len() {
                return Err(PgError::protocol_violation(
                    "malformed SASLInitialResponse length",
                ));
            }
            channel_binding::check_flag(data, bound, plus)?;
            let verifier = match known.and_then(|u| u.verifier.as_ref()) {
                Some(v) => std::borrow::Cow::Borrowed(v),
                None => creds.verifier_or_mock(user),
            };
            // With PLUS offered, pgwire checks the client-final's `c=` against the
            // certificate's hash (and refuses `y`), whichever mechanism was selected.
            let scram = end_point.map_or_else(ScramServerAuth::new, |e| e.scram().clone());
            let (server_first, waiting) = scram
                .on_client_first_message_with_secret(data, verifier.secret())
                .map_err(|_| PgError::auth_failed(user))?;
            messages::auth_sasl_continue(out, server_first.as_bytes());
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let server_final = waiting
                .on_client_final_message(&body)
                .map_err(|_| PgError::auth_failed(user))?;
            let Some(known) = known.filter(|u| u.verifier.is_some()) else {
                return Err(PgError::auth_failed(user));
            };
            if known.backend_password.is_none() {
                remember_client_key(app, user, &verifier, data, &server_first, &body);
            }
            messages::auth_sasl_final(out, server_final.as_bytes());
        }
    }
    messages::auth_ok(out);
    Ok(())
}

/// A user known by its SCRAM verifier alone: keeps the key its client just proved, for the
/// proxy's own logins as that user (`auth::passthrough`). Bounded; the newest key wins.
fn remember_client_key(
    app: &App,
    user: &str,
    verifier: &auth::Verifier,
    client_first: &[u8],
    server_first: &str,
    client_final: &[u8],
) {
    let Some(key) =
        auth::passthrough::ClientKey::recover(verifier, client_first, server_first, client_final)
    else {
        tracing::warn!(%user, "SCRAM pass-through: the client's key could not be recovered");
        return;
    };
    let mut keys = app.pass_keys.write();
    if keys.len() < crate::app::MAX_PASS_KEYS || keys.contains_key(user) {
        keys.insert(user.to_owned(), std::sync::Arc::new(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postgres_protocol::message::frontend;

    fn app() -> std::sync::Arc<App> {
        let yaml = "auth:\n  method: md5\n  users:\n    - { name: app, password: secret }\n";
        let cfg = crate::config::Config::from_yaml(yaml).unwrap();
        App::new(
            cfg,
            std::sync::Arc::new(crate::policy::rules::RuleSet::new()),
        )
        .unwrap()
    }

    /// An md5 login: the client gets the challenge, and nothing after its right answer until
    /// the session sends AuthenticationOk with its parameters; a wrong answer is refused
    /// (28P01) with nothing owed.
    #[tokio::test]
    async fn authentication_ok_is_owed_not_sent() {
        for (password, accepted) in [("secret", true), ("wrong", false)] {
            let params = [("user", "app"), ("database", "db")];
            let (r, _, challenge, rest) = log_in(&params, Some(password), b"").await;
            let challenge = challenge.expect("a challenge");
            assert_eq!(&challenge[..9], b"R\0\0\0\x0c\0\0\0\x05", "md5 challenge");
            match (r, accepted) {
                (Ok(Start::Login(a)), true) => {
                    assert_eq!(
                        (a.login.user.as_str(), a.login.database.as_str()),
                        ("app", "db")
                    );
                    assert_eq!(
                        &a.owed[..],
                        b"R\0\0\0\x08\0\0\0\0",
                        "AuthenticationOk, owed"
                    );
                }
                (Err(Fail::Report(e)), false) => assert_eq!(e.code, "28P01"),
                (Ok(_), _) => panic!("{password}: unexpected login"),
                (Err(e), _) => panic!("{password}: unexpected failure {e:?}"),
            }
            // Nothing else reached the client: the server side wrote only the challenge.
            assert!(rest.is_empty(), "{password}: sent early: {rest:?}");
        }
    }

    /// Runs `startup` against a client that sends a startup packet of `params` and, when
    /// `password` is given, reads the md5 challenge and answers it, followed by `after`.
    /// Returns the outcome, what is left in the session's buffer, the challenge the client
    /// read, and whatever else reached the client before the server side closed.
    async fn log_in(
        params: &[(&str, &str)],
        password: Option<&str>,
        after: &[u8],
    ) -> (Result<Start, Fail>, BytesMut, Option<[u8; 13]>, Vec<u8>) {
        let app = app();
        let (mut client, server) = tokio::io::duplex(4096);
        let mut s = ClientStream::Plain(server);
        let mut buf = BytesMut::new();
        let ip = std::net::IpAddr::from([127, 0, 0, 1]);
        let login = startup(&app, &mut s, &mut buf, ip);
        let talk = async {
            let mut p = BytesMut::new();
            frontend::startup_message(params.iter().copied(), &mut p).unwrap();
            client.write_all(&p).await.unwrap();
            let password = password?;
            let mut challenge = [0u8; 13];
            client.read_exact(&mut challenge).await.unwrap();
            let salt = [challenge[9], challenge[10], challenge[11], challenge[12]];
            let hash =
                postgres_protocol::authentication::md5_hash(b"app", password.as_bytes(), salt);
            let mut msg = BytesMut::new();
            frontend::password_message(hash.as_bytes(), &mut msg).unwrap();
            msg.extend_from_slice(after);
            client.write_all(&msg).await.unwrap();
            Some(challenge)
        };
        let (r, challenge) = tokio::join!(login, talk);
        drop(s);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        (r, buf, challenge, rest)
    }

    /// What a login reads is consumed exactly: a query pipelined behind the password stays in
    /// `buf` for the session. The user and database are taken out of the parameters (the
    /// database defaults to the user), and the rest become the settings, names lower-cased.
    /// Without a user, the login is refused (28000) before any challenge.
    #[tokio::test]
    async fn startup_takes_user_and_database_out_and_leaves_what_follows() {
        let mut query = BytesMut::new();
        frontend::query("SELECT 1", &mut query).unwrap();
        let params = [
            ("application_name", "x"),
            ("user", "app"),
            ("Search_Path", "a"),
        ];
        let (r, buf, _, _) = log_in(&params, Some("secret"), &query).await;
        let Ok(Start::Login(a)) = r else {
            panic!("login failed")
        };
        assert_eq!(
            (a.login.user.as_str(), a.login.database.as_str()),
            ("app", "app")
        );
        let settings: Vec<(&str, &str)> = a
            .login
            .settings
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(settings, [("application_name", "x"), ("search_path", "a")]);
        assert_eq!(
            &buf[..],
            &query[..],
            "the pipelined query is left for the session"
        );

        let (r, _, challenge, rest) = log_in(&[("database", "db")], None, b"").await;
        assert!(
            challenge.is_none() && rest.is_empty(),
            "nothing sent before the refusal"
        );
        match r {
            Err(Fail::Report(e)) => assert_eq!(e.code, "28000"),
            Ok(_) => panic!("a login without a user"),
            Err(e) => panic!("unexpected failure {e:?}"),
        }
    }
}
