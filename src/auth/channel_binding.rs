//! SCRAM channel binding toward clients: which SASL mechanisms a connection offers
//! (`SCRAM-SHA-256-PLUS` first, then `SCRAM-SHA-256`, over TLS; `SCRAM-SHA-256` alone
//! otherwise), the `tls-server-end-point` binding (RFC 5929) of the certificate the proxy
//! presents, and Postgres's rules for the mechanism and gs2 channel-binding flag a client may
//! combine (`scram_init` and `read_client_first_message` in Postgres's `auth-scram.c`), with
//! its SQLSTATEs and messages.
//!
//! The exchange itself is pgwire's: [`EndPoint`] is a `ScramServerAuth` configured with the
//! certificate, which hashes it (SHA-256 for an MD5 or SHA-1 signature, otherwise the
//! signature's own hash, as Postgres's `be_tls_get_certificate_hash`), refuses a client-final
//! whose `c=` is not base64(gs2 header + hash), and refuses the `y` flag (a downgrade). This
//! module decides, before pgwire sees the client-first message, what Postgres refuses there
//! and pgwire does not (a PLUS client without binding data, binding data under the plain
//! mechanism, PLUS without TLS). Pure: no socket, no configuration.

use pgwire::api::auth::sasl::scram::ScramServerAuth;
use rustls_pki_types::CertificateDer;

use crate::protocol::PgError;

/// The SASL mechanism without channel binding.
pub const SCRAM_SHA_256: &str = "SCRAM-SHA-256";
/// The SASL mechanism with channel binding.
pub const SCRAM_SHA_256_PLUS: &str = "SCRAM-SHA-256-PLUS";
/// The only channel-binding type offered (as in Postgres).
pub const TLS_SERVER_END_POINT: &str = "tls-server-end-point";

/// The SCRAM server for logins over TLS with one certificate: pgwire's, holding that
/// certificate's `tls-server-end-point` hash. Built once per load of `tls.cert_file`, with the
/// acceptor that presents the certificate, so a login checks the binding of the certificate
/// its own connection was shown even across a reload.
#[derive(Clone)]
pub struct EndPoint(ScramServerAuth);

impl std::fmt::Debug for EndPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndPoint(..)")
    }
}

impl EndPoint {
    /// The binding of `cert`, the end-entity certificate the TLS acceptor presents. An error
    /// when its signature algorithm names no hash pgwire knows (Ed25519, RSA-PSS,
    /// ecdsa-with-SHA512, …): such a connection offers no PLUS.
    pub fn new(cert: &CertificateDer<'_>) -> Result<EndPoint, String> {
        let pem = pem::encode(&pem::Pem::new("CERTIFICATE", cert.as_ref()));
        let mut scram = ScramServerAuth::new();
        scram
            .configure_certificate(pem.as_bytes())
            .map_err(|e| e.to_string())?;
        Ok(EndPoint(scram))
    }

    /// The SCRAM server that checks this binding.
    pub fn scram(&self) -> &ScramServerAuth {
        &self.0
    }
}

/// The mechanisms a connection offers, in Postgres's order.
pub fn mechanisms(plus: bool) -> &'static [&'static str] {
    if plus {
        &[SCRAM_SHA_256_PLUS, SCRAM_SHA_256]
    } else {
        &[SCRAM_SHA_256]
    }
}

/// The mechanism a client selected in its SASLInitialResponse, on a connection that offered
/// PLUS (`plus`) or not: whether the exchange is channel-bound. Anything not offered is a
/// protocol violation, as in Postgres.
pub fn select(mechanism: &[u8], plus: bool) -> Result<bool, PgError> {
    match mechanism {
        m if m == SCRAM_SHA_256_PLUS.as_bytes() && plus => Ok(true),
        m if m == SCRAM_SHA_256.as_bytes() => Ok(false),
        _ => Err(PgError::protocol_violation(
            "client selected an invalid SASL authentication mechanism",
        )),
    }
}

/// The gs2-cbind-flag that opens a client-first-message (RFC 5802 §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CbindFlag<'a> {
    /// `n`: the client does not bind.
    No,
    /// `y`: the client could bind but thinks the server cannot.
    ClientOnly,
    /// `p=NAME`: the client binds with channel-binding type NAME.
    Bound(&'a str),
}

/// Reads the gs2-cbind-flag of `client_first`; `None` when there is none to read.
pub fn cbind_flag(client_first: &[u8]) -> Option<CbindFlag<'_>> {
    let end = client_first.iter().position(|&b| b == b',')?;
    match &client_first[..end] {
        b"n" => Some(CbindFlag::No),
        b"y" => Some(CbindFlag::ClientOnly),
        flag => {
            let name = std::str::from_utf8(flag.strip_prefix(b"p=")?).ok()?;
            (!name.is_empty()).then_some(CbindFlag::Bound(name))
        }
    }
}

fn malformed(detail: &str) -> PgError {
    PgError::protocol_violation("malformed SCRAM message").with_detail(detail)
}

/// A client that could bind, told PLUS was offered, says it was not: someone in between may
/// have removed it from the list.
fn downgrade() -> PgError {
    PgError::fatal("28000", "SCRAM channel binding negotiation error").with_detail(
        "The client supports SCRAM channel binding but thinks the server does not.  However, \
         this server does support channel binding.",
    )
}

/// Checks the client-first message's flag against the mechanism: `bound` is what
/// [`select`] returned, `plus` whether PLUS was offered. The refusals and their SQLSTATEs are
/// Postgres's.
pub fn check_flag(client_first: &[u8], bound: bool, plus: bool) -> Result<(), PgError> {
    let flag =
        cbind_flag(client_first).ok_or_else(|| malformed("Unexpected channel-binding flag."))?;
    match flag {
        CbindFlag::No | CbindFlag::ClientOnly if bound => Err(malformed(
            "The client selected SCRAM-SHA-256-PLUS, but the SCRAM message does not include \
             channel binding data.",
        )),
        CbindFlag::ClientOnly if plus => Err(downgrade()),
        CbindFlag::No | CbindFlag::ClientOnly => Ok(()),
        CbindFlag::Bound(_) if !bound => Err(malformed(
            "The client selected SCRAM-SHA-256 without channel binding, but the SCRAM message \
             includes channel binding data.",
        )),
        CbindFlag::Bound(TLS_SERVER_END_POINT) => Ok(()),
        CbindFlag::Bound(name) => Err(PgError::protocol_violation(format!(
            "unsupported SCRAM channel-binding type \"{}\"",
            name.escape_default()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
    use ring::digest;
    use rustls_pki_types::pem::PemObject;

    #[test]
    fn the_gs2_flag_is_read_as_rfc_5802_spells_it() {
        let cases: [(&[u8], Option<CbindFlag>); 9] = [
            (b"n,,n=,r=abc", Some(CbindFlag::No)),
            (b"y,,n=,r=abc", Some(CbindFlag::ClientOnly)),
            (
                b"p=tls-server-end-point,,n=,r=abc",
                Some(CbindFlag::Bound("tls-server-end-point")),
            ),
            (
                b"p=tls-unique,,n=,r=abc",
                Some(CbindFlag::Bound("tls-unique")),
            ),
            (b"p=,,n=,r=abc", None),
            (b"x,,n=,r=abc", None),
            (b"nn,,n=,r=abc", None),
            (b"n", None),
            (b"", None),
        ];
        for (message, want) in cases {
            assert_eq!(
                cbind_flag(message),
                want,
                "{}",
                String::from_utf8_lossy(message)
            );
        }
    }

    #[test]
    fn plus_is_offered_first_and_only_when_asked() {
        assert_eq!(mechanisms(true), ["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]);
        assert_eq!(mechanisms(false), ["SCRAM-SHA-256"]);
        assert_eq!(select(b"SCRAM-SHA-256-PLUS", true), Ok(true));
        assert_eq!(select(b"SCRAM-SHA-256", true), Ok(false));
        assert_eq!(select(b"SCRAM-SHA-256", false), Ok(false));
        for (mech, plus) in [
            (&b"SCRAM-SHA-256-PLUS"[..], false),
            (b"SCRAM-SHA-1", true),
            (b"scram-sha-256", false),
            (b"", true),
        ] {
            let e = select(mech, plus).expect_err("not offered");
            assert_eq!(e.code, "08P01", "{e}");
            assert!(e.message.contains("invalid SASL authentication mechanism"));
        }
    }

    /// Every (mechanism, flag, PLUS offered) combination, against what Postgres answers.
    #[test]
    fn flags_are_refused_where_postgres_refuses_them() {
        let n = b"n,,n=,r=x".as_slice();
        let y = b"y,,n=,r=x".as_slice();
        let p = b"p=tls-server-end-point,,n=,r=x".as_slice();
        let unique = b"p=tls-unique,,n=,r=x".as_slice();
        let odd = b"q,,n=,r=x".as_slice();
        // (message, bound, plus offered) → None when accepted, else (SQLSTATE, text in it).
        let cases = [
            (n, false, false, None),
            (n, false, true, None),
            (y, false, false, None),
            (y, false, true, Some(("28000", "negotiation error"))),
            (p, true, true, None),
            (
                p,
                false,
                true,
                Some(("08P01", "includes channel binding data")),
            ),
            (
                p,
                false,
                false,
                Some(("08P01", "includes channel binding data")),
            ),
            (
                n,
                true,
                true,
                Some(("08P01", "does not include channel binding")),
            ),
            (
                y,
                true,
                true,
                Some(("08P01", "does not include channel binding")),
            ),
            (
                unique,
                true,
                true,
                Some(("08P01", "channel-binding type \"tls-unique\"")),
            ),
            (
                odd,
                false,
                true,
                Some(("08P01", "Unexpected channel-binding flag")),
            ),
        ];
        for (message, bound, plus, want) in cases {
            let got = check_flag(message, bound, plus).err().map(|e| {
                let text = format!("{} {}", e.message, e.detail.unwrap_or_default());
                (e.code, text)
            });
            let case = format!(
                "{} bound={bound} plus={plus}: {got:?}",
                String::from_utf8_lossy(message)
            );
            match (want, got) {
                (None, None) => {}
                (Some((code, text)), Some((got_code, got_text))) => {
                    assert_eq!(code, got_code, "{case}");
                    assert!(got_text.contains(text), "{case}");
                }
                _ => panic!("{case}"),
            }
        }
    }

    /// A SCRAM-SHA-256-PLUS exchange through `end_point` by postgres-protocol's client, bound
    /// to `hash`: whether the proxy's side accepts it.
    fn exchange(end_point: &EndPoint, binding: ChannelBinding) -> bool {
        let verifier = crate::auth::Verifier::from_password("pw");
        let mut client = ScramSha256::new(b"pw", binding);
        let Ok((server_first, waiting)) = end_point
            .scram()
            .on_client_first_message_with_secret(client.message(), verifier.secret())
        else {
            return false;
        };
        client
            .update(server_first.as_bytes())
            .expect("server-first");
        match waiting.on_client_final_message(client.message()) {
            Ok(server_final) => {
                client
                    .finish(server_final.as_bytes())
                    .expect("server signature");
                true
            }
            Err(_) => false,
        }
    }

    fn rcgen_cert(alg: &'static rcgen::SignatureAlgorithm) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate_for(alg).expect("key");
        let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.self_signed(&key).expect("cert").der().clone()
    }

    /// The certificate hash follows RFC 5929 as Postgres applies it: the signature's hash,
    /// SHA-256 in place of SHA-1; a signature without a hash of its own offers no binding.
    #[test]
    fn the_certificate_hash_follows_its_signature_algorithm() {
        let pem = |text: &str| CertificateDer::from_pem_slice(text.as_bytes()).expect("pem");
        let cases = [
            (
                "ecdsa-with-SHA256",
                rcgen_cert(&rcgen::PKCS_ECDSA_P256_SHA256),
                &digest::SHA256,
            ),
            (
                "ecdsa-with-SHA384",
                rcgen_cert(&rcgen::PKCS_ECDSA_P384_SHA384),
                &digest::SHA384,
            ),
            (
                "sha1WithRSAEncryption",
                pem(include_str!("testdata/rsa-sha1.pem")),
                &digest::SHA256,
            ),
            (
                "sha512WithRSAEncryption",
                pem(include_str!("testdata/rsa-sha512.pem")),
                &digest::SHA512,
            ),
        ];
        let hashes = [
            &digest::SHA256,
            &digest::SHA384,
            &digest::SHA512,
            &digest::SHA1_FOR_LEGACY_USE_ONLY,
        ];
        for (what, cert, want) in cases {
            let end_point = EndPoint::new(&cert).unwrap_or_else(|e| panic!("{what}: {e}"));
            for alg in hashes {
                let hash = digest::digest(alg, cert.as_ref()).as_ref().to_vec();
                let accepted = exchange(&end_point, ChannelBinding::tls_server_end_point(hash));
                assert_eq!(accepted, alg == want, "{what} hashed with {alg:?}");
            }
            // Without binding the same server lets the client in; claiming TLS without it
            // (`y`) is a downgrade.
            assert!(
                exchange(&end_point, ChannelBinding::unsupported()),
                "{what}: n"
            );
            assert!(
                !exchange(&end_point, ChannelBinding::unrequested()),
                "{what}: y"
            );
        }
        // No binding, so no PLUS (docs/OPERATIONS.md, `tls`): Ed25519 names no hash (Postgres
        // refuses it too); pgwire does not read the hash of RSA-PSS or ecdsa-with-SHA512.
        let unbound = [
            ("Ed25519", rcgen_cert(&rcgen::PKCS_ED25519)),
            ("rsassaPss", pem(include_str!("testdata/rsa-pss.pem"))),
            (
                "ecdsa-with-SHA512",
                pem(include_str!("testdata/ecdsa-sha512.pem")),
            ),
        ];
        for (what, cert) in unbound {
            assert!(EndPoint::new(&cert).is_err(), "{what}");
        }
    }
}
