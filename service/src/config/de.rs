//! Reading the TOML: a parse error turned into the key path it is about, and the value forms
//! the schema accepts beyond plain TOML (byte counts with units, `IP:port` literals).

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;

use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, Visitor,
};

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

    // A value of a tagged table is refused at the table's header, its key first (`Untagged`).
    let (keyed, message) = match message.strip_prefix(KEYED).and_then(|m| m.split_once("`: ")) {
        Some((key, rest)) => (Some(key.to_owned()), rest.to_owned()),
        None => (None, message),
    };
    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split('`').next())
        .map(str::to_owned);
    let of_value = keyed.is_some();
    let named = named.or(keyed);
    let (mut line, mut column) = (line_index + 1, column);
    let leaf = if error_line_is_header {
        // An unknown section is named by its own header; a key of the header's table (missing,
        // or one of a tagged table's) by the message, and found below the header when set.
        let header = section.rsplit('.').next().unwrap_or_default().to_owned();
        match named {
            Some(field) if field != header.split('[').next().unwrap_or_default() => {
                if let Some((at, key, value)) = key_below(text, line_index, &field) {
                    (line, column) = (at, if of_value { value } else { key });
                }
                field
            }
            _ => {
                section = section[..section.len() - header.len()].trim_end_matches('.').to_owned();
                header
            }
        }
    } else {
        let line = &text[line_start..];
        let line = line.split('\n').next().unwrap_or_default();
        match (named, line.find('=')) {
            (Some(field), _) => field,
            (None, Some(eq)) => line[..eq].trim().trim_matches('"').to_owned(),
            (None, None) => String::new(),
        }
    };
    ConfigError::Parse { key: join(&section, &leaf), message, line, column }
}

/// The line of `key` in the table whose header is line `header` (from 0), when set, and the
/// columns of the key and of its value.
fn key_below(text: &str, header: usize, key: &str) -> Option<(usize, usize, usize)> {
    let below = text.lines().enumerate().skip(header + 1);
    let mut table = below.take_while(|(_, l)| !l.trim_start().starts_with('['));
    let (i, l) = table
        .find(|(_, l)| l.split_once('=').is_some_and(|(k, _)| k.trim().trim_matches('"') == key))?;
    let column = |rest: &str| l.chars().count() - rest.chars().count() + 1;
    let value = l.split_once('=').map_or(l, |(_, v)| v).trim_start();
    Some((i + 1, column(l.trim_start()), column(value)))
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

/// How [`Untagged::read`] names the key of a value it refuses: `` field `key`: `` then why.
const KEYED: &str = "field `";

/// Reads a table tagged by its `tag` key, as serde's `#[serde(tag = "...")]` enums do, but so
/// that every error keeps its place: serde's read the table whole and report an error in any of
/// its values at the array that holds the table, naming neither the table nor the key. Here the
/// tag is read in place (an unknown one is reported at its value), and the other keys are kept,
/// for [`Untagged::read`] into the tag's type.
pub(super) fn tagged<'de, A: MapAccess<'de>, T: Deserialize<'de>>(
    mut map: A,
    tag: &'static str,
) -> Result<(T, Untagged), A::Error> {
    let mut found = None;
    let mut rest = Vec::new();
    while let Some(key) = map.next_key::<String>()? {
        if key == tag {
            found = Some(map.next_value()?);
        } else {
            let value = map.next_value()?;
            rest.push((key, value));
        }
    }
    let found = found.ok_or_else(|| de::Error::missing_field(tag))?;
    Ok((found, Untagged(rest)))
}

/// The keys of a tagged table but its tag (see [`tagged`]).
pub(super) struct Untagged(Vec<(String, toml::Value)>);

impl Untagged {
    /// Reads the keys as a `T`, whose `deny_unknown_fields` refuses a key of another tag's. An
    /// error in a value names its key, which [`parse_error`] makes the error's key path.
    pub(super) fn read<T: DeserializeOwned, E: de::Error>(self) -> Result<T, E> {
        let values = Values { keys: self.0.into_iter(), value: None };
        T::deserialize(MapAccessDeserializer::new(values)).map_err(|e| E::custom(e.message()))
    }
}

/// [`Untagged`]'s keys, handed to a struct's `Deserialize` one by one.
struct Values {
    keys: std::vec::IntoIter<(String, toml::Value)>,
    value: Option<(String, toml::Value)>,
}

impl<'de> MapAccess<'de> for Values {
    type Error = toml::de::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some((key, value)) = self.keys.next() else { return Ok(None) };
        let read = seed.deserialize(key.as_str().into_deserializer())?;
        self.value = Some((key, value));
        Ok(Some(read))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let (key, value) =
            self.value.take().ok_or_else(|| de::Error::custom("a value before its key"))?;
        seed.deserialize(value)
            .map_err(|e| de::Error::custom(format!("{KEYED}{key}`: {}", e.message())))
    }
}
