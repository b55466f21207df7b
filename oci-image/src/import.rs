//! Building Strata layers from an [`ImagePlan`]: each layer blob is read once, hashed as it
//! is read (the blob's digest and size), decompressed by its media type and hashed again
//! (the diff_id), and fed to `erofs-builder`'s tar reader; when the builder is done the rest
//! of the stream is drained (so trailing bytes count) and the three checks are made. A layer
//! whose checks fail is discarded; nothing is pushed (see [`crate::store::push_stack`])
//! before every layer passed.

use std::io::{Cursor, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use erofs_builder::{LayerOptions, LayerStats, Source};

use crate::digest::{Hashing, Sha256Digest};
use crate::image::{Compression, ImagePlan, LayerPlan};
use crate::{io_err, Error, Result};

/// Options of [`build_layers`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ImportOptions {
    /// One layer of the whole image instead of one per image layer.
    pub flatten: bool,
    /// Where the built meta images and blobs (and the builder's spool) go.
    pub work_dir: PathBuf,
    /// The chunk size of each built layer's tails blob (its device 2, holding small files
    /// and the partial last chunks of larger ones); `None`: no tails blob.
    pub tail_chunk_size: Option<u32>,
    /// Files of at most this many bytes inline in each layer's meta image
    /// (`erofs_builder::LayerOptions::inline_max`); 0 (the default): none.
    pub inline_max: u64,
}

impl ImportOptions {
    /// Options writing into `work_dir`.
    pub fn new(work_dir: &Path) -> Self {
        Self {
            flatten: false,
            work_dir: work_dir.to_path_buf(),
            tail_chunk_size: Some(erofs_builder::layer::DEFAULT_TAIL_CHUNK_SIZE),
            inline_max: 0,
        }
    }

    /// With files of at most `bytes` inline in the meta images.
    pub fn inline_max(mut self, bytes: u64) -> Self {
        self.inline_max = bytes;
        self
    }

    /// With tails blobs of `chunk_size` (`None`: one data blob per layer).
    pub fn tail_chunk_size(mut self, chunk_size: Option<u32>) -> Self {
        self.tail_chunk_size = chunk_size;
        self
    }

    /// With `flatten`.
    pub fn flatten(mut self, f: bool) -> Self {
        self.flatten = f;
        self
    }
}

/// A Strata layer built from one image layer (or, flattened, from all of them).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BuiltLayer {
    /// The meta image.
    pub meta: PathBuf,
    /// The data blob.
    pub blob: PathBuf,
    /// The tails blob, when the builder wrote one (`stats.tails` says what it holds).
    pub tails: Option<PathBuf>,
    /// What the builder wrote.
    pub stats: LayerStats,
    /// The diff_ids of the image layers in it (one, or all of them when flattened).
    pub diff_ids: Vec<Sha256Digest>,
    /// Bytes of the layer blobs read (compressed) and of their tars.
    pub compressed_bytes: u64,
    /// Bytes of the uncompressed tars.
    pub tar_bytes: u64,
}

/// A reader that adds what passes through it to a shared hash.
struct Tap<R> {
    inner: R,
    hash: Arc<Mutex<Hashing>>,
}

impl<R: Read> Read for Tap<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .update(&buf[..n]);
        Ok(n)
    }
}

/// The reader the builder gets: a handle on a stream we take back afterwards.
struct Shared(Arc<Mutex<Box<dyn Read + Send>>>);

impl Read for Shared {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).read(buf)
    }
}

/// One layer blob being read, with what to check at its end.
struct Checked {
    stream: Arc<Mutex<Box<dyn Read + Send>>>,
    raw: Arc<Mutex<Hashing>>,
    plain: Arc<Mutex<Hashing>>,
    plan: LayerPlan,
    what: String,
}

impl Checked {
    fn open(plan: &ImagePlan, i: usize) -> Result<Self> {
        let lp = plan.layers[i].clone();
        let what = format!("layer {i} ({})", lp.path);
        let (r, _) = plan.layout.open_file(&lp.path, lp.follow_links)?;
        let raw = Arc::new(Mutex::new(Hashing::default()));
        let mut tapped = Tap {
            inner: r,
            hash: raw.clone(),
        };
        let compression = match lp.compression {
            Compression::Detect => {
                let mut head = [0u8; 4];
                let mut n = 0;
                while n < head.len() {
                    let k = tapped
                        .read(&mut head[n..])
                        .map_err(io_err(format!("read {what}")))?;
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                let c = if head[..n].starts_with(&[0x1f, 0x8b]) {
                    Compression::Gzip
                } else if head[..n] == [0x28, 0xb5, 0x2f, 0xfd] {
                    Compression::Zstd
                } else {
                    Compression::None
                };
                let r = Cursor::new(head[..n].to_vec()).chain(tapped);
                return Self::finish(r, c, raw, lp, what);
            }
            c => c,
        };
        Self::finish(tapped, compression, raw, lp, what)
    }

    fn finish<R: Read + Send + 'static>(
        r: R,
        c: Compression,
        raw: Arc<Mutex<Hashing>>,
        plan: LayerPlan,
        what: String,
    ) -> Result<Self> {
        let decoded: Box<dyn Read + Send> = match c {
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(
                std::io::BufReader::with_capacity(1 << 16, r),
            )),
            Compression::Zstd => Box::new(
                zstd::stream::read::Decoder::new(r).map_err(io_err("start zstd decoding"))?,
            ),
            Compression::None | Compression::Detect => Box::new(r),
        };
        let plain = Arc::new(Mutex::new(Hashing::default()));
        let tap: Box<dyn Read + Send> = Box::new(Tap {
            inner: decoded,
            hash: plain.clone(),
        });
        Ok(Checked {
            stream: Arc::new(Mutex::new(tap)),
            raw,
            plain,
            plan,
            what,
        })
    }

    fn reader(&self) -> Box<dyn Read + Send> {
        Box::new(Shared(self.stream.clone()))
    }

    /// Reads what the builder left, then checks size, digest and diff_id; returns
    /// (compressed bytes, tar bytes). A stream that cannot be read to its end (a corrupt
    /// gzip or zstd stream) is explained by its blob's digest when that is wrong.
    fn verify(&self, plan: &ImagePlan) -> Result<(u64, u64)> {
        let drained = {
            let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
            std::io::copy(&mut *s, &mut std::io::sink())
        };
        if let Err(e) = drained {
            self.recheck(plan)?;
            return Err(Error::Invalid {
                what: self.what.clone(),
                reason: format!("cannot read to its end: {e}"),
            });
        }
        let raw = self.raw.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let plain = self.plain.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.check_raw(&raw)?;
        let actual = plain.finish();
        if actual != self.plan.diff_id {
            return Err(Error::DigestMismatch {
                what: format!("{} uncompressed (the config's diff_id)", self.what),
                expected: self.plan.diff_id.to_string(),
                actual: actual.to_string(),
            });
        }
        Ok((raw.bytes, plain.bytes))
    }

    fn check_raw(&self, raw: &Hashing) -> Result<()> {
        if let Some(size) = self.plan.size {
            if raw.bytes != size {
                return Err(Error::SizeMismatch {
                    what: self.what.clone(),
                    expected: size,
                    actual: raw.bytes,
                });
            }
        }
        if let Some(d) = self.plan.digest {
            let actual = raw.finish();
            if actual != d {
                return Err(Error::DigestMismatch {
                    what: self.what.clone(),
                    expected: d.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        Ok(())
    }

    /// On the error path: hashes the whole blob again, so that a damaged blob is reported
    /// as the digest or size mismatch it is rather than as the tar or decompression error
    /// it caused.
    fn recheck(&self, plan: &ImagePlan) -> Result<()> {
        let (mut r, _) = plan
            .layout
            .open_file(&self.plan.path, self.plan.follow_links)?;
        let mut h = Hashing::default();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r
                .read(&mut buf)
                .map_err(io_err(format!("read {}", self.what)))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        self.check_raw(&h)
    }
}

/// The builder's options for one layer, its tails blob (if any) at `tails`.
fn layer_options(opts: &ImportOptions, tails: &Path) -> LayerOptions {
    let mut o = LayerOptions::default();
    o.build.fsync = false;
    o.build.tar.temp_dir = Some(opts.work_dir.clone());
    o.tails = opts
        .tail_chunk_size
        .map(|cs| erofs_builder::TailsBlob::new(tails, cs));
    o.inline_max = opts.inline_max;
    o
}

/// Builds the image's layers into `opts.work_dir` (`layer-<i>.meta` / `layer-<i>.blob` /
/// `layer-<i>.tails`),
/// checking every blob; returns them lowest first. On error nothing built is returned (the
/// caller removes the work directory).
pub fn build_layers(plan: &ImagePlan, opts: &ImportOptions) -> Result<Vec<BuiltLayer>> {
    let work = &opts.work_dir;
    if opts.flatten {
        let checked = (0..plan.layers.len())
            .map(|i| Checked::open(plan, i))
            .collect::<Result<Vec<_>>>()?;
        let source = if checked.is_empty() {
            // An image without layers: an empty root.
            Source::tar(Cursor::new(vec![0u8; 1024]))
        } else {
            Source::TarStack(checked.iter().map(Checked::reader).collect())
        };
        let (meta, blob, tails) = (
            work.join("flat.meta"),
            work.join("flat.blob"),
            work.join("flat.tails"),
        );
        let lopts = layer_options(opts, &tails);
        let stats = erofs_builder::build_layer_from(source, &meta, &blob, &lopts).map_err(|e| {
            checked
                .iter()
                .find_map(|c| c.recheck(plan).err())
                .unwrap_or(Error::Build(e))
        })?;
        let (mut compressed, mut tar) = (0, 0);
        for c in &checked {
            let (a, b) = c.verify(plan)?;
            compressed += a;
            tar += b;
        }
        return Ok(vec![BuiltLayer {
            meta,
            blob,
            tails: lopts.tails.map(|t| t.path),
            stats,
            diff_ids: plan.layers.iter().map(|l| l.diff_id).collect(),
            compressed_bytes: compressed,
            tar_bytes: tar,
        }]);
    }
    let mut out = Vec::with_capacity(plan.layers.len());
    for i in 0..plan.layers.len() {
        let c = Checked::open(plan, i)?;
        let (meta, blob, tails) = (
            work.join(format!("layer-{i}.meta")),
            work.join(format!("layer-{i}.blob")),
            work.join(format!("layer-{i}.tails")),
        );
        let lopts = layer_options(opts, &tails);
        let stats = erofs_builder::build_layer_from(Source::Tar(c.reader()), &meta, &blob, &lopts)
            .map_err(|e| match c.recheck(plan) {
                // A damaged blob explains a broken stream better than the tar error.
                Err(v) => v,
                Ok(()) => Error::Build(e),
            })?;
        let (compressed_bytes, tar_bytes) = c.verify(plan)?;
        out.push(BuiltLayer {
            meta,
            blob,
            tails: lopts.tails.map(|t| t.path),
            stats,
            diff_ids: vec![plan.layers[i].diff_id],
            compressed_bytes,
            tar_bytes,
        });
    }
    Ok(out)
}
