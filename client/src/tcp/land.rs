//! Landing GET answers in the caller's buffers: from a frame, checksum verified in the copy, or
//! from the shared segment, where the server already wrote and verified them.

use gpucache_dataplane::checksum::Checksum;
use gpucache_dataplane::store::{Get, MissReason, StoreError};
use gpucache_wire::{FetchedRef, Frame, Op, Response, decode_get_response};

use super::errors::{transport, unexpected};
use super::shm::Place;

/// Lands one GET frame's answer in its items' buffers.
pub(super) fn land_framed(
    frame: &Frame,
    dsts: &mut [&mut [u8]],
) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
    if frame.op != Op::Get {
        let answer = Response::from_frame(frame).map_err(|e| transport("get", e))?;
        return Err(unexpected("get", &answer));
    }
    let answers = decode_get_response(&frame.body).map_err(|e| transport("get", e))?;
    if answers.len() != dsts.len() {
        return Err(transport("get", "answers do not match the batch"));
    }
    // The block lands in the caller's buffer straight from the frame body.
    Ok(dsts.iter_mut().zip(answers).map(|(dst, answer)| answer.map(|f| land(f, dst))).collect())
}

/// Lands one GET_SHARED frame's answer: each hit is in the segment at its item's place.
pub(super) fn land_shared_frame(
    frame: &Frame,
    places: &[Place],
    dsts: &mut [&mut [u8]],
) -> Result<Vec<Result<Get, StoreError>>, StoreError> {
    match Response::from_frame(frame) {
        Ok(Response::GetShared(answers)) if answers.len() == dsts.len() => Ok(dsts
            .iter_mut()
            .zip(places)
            .zip(answers)
            .map(|((dst, place), answer)| answer.map(|g| land_shared(g, place, dst)))
            .collect()),
        // Refused at the protocol level: the server wrote nothing.
        Ok(other) => Err(unexpected("get", &other)),
        Err(e) => Err(transport("get", e)),
    }
}

/// Lands a block the server wrote into the segment: from a bounce buffer it is copied into the
/// caller's buffer. It is not hashed again here: the store's `get_into` verified the bytes in
/// the segment itself (a hit means written and verified), and nothing but this process and the
/// server can write the segment; a length the server could not have delivered is a miss.
fn land_shared(got: Get, place: &Place, dst: &mut [u8]) -> Get {
    match got {
        Get::Hit { len, checksum } => {
            let n = match usize::try_from(len) {
                Ok(n) if n <= dst.len() => n,
                _ => {
                    dst.fill(0);
                    return Get::Miss(MissReason::Corrupt);
                }
            };
            if let Place::Bounce(b) = place {
                dst[..n].copy_from_slice(&b[..n]);
            }
            Get::Hit { len, checksum }
        }
        Get::Miss(MissReason::Corrupt) => {
            dst.fill(0);
            Get::Miss(MissReason::Corrupt)
        }
        miss => miss,
    }
}

/// Lands a fetched block in the caller's buffer after checking its checksum.
fn land(fetched: FetchedRef<'_>, dst: &mut [u8]) -> Get {
    match fetched {
        FetchedRef::Hit { checksum, data } => {
            // Checked in the caller's buffer, in the pass that copies it there; what does not
            // verify is zeroed, as the store zeroes a corrupt read.
            match Checksum::copy_of(dst, data) {
                Some(sum) if sum == checksum => Get::Hit { len: data.len() as u64, checksum },
                Some(_) => {
                    dst[..data.len()].fill(0);
                    Get::Miss(MissReason::Corrupt)
                }
                None => Get::Miss(MissReason::Corrupt),
            }
        }
        FetchedRef::Miss(MissReason::Corrupt) => {
            // The store zeroes a corrupt read's destination; so does its remote form.
            dst.fill(0);
            Get::Miss(MissReason::Corrupt)
        }
        FetchedRef::Miss(reason) => Get::Miss(reason),
    }
}
