//! Credentials and the password checks of both sides: what a client must prove to the proxy
//! (SCRAM-SHA-256 verifiers, md5 hashes, trust) and what the proxy tells Postgres.
//!
//! Secrets are derived once, when the config is loaded, so a login costs an HMAC and not a
//! PBKDF2 run. Unknown users get a mock verifier and walk the same SCRAM exchange, so unknown
//! users and wrong passwords look identical (28P01) in text and timing. No socket I/O here.
//!
//! The mock verifier's salt is not shared: like Postgres' mock authentication nonce, it is
//! HMAC-SHA-256(per-credentials random secret, user name) cut to the length of a real salt,
//! with a real verifier's iteration count. An unknown name therefore gets the same salt on
//! every attempt and each name its own, as a real user does, so the server-first message does
//! not tell which users exist. (Real verifiers get fresh salts when the config is reloaded;
//! so does the mock secret.)

pub mod cache;
pub mod channel_binding;
pub mod passthrough;

use std::borrow::Cow;
use std::collections::HashMap;

use base64::Engine;
use pgwire::api::auth::sasl::scram::ScramSecret;

use crate::config::{AuthMethod, Config};

/// Salt length of the verifiers the proxy derives (Postgres' `SCRAM_DEFAULT_SALT_LEN`).
const SALT_LEN: usize = 16;

/// A SCRAM-SHA-256 verifier (`SCRAM-SHA-256$iter:salt$stored:server`), decoded.
#[derive(Clone)]
pub struct Verifier {
    salt: Vec<u8>,
    iterations: usize,
    stored_key: Vec<u8>,
    server_key: Vec<u8>,
}

impl Verifier {
    /// Derives a verifier from a plaintext password (PBKDF2, 4096 rounds).
    pub fn from_password(password: &str) -> Verifier {
        let s = postgres_protocol::password::scram_sha_256(password.as_bytes());
        // The string we just generated always has the documented shape.
        Verifier::parse(&s).unwrap_or_else(|| Verifier {
            salt: vec![0; 16],
            iterations: 4096,
            stored_key: vec![0; 32],
            server_key: vec![0; 32],
        })
    }

    /// Parses Postgres' `pg_authid.rolpassword` SCRAM format.
    pub fn parse(s: &str) -> Option<Verifier> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let (iter_salt, keys) = s.strip_prefix("SCRAM-SHA-256$")?.split_once('$')?;
        let (iter, salt) = iter_salt.split_once(':')?;
        let (stored, server) = keys.split_once(':')?;
        Some(Verifier {
            salt: b64.decode(salt).ok()?,
            iterations: iter.parse().ok()?,
            stored_key: b64.decode(stored).ok()?,
            server_key: b64.decode(server).ok()?,
        })
    }

    /// A fresh pgwire secret for one exchange (the state machine consumes it).
    pub fn secret(&self) -> ScramSecret {
        ScramSecret::Verifier {
            salt: self.salt.clone(),
            iterations: self.iterations,
            stored_key: self.stored_key.clone(),
            server_key: self.server_key.clone(),
        }
    }
}

/// What the proxy knows about one user.
#[derive(Clone)]
pub struct UserAuth {
    pub method: AuthMethod,
    pub verifier: Option<Verifier>,
    /// `md5(password || user)` as hex, for md5 client auth.
    pub md5_inner: Option<String>,
    /// Password the proxy uses toward Postgres for this user.
    pub backend_password: Option<String>,
}

impl std::fmt::Debug for UserAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserAuth")
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

/// All users that may log in, plus what unknown ones are tested against.
pub struct Credentials {
    users: HashMap<String, UserAuth>,
    /// Keys no password matches and the iteration count of a real verifier; the salt is
    /// replaced per user name ([`Credentials::verifier_or_mock`]).
    mock: Verifier,
    /// Key of the per-name mock salts; random per credentials set, never shown.
    mock_salt_key: ring::hmac::Key,
    /// Known users asking for md5 and for SCRAM: an unknown user is challenged with one or
    /// the other in the same proportion ([`Credentials::method_for_unknown`]).
    md5_users: u32,
    scram_users: u32,
}

impl Credentials {
    pub fn from_config(cfg: &Config) -> Credentials {
        let mut users = HashMap::new();
        let mut add = |name: &str, password: Option<&str>, method: AuthMethod| {
            // A verifier in place of the password: SCRAM only, and pass-through toward
            // Postgres (`passthrough`).
            let auth = match password.and_then(|p| {
                p.starts_with("SCRAM-SHA-256$")
                    .then(|| Verifier::parse(p))
                    .flatten()
            }) {
                Some(v) => UserAuth {
                    method,
                    verifier: Some(v),
                    md5_inner: None,
                    backend_password: None,
                },
                None => UserAuth {
                    method,
                    verifier: password.map(Verifier::from_password),
                    md5_inner: password.map(|p| md5_inner(name, p)),
                    backend_password: password.map(str::to_string),
                },
            };
            users.insert(name.to_string(), auth);
        };
        if let Some(u) = cfg.backend_url() {
            add(&u.user, u.password.as_deref(), cfg.auth.method);
        }
        for u in &cfg.auth.users {
            add(
                &u.name,
                u.password.as_deref(),
                u.method.unwrap_or(cfg.auth.method),
            );
        }
        let secret: [u8; 32] = rand::random();
        let count = |m: AuthMethod| users.values().filter(|u| u.method == m).count() as u32;
        let (md5_users, scram_users) = (count(AuthMethod::Md5), count(AuthMethod::ScramSha256));
        Credentials {
            md5_users,
            scram_users,
            users,
            mock: Verifier::from_password(&random_hex(16)),
            mock_salt_key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret),
        }
    }

    pub fn user(&self, name: &str) -> Option<&UserAuth> {
        self.users.get(name)
    }

    /// The method an unknown user `name` is challenged with, so the challenge does not tell
    /// whether a user exists: where known users ask for both md5 and SCRAM, md5 for the same
    /// share of unknown names (chosen by a keyed hash of the name: the same name always gets
    /// the same method); else the one method known users get, or `default` when none does.
    pub fn method_for_unknown(&self, name: &str, default: AuthMethod) -> AuthMethod {
        let (m, s) = (u64::from(self.md5_users), u64::from(self.scram_users));
        if default == AuthMethod::Trust || m + s == 0 {
            return default;
        }
        let tag = ring::hmac::sign(&self.mock_salt_key, name.as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&tag.as_ref()[SALT_LEN..SALT_LEN + 8]);
        if u64::from_be_bytes(b) % (m + s) < m {
            AuthMethod::Md5
        } else {
            AuthMethod::ScramSha256
        }
    }

    /// The verifier to run SCRAM with: the user's, or a mock that no password matches, whose
    /// salt is stable for `name` and different for every other name (see the module doc).
    pub fn verifier_or_mock(&self, name: &str) -> Cow<'_, Verifier> {
        if let Some(v) = self.users.get(name).and_then(|u| u.verifier.as_ref()) {
            return Cow::Borrowed(v);
        }
        let tag = ring::hmac::sign(&self.mock_salt_key, name.as_bytes());
        let mut mock = self.mock.clone();
        mock.salt = tag.as_ref()[..SALT_LEN].to_vec();
        Cow::Owned(mock)
    }
}

/// The inner md5 hash Postgres stores: hex(md5(password || user)).
pub fn md5_inner(user: &str, password: &str) -> String {
    // postgres_protocol returns "md5" + hex; we keep only the hex.
    let s = postgres_protocol::password::md5(password.as_bytes(), user);
    s.trim_start_matches("md5").to_string()
}

/// Checks an md5 PasswordMessage (`md5` + hex(md5(inner || salt))) in constant time.
/// Computed on the stack: this runs once per md5 login.
pub fn md5_response_matches(inner_hex: &str, salt: [u8; 4], response: &[u8]) -> bool {
    use md5::Digest;
    let mut h = md5::Md5::new();
    h.update(inner_hex.as_bytes());
    h.update(salt);
    let digest = h.finalize();
    let mut expected = *b"md5________________________________";
    // 16 bytes into 32 characters: the lengths always match.
    let _ = hex::encode_to_slice(digest, &mut expected[3..]);
    ct_eq(&expected, response)
}

/// Constant-time equality for secrets.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Random lowercase hex, for dummy secrets and nonces.
pub fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_matches_what_libpq_sends() {
        let salt = [1, 2, 3, 4];
        let sent = postgres_protocol::authentication::md5_hash(b"app", b"secret", salt);
        let inner = md5_inner("app", "secret");
        assert!(md5_response_matches(&inner, salt, sent.as_bytes()));
        assert!(!md5_response_matches(&inner, [4, 3, 2, 1], sent.as_bytes()));
        // Every salt byte and password length against libpq's own computation; a response
        // off by one character, upper-case or cut short is refused.
        for (i, password) in ["", "p", "a much longer password with spaces"]
            .iter()
            .enumerate()
        {
            for salt in [[0, 0, 0, 0], [255, 254, 1, 0], [i as u8, 0x10, 0xab, 0x7f]] {
                let sent =
                    postgres_protocol::authentication::md5_hash(b"u", password.as_bytes(), salt);
                let inner = md5_inner("u", password);
                assert!(md5_response_matches(&inner, salt, sent.as_bytes()));
                let mut off = sent.clone().into_bytes();
                off[10] = if off[10] == b'0' { b'1' } else { b'0' };
                assert!(!md5_response_matches(&inner, salt, &off));
                assert!(!md5_response_matches(
                    &inner,
                    salt,
                    sent.to_uppercase().as_bytes()
                ));
                assert!(!md5_response_matches(&inner, salt, &sent.as_bytes()[..34]));
            }
        }
    }

    #[test]
    fn verifier_roundtrip() {
        let s = postgres_protocol::password::scram_sha_256(b"pw");
        assert!(Verifier::parse(&s).is_some());
        assert!(Verifier::parse("SCRAM-SHA-256$x").is_none());
    }

    fn salt_and_iterations(v: &Verifier) -> (Vec<u8>, usize) {
        match v.secret() {
            ScramSecret::Verifier {
                salt, iterations, ..
            } => (salt, iterations),
            _ => panic!("a verifier's secret is a verifier"),
        }
    }

    #[test]
    fn unknown_users_get_a_stable_salt_of_their_own() {
        let cfg = Config::from_yaml(
            "auth:\n  users:\n    - { name: alice, password: pw1 }\n    - { name: bob, password: pw2 }\n",
        )
        .unwrap();
        let creds = Credentials::from_config(&cfg);
        let (ghost, ghost_iter) = salt_and_iterations(&creds.verifier_or_mock("ghost"));
        let (again, _) = salt_and_iterations(&creds.verifier_or_mock("ghost"));
        let (other, _) = salt_and_iterations(&creds.verifier_or_mock("phantom"));
        let (alice, alice_iter) = salt_and_iterations(&creds.verifier_or_mock("alice"));
        let (bob, _) = salt_and_iterations(&creds.verifier_or_mock("bob"));
        assert_eq!(
            ghost, again,
            "an unknown user's salt is stable across attempts"
        );
        assert_ne!(ghost, other, "two unknown users get different salts");
        assert_ne!(alice, bob);
        assert_eq!(
            ghost.len(),
            alice.len(),
            "a mock salt is as long as a real one"
        );
        assert_eq!(ghost.len(), SALT_LEN);
        assert_eq!(
            ghost_iter, alice_iter,
            "same iteration count as a real verifier"
        );
        assert!(![alice.as_slice(), bob.as_slice()].contains(&ghost.as_slice()));
        // A fresh credentials set (a reload) has a new secret, as real users get new salts.
        let reloaded = Credentials::from_config(&cfg);
        assert_ne!(
            salt_and_iterations(&reloaded.verifier_or_mock("ghost")).0,
            ghost
        );
    }

    /// With md5 and SCRAM users both configured, an unknown name is challenged like a known
    /// user would be, in the same proportion, and the same way on every attempt.
    #[test]
    fn an_unknown_users_challenge_does_not_reveal_that_it_is_unknown() {
        let cfg = Config::from_yaml(
            "auth:\n  method: scram-sha-256\n  users:\n    - { name: alice, password: pw1, method: md5 }\n    - { name: bob, password: pw2 }\n",
        )
        .unwrap();
        let creds = Credentials::from_config(&cfg);
        let default = AuthMethod::ScramSha256;
        let names: Vec<String> = (0..2000).map(|i| format!("ghost{i}")).collect();
        let md5 = names
            .iter()
            .filter(|n| creds.method_for_unknown(n, default) == AuthMethod::Md5)
            .count();
        assert!(
            (800..1200).contains(&md5),
            "{md5} of 2000 unknown names got md5"
        );
        for n in &names[..20] {
            assert_eq!(
                creds.method_for_unknown(n, default),
                creds.method_for_unknown(n, default),
                "stable per name"
            );
        }
        // One method for everyone known: unknown users get it too.
        let only_md5 = Config::from_yaml(
            "auth:\n  method: scram-sha-256\n  users:\n    - { name: alice, password: pw1, method: md5 }\n",
        )
        .unwrap();
        let creds = Credentials::from_config(&only_md5);
        assert!(
            names
                .iter()
                .all(|n| creds.method_for_unknown(n, default) == AuthMethod::Md5)
        );
    }

    #[test]
    fn ct_eq_works() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }
}
