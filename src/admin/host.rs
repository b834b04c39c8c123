//! Which `Host` names the admin API answers to: the defence against DNS rebinding, where a
//! web page makes the operator's browser send requests to an admin port it can reach (on
//! loopback or inside the network) under the attacker's own host name.
//!
//! Answered: a request without a host (not a browser), an IP literal (a rebinding needs a
//! name), `localhost`, and the names in `admin.allowed_hosts` (exact, case-insensitive;
//! `*.example.com` also matches its subdomains; `*` alone turns the check off). Anything
//! else gets 421 with the key to set. `/healthz`, `/readyz` and `/v1/openapi.json` are
//! answered under any name (they reveal nothing and load balancers probe them by name).

use std::net::IpAddr;

use axum::http::{Request, header};

use super::error::ApiError;

/// The host part of the request's authority (HTTP/2) or `Host` header (HTTP/1): no port,
/// no brackets, lowercase. `None` when the request names none.
pub fn requested<B>(req: &Request<B>) -> Option<String> {
    let raw = match req.uri().authority() {
        Some(a) => a.as_str().to_owned(),
        None => req.headers().get(header::HOST)?.to_str().ok()?.to_owned(),
    };
    let raw = raw.rsplit_once('@').map_or(raw.as_str(), |(_, h)| h).trim();
    let host = if let Some(rest) = raw.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(h, _)| h)
    } else {
        raw.split_once(':').map_or(raw, |(h, _)| h)
    };
    Some(host.trim_end_matches('.').to_ascii_lowercase())
}

/// Whether the API answers to `host` given `admin.allowed_hosts`.
pub fn allowed(host: &str, allowed_hosts: &[String]) -> bool {
    if host.parse::<IpAddr>().is_ok() || host == "localhost" {
        return true;
    }
    allowed_hosts.iter().any(|a| {
        let a = a.trim().trim_end_matches('.').to_ascii_lowercase();
        a == "*"
            || a == host
            || a.strip_prefix("*.")
                .is_some_and(|domain| host.strip_suffix(domain).is_some_and(|h| h.ends_with('.')))
    })
}

/// The check as the guard runs it.
pub fn check<B>(req: &Request<B>, allowed_hosts: &[String]) -> Result<(), ApiError> {
    match requested(req) {
        Some(h) if !allowed(&h, allowed_hosts) => Err(ApiError::MisdirectedHost(format!(
            "the admin API does not answer to the host name {h:?}; if that name is yours, \
             add it to admin.allowed_hosts"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(host: Option<&str>, uri: &str) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header(header::HOST, h);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn names_and_literals() {
        assert_eq!(
            requested(&req(Some("Evil.COM:9930"), "/v1/rules")),
            Some("evil.com".into())
        );
        assert_eq!(requested(&req(Some("[::1]:9930"), "/")), Some("::1".into()));
        assert_eq!(
            requested(&req(Some("localhost."), "/")),
            Some("localhost".into())
        );
        assert_eq!(requested(&req(None, "/")), None);
        assert_eq!(
            requested(&req(Some("ignored"), "http://admin.example.com:1/x")),
            Some("admin.example.com".into())
        );
        let none: Vec<String> = Vec::new();
        for ok in ["127.0.0.1", "10.2.3.4", "::1", "localhost"] {
            assert!(allowed(ok, &none), "{ok}");
        }
        assert!(!allowed("evil.com", &none));
        assert!(!allowed("localhost.evil.com", &none));
        let list = vec![
            "admin.example.com".to_owned(),
            "*.svc.cluster.local".to_owned(),
        ];
        assert!(allowed("admin.example.com", &list));
        assert!(allowed("pgsluice.db.svc.cluster.local", &list));
        assert!(!allowed("svc.cluster.local", &list));
        assert!(!allowed("evilsvc.cluster.local", &list));
        assert!(!allowed("example.com", &list));
        assert!(allowed("anything", &["*".to_owned()]));
        assert!(check(&req(Some("evil.com"), "/v1/rules"), &none).is_err());
        assert!(check(&req(Some("127.0.0.1:9930"), "/v1/rules"), &none).is_ok());
        assert!(check(&req(None, "/v1/rules"), &none).is_ok());
    }
}
