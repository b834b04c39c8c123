//! `backend.url`: where Postgres is and as whom the proxy logs in, parsed by
//! tokio-postgres's connection-string parser, with every query parameter either honoured or
//! refused by name — never silently dropped.
//!
//! Honoured: several hosts (`host1:5432,host2:5433`, tried in order, as libpq does),
//! `target_session_attrs` (`any`, `read-write`, `read-only`: a host that does not qualify
//! is skipped), `connect_timeout` (seconds, per host), `application_name` and `options`
//! (sent in the startup packet), `sslmode` (`disable` … `verify-full`: the backend TLS mode),
//! and `host`, `port`, `user`, `password`, `dbname` given as parameters. Anything else
//! (`keepalives`, `hostaddr`, `channel_binding`, `load_balance_hosts`, …) is an error that
//! names it. A host that is a directory (`host=/var/run/postgresql`, or `%2Fvar%2Frun%2Fpostgresql`
//! in the authority) is a Unix-domain socket directory, as in libpq: the server's socket is
//! `DIR/.s.PGSQL.PORT`. Errors never quote the password.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::config::{Host, TargetSessionAttrs};

use super::BackendTlsMode;

/// Query parameters the proxy acts on.
pub const URL_PARAMETERS: [&str; 10] = [
    "sslmode",
    "connect_timeout",
    "target_session_attrs",
    "application_name",
    "options",
    "host",
    "port",
    "user",
    "password",
    "dbname",
];

/// Which servers of the host list may serve (libpq's `target_session_attrs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetAttrs {
    #[default]
    Any,
    /// `transaction_read_only` must be off (a primary).
    ReadWrite,
    /// `transaction_read_only` must be on (a standby).
    ReadOnly,
}

/// `postgres://USER:PASSWORD@HOST:PORT[,HOST:PORT…]/DB?…`, percent-decoded.
#[derive(Clone, PartialEq, Eq)]
pub struct BackendUrl {
    pub user: String,
    pub password: Option<String>,
    /// The first host, and the list in order (the first included).
    pub host: String,
    pub port: u16,
    pub hosts: Vec<(String, u16)>,
    pub database: String,
    pub target: TargetAttrs,
    pub connect_timeout: Option<Duration>,
    pub application_name: Option<String>,
    pub options: Option<String>,
    /// `sslmode`, when the URL gives one.
    pub sslmode: Option<BackendTlsMode>,
}

impl fmt::Debug for BackendUrl {
    // Never print the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hosts: Vec<String> = self.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        write!(
            f,
            "postgres://{}@{}/{}",
            self.user,
            hosts.join(","),
            self.database
        )
    }
}

impl BackendUrl {
    /// `backend.url`: a user is required; the database defaults to the user's name.
    pub fn parse(url: &str) -> Result<BackendUrl, String> {
        Self::parse_with(url, true)
    }

    /// A `databases[].url`: user and database may be left out (then `user` and `database`
    /// are empty: the client's user, the entry's name).
    pub fn parse_entry(url: &str) -> Result<BackendUrl, String> {
        Self::parse_with(url, false)
    }

    fn parse_with(url: &str, need_user: bool) -> Result<BackendUrl, String> {
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .ok_or("must start with postgres:// or postgresql://")?;
        // The parameters are checked here, by name, before the parser sees them: it accepts
        // some the proxy would not act on, and knows fewer sslmode values than the proxy.
        let (head, query) = rest.split_once('?').unwrap_or((rest, ""));
        // The parser decodes the password leniently; a malformed one is refused here, with
        // an error that does not quote it.
        let authority = head.split('/').next().unwrap_or(head);
        if let Some((userinfo, _)) = authority.split_once('@') {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            percent_decode(user).map_err(|e| e.describe(&format!("`{user}`")))?;
            percent_decode(password)
                .map_err(|e| e.describe("the password in backend.url (not shown)"))?;
        }
        let mut sslmode = None;
        let mut passed = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "sslmode" => {
                    sslmode = Some(match value {
                        "disable" => BackendTlsMode::Disable,
                        "prefer" => BackendTlsMode::Prefer,
                        "require" => BackendTlsMode::Require,
                        "verify-ca" => BackendTlsMode::VerifyCa,
                        "verify-full" => BackendTlsMode::VerifyFull,
                        _ => {
                            return Err(format!(
                                "sslmode={value:?}: must be disable, prefer, require, verify-ca \
                                 or verify-full"
                            ));
                        }
                    });
                }
                k if URL_PARAMETERS.contains(&k) => passed.push(pair),
                k => {
                    return Err(format!(
                        "the parameter {k:?} is not supported by pgsluice (it would be ignored, \
                         so it is refused); supported: {}",
                        URL_PARAMETERS.join(", ")
                    ));
                }
            }
        }
        let for_parser = if passed.is_empty() {
            format!("postgres://{head}")
        } else {
            format!("postgres://{head}?{}", passed.join("&"))
        };
        let c = tokio_postgres::Config::from_str(&for_parser).map_err(|e| {
            // The parser's messages name options, never values.
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg = format!("{msg}: {s}");
                source = s.source();
            }
            msg
        })?;
        let user = match c.get_user().filter(|u| !u.is_empty()) {
            Some(u) => u.to_owned(),
            None if need_user => {
                return Err("must name a user: postgres://USER:PASSWORD@HOST:PORT/DB".into());
            }
            None => String::new(),
        };
        if user.is_empty() && c.get_password().is_some() {
            return Err("a password without a user".into());
        }
        let password = c
            .get_password()
            .map(|p| {
                String::from_utf8(p.to_vec())
                    .map_err(|_| "the password in the URL (not shown) is not UTF-8".to_owned())
            })
            .transpose()?;
        let ports = c.get_ports();
        let mut hosts = Vec::new();
        for (i, h) in c.get_hosts().iter().enumerate() {
            let port = ports
                .get(i)
                .or_else(|| ports.first())
                .copied()
                .unwrap_or(5432);
            match h {
                Host::Tcp(name) if !name.is_empty() => hosts.push((name.clone(), port)),
                Host::Tcp(_) => return Err("a host is empty".into()),
                Host::Unix(path) => match path.to_str() {
                    Some(dir) if crate::addr::is_socket_dir(dir) => {
                        hosts.push((dir.to_owned(), port))
                    }
                    _ => {
                        return Err(format!(
                            "the socket directory {} must be an absolute UTF-8 path",
                            path.display()
                        ));
                    }
                },
            }
        }
        if ports.len() > 1 && ports.len() != hosts.len() {
            return Err(format!(
                "{} ports for {} hosts: give one port, or one per host",
                ports.len(),
                hosts.len()
            ));
        }
        let (host, port) = hosts.first().cloned().ok_or("the host is empty")?;
        let target = match c.get_target_session_attrs() {
            TargetSessionAttrs::ReadWrite => TargetAttrs::ReadWrite,
            TargetSessionAttrs::ReadOnly => TargetAttrs::ReadOnly,
            _ => TargetAttrs::Any,
        };
        let given = |k: &str| passed.iter().any(|p| p.split('=').next() == Some(k));
        let connect_timeout = c.get_connect_timeout().copied();
        if given("connect_timeout") && connect_timeout.is_none() {
            return Err("connect_timeout must be a positive number of seconds".into());
        }
        let default_db = if need_user { user.as_str() } else { "" };
        Ok(BackendUrl {
            database: c.get_dbname().unwrap_or(default_db).to_owned(),
            user,
            password,
            host,
            port,
            hosts,
            target,
            connect_timeout,
            application_name: c.get_application_name().map(str::to_owned),
            options: c.get_options().map(str::to_owned),
            sslmode,
        })
    }

    /// Parameters the startup packet carries besides user and database.
    pub fn startup(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        if let Some(a) = &self.application_name {
            v.push(("application_name".to_owned(), a.clone()));
        }
        if let Some(o) = &self.options {
            v.push(("options".to_owned(), o.clone()));
        }
        v
    }
}

/// Why a URL segment does not decode.
enum DecodeError {
    Percent,
    Utf8,
}

impl DecodeError {
    fn describe(&self, what: &str) -> String {
        match self {
            DecodeError::Percent => format!("invalid percent-encoding in {what}"),
            DecodeError::Utf8 => format!("{what} is not UTF-8 after percent-decoding"),
        }
    }
}

fn percent_decode(s: &str) -> Result<String, DecodeError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or(DecodeError::Percent)?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| DecodeError::Utf8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_is_honoured_or_refused_by_name() {
        let u = BackendUrl::parse(
            "postgres://app:s%40cret@h1:5433,h2:5434/appdb?target_session_attrs=read-write\
             &connect_timeout=3&application_name=pgsluice&options=-c%20search_path%3Dx&sslmode=verify-full",
        )
        .unwrap();
        assert_eq!(u.user, "app");
        assert_eq!(u.password.as_deref(), Some("s@cret"));
        assert_eq!(u.hosts, vec![("h1".into(), 5433), ("h2".into(), 5434)]);
        assert_eq!((u.host.as_str(), u.port), ("h1", 5433));
        assert_eq!(u.database, "appdb");
        assert_eq!(u.target, TargetAttrs::ReadWrite);
        assert_eq!(u.connect_timeout, Some(Duration::from_secs(3)));
        assert_eq!(u.sslmode, Some(BackendTlsMode::VerifyFull));
        assert_eq!(
            u.startup(),
            vec![
                ("application_name".into(), "pgsluice".into()),
                ("options".into(), "-c search_path=x".into())
            ]
        );
        assert!(!format!("{u:?}").contains("s@cret"));
        let one_port = BackendUrl::parse("postgres://app@a,b:6000/db").unwrap();
        assert_eq!(one_port.hosts, vec![("a".into(), 5432), ("b".into(), 6000)]);
        let plain = BackendUrl::parse("postgresql://app@[::1]/").unwrap();
        assert_eq!((plain.host.as_str(), plain.port), ("::1", 5432));
        assert_eq!(
            (plain.database.as_str(), plain.target),
            ("app", TargetAttrs::Any)
        );

        for (bad, says) in [
            (
                "postgres://app@h/db?keepalives=1",
                "\"keepalives\" is not supported",
            ),
            (
                "postgres://app@h/db?hostaddr=1.2.3.4",
                "\"hostaddr\" is not supported",
            ),
            (
                "postgres://app@h/db?sslmode=sometimes",
                "sslmode=\"sometimes\"",
            ),
            (
                "postgres://app@h/db?target_session_attrs=primary",
                "target_session_attrs",
            ),
            ("postgres://app@h/db?connect_timeout=0", "connect_timeout"),
            ("postgres://h/db", "must name a user"),
            ("mysql://app@h/db", "postgres://"),
            ("postgres://app@/db?host=a,b,c&port=1,2", "2 ports for"),
        ] {
            let e = BackendUrl::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // Socket directories, as a parameter or percent-encoded in the authority, and mixed
        // with TCP hosts.
        let u = BackendUrl::parse("postgres://app@/db?host=/var/run/postgresql&port=5433").unwrap();
        assert_eq!(u.hosts, vec![("/var/run/postgresql".into(), 5433)]);
        let u = BackendUrl::parse("postgres://app@%2Ftmp%2Fpg,db2:5434/db").unwrap();
        assert_eq!(
            u.hosts,
            vec![("/tmp/pg".into(), 5432), ("db2".into(), 5434)]
        );
        let e = BackendUrl::parse("postgres://app:hunter2@h/db?x=1").unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
    }
}
