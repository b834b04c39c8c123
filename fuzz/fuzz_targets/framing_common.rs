//! Shared body of the two framing targets: walk a byte stream frame by frame, as the relay
//! does, and check the invariants the relay relies on.

use pgsluice::protocol::framing::{self, Direction, HEADER_LEN, LARGE_LIMIT};

pub fn walk(mut data: &[u8], dir: Direction) {
    loop {
        let h = match framing::header(data, dir) {
            Ok(Some(h)) => h,
            Ok(None) => {
                assert!(data.len() < HEADER_LEN);
                return;
            }
            Err(_) => return,
        };
        // A header never promises less than itself or more than the largest limit.
        assert!(h.total >= HEADER_LEN && h.total <= LARGE_LIMIT + 1);
        assert_eq!(h.body_len(), h.total - HEADER_LEN);
        let limit = dir.limit(h.tag).expect("accepted tags have a limit");
        assert!(h.total - 1 <= limit);
        match framing::complete(data, dir) {
            Ok(Some(c)) => {
                assert_eq!(c, h);
                data = &data[c.total..];
            }
            Ok(None) => {
                assert!(data.len() < h.total);
                return;
            }
            Err(_) => panic!("complete() failed where header() succeeded"),
        }
    }
}
