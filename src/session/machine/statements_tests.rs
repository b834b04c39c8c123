//! Fixtures for statement renaming: client Parse/Bind/Describe/Close frames in, the bytes the
//! backend gets and the replies they are owed out, on backends that hold the statement, lack
//! it, are full, or hold a stale plan of it.

use bytes::{Bytes, BytesMut};

use super::*;
use crate::classify::Classifier;

fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![tag];
    f.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// A Parse frame and its body.
fn parse_frame(name: &str, sql: &str) -> (Vec<u8>, Bytes) {
    let body = format!("{name}\0{sql}\0\0\0");
    (msg(b'P', body.as_bytes()), Bytes::from(body.into_bytes()))
}

/// A Bind of statement `name` with one text parameter `1`, text results.
fn bind_frame(name: &str) -> Vec<u8> {
    let mut body = format!("\0{name}\0").into_bytes();
    body.extend_from_slice(b"\0\0\0\x01\0\0\0\x011\0\0");
    msg(b'B', &body)
}

/// One session's statements, a backend's cache, and what goes to that backend.
struct Fixture {
    st: Statements,
    prepared: PreparedCache,
    stale: Vec<u64>,
    out: Outbox,
    classifier: Classifier,
}

impl Fixture {
    fn new(transaction_mode: bool) -> Fixture {
        Fixture {
            st: Statements::new(transaction_mode, 7, 3),
            prepared: PreparedCache::new(2, 1 << 20),
            stale: Vec::new(),
            out: Outbox::default(),
            classifier: Classifier::new(0, 1 << 16),
        }
    }

    /// Runs `f` on the statements, this backend and the outbox.
    fn with(&mut self, f: impl FnOnce(&mut Statements, Server<'_>, &mut Outbox)) {
        let srv = Server {
            prepared: &mut self.prepared,
            stale: &mut self.stale,
            pool: "test",
        };
        f(&mut self.st, srv, &mut self.out);
    }

    fn srv(&mut self) -> Server<'_> {
        Server {
            prepared: &mut self.prepared,
            stale: &mut self.stale,
            pool: "test",
        }
    }

    fn parse(&mut self, name: &str, sql: &str) {
        let (frame, body) = parse_frame(name, sql);
        let p = Parse::read(&body).unwrap();
        let class = self.classifier.classify(sql);
        self.with(|st, srv, out| st.parse(&frame, &body, p, class, srv, out));
    }

    fn bind(&mut self, name: &str) {
        let frame = bind_frame(name);
        let b = Bind::read(&frame[5..]).unwrap();
        self.with(|st, srv, out| st.bind(&frame, b, srv, out));
    }

    fn target(&mut self, tag: u8, kind: u8, name: &str) {
        let frame = msg(tag, format!("{}{name}\0", char::from(kind)).as_bytes());
        let t = Target::read(&frame[5..]).unwrap();
        self.with(|st, srv, out| st.describe_or_close(tag, &frame, t, srv, out));
    }

    /// What the backend got since the last call, as (tag, statement name it names) pairs,
    /// and forgets it.
    fn sent(&mut self) -> Vec<(char, String)> {
        let mut v = Vec::new();
        let mut rest = self.out.pending();
        while !rest.is_empty() {
            let len = i32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            let body = &rest[5..1 + len];
            let name = match rest[0] {
                b'P' => body.split(|b| *b == 0).next().unwrap().to_vec(),
                b'B' => body.split(|b| *b == 0).nth(1).unwrap().to_vec(),
                b'D' | b'C' => body[1..].split(|b| *b == 0).next().unwrap().to_vec(),
                _ => Vec::new(),
            };
            v.push((char::from(rest[0]), String::from_utf8(name).unwrap()));
            rest = &rest[1 + len..];
        }
        self.out.clear();
        v
    }

    /// The proxy name of the client's statement `name`.
    fn proxy_name(&self, name: &str) -> String {
        let hash = self.st.class_and_hash(name.as_bytes()).1.expect("renamed");
        String::from_utf8(server_name(hash).to_vec()).unwrap()
    }

    /// Answers owed by the proxy itself, taken off the queue in order.
    fn answered_here(&mut self) -> Vec<u8> {
        let mut client = BytesMut::new();
        self.out.t.answer_synthetic(&mut client);
        client.to_vec()
    }
}

#[test]
fn a_named_parse_goes_out_under_the_shared_proxy_name() {
    let mut f = Fixture::new(true);
    f.parse("q1", "SELECT $1::int");
    let name = f.proxy_name("q1");
    assert!(name.starts_with("_pgsl_") && name.len() == 22);
    assert_eq!(f.sent(), vec![('P', name.clone())]);
    f.bind("q1");
    assert_eq!(f.sent(), vec![('B', name)]);
    assert!(f.st.knows(b"q1"));
}

#[test]
fn the_same_text_under_another_name_or_session_shares_the_server_statement() {
    let mut f = Fixture::new(true);
    f.parse("a", "SELECT 1");
    f.sent();
    // Another client's name for the same text, on the same backend: answered here.
    f.parse("b", "SELECT 1");
    assert!(f.sent().is_empty(), "nothing goes to the backend");
    assert_eq!(f.proxy_name("a"), f.proxy_name("b"));
    // The Parse before it still owes its reply: ours waits its turn.
    assert!(f.answered_here().is_empty());
    f.out.t.on_backend(b'1', None);
    assert_eq!(f.answered_here(), msg(b'1', b""));
}

#[test]
fn a_bind_on_a_backend_that_lacks_the_statement_is_preceded_by_its_parse() {
    let mut f = Fixture::new(true);
    f.parse("q", "SELECT 2");
    f.sent();
    // The next transaction borrows another backend: an empty cache, nothing owed.
    f.prepared = PreparedCache::new(2, 1 << 20);
    f.out = Outbox::default();
    f.bind("q");
    let name = f.proxy_name("q");
    // The kept text and types, cut from the client's Parse, go out whole under the new name.
    let parse = msg(b'P', format!("{name}\0SELECT 2\0\0\0").as_bytes());
    assert_eq!(&f.out.pending()[..parse.len()], &parse[..]);
    assert_eq!(f.sent(), vec![('P', name.clone()), ('B', name)]);
    // The injected Parse's reply is the proxy's own: swallowed, not the client's.
    assert!(!f.out.t.on_backend(b'1', None).forward);
    assert!(f.out.t.on_backend(b'2', None).forward);
}

#[test]
fn a_full_backend_closes_its_least_recently_used_statement_first() {
    let mut f = Fixture::new(true);
    f.parse("a", "SELECT 'a'");
    f.parse("b", "SELECT 'b'");
    f.bind("a"); // `a` used last: `b` is the least recently used
    f.sent();
    let b = f.proxy_name("b");
    f.parse("c", "SELECT 'c'");
    assert_eq!(f.sent(), vec![('C', b), ('P', f.proxy_name("c"))]);
}

#[test]
fn a_stale_statement_is_closed_then_prepared_again() {
    let mut f = Fixture::new(true);
    f.parse("s", "SELECT * FROM t");
    f.sent();
    let hash = f.st.class_and_hash(b"s").1.unwrap();
    // Postgres said the cached plan's result type changed.
    f.srv().forget_stale(hash);
    f.bind("s");
    let name = f.proxy_name("s");
    assert_eq!(
        f.sent(),
        vec![('C', name.clone()), ('P', name.clone()), ('B', name)]
    );
    assert!(f.stale.is_empty());
}

#[test]
fn describe_of_a_statement_is_renamed_and_of_a_portal_is_not() {
    let mut f = Fixture::new(true);
    f.parse("d", "SELECT 3");
    f.sent();
    f.target(b'D', b'S', "d");
    f.target(b'D', b'P', "");
    assert_eq!(
        f.sent(),
        vec![('D', f.proxy_name("d")), ('D', String::new())]
    );
}

#[test]
fn close_forgets_the_clients_name_and_keeps_the_server_statement() {
    let mut f = Fixture::new(true);
    f.parse("c", "SELECT 4");
    f.sent();
    f.out.t.on_backend(b'1', None);
    f.target(b'C', b'S', "c");
    assert!(f.sent().is_empty(), "nothing goes to the backend");
    assert_eq!(
        f.answered_here(),
        msg(b'3', b""),
        "CloseComplete from the proxy"
    );
    assert!(!f.st.knows(b"c"));
    assert_eq!(f.prepared.len(), 1, "still prepared for others");
    // A Bind of the closed name now goes as it is: Postgres tells the client it is unknown.
    f.bind("c");
    assert_eq!(f.sent(), vec![('B', "c".to_owned())]);
}

#[test]
fn session_mode_keeps_the_clients_names() {
    let mut f = Fixture::new(false);
    f.parse("mine", "SELECT 5");
    f.bind("mine");
    f.target(b'D', b'S', "mine");
    f.target(b'C', b'S', "mine");
    assert_eq!(
        f.sent(),
        vec![
            ('P', "mine".to_owned()),
            ('B', "mine".to_owned()),
            ('D', "mine".to_owned()),
            ('C', "mine".to_owned())
        ]
    );
    assert!(f.prepared.is_empty(), "nothing in the shared cache");
}

#[test]
fn the_unnamed_statement_passes_through_and_keeps_its_classification() {
    let mut f = Fixture::new(true);
    f.parse("", "SELECT set_config('a.b', $1, false)");
    f.bind("");
    assert_eq!(f.sent(), vec![('P', String::new()), ('B', String::new())]);
    assert!(f.st.class_and_hash(b"").0.is_some());
    assert!(
        f.st.text_of(b"")
            .is_some_and(|t| t.starts_with(b"SELECT set_config")),
        "kept: the settings read-back needs the names it sets"
    );
    f.parse("", "SELECT 6");
    assert_eq!(f.st.text_of(b"").as_deref(), Some(&b"SELECT 6"[..]));
}

/// The unnamed statement on a backend the client got back from the pool is someone else's:
/// the client's own is parsed there again before its Bind, once.
#[test]
fn the_unnamed_statement_is_parsed_again_on_another_backend() {
    let mut f = Fixture::new(true);
    assert!(!f.st.has_unnamed());
    f.parse("", "SELECT $1::int + 1");
    f.sent();
    assert!(f.st.has_unnamed());
    // Same backend: nothing to do.
    f.st.ensure_unnamed(b"", &mut f.out);
    assert!(f.sent().is_empty());
    f.st.unnamed_left();
    f.st.ensure_unnamed(b"", &mut f.out);
    f.bind("");
    assert_eq!(f.sent(), vec![('P', String::new()), ('B', String::new())]);
    f.st.ensure_unnamed(b"", &mut f.out);
    assert!(f.sent().is_empty(), "parsed once");
    // Named statements and session mode are not its business.
    f.st.unnamed_left();
    f.st.ensure_unnamed(b"x", &mut f.out);
    assert!(f.sent().is_empty());
    let mut s = Fixture::new(false);
    s.parse("", "SELECT 1");
    s.sent();
    s.st.unnamed_left();
    s.st.ensure_unnamed(b"", &mut s.out);
    assert!(s.sent().is_empty());
}

#[test]
fn the_statement_limit_refuses_a_new_name_but_not_a_redefinition() {
    let mut f = Fixture::new(true);
    for (i, n) in ["a", "b", "c"].into_iter().enumerate() {
        assert!(f.st.over_limit(n.as_bytes(), 10).is_none());
        f.parse(n, &format!("SELECT {i}"));
    }
    let e = f.st.over_limit(b"d", 10).expect("over the limit of 3");
    assert_eq!(e.code, "54000");
    assert!(
        f.st.over_limit(b"a", 10).is_none(),
        "redefining a held name"
    );
    assert!(f.st.over_limit(b"", 10).is_none(), "the unnamed statement");
}

/// Statement texts count in bytes too: a Parse that would take the client's statements over
/// `limits.max_client_statement_bytes` is refused; a Close gives its bytes back.
#[test]
fn the_statement_bytes_limit_refuses_a_parse_that_would_exceed_it() {
    let mut f = Fixture::new(true);
    f.st = Statements::new(true, 7, 100).with_max_bytes(100);
    let long = format!("SELECT '{}'", "x".repeat(60));
    assert!(f.st.over_limit(b"a", long.len() + 4).is_none());
    f.parse("a", &long);
    let e =
        f.st.over_limit(b"b", long.len() + 4)
            .expect("over 100 bytes");
    assert_eq!(e.code, "54000");
    assert!(
        e.message.contains("max_client_statement_bytes"),
        "{}",
        e.message
    );
    assert!(
        f.st.over_limit(b"a", long.len() + 4).is_none(),
        "redefining a name replaces its bytes"
    );
    f.target(b'C', b'S', "a");
    assert!(
        f.st.over_limit(b"b", long.len() + 4).is_none(),
        "closed: bytes back"
    );
}

#[test]
fn two_texts_sharing_a_hash_are_never_confused() {
    let mut f = Fixture::new(true);
    f.parse("x", "SELECT 7");
    f.sent();
    let hash = f.st.class_and_hash(b"x").1.unwrap();
    // Another text under the same hash (as if it collided): not a hit, marked stale.
    assert!(!f.srv().has(hash, b"SELECT 8", b"\0\0"));
    assert_eq!(f.stale, vec![hash]);
    // The next use of `x` closes the server statement and prepares `x`'s text again.
    f.bind("x");
    let name = f.proxy_name("x");
    assert_eq!(
        f.sent(),
        vec![('C', name.clone()), ('P', name.clone()), ('B', name)]
    );
}

/// A Parse kept without sending it (a shared read answered the client): nothing goes to
/// the backend then, and the statement is prepared where its next Bind runs.
#[test]
fn a_remembered_parse_is_prepared_at_its_next_bind() {
    let mut f = Fixture::new(true);
    for name in ["q1", ""] {
        let sql = "SELECT $1::int";
        let (_, body) = parse_frame(name, sql);
        let p = Parse::read(&body).unwrap();
        let class = f.classifier.classify(sql);
        f.st.remember(&body, p, class);
        assert_eq!(f.sent(), vec![], "nothing sent for {name:?}");
        let (text, types) = f.st.text_and_types(name.as_bytes()).expect("known");
        assert_eq!((&text[..], &types[..]), (sql.as_bytes(), &b"\0\0"[..]));
    }
    assert!(f.st.has_unnamed());
    let name = f.proxy_name("q1");
    f.bind("q1");
    assert_eq!(f.sent(), vec![('P', name.clone()), ('B', name)]);
    // The unnamed one is parsed again before its Bind.
    f.with(|st, _, out| st.ensure_unnamed(b"", out));
    assert_eq!(f.sent(), vec![('P', String::new())]);
    assert!(f.st.text_and_types(b"never").is_none());
}
