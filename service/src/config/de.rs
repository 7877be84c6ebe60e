//! Reading the TOML: a parse error turned into the key path it is about, and the value forms
//! the schema accepts beyond plain TOML (byte counts with units, `IP:port` literals).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use super::error::{ConfigError, join};

/// A TOML error with the key path it is about. The toml crate knows the path but does not
/// expose it, so it is recovered from the error's position: the last table header above it
/// (counting `[[tenants]]` entries) and the key on its line, or the field the message names.
pub(super) fn parse_error(text: &str, error: &toml::de::Error) -> ConfigError {
    let message = error.message().trim_end().to_owned();
    let start = error.span().map_or(0, |s| s.start).min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_index = text[..line_start].matches('\n').count();
    let column = text[line_start..start].chars().count() + 1;

    let mut section = String::new();
    let mut arrays: HashMap<String, usize> = HashMap::new();
    let mut error_line_is_header = false;
    for (i, raw) in text.lines().take(line_index + 1).enumerate() {
        let line = raw.trim_start();
        let header = if let Some(rest) = line.strip_prefix("[[") {
            rest.split("]]").next().map(|name| {
                let name = name.trim().to_owned();
                let n = arrays.entry(name.clone()).or_default();
                *n += 1;
                format!("{name}[{}]", *n - 1)
            })
        } else if let Some(rest) = line.strip_prefix('[') {
            rest.split(']').next().map(|name| name.trim().to_owned())
        } else {
            None
        };
        if let Some(h) = header {
            section = h;
            error_line_is_header = i == line_index;
        } else if i == line_index {
            error_line_is_header = false;
        }
    }

    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split('`').next());
    let leaf = if error_line_is_header {
        // An unknown section is named by its own header; a missing field by the message.
        match named {
            Some(field) if message.starts_with("missing") => field.to_owned(),
            _ => {
                let key = section.rsplit('.').next().unwrap_or_default().to_owned();
                section = section[..section.len() - key.len()].trim_end_matches('.').to_owned();
                key
            }
        }
    } else {
        let line = &text[line_start..];
        let line = line.split('\n').next().unwrap_or_default();
        match (named, line.find('=')) {
            (Some(field), _) => field.to_owned(),
            (None, Some(eq)) => line[..eq].trim().trim_matches('"').to_owned(),
            (None, None) => String::new(),
        }
    };
    ConfigError::Parse { key: join(&section, &leaf), message, line: line_index + 1, column }
}

/// Deserializes a byte count from an integer or a string with a binary unit.
pub(super) fn byte_count<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    struct ByteCount;
    impl Visitor<'_> for ByteCount {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a byte count: an integer, or a string such as \"64MiB\" or \"4G\"")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            crate::units::parse_bytes(v).map_err(E::custom)
        }
    }
    d.deserialize_any(ByteCount)
}

/// Deserializes `IP:port`. Host names are refused rather than resolved: what the service binds
/// must not depend on a resolver at start time.
pub(super) fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(|_| {
        de::Error::custom(format!(
            "{text:?} is not IP:port (such as \"127.0.0.1:7470\" or \"[::1]:7470\"); \
             host names are not resolved"
        ))
    })
}

/// A byte count that may be left out.
pub(super) fn optional_byte_count<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    byte_count(d).map(Some)
}
