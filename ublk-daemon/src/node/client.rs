//! A blocking client of the API socket (what `strata mount`, `umount` and `status` use).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::proto::{
    ApiError, ErrorKind, Request, RequestLine, ResponseLine, MAX_RESPONSE_LINE, VERSION,
};

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
        let request = serde_json::to_value(RequestLine {
            v: VERSION,
            request,
        })
        .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        self.call_streaming(&request, |_| Ok(()))
    }

    /// Send `request` (a whole request object: `op` and its fields; `v` is set here) and
    /// decode its result, handing every `event` line that comes before it to `on_event` (an
    /// extension's streamed answer, see `server::Extension`). An error from `on_event` stops
    /// reading and is returned.
    pub fn call_streaming<T: DeserializeOwned>(
        &mut self,
        request: &serde_json::Value,
        mut on_event: impl FnMut(serde_json::Value) -> Result<(), ApiError>,
    ) -> Result<T, ApiError> {
        let transport = |e: std::io::Error| {
            ApiError::new(
                ErrorKind::Internal,
                format!("talking to the strata daemon: {e}"),
            )
        };
        let mut request = request.clone();
        if let Some(o) = request.as_object_mut() {
            o.insert("v".into(), VERSION.into());
        }
        let mut line = serde_json::to_vec(&request)
            .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        line.push(b'\n');
        self.writer.write_all(&line).map_err(transport)?;
        loop {
            let mut answer = Vec::new();
            (&mut self.reader)
                .take(MAX_RESPONSE_LINE as u64)
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
            if let Some(event) = response.event {
                on_event(event)?;
                continue;
            }
            if !response.ok {
                return Err(response.error.unwrap_or_else(|| {
                    ApiError::new(ErrorKind::Internal, "the daemon failed without saying why")
                }));
            }
            return serde_json::from_value(response.result.unwrap_or(serde_json::Value::Null))
                .map_err(|e| {
                    ApiError::new(
                        ErrorKind::Internal,
                        format!("the daemon's answer has an unexpected shape: {e}"),
                    )
                });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::proto::{MountInfo, Pong, Status};

    /// A `stats` answer for a node with 10,000 mounts (several MiB on one line) is read whole.
    #[test]
    fn a_status_of_ten_thousand_mounts_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mounts: Vec<MountInfo> = (0..10_000)
            .map(|i| MountInfo {
                mountpoint: format!("/sandboxes/{i:05}/root").into(),
                layers: vec!["base/os:1".into(), "toolkit/py:3".into()],
                layer_ids: vec!["ab".repeat(32), "cd".repeat(32)],
                kind: "overlay".into(),
                upper: Some(format!("/sandboxes/{i:05}/upper").into()),
                work: Some(format!("/sandboxes/{i:05}/upper.work").into()),
            })
            .collect();
        let status = Status {
            pong: Pong {
                version: VERSION,
                pid: 1,
                store: "/store".into(),
                run_dir: "/run/strata".into(),
            },
            layers: vec![],
            mounts,
            cache: Default::default(),
            blob_files: vec![],
            node: Default::default(),
        };
        let answer = ResponseLine::success(serde_json::to_value(&status).unwrap());
        let mut line = serde_json::to_vec(&answer).unwrap();
        line.push(b'\n');
        assert!(line.len() > 2 << 20, "{} bytes", line.len());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = String::new();
            BufReader::new(s.try_clone().unwrap())
                .read_line(&mut req)
                .unwrap();
            s.write_all(&line).unwrap();
        });
        let mut c = Client::connect(&path).unwrap();
        let got: Status = c.call(Request::Stats).unwrap();
        server.join().unwrap();
        assert_eq!(got.mounts.len(), 10_000);
        assert_eq!(
            got.mounts[9_999].mountpoint,
            status.mounts[9_999].mountpoint
        );
    }
}
