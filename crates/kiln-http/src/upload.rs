//! Reading uploads, as the E2B facade's `POST /files` takes them: a gzip body gunzipped
//! within a limit, and a multipart body's file parts, each named by its file name and
//! bounded. What is here only reads bytes; the face writes the files and answers errors.

use bytes::Bytes;
use futures::Stream;

/// Why an upload was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UploadError {
    /// A file (gunzipped, or one part) is larger than the limit.
    TooLarge,
    /// The gzip or multipart body is not well-formed.
    Malformed(String),
    /// A multipart `Content-Type` without a boundary.
    NoBoundary,
    /// A file part with no file name and no default path.
    NoFileName,
}

impl std::fmt::Display for UploadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UploadError::TooLarge => {
                f.write_str("a file is larger than the most one upload writes")
            }
            UploadError::Malformed(why) => f.write_str(why),
            UploadError::NoBoundary => f.write_str("the multipart body has no boundary"),
            UploadError::NoFileName => f.write_str("each file part needs a file name (its path)"),
        }
    }
}

/// `raw` gunzipped, refused once it would pass `max` bytes (a small bomb never grows past
/// `max + 1` bytes in memory).
pub fn gunzip_limited(raw: &[u8], max: usize) -> Result<Vec<u8>, UploadError> {
    use std::io::Read;
    let mut out = Vec::new();
    let decoder = flate2::read::GzDecoder::new(raw);
    // One byte past the limit tells a bomb from a file of exactly the limit.
    decoder
        .take(max as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| UploadError::Malformed(format!("the gzip body is malformed: {e}")))?;
    if out.len() > max {
        return Err(UploadError::TooLarge);
    }
    Ok(out)
}

/// The file parts of a multipart body.
pub struct Parts {
    inner: multer::Multipart<'static>,
    default_name: Option<String>,
    max: usize,
}

impl Parts {
    /// The parts of a body of `content_type` (which names the boundary); a part without a
    /// file name is named `default_name`; each may hold at most `max` bytes.
    pub fn new<S, E>(
        content_type: &str,
        body: S,
        default_name: Option<String>,
        max: usize,
    ) -> Result<Parts, UploadError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
    {
        let boundary = multer::parse_boundary(content_type).map_err(|_| UploadError::NoBoundary)?;
        Ok(Parts {
            inner: multer::Multipart::new(body, boundary),
            default_name,
            max,
        })
    }

    /// The next file part: its name (never empty) and its bytes; `None` after the last.
    pub async fn next_file(&mut self) -> Result<Option<(String, Vec<u8>)>, UploadError> {
        let malformed =
            |e: multer::Error| UploadError::Malformed(format!("malformed multipart body: {e}"));
        let Some(mut part) = self.inner.next_field().await.map_err(malformed)? else {
            return Ok(None);
        };
        let name = part
            .file_name()
            .map(str::to_owned)
            .or_else(|| self.default_name.clone())
            .filter(|p| !p.is_empty())
            .ok_or(UploadError::NoFileName)?;
        let mut data = Vec::new();
        while let Some(chunk) = part.chunk().await.map_err(malformed)? {
            if data.len() + chunk.len() > self.max {
                return Err(UploadError::TooLarge);
            }
            data.extend_from_slice(&chunk);
        }
        Ok(Some((name, data)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(data).unwrap();
        encoder.finish().unwrap()
    }

    #[test]
    fn gzip_is_read_within_its_limit() {
        assert_eq!(gunzip_limited(&gzip(b"hello"), 5).unwrap(), b"hello");
        assert_eq!(
            gunzip_limited(&gzip(b"hello!"), 5),
            Err(UploadError::TooLarge)
        );
        let bomb = gzip(&vec![0; 8 << 20]);
        assert!(bomb.len() < 64 << 10);
        assert_eq!(gunzip_limited(&bomb, 1 << 20), Err(UploadError::TooLarge));
        assert!(matches!(
            gunzip_limited(b"not gzip", 5),
            Err(UploadError::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn multipart_files_are_named_and_bounded() {
        let body = "--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\nAAA\r\n\
                    --b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nBB\r\n--b--\r\n";
        let stream = |text: &'static str| {
            futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(text.as_bytes()))])
        };
        let mut parts = Parts::new(
            "multipart/form-data; boundary=b",
            stream(body),
            Some("d.txt".into()),
            3,
        )
        .unwrap();
        assert_eq!(
            parts.next_file().await.unwrap(),
            Some(("a.txt".into(), b"AAA".to_vec()))
        );
        assert_eq!(
            parts.next_file().await.unwrap(),
            Some(("d.txt".into(), b"BB".to_vec()))
        );
        assert_eq!(parts.next_file().await.unwrap(), None);
        let mut parts =
            Parts::new("multipart/form-data; boundary=b", stream(body), None, 2).unwrap();
        assert_eq!(parts.next_file().await, Err(UploadError::TooLarge));
        let mut parts =
            Parts::new("multipart/form-data; boundary=b", stream(body), None, 9).unwrap();
        parts.next_file().await.unwrap();
        assert_eq!(parts.next_file().await, Err(UploadError::NoFileName));
        assert!(matches!(
            Parts::new("multipart/form-data", stream(body), None, 9),
            Err(UploadError::NoBoundary)
        ));
    }
}
