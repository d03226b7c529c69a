//! Uploads as the E2B facade's `POST /files` reads them (`kiln_http::upload`): the first
//! byte picks the form (even: a multipart body, odd: a gzip body), the second how the body
//! arrives (the size of its chunks, as a client's writes split it), the rest is the body.
//!
//! Invariant: nothing panics; a multipart body gives file parts that each have a name and
//! hold at most the limit, and reading it ends (every part is read, or a clean refusal); a
//! gzip body gives at most the limit, whatever it claims, and what it gives, gzipped again,
//! gives the same bytes.
#![no_main]

use bytes::Bytes;
use kiln_http::upload::{Parts, UploadError, gunzip_limited};
use libfuzzer_sys::fuzz_target;

/// Small, so that the limits are reached by what the fuzzer writes.
const MAX: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let [form, split, body @ ..] = data else { return };
    if form % 2 == 1 {
        match gunzip_limited(body, MAX) {
            Ok(out) => {
                assert!(out.len() <= MAX);
                use std::io::Write;
                let mut encoder =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                encoder.write_all(&out).unwrap();
                let again = gunzip_limited(&encoder.finish().unwrap(), MAX).unwrap();
                assert_eq!(again, out);
            }
            Err(UploadError::TooLarge | UploadError::Malformed(_)) => {}
            Err(other) => panic!("gzip refused with {other:?}"),
        }
        return;
    }
    let size = usize::from(*split).max(1);
    let chunks: Vec<Result<Bytes, std::io::Error>> = body
        .chunks(size)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let stream = futures::stream::iter(chunks);
        let mut parts = Parts::new(
            "multipart/form-data; boundary=kiln",
            stream,
            (form % 4 == 0).then(|| "default.txt".to_owned()),
            MAX,
        )
        .expect("the boundary is given");
        let mut count = 0usize;
        loop {
            match parts.next_file().await {
                Ok(Some((name, bytes))) => {
                    assert!(!name.is_empty());
                    assert!(bytes.len() <= MAX);
                    count += 1;
                    assert!(count <= body.len(), "more parts than bytes");
                }
                Ok(None) | Err(_) => break,
            }
        }
    });
});
