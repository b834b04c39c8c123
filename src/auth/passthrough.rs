//! SCRAM pass-through, for users the proxy knows only by a SCRAM verifier (no password):
//! while such a client proves itself, its ClientKey falls out of the exchange
//! (ClientProof XOR HMAC(StoredKey, AuthMessage), checked against StoredKey = H(ClientKey));
//! kept in memory, it answers Postgres' own SCRAM challenge when the proxy logs in as that
//! user — valid exactly when Postgres holds the same verifier (same salt and iteration
//! count), as it does when the verifier came from it. PgBouncer does the same.
//!
//! Owns the recovery and a minimal SCRAM-SHA-256 client keyed by ClientKey (no channel
//! binding toward Postgres). Recovery reads a client's SCRAM-SHA-256-PLUS exchange as well:
//! the gs2 header and the client-final's `c=` enter the AuthMessage as the client sent them.
//! The key is never logged or shown.

use base64::Engine;
use ring::{digest, hmac};

use super::Verifier;

/// What a client proved, enough to log in as it: its ClientKey and the verifier it matched.
pub struct ClientKey {
    key: Vec<u8>,
    verifier: Verifier,
}

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientKey(..)")
    }
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data)
        .as_ref()
        .to_vec()
}

fn xor(a: &[u8], b: &[u8]) -> Vec<u8> {
    a.iter().zip(b).map(|(x, y)| x ^ y).collect()
}

/// `client-first-message-bare`: the client-first message without its GS2 header.
fn bare(client_first: &str) -> Option<&str> {
    let mut parts = client_first.splitn(3, ',');
    let (_cb, _authzid) = (parts.next()?, parts.next()?);
    parts.next()
}

impl ClientKey {
    /// The ClientKey of an exchange `verifier` accepted: from the client-first message (GS2
    /// header included), the server-first message and the client-final message. `None` when
    /// anything does not parse or the key does not hash to the verifier's StoredKey.
    pub fn recover(
        verifier: &Verifier,
        client_first: &[u8],
        server_first: &str,
        client_final: &[u8],
    ) -> Option<ClientKey> {
        let client_first = std::str::from_utf8(client_first).ok()?;
        let client_final = std::str::from_utf8(client_final).ok()?;
        let (without_proof, proof) = client_final.rsplit_once(",p=")?;
        let proof = base64::engine::general_purpose::STANDARD
            .decode(proof)
            .ok()?;
        let auth_message = format!("{},{server_first},{without_proof}", bare(client_first)?);
        let signature = hmac_sha256(&verifier.stored_key, auth_message.as_bytes());
        if proof.len() != signature.len() {
            return None;
        }
        let key = xor(&proof, &signature);
        let stored = digest::digest(&digest::SHA256, &key);
        super::ct_eq(stored.as_ref(), &verifier.stored_key).then(|| ClientKey {
            key,
            verifier: verifier.clone(),
        })
    }
}

/// A SCRAM-SHA-256 client that proves itself with a ClientKey.
pub struct KeyedScram<'a> {
    key: &'a ClientKey,
    nonce: String,
    client_first_bare: String,
    message: Vec<u8>,
    server_signature: Option<Vec<u8>>,
}

impl<'a> KeyedScram<'a> {
    pub fn new(key: &'a ClientKey) -> KeyedScram<'a> {
        let nonce = base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 18]>());
        let client_first_bare = format!("n=,r={nonce}");
        KeyedScram {
            key,
            message: format!("n,,{client_first_bare}").into_bytes(),
            nonce,
            client_first_bare,
            server_signature: None,
        }
    }

    /// The message to send now.
    pub fn message(&self) -> &[u8] {
        &self.message
    }

    /// Reads server-first; the next message is the client-final with the proof.
    pub fn update(&mut self, server_first: &[u8]) -> Result<(), String> {
        let text = std::str::from_utf8(server_first).map_err(|_| "server-first is not UTF-8")?;
        let field = |k: &str| {
            text.split(',')
                .find_map(|f| f.strip_prefix(k).map(str::to_owned))
        };
        let nonce = field("r=").ok_or("server-first has no nonce")?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err("the server's nonce does not extend ours".into());
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let salt = b64
            .decode(field("s=").ok_or("server-first has no salt")?)
            .map_err(|_| "malformed salt")?;
        let iterations: usize = field("i=")
            .and_then(|i| i.parse().ok())
            .ok_or("malformed iteration count")?;
        let v = &self.key.verifier;
        if salt != v.salt || iterations != v.iterations {
            return Err(
                "Postgres holds another SCRAM verifier for this user than the proxy (salt or \
                 iteration count differ): pass-through login needs the same one"
                    .into(),
            );
        }
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{text},{without_proof}", self.client_first_bare);
        let signature = hmac_sha256(&v.stored_key, auth_message.as_bytes());
        let proof = xor(&self.key.key, &signature);
        self.server_signature = Some(hmac_sha256(&v.server_key, auth_message.as_bytes()));
        self.message = format!("{without_proof},p={}", b64.encode(proof)).into_bytes();
        Ok(())
    }

    /// Checks server-final's signature: the server knows the verifier.
    pub fn finish(&mut self, server_final: &[u8]) -> Result<(), String> {
        let text = std::str::from_utf8(server_final).map_err(|_| "server-final is not UTF-8")?;
        if let Some(e) = text.strip_prefix("e=") {
            return Err(format!("the server refused the proof: {e}"));
        }
        let v = text
            .strip_prefix("v=")
            .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok())
            .ok_or("malformed server-final")?;
        let expected = self
            .server_signature
            .as_deref()
            .ok_or("server-final too early")?;
        if super::ct_eq(&v, expected) {
            Ok(())
        } else {
            Err("the server's signature does not match the verifier".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client (postgres-protocol's, with the password) against a verifier: the key the
    /// proxy recovers logs in like the password does, against the same verifier.
    #[test]
    fn a_recovered_key_logs_in_as_the_password_would() {
        use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
        let verifier = Verifier::from_password("s3cret");
        // The proxy's side of the client's login, by hand (as pgwire runs it).
        let mut client = ScramSha256::new(b"s3cret", ChannelBinding::unsupported());
        let client_first = client.message().to_vec();
        let cfb = std::str::from_utf8(&client_first).unwrap();
        let client_nonce = cfb.rsplit_once("r=").unwrap().1.to_owned();
        let b64 = base64::engine::general_purpose::STANDARD;
        let server_first = format!(
            "r={client_nonce}srv,s={},i={}",
            b64.encode(&verifier.salt),
            verifier.iterations
        );
        client.update(server_first.as_bytes()).unwrap();
        let client_final = client.message().to_vec();
        let key = ClientKey::recover(&verifier, &client_first, &server_first, &client_final)
            .expect("the key of a correct proof");
        // A wrong proof gives nothing.
        let mut bad = client_final.clone();
        let n = bad.len();
        bad[n - 3] ^= 1;
        assert!(ClientKey::recover(&verifier, &client_first, &server_first, &bad).is_none());

        // The key proves itself to a server holding the same verifier.
        let mut keyed = KeyedScram::new(&key);
        let first = String::from_utf8(keyed.message().to_vec()).unwrap();
        let nonce = first.rsplit_once("r=").unwrap().1.to_owned();
        let server_first = format!(
            "r={nonce}xyz,s={},i={}",
            b64.encode(&verifier.salt),
            verifier.iterations
        );
        keyed.update(server_first.as_bytes()).unwrap();
        let fin = String::from_utf8(keyed.message().to_vec()).unwrap();
        let (without_proof, proof) = fin.rsplit_once(",p=").unwrap();
        let auth = format!("n=,r={nonce},{server_first},{without_proof}");
        let sig = hmac_sha256(&verifier.stored_key, auth.as_bytes());
        let recovered = xor(&b64.decode(proof).unwrap(), &sig);
        assert_eq!(
            digest::digest(&digest::SHA256, &recovered).as_ref(),
            verifier.stored_key.as_slice(),
            "the server's check of the proof passes"
        );
        let server_sig = hmac_sha256(&verifier.server_key, auth.as_bytes());
        assert!(
            keyed
                .finish(format!("v={}", b64.encode(server_sig)).as_bytes())
                .is_ok()
        );
        assert!(keyed.finish(b"v=AAAA").is_err());
        // Another salt: refused before anything is sent.
        let mut other = KeyedScram::new(&key);
        let first = String::from_utf8(other.message().to_vec()).unwrap();
        let nonce = first.rsplit_once("r=").unwrap().1.to_owned();
        let e = other
            .update(format!("r={nonce}x,s=AAAA,i=4096").as_bytes())
            .unwrap_err();
        assert!(e.contains("another SCRAM verifier"), "{e}");
    }

    /// SCRAM-SHA-256-PLUS (as pgwire runs it for a TLS client): the client-first message
    /// starts with `p=tls-server-end-point,,` and the client-final's `c=` carries the
    /// certificate's hash, and the key recovered is the same one an unbound login proves.
    #[test]
    fn the_key_is_recovered_from_a_channel_bound_exchange() {
        use crate::auth::channel_binding::EndPoint;
        use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        let cert = params.self_signed(&key).expect("cert").der().clone();
        let end_point = EndPoint::new(&cert).expect("an ECDSA P-256 certificate binds");
        let hash = digest::digest(&digest::SHA256, cert.as_ref())
            .as_ref()
            .to_vec();
        let verifier = Verifier::from_password("s3cret");
        let recover = |binding: ChannelBinding| {
            let mut client = ScramSha256::new(b"s3cret", binding);
            let client_first = client.message().to_vec();
            let (server_first, waiting) = end_point
                .scram()
                .on_client_first_message_with_secret(&client_first, verifier.secret())
                .expect("client-first");
            client
                .update(server_first.as_bytes())
                .expect("server-first");
            let client_final = client.message().to_vec();
            waiting
                .on_client_final_message(&client_final)
                .expect("the proof and the binding check out");
            let key = ClientKey::recover(&verifier, &client_first, &server_first, &client_final)
                .expect("the key of a correct proof");
            (client_first, client_final, key.key)
        };
        let (first, last, bound) = recover(ChannelBinding::tls_server_end_point(hash));
        assert!(first.starts_with(b"p=tls-server-end-point,,n=,r="));
        assert!(!last.starts_with(b"c=biws,"), "c= carries the binding data");
        let (_, _, unbound) = recover(ChannelBinding::unsupported());
        assert_eq!(bound, unbound, "one password, one ClientKey");
    }
}
