//! Fuzz both ends of the node daemon's JSON-lines protocol (`ublk_daemon::node::proto`):
//! request lines read the way the server reads them (a JSON value, then the envelope and the
//! op), and answers read by the real client (`node::client::Client`, over a Unix socket from a
//! fake daemon that sends the input back) plus every result type the command line decodes.
//! Nothing may panic; what parses must serialise and parse back the same.
#![no_main]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use ublk_daemon::node::client::Client;
use ublk_daemon::node::proto::{
    BlobBytes, LayerInfo, MountInfo, Pong, Request, RequestLine, ResponseLine, Status, WarmInfo,
    MAX_LINE,
};

/// A fake daemon: for each connection, reads one request line and answers with the bytes it
/// was handed, then closes. Returns the socket path and the channel of answers.
fn daemon() -> &'static (PathBuf, Mutex<SyncSender<Vec<u8>>>) {
    static D: OnceLock<(PathBuf, Mutex<SyncSender<Vec<u8>>>)> = OnceLock::new();
    D.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("strata-fuzz-proto-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let path = dir.join("strata.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind the fake daemon's socket");
        // libFuzzer's main does not ignore SIGPIPE as a Rust main does: a client that stops
        // reading before the end of a long answer must not kill the process.
        // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let (tx, rx) = sync_channel::<Vec<u8>>(1);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let Ok(answer) = rx.recv() else { return };
                let mut line = Vec::new();
                let mut r = BufReader::new(&stream);
                let _ = r.read_until(b'\n', &mut line);
                let _ = (&stream).write_all(&answer);
            }
        });
        (path, Mutex::new(tx))
    })
}

/// A value that decodes as `T` encodes and decodes back to the same `T`.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    v: &serde_json::Value,
) {
    if let Ok(t) = serde_json::from_value::<T>(v.clone()) {
        let again = serde_json::to_value(&t).expect("a result serialises");
        assert_eq!(serde_json::from_value::<T>(again).ok().as_ref(), Some(&t));
    }
}

fuzz_target!(|data: &[u8]| {
    // The server's side: each line as it reads one.
    for line in data.split(|&b| b == b'\n') {
        if line.len() >= MAX_LINE {
            continue;
        }
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(line) else {
            continue;
        };
        let _ = value.get("op").and_then(|o| o.as_str());
        if let Ok(r) = serde_json::from_value::<RequestLine>(value) {
            let text = serde_json::to_vec(&r).expect("a request line serialises");
            let value: serde_json::Value = serde_json::from_slice(&text).expect("JSON");
            let back: RequestLine = serde_json::from_value(value).expect("a written line parses");
            assert_eq!((back.v, &back.request), (r.v, &r.request));
        }
        // The client's side, line by line: every result type it decodes.
        if let Ok(resp) = serde_json::from_slice::<ResponseLine>(line) {
            let text = serde_json::to_vec(&resp).expect("a response serialises");
            let back: ResponseLine =
                serde_json::from_slice(&text).expect("a written answer parses");
            assert_eq!(back.ok, resp.ok);
            assert_eq!(back.error, resp.error);
            if let Some(v) = resp.result.as_ref().or(resp.event.as_ref()) {
                round_trip::<Pong>(v);
                round_trip::<LayerInfo>(v);
                round_trip::<MountInfo>(v);
                round_trip::<WarmInfo>(v);
                round_trip::<BlobBytes>(v);
                round_trip::<Vec<LayerInfo>>(v);
                if let Ok(s) = serde_json::from_value::<Status>(v.clone()) {
                    let again = serde_json::to_value(&s).expect("a status serialises");
                    let s2: Status = serde_json::from_value(again).expect("a status reads back");
                    assert_eq!(
                        (&s2.layers, &s2.mounts, &s2.pong),
                        (&s.layers, &s.mounts, &s.pong)
                    );
                    assert_eq!(s2.cache, s.cache);
                }
            }
        }
    }
    // The real client, over a socket, reading the whole input as the daemon's answer.
    let (path, tx) = daemon();
    let tx = tx.lock().unwrap_or_else(|p| p.into_inner());
    tx.send(data.to_vec()).expect("the fake daemon runs");
    let mut client = Client::connect(path).expect("connect to the fake daemon");
    let _ = client.call::<Status>(Request::Stats);
});
