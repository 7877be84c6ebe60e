//! Fuzzes the FileStore block-file header parser
//! (`gpucache_storage::file::layout::decode_header`).
//!
//! Input layout: a control byte, then the first bytes of a block file. With control bit 0 set,
//! the header checksum field is overwritten with the correct checksum of the header the bytes
//! declare (when they are long enough to hold it), so that the fuzzer reaches the payload
//! length and key checks behind it; with it clear the bytes are parsed as they are.
//!
//! Nothing may panic. An accepted header never claims more bytes than it was given, reads only
//! the header it declares (the same header parses from exactly those bytes, and one byte fewer
//! is refused as short), has the length its key calls for, and a file length of header plus
//! padded payload. Encoded again from what was parsed it parses to an equal header, and to the
//! input bytes exactly when the input's flags and padding are zero, as the encoder writes them.

use gpucache_dataplane::checksum::Checksum;
use gpucache_storage::file::BlockFileError;
use gpucache_storage::file::layout::{
    FIXED_HEADER_BYTES, HEADER_CHECKSUM_AT, PAYLOAD_BYTES_MAX, declared_header_len, decode_header,
    encode_header, header_len_for, padded,
};

use crate::Outcome;

/// Where the flags sit in the fixed part.
const FLAGS_AT: usize = 6;

/// Writes the correct header checksum into `bytes` when they hold the whole header they
/// declare.
pub fn fix_checksum(bytes: &mut [u8]) {
    let Ok(len) = declared_header_len(bytes) else { return };
    let Some(header) = bytes.get_mut(..len) else { return };
    header[HEADER_CHECKSUM_AT..HEADER_CHECKSUM_AT + 8].fill(0);
    let sum = Checksum::of(header).0.to_le_bytes();
    header[HEADER_CHECKSUM_AT..HEADER_CHECKSUM_AT + 8].copy_from_slice(&sum);
}

/// Parses the header as the control byte says and checks what an accepted one must satisfy.
pub fn run(data: &[u8]) -> Outcome {
    let Some((&control, rest)) = data.split_first() else { return Outcome::Refused };
    let mut bytes = rest.to_vec();
    if control & 1 == 1 {
        fix_checksum(&mut bytes);
    }
    let header = match decode_header(&bytes) {
        Ok(header) => header,
        Err(BlockFileError::Short { len }) => {
            assert_eq!(len, bytes.len(), "a short header names another length");
            return Outcome::Refused;
        }
        Err(_) => return Outcome::Refused,
    };
    let len = usize::try_from(header.header_len).expect("header length fits usize");
    let key = header.key.encoded();
    assert!(len <= bytes.len(), "a {len}-byte header parsed from {} bytes", bytes.len());
    assert_eq!(declared_header_len(&bytes), Ok(len), "parsed and declared lengths differ");
    assert_eq!(len, header_len_for(key.len()), "header length does not fit the key");
    assert_eq!(&bytes[FIXED_HEADER_BYTES..FIXED_HEADER_BYTES + key.len()], key, "key bytes");
    assert!(header.payload_len <= PAYLOAD_BYTES_MAX, "payload over the format's limit");
    let pad = padded(header.payload_len);
    assert!(pad >= header.payload_len && pad - header.payload_len < 4096, "payload padding");
    assert_eq!(header.file_len(), header.header_len + pad, "file length");

    // Only the declared header is read.
    assert_eq!(decode_header(&bytes[..len]).as_ref(), Ok(&header), "the header alone differs");
    assert_eq!(
        decode_header(&bytes[..len - 1]).map(|_| ()),
        Err(BlockFileError::Short { len: len - 1 }),
        "one byte short of the header"
    );

    let mut again = vec![0u8; len];
    encode_header(
        &mut again,
        &header.key,
        header.payload_len,
        header.checksum,
        header.seq,
        header.epoch,
    );
    let back = decode_header(&again).unwrap_or_else(|e| panic!("a re-encoded header: {e}"));
    assert_eq!(back, header, "header changed through encode and decode");
    let zero_flags = bytes[FLAGS_AT..FLAGS_AT + 2] == [0, 0];
    let zero_padding = bytes[FIXED_HEADER_BYTES + key.len()..len].iter().all(|&b| b == 0);
    if zero_flags && zero_padding {
        assert_eq!(again, bytes[..len], "header encoding is not canonical");
    }
    Outcome::Accepted
}
