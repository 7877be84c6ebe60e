//! [`S3Objects`]: [`ColdObjects`] on an S3-compatible store through the `object_store` crate.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::objects::{ColdError, ColdObjects, LIST_OBJECTS_MAX};

/// One object store call gives up after this long unless configured otherwise.
pub const S3_REQUEST_TIMEOUT_MS_DEFAULT: u64 = 10_000;

/// Where the objects live. Credentials left out are taken from the environment
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Config {
    /// An S3-compatible endpoint (`http://127.0.0.1:9000`); AWS itself when none.
    pub endpoint: Option<String>,
    pub region: String,
    pub bucket: String,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub request_timeout_ms: u64,
}

impl S3Config {
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            endpoint: None,
            region: "us-east-1".into(),
            bucket: bucket.into(),
            access_key_id: None,
            secret_access_key: None,
            request_timeout_ms: S3_REQUEST_TIMEOUT_MS_DEFAULT,
        }
    }
}

/// An S3 bucket as [`ColdObjects`]; each call blocks the caller on a small runtime of its own.
pub struct S3Objects {
    runtime: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    timeout: Duration,
}

impl std::fmt::Debug for S3Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Objects").field("store", &self.store.to_string()).finish_non_exhaustive()
    }
}

impl S3Objects {
    pub fn open(config: &S3Config) -> Result<Self, ColdError> {
        let mut builder = AmazonS3Builder::from_env()
            .with_region(&config.region)
            .with_bucket_name(&config.bucket);
        if let Some(endpoint) = &config.endpoint {
            // A loopback or private S3 server: plain HTTP allowed, path-style addressing.
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if let (Some(id), Some(secret)) = (&config.access_key_id, &config.secret_access_key) {
            builder = builder.with_access_key_id(id).with_secret_access_key(secret);
        }
        let store = builder.build().map_err(|e| ColdError::Config(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpucache-cold")
            .enable_all()
            .build()
            .map_err(|e| ColdError::Config(format!("cannot start the runtime: {e}")))?;
        Ok(Self {
            runtime,
            store: Arc::new(store),
            timeout: Duration::from_millis(config.request_timeout_ms.max(1)),
        })
    }

    /// Runs one call within the store's deadline.
    fn run<T>(
        &self,
        operation: &'static str,
        key: &str,
        call: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T, ColdError> {
        self.run_within(operation, key, self.timeout, call)
    }

    /// Runs one call within `within` or the store's deadline, whichever is sooner.
    fn run_within<T>(
        &self,
        operation: &'static str,
        key: &str,
        within: Duration,
        call: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T, ColdError> {
        let within = within.min(self.timeout);
        match self.runtime.block_on(async { tokio::time::timeout(within, call).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(typed(operation, key, e)),
            Err(_) => Err(ColdError::Transient {
                operation,
                key: key.to_owned(),
                detail: format!("no answer within {within:?}"),
            }),
        }
    }
}

/// The store's error as one of ours.
fn typed(operation: &'static str, key: &str, e: object_store::Error) -> ColdError {
    let key = key.to_owned();
    match e {
        object_store::Error::NotFound { .. } => ColdError::NotFound { key },
        object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
            ColdError::AlreadyExists { key }
        }
        object_store::Error::Generic { .. } | object_store::Error::JoinError { .. } => {
            ColdError::Transient { operation, key, detail: e.to_string() }
        }
        other => ColdError::Permanent { operation, key, detail: other.to_string() },
    }
}

fn path(key: &str) -> Result<Path, ColdError> {
    Path::parse(key).map_err(|e| ColdError::Config(format!("object name {key:?}: {e}")))
}

impl ColdObjects for S3Objects {
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<(), ColdError> {
        let p = path(key)?;
        let options = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        let payload = PutPayload::from(bytes.to_vec());
        self.run("put", key, self.store.put_opts(&p, payload, options)).map(drop)
    }

    fn head(&self, key: &str) -> Result<Option<u64>, ColdError> {
        let p = path(key)?;
        match self.run("head", key, self.store.head(&p)) {
            Ok(meta) => Ok(Some(meta.size)),
            Err(ColdError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        within: Duration,
    ) -> Result<Vec<u8>, ColdError> {
        let p = path(key)?;
        self.run_within("get", key, within, self.store.get_range(&p, range)).map(|b| b.to_vec())
    }

    fn delete(&self, key: &str) -> Result<(), ColdError> {
        let p = path(key)?;
        match self.run("delete", key, self.store.delete(&p)) {
            Err(ColdError::NotFound { .. }) => Ok(()),
            other => other,
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ColdError> {
        // One level at a time (the store pages through each), so a name with slashes below
        // `prefix` is walked folder by folder.
        let mut found = Vec::new();
        let mut folders = vec![path(prefix.trim_end_matches('/'))?];
        while let Some(folder) = folders.pop() {
            let level = self.run("list", prefix, self.store.list_with_delimiter(Some(&folder)))?;
            folders.extend(level.common_prefixes);
            for meta in level.objects {
                found.push((meta.location.to_string(), meta.size));
            }
            if found.len() > LIST_OBJECTS_MAX {
                return Err(ColdError::Permanent {
                    operation: "list",
                    key: prefix.to_owned(),
                    detail: format!("more than {LIST_OBJECTS_MAX} objects"),
                });
            }
        }
        found.sort();
        Ok(found)
    }
}
