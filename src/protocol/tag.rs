//! Message type bytes by direction, and the other one-byte codes of the protocol.
//!
//! The same byte names different messages each way — `D` is DataRow from the server and
//! Describe from the client, `C` CommandComplete and Close, `E` ErrorResponse and Execute — so
//! each direction has its own names, and code that reads one side's messages uses only that
//! side's module.

/// Messages a client sends.
pub mod frontend {
    pub const QUERY: u8 = b'Q';
    pub const PARSE: u8 = b'P';
    pub const BIND: u8 = b'B';
    pub const DESCRIBE: u8 = b'D';
    pub const EXECUTE: u8 = b'E';
    pub const CLOSE: u8 = b'C';
    pub const SYNC: u8 = b'S';
    pub const FLUSH: u8 = b'H';
    pub const FUNCTION_CALL: u8 = b'F';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_FAIL: u8 = b'f';
    pub const TERMINATE: u8 = b'X';
    /// Any password or SASL response.
    pub const PASSWORD: u8 = b'p';
}

/// Messages a server sends.
pub mod backend {
    pub const READY_FOR_QUERY: u8 = b'Z';
    pub const ROW_DESCRIPTION: u8 = b'T';
    pub const DATA_ROW: u8 = b'D';
    pub const COMMAND_COMPLETE: u8 = b'C';
    pub const EMPTY_QUERY: u8 = b'I';
    pub const PORTAL_SUSPENDED: u8 = b's';
    pub const ERROR_RESPONSE: u8 = b'E';
    pub const NOTICE_RESPONSE: u8 = b'N';
    pub const PARSE_COMPLETE: u8 = b'1';
    pub const BIND_COMPLETE: u8 = b'2';
    pub const CLOSE_COMPLETE: u8 = b'3';
    pub const NO_DATA: u8 = b'n';
    pub const PARAMETER_DESCRIPTION: u8 = b't';
    pub const PARAMETER_STATUS: u8 = b'S';
    pub const COPY_IN: u8 = b'G';
    pub const COPY_OUT: u8 = b'H';
    pub const COPY_BOTH: u8 = b'W';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const NOTIFICATION: u8 = b'A';
    pub const FUNCTION_CALL_RESPONSE: u8 = b'V';
    /// Any authentication request or outcome (its first body word says which).
    pub const AUTHENTICATION: u8 = b'R';
    pub const BACKEND_KEY_DATA: u8 = b'K';
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
}

/// The transaction status a ReadyForQuery carries.
pub mod status {
    pub const IDLE: u8 = b'I';
    pub const IN_TRANSACTION: u8 = b'T';
    pub const FAILED: u8 = b'E';
}

/// What a Describe or Close names (its first body byte).
pub mod target {
    pub const STATEMENT: u8 = b'S';
    pub const PORTAL: u8 = b'P';
}
