//! Reading an image's documents and choosing what to import: an [`ImagePlan`] (the layers
//! to read, with the digests, sizes and diff_ids to check them against). The rules are in
//! the crate docs ("What import validates").

use std::path::{Path, PathBuf};

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::Deserialize;

use crate::archive::{normalize, Layout};
use crate::digest::Sha256Digest;
use crate::{invalid, Error, Result, MAX_INDEX_DEPTH, MAX_JSON};

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
const REF_NAME: &str = "org.opencontainers.image.ref.name";
const CONTAINERD_NAME: &str = "io.containerd.image.name";

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
    /// Unknown (docker save archives): detected from the first bytes.
    Detect,
}

/// One layer to import.
#[derive(Debug, Clone)]
pub struct LayerPlan {
    /// The file in the layout.
    pub path: String,
    /// Whether the file may be a link inside the archive (docker save deduplication).
    pub follow_links: bool,
    /// The blob's digest, if the image names one (every OCI layer; docker save layers named
    /// by digest).
    pub digest: Option<Sha256Digest>,
    /// The blob's size, if the image gives one.
    pub size: Option<u64>,
    /// Its compression.
    pub compression: Compression,
    /// The sha256 of the uncompressed tar, from the config.
    pub diff_id: Sha256Digest,
    /// The media type (or `docker-save`).
    pub media_type: String,
}

/// What [`open_image`] found: the layers of the chosen image, bottom first.
#[derive(Debug)]
pub struct ImagePlan {
    /// The image's files.
    pub layout: Layout,
    /// Where it came from (for the manifests' `source`).
    pub source: String,
    /// The manifest's digest (OCI layouts).
    pub manifest: Option<Sha256Digest>,
    /// The config's digest.
    pub config: Sha256Digest,
    /// `os/arch[/variant]` of the config.
    pub platform: String,
    /// The layers, lowest first.
    pub layers: Vec<LayerPlan>,
}

/// How to choose an image.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct OpenOptions {
    /// The tag (`org.opencontainers.image.ref.name`, or a docker `RepoTags` entry).
    pub reference: Option<String>,
    /// `os/arch[/variant]` to pick from a manifest list (default `linux/amd64`).
    pub platform: Option<String>,
    /// Where a compressed archive is decompressed (default: the system's temp dir).
    pub temp_dir: Option<PathBuf>,
}

impl OpenOptions {
    /// With a reference.
    pub fn reference(mut self, r: Option<String>) -> Self {
        self.reference = r;
        self
    }
    /// With a platform.
    pub fn platform(mut self, p: Option<String>) -> Self {
        self.platform = p;
        self
    }
    /// With a temporary directory.
    pub fn temp_dir(mut self, d: Option<PathBuf>) -> Self {
        self.temp_dir = d;
        self
    }
}

fn parse_json<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| invalid(what, format!("bad JSON: {e}")))
}

/// A descriptor's digest, checked.
fn desc_digest(d: &Descriptor, what: &str) -> Result<Sha256Digest> {
    Sha256Digest::parse(d.digest().as_ref(), what)
}

/// Reads a blob named by a descriptor (a JSON document): size and digest checked.
fn read_blob(layout: &Layout, d: &Descriptor, what: &str) -> Result<(Sha256Digest, Vec<u8>)> {
    let digest = desc_digest(d, what)?;
    if d.size() > MAX_JSON {
        return Err(invalid(
            what,
            format!(
                "descriptor size {} over the {MAX_JSON}-byte limit",
                d.size()
            ),
        ));
    }
    let bytes = layout.read_limited(&digest.blob_path(), MAX_JSON)?;
    check_blob(what, &digest, d.size(), &bytes)?;
    Ok((digest, bytes))
}

fn check_blob(what: &str, digest: &Sha256Digest, size: u64, bytes: &[u8]) -> Result<()> {
    if bytes.len() as u64 != size {
        return Err(Error::SizeMismatch {
            what: what.into(),
            expected: size,
            actual: bytes.len() as u64,
        });
    }
    let actual = Sha256Digest::of(bytes);
    if actual != *digest {
        return Err(Error::DigestMismatch {
            what: what.into(),
            expected: digest.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(())
}

fn platform_of(d: &Descriptor) -> Option<String> {
    d.platform().as_ref().map(|p| {
        let mut s = format!("{}/{}", p.os(), p.architecture());
        if let Some(v) = p.variant() {
            s.push('/');
            s.push_str(v);
        }
        s
    })
}

fn platform_matches(have: &str, want: &str) -> bool {
    // "linux/arm64" matches "linux/arm64/v8"; a variant asked for must match.
    have == want || (want.matches('/').count() == 1 && have.starts_with(&format!("{want}/")))
}

fn ref_names(d: &Descriptor) -> Vec<String> {
    let Some(a) = d.annotations() else {
        return Vec::new();
    };
    [REF_NAME, CONTAINERD_NAME]
        .iter()
        .filter_map(|k| a.get(*k).cloned())
        .collect()
}

fn ref_matches(d: &Descriptor, want: &str) -> bool {
    ref_names(d).iter().any(|n| {
        n == want
            || n.rsplit_once(':')
                .is_some_and(|(_, tag)| tag == want && !want.contains(':'))
    })
}

/// Opens the image at `path` (an OCI layout directory or archive, or a docker save
/// archive) and chooses the image to import.
pub fn open_image(path: &Path, opts: &OpenOptions) -> Result<ImagePlan> {
    let temp = crate::temp_dir_or(opts.temp_dir.as_ref());
    let layout = Layout::open(path, &temp)?;
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    plan_layout(layout, &abs, opts)
}

/// [`open_image`] for a layout already opened; `path` names it in messages and sources.
pub fn plan_layout(layout: Layout, path: &Path, opts: &OpenOptions) -> Result<ImagePlan> {
    let abs = path;
    if layout.exists("oci-layout") {
        return open_oci(layout, abs, opts);
    }
    if layout.exists("manifest.json") {
        return open_docker(layout, abs, opts);
    }
    Err(invalid(
        path.display().to_string(),
        "neither an OCI image layout (no oci-layout file) nor a docker save archive (no manifest.json)",
    ))
}

#[derive(Deserialize)]
struct LayoutFile {
    #[serde(rename = "imageLayoutVersion")]
    version: String,
}

pub(crate) fn check_layout_file(bytes: &[u8]) -> Result<()> {
    let l: LayoutFile = parse_json("oci-layout", bytes)?;
    let major = l.version.split('.').next().unwrap_or("");
    if major != "1" || l.version.split('.').count() != 3 {
        return Err(Error::Unsupported(format!(
            "oci-layout imageLayoutVersion {:?} (1.x.y is read)",
            l.version
        )));
    }
    Ok(())
}

pub(crate) fn check_index(what: &str, idx: &ImageIndex) -> Result<()> {
    if idx.schema_version() != 2 {
        return Err(invalid(
            what,
            format!("schemaVersion {} (2 expected)", idx.schema_version()),
        ));
    }
    if let Some(mt) = idx.media_type() {
        let mt = mt.to_string();
        if mt != OCI_INDEX && mt != DOCKER_LIST {
            return Err(invalid(
                what,
                format!("media type {mt} is not an image index"),
            ));
        }
    }
    Ok(())
}

fn open_oci(layout: Layout, path: &Path, opts: &OpenOptions) -> Result<ImagePlan> {
    check_layout_file(&layout.read_limited("oci-layout", MAX_JSON)?)?;
    let idx: ImageIndex = parse_json("index.json", &layout.read_limited("index.json", MAX_JSON)?)?;
    check_index("index.json", &idx)?;
    let want_platform = opts
        .platform
        .clone()
        .unwrap_or_else(|| "linux/amd64".into());
    let mut candidates: Vec<Descriptor> = idx.manifests().clone();
    if let Some(r) = &opts.reference {
        let all: Vec<String> = candidates.iter().flat_map(ref_names).collect();
        candidates.retain(|d| ref_matches(d, r));
        if candidates.is_empty() {
            return Err(Error::Ambiguous(format!(
                "no image tagged {r:?} in index.json (tags: {all:?})"
            )));
        }
    }
    let mut depth = 0;
    let manifest_desc = loop {
        if candidates.len() > 1 {
            let platforms: Vec<String> = candidates.iter().filter_map(platform_of).collect();
            let picked: Vec<Descriptor> = candidates
                .iter()
                .filter(|d| platform_of(d).is_some_and(|p| platform_matches(&p, &want_platform)))
                .cloned()
                .collect();
            if picked.len() != 1 {
                let tags: Vec<String> = candidates.iter().flat_map(ref_names).collect();
                return Err(Error::Ambiguous(format!(
                    "the index holds {} images and {} match platform {want_platform} \
                     (platforms: {platforms:?}, tags: {tags:?}): choose one with --platform \
                     or --ref",
                    candidates.len(),
                    picked.len()
                )));
            }
            candidates = picked;
        }
        let Some(d) = candidates.pop() else {
            return Err(invalid("index.json", "no manifests"));
        };
        let mt = d.media_type().to_string();
        if mt == OCI_INDEX || mt == DOCKER_LIST {
            depth += 1;
            if depth > MAX_INDEX_DEPTH {
                return Err(invalid("index.json", "image indexes nested too deeply"));
            }
            let what = format!("image index {}", d.digest());
            let (_, bytes) = read_blob(&layout, &d, &what)?;
            let nested: ImageIndex = parse_json(&what, &bytes)?;
            check_index(&what, &nested)?;
            if nested
                .media_type()
                .as_ref()
                .is_some_and(|m| m.to_string() != mt)
            {
                return Err(invalid(&what, "media type differs from its descriptor's"));
            }
            candidates = nested.manifests().clone();
            continue;
        }
        if mt != OCI_MANIFEST && mt != DOCKER_MANIFEST {
            return Err(invalid(
                format!("descriptor {}", d.digest()),
                format!("media type {mt} is not an image manifest"),
            ));
        }
        break d;
    };
    let what = format!("manifest {}", manifest_desc.digest());
    let (manifest_digest, bytes) = read_blob(&layout, &manifest_desc, &what)?;
    let (config, platform, layers) = plan_manifest(&layout, &what, &bytes, opts)?;
    Ok(ImagePlan {
        layout,
        source: format!("oci:{}@{manifest_digest}", path.display()),
        manifest: Some(manifest_digest),
        config,
        platform,
        layers,
    })
}

/// Checks a manifest, reads its config, and lists its layers.
fn plan_manifest(
    layout: &Layout,
    what: &str,
    bytes: &[u8],
    opts: &OpenOptions,
) -> Result<(Sha256Digest, String, Vec<LayerPlan>)> {
    let m: ImageManifest = parse_json(what, bytes)?;
    if m.schema_version() != 2 {
        return Err(invalid(
            what,
            format!("schemaVersion {}", m.schema_version()),
        ));
    }
    if let Some(mt) = m.media_type() {
        let mt = mt.to_string();
        if mt != OCI_MANIFEST && mt != DOCKER_MANIFEST {
            return Err(invalid(
                what,
                format!("media type {mt} is not an image manifest"),
            ));
        }
    }
    let cmt = m.config().media_type().to_string();
    if cmt != OCI_CONFIG && cmt != DOCKER_CONFIG {
        return Err(invalid(
            what,
            format!("config media type {cmt} is not an image config"),
        ));
    }
    let cwhat = format!("config {}", m.config().digest());
    let (config_digest, cbytes) = read_blob(layout, m.config(), &cwhat)?;
    let (platform, diff_ids) = check_config(&cwhat, &cbytes, opts)?;
    if diff_ids.len() != m.layers().len() {
        return Err(invalid(
            &cwhat,
            format!(
                "{} diff_ids for {} layers",
                diff_ids.len(),
                m.layers().len()
            ),
        ));
    }
    let mut layers = Vec::new();
    for (i, (l, diff_id)) in m.layers().iter().zip(diff_ids).enumerate() {
        let lwhat = format!("layer {i} ({})", l.digest());
        let compression = match l.media_type() {
            MediaType::ImageLayer | MediaType::ImageLayerNonDistributable => Compression::None,
            MediaType::ImageLayerGzip | MediaType::ImageLayerNonDistributableGzip => {
                Compression::Gzip
            }
            MediaType::ImageLayerZstd | MediaType::ImageLayerNonDistributableZstd => {
                Compression::Zstd
            }
            MediaType::Other(s)
                if s == "application/vnd.docker.image.rootfs.diff.tar.gzip"
                    || s == "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" =>
            {
                Compression::Gzip
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "{lwhat}: media type {other} is not a layer tar this reads"
                )))
            }
        };
        let digest = desc_digest(l, &lwhat)?;
        layers.push(LayerPlan {
            path: digest.blob_path(),
            follow_links: false,
            digest: Some(digest),
            size: Some(l.size()),
            compression,
            diff_id,
            media_type: l.media_type().to_string(),
        });
    }
    Ok((config_digest, platform, layers))
}

/// Checks a config: linux, the platform asked for (if any), `rootfs.type == layers`;
/// returns `os/arch[/variant]` and the diff_ids.
fn check_config(
    what: &str,
    bytes: &[u8],
    opts: &OpenOptions,
) -> Result<(String, Vec<Sha256Digest>)> {
    let c: ImageConfiguration = parse_json(what, bytes)?;
    let mut platform = format!("{}/{}", c.os(), c.architecture());
    if let Some(v) = c.variant() {
        platform.push('/');
        platform.push_str(v);
    }
    if c.os().to_string() != "linux" {
        return Err(Error::Unsupported(format!(
            "{what}: os {} (only linux images are imported)",
            c.os()
        )));
    }
    if let Some(p) = &opts.platform {
        if !platform_matches(&platform, p) {
            return Err(Error::Ambiguous(format!(
                "{what}: the image is {platform}, not {p}"
            )));
        }
    }
    if c.rootfs().typ() != "layers" {
        return Err(invalid(
            what,
            format!("rootfs.type {:?} (\"layers\" expected)", c.rootfs().typ()),
        ));
    }
    let ids = c
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| Sha256Digest::parse(d, &format!("{what} diff_id")))
        .collect::<Result<Vec<_>>>()?;
    Ok((platform, ids))
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

fn open_docker(layout: Layout, path: &Path, opts: &OpenOptions) -> Result<ImagePlan> {
    let entries: Vec<DockerEntry> = parse_json(
        "manifest.json",
        &layout.read_limited("manifest.json", MAX_JSON)?,
    )?;
    let tags: Vec<String> = entries
        .iter()
        .flat_map(|e| e.repo_tags.clone().unwrap_or_default())
        .collect();
    let chosen: Vec<&DockerEntry> = match &opts.reference {
        Some(r) => entries
            .iter()
            .filter(|e| {
                e.repo_tags
                    .iter()
                    .flatten()
                    .any(|t| t == r || t.rsplit_once(':').is_some_and(|(_, tag)| tag == r))
            })
            .collect(),
        None => entries.iter().collect(),
    };
    let e = match chosen.as_slice() {
        [e] => *e,
        [] => {
            return Err(Error::Ambiguous(format!(
                "no image {} in manifest.json (tags: {tags:?})",
                opts.reference.as_deref().unwrap_or("")
            )))
        }
        _ => {
            return Err(Error::Ambiguous(format!(
                "manifest.json holds {} images: choose one with --ref (tags: {tags:?})",
                chosen.len()
            )))
        }
    };
    let config_path = normalize(&e.config, true)?;
    let cbytes = layout.read_limited(&config_path, MAX_JSON)?;
    let config = Sha256Digest::of(&cbytes);
    // A config named by its digest (`<hex>.json`, `blobs/sha256/<hex>`) must hash to it.
    if let Some(named) = digest_in_name(&config_path) {
        check_blob(
            &format!("config {config_path}"),
            &named,
            cbytes.len() as u64,
            &cbytes,
        )?;
    }
    let (platform, diff_ids) = check_config(&format!("config {config_path}"), &cbytes, opts)?;
    if diff_ids.len() != e.layers.len() {
        return Err(invalid(
            format!("config {config_path}"),
            format!("{} diff_ids for {} layers", diff_ids.len(), e.layers.len()),
        ));
    }
    let mut layers = Vec::new();
    for (l, diff_id) in e.layers.iter().zip(diff_ids) {
        let p = normalize(l, true)?;
        layers.push(LayerPlan {
            digest: p
                .strip_prefix("blobs/sha256/")
                .and_then(Sha256Digest::parse_hex),
            path: p,
            follow_links: true,
            size: None,
            compression: Compression::Detect,
            diff_id,
            media_type: "docker-save".into(),
        });
    }
    Ok(ImagePlan {
        layout,
        source: format!("docker-save:{}", path.display()),
        manifest: None,
        config,
        platform,
        layers,
    })
}

fn digest_in_name(p: &str) -> Option<Sha256Digest> {
    if let Some(h) = p.strip_prefix("blobs/sha256/") {
        return Sha256Digest::parse_hex(h);
    }
    p.strip_suffix(".json").and_then(Sha256Digest::parse_hex)
}

/// Parses `data` as every kind of document (for fuzzing).
pub(crate) fn fuzz_documents(data: &[u8]) {
    let _ = check_layout_file(data);
    if let Ok(idx) = parse_json::<ImageIndex>("x", data) {
        let _ = check_index("x", &idx);
        for d in idx.manifests() {
            let _ = desc_digest(d, "x");
            let _ = platform_of(d);
            let _ = ref_matches(d, "latest");
        }
    }
    if let Ok(m) = parse_json::<ImageManifest>("x", data) {
        for l in m.layers() {
            let _ = desc_digest(l, "x");
        }
    }
    let _ = check_config("x", data, &OpenOptions::default());
    let _ = parse_json::<Vec<DockerEntry>>("x", data);
}
