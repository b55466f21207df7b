//! A blocking client of the API socket (what `strata mount`, `umount` and `status` use).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::proto::{ApiError, ErrorKind, Request, RequestLine, ResponseLine, MAX_LINE, VERSION};

/// One connection to a daemon.
#[derive(Debug)]
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    /// Connect to the socket at `path`. The error is the OS error, so a caller can tell "no
    /// daemon" (`NotFound`, `ConnectionRefused`) from "not allowed" (`PermissionDenied`).
    pub fn connect(path: &Path) -> std::io::Result<Client> {
        let stream = UnixStream::connect(path)?;
        // Mounting a large layer fetches its meta image first; allow for a slow backend.
        stream.set_read_timeout(Some(Duration::from_secs(600)))?;
        Ok(Client {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// How long to wait for an answer (`None`: as long as it takes); 600 s from `connect`.
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.writer.set_read_timeout(timeout)
    }

    /// Send one request and decode its result.
    pub fn call<T: DeserializeOwned>(&mut self, request: Request) -> Result<T, ApiError> {
        let transport = |e: std::io::Error| {
            ApiError::new(
                ErrorKind::Internal,
                format!("talking to the strata daemon: {e}"),
            )
        };
        let mut line = serde_json::to_vec(&RequestLine {
            v: VERSION,
            request,
        })
        .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        line.push(b'\n');
        self.writer.write_all(&line).map_err(transport)?;
        let mut answer = Vec::new();
        (&mut self.reader)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut answer)
            .map_err(transport)?;
        if answer.last() != Some(&b'\n') {
            return Err(transport(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the daemon closed the connection without an answer",
            )));
        }
        let response: ResponseLine = serde_json::from_slice(&answer).map_err(|e| {
            ApiError::new(
                ErrorKind::Internal,
                format!("the daemon's answer is not a response line: {e}"),
            )
        })?;
        if !response.ok {
            return Err(response.error.unwrap_or_else(|| {
                ApiError::new(ErrorKind::Internal, "the daemon failed without saying why")
            }));
        }
        serde_json::from_value(response.result.unwrap_or(serde_json::Value::Null)).map_err(|e| {
            ApiError::new(
                ErrorKind::Internal,
                format!("the daemon's answer has an unexpected shape: {e}"),
            )
        })
    }
}
