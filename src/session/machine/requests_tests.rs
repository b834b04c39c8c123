//! Byte fixtures for the client → backend framing: client bytes are fed as reads (whole, or
//! cut at every size), and the tests check which requests reach the driver, which bytes go to
//! the backend unasked, and what the client is answered here.

use super::*;
use crate::session::tracker::{Expect, Kind, Mode};

fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = vec![tag];
    f.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    f.extend_from_slice(body);
    f
}

fn query(sql: &str) -> Vec<u8> {
    msg(b'Q', format!("{sql}\0").as_bytes())
}

fn sync() -> Vec<u8> {
    msg(b'S', b"")
}

/// The relay's client side: what reaches the driver, the backend, the client.
struct Session {
    requests: Requests,
    out: Outbox,
    client: BytesMut,
    attached: bool,
    /// Requests handed to the driver, frames as their bytes.
    got: Vec<Got>,
}

impl Session {
    fn new(max_message: usize) -> Session {
        Session {
            requests: Requests::new(BytesMut::new(), max_message),
            out: Outbox::default(),
            client: BytesMut::new(),
            attached: true,
            got: Vec::new(),
        }
    }

    fn read(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        self.requests.buf_mut().extend_from_slice(bytes);
        loop {
            match self
                .requests
                .next(self.attached, b'I', &mut self.out, &mut self.client)?
            {
                Request::Read => return Ok(()),
                Request::Frame { tag, len } => {
                    // As the driver does: handled in place, then given back.
                    let held = self.requests.hold();
                    assert_eq!(held[0], tag);
                    self.got.push(Got::Frame(held[..len].to_vec()));
                    self.requests.give_back(held, len);
                }
                r => self.got.push(Got::Other(r)),
            }
        }
    }

    fn read_in(&mut self, bytes: &[u8], size: usize) {
        for c in bytes.chunks(size) {
            self.read(c).expect("well-formed fixture");
        }
    }
}

/// What reached the driver: a frame's bytes, or anything else.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Frame(Vec<u8>),
    Other(Request),
}

fn frame(bytes: Vec<u8>) -> Got {
    Got::Frame(bytes)
}

#[test]
fn whole_requests_reach_the_driver_in_order_at_any_cut() {
    let parse = msg(b'P', b"\0SELECT $1\0\0\0");
    let bind = msg(b'B', b"\0\0\0\0\0\x01\0\0\0\x011\0\0");
    let execute = msg(b'E', b"\0\0\0\0\0");
    let stream = [
        query("SELECT 1"),
        parse.clone(),
        bind.clone(),
        execute.clone(),
        sync(),
    ]
    .concat();
    let want = vec![
        frame(query("SELECT 1")),
        frame(parse),
        frame(bind),
        frame(execute),
        frame(sync()),
    ];
    for size in 1..=stream.len() {
        let mut s = Session::new(1 << 20);
        s.read_in(&stream, size);
        assert_eq!(s.got, want, "reads of {size} bytes");
        assert!(!s.requests.has_buffered() && s.out.is_empty());
    }
}

#[test]
fn copy_data_and_flush_go_straight_to_an_attached_backend() {
    let data = msg(b'd', &[b'x'; 1000]);
    let stream = [data.clone(), msg(b'H', b""), msg(b'c', b"")].concat();
    for size in [1, 7, 100, 999, stream.len()] {
        let mut s = Session::new(1 << 20);
        s.read_in(&stream, size);
        assert!(s.got.is_empty(), "nothing for the driver");
        assert_eq!(s.out.pending(), &stream[..], "reads of {size} bytes");
    }
    // With no backend attached they go nowhere (Postgres would ignore them outside COPY).
    let mut s = Session::new(1 << 20);
    s.attached = false;
    s.read(&stream).unwrap();
    assert!(s.got.is_empty() && s.out.is_empty() && !s.requests.has_buffered());
}

#[test]
fn a_long_copy_data_is_streamed_before_it_is_whole() {
    let mut s = Session::new(1 << 20);
    let data = msg(b'd', &[b'y'; 50_000]);
    s.read(&data[..10_000]).unwrap();
    assert_eq!(s.out.pending().len(), 10_000, "forwarded as it arrives");
    assert!(!s.requests.has_buffered());
    s.read(&[&data[10_000..], &query("SELECT 1")[..]].concat())
        .unwrap();
    assert_eq!(s.out.pending(), &data[..]);
    assert_eq!(s.got, vec![frame(query("SELECT 1"))]);
}

#[test]
fn an_oversized_request_is_refused_and_dropped_without_being_buffered() {
    let mut s = Session::new(100);
    let big = query(&"x".repeat(10_000));
    s.read(&big[..50]).unwrap();
    assert_eq!(
        s.got,
        vec![Got::Other(Request::TooLarge {
            tag: b'Q',
            total: big.len()
        })],
        "refused at its header"
    );
    assert!(!s.requests.has_buffered());
    s.read_in(&[&big[50..], &query("SELECT 2")[..]].concat(), 333);
    assert_eq!(s.got.len(), 2);
    assert_eq!(
        s.got[1],
        frame(query("SELECT 2")),
        "the next request is intact"
    );
    // CopyData has no such limit: it is streamed.
    let mut s = Session::new(100);
    s.read(&msg(b'd', &[0; 500])).unwrap();
    assert!(s.got.is_empty());
    assert_eq!(s.out.pending().len(), 505);
}

#[test]
fn after_a_refusal_the_batch_is_dropped_up_to_its_sync_which_is_answered_here() {
    let mut s = Session::new(200);
    s.requests.skip_until_sync();
    let big_bind = msg(b'B', &[0; 1000]);
    let rest = [
        msg(b'D', b"P\0"),
        msg(b'E', b"\0\0\0\0\0"),
        big_bind,
        msg(b'd', &[1; 300]),
        sync(),
        query("SELECT 3"),
    ]
    .concat();
    s.read_in(&rest, 64);
    // Nothing of the batch reached the driver or the backend, not even the oversized Bind's
    // refusal (one error per batch, like Postgres); its Sync got ReadyForQuery here.
    assert_eq!(s.got, vec![frame(query("SELECT 3"))]);
    assert!(s.out.is_empty());
    assert_eq!(&s.client[..], &msg(b'Z', b"I")[..]);
    assert!(!s.requests.skipping());
}

#[test]
fn terminate_and_a_late_password_message_end_the_session() {
    let mut s = Session::new(1 << 20);
    s.read(&msg(b'X', b"")).unwrap();
    assert_eq!(s.got, vec![Got::Other(Request::Terminate)]);
    let mut s = Session::new(1 << 20);
    s.requests.skip_until_sync();
    s.read(&msg(b'X', b"")).unwrap();
    assert_eq!(
        s.got,
        vec![Got::Other(Request::Terminate)],
        "also while skipping"
    );
    let mut s = Session::new(1 << 20);
    s.read(&msg(b'p', b"secret\0")).unwrap();
    assert!(matches!(s.got[..], [Got::Other(Request::Violation(_))]));
}

#[test]
fn malformed_frames_are_errors() {
    let mut s = Session::new(1 << 20);
    assert!(matches!(
        s.read(&[b'Q', 0, 0, 0, 2]),
        Err(FrameError::BadLength { tag: b'Q', .. })
    ));
    let mut s = Session::new(1 << 20);
    assert!(matches!(
        s.read(&msg(b'Z', b"I")),
        Err(FrameError::UnknownType { tag: b'Z', .. })
    ));
}

#[test]
fn bytes_passed_through_keep_their_place_among_requests() {
    // A COPY statement followed at once by its data (pgx sends both before any reply): the
    // driver writes the Query when it gets it, and the data must follow it, not precede it.
    let mut s = Session::new(1 << 20);
    let copy = query("COPY t FROM STDIN");
    s.read(&copy).unwrap();
    let Got::Frame(frame) = s.got.pop().unwrap() else {
        panic!("a frame")
    };
    s.out.send(Expect::new(Kind::Query, Mode::Forward), &frame);
    s.read(&[msg(b'd', b"1\n"), msg(b'c', b"")].concat())
        .unwrap();
    assert_eq!(
        s.out.pending(),
        &[copy, msg(b'd', b"1\n"), msg(b'c', b"")].concat()[..]
    );
}

#[test]
fn a_held_frame_is_read_in_place_and_what_arrives_meanwhile_goes_behind_the_rest() {
    // Two queries in one read; while the first is handled (a checkout waits, and the client's
    // next bytes are read meanwhile), the second must still come next, then the new bytes.
    let mut s = Session::new(1 << 20);
    let (one, two, three) = (query("SELECT 1"), query("SELECT 2"), query("SELECT 3"));
    s.requests
        .buf_mut()
        .extend_from_slice(&[one.clone(), two.clone()].concat());
    let r = s
        .requests
        .next(true, b'I', &mut s.out, &mut s.client)
        .unwrap();
    assert_eq!(
        r,
        Request::Frame {
            tag: b'Q',
            len: one.len()
        }
    );
    let held = s.requests.hold();
    assert!(!s.requests.has_buffered(), "the frame is not framed twice");
    s.requests.buf_mut().extend_from_slice(&three[..3]);
    assert_eq!(&held[..one.len()], &one[..], "read where it arrived");
    s.requests.give_back(held, one.len());
    s.read(&three[3..]).unwrap();
    assert_eq!(s.got, vec![frame(two), frame(three)]);
    assert!(!s.requests.has_buffered());
    // The stand-in is kept for the next hold (a wait's read allocates once per session)…
    let held = s.requests.hold();
    assert!(
        s.requests.buf_mut().capacity() >= 3,
        "the stand-in is reused"
    );
    s.requests
        .buf_mut()
        .extend_from_slice(&vec![b'x'; SPARE_MAX + 1]);
    s.requests.give_back(held, 0);
    assert_eq!(s.requests.buf_mut().len(), SPARE_MAX + 1);
    // …unless a burst made it large.
    let held = s.requests.hold();
    assert_eq!(
        s.requests.buf_mut().capacity(),
        0,
        "a large stand-in is let go"
    );
    s.requests.give_back(held, 0);
}
